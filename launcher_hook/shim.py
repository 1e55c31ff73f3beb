"""``onDefineDomain``: the program KubeVirt's sidecar-shim runs instead of talking gRPC itself.

The sidecar-shim image serves the hook protocol and, for OnDefineDomain, runs the ``onDefineDomain``
executable found on ``PATH`` as ``onDefineDomain --vmi <VMI JSON> --domain <domain XML>``; stdout becomes the
new domain, stderr is logged, a non-zero exit fails the call (docs/protocols.md, "KubeVirt hooks"). So: the
whole new domain on stdout and exit 0, or the error on stderr, exit 1 (2 for a usage error) and nothing on
stdout.

The shim passes no other arguments, so the allocation source and options are chosen by env variables
(``LAUNCHER_HOOK_POD_RESOURCES_SOCKET``, ``LAUNCHER_HOOK_ENVIRON_FILE``, ``LAUNCHER_HOOK_CONTAINER``,
``LAUNCHER_HOOK_DRIVER``, ``LAUNCHER_HOOK_FORCE_GPU_ALIASES``, ``LAUNCHER_HOOK_PCI_MMIO64``,
``LAUNCHER_HOOK_SYSFS_ROOT``, ``LAUNCHER_HOOK_DRA_METADATA_ROOT``), with the same precedence as
``launcher-hook serve`` (with none of them, and no allocation variable in its env, the allocation is read from the
``--domain`` XML); so is the log line format (``LAUNCHER_HOOK_LOG_FORMAT``: ``json``, the default, or
``text``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from launcher_hook.builder import BuildOptions
from launcher_hook.cli import (
    allocation_options,
    bar_source,
    claim_reader,
    companion_reader,
    dra_metadata_option,
    force_gpu_aliases_option,
    log_format_option,
    make_source,
    mmio_window_options,
)
from launcher_hook.service import COMPONENT, HookFault, HookService
from runtime.logs import configure_logging
from runtime.pci_topology import SysfsTopology
from schemas.logformat import LogFormat


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--vmi", "vmi_json", required=True, help="The VirtualMachineInstance as JSON.")
@click.option("--domain", "domain_xml", required=True, help="The libvirt domain XML virt-launcher will define.")
@allocation_options
@force_gpu_aliases_option
@mmio_window_options
@dra_metadata_option
@log_format_option
def on_define_domain(
    vmi_json: str,
    domain_xml: str,
    pod_resources_socket: Path | None,
    environ_file: Path | None,
    container: str,
    driver: str | None,
    force_gpu_aliases: bool,
    pci_mmio64: str,
    sysfs_root: Path,
    dra_metadata_root: Path,
    log_format: LogFormat,
) -> None:
    """Print the --domain XML with the pod's GPUs added as <hostdev> elements (for KubeVirt's sidecar-shim)."""
    configure_logging(COMPONENT, log_format)
    source = make_source(pod_resources_socket, environ_file, container, os.environ)
    try:
        # os.fsencode gives back the exact argv bytes, even ones that are not valid UTF-8 (the builder says so).
        options = BuildOptions(
            driver=driver,
            force_gpu_aliases=force_gpu_aliases,
            bars=bar_source(pci_mmio64, sysfs_root),
            claims=claim_reader(dra_metadata_root),
            companion_reader=companion_reader(sysfs_root),
            topology=SysfsTopology(sysfs_root),
        )
        outcome = HookService(source, options).define_domain(
            os.fsencode(domain_xml), os.fsencode(vmi_json), via="onDefineDomain"
        )
    except HookFault as fault:
        click.echo(f"error: {fault.code}: {fault.message}", err=True)
        sys.exit(1)
    finally:
        source.close()
    sys.stdout.buffer.write(outcome.domain_xml)
    sys.stdout.buffer.flush()


def main() -> None:
    on_define_domain(prog_name="onDefineDomain")
