"""``xmlgen render``: what the launcher hook would make of a domain, from the shell."""

from __future__ import annotations

import os
from pathlib import Path

import click

from launcher_hook import BuildOptions, build_domain
from launcher_hook.allocation import is_allocation_variable, parse_environ
from launcher_hook.cli import PCI_MMIO64_CHOICES, bar_source, claim_reader, dra_metadata_option
from runtime.pci_topology import SysfsTopology
from runtime.sysfs_paths import DEFAULT_SYSFS_ROOT
from schemas.companions import is_companions_variable
from xmlgen.io import max_input_bytes_option, read_input, user_errors, write_stdout


@click.command()
@click.option(
    "--domain",
    "domain_path",
    metavar="FILE|-",
    help="Domain XML to add the GPUs to. Without it: a <devices> element holding just the hostdevs.",
)
@click.option(
    "--vmi",
    "vmi_path",
    metavar="FILE|-",
    help="VMI JSON (or a VirtualMachine's); its gpus[] and hostDevices[] decide the aliases.",
)
@click.option(
    "--environ-file",
    metavar="FILE",
    help="Allocation variables from KEY=VALUE lines or /proc/<pid>/environ; they replace the process env's "
    "PCI_RESOURCE_*/MDEV_PCI_RESOURCE_*/PCI_COMPANIONS_* variables.",
)
@click.option(
    "--managed", type=click.Choice(["yes", "no"]), default="no", show_default=True, help="managed= on PCI hostdevs."
)
@click.option("--driver", type=click.Choice(["vfio"]), help="Write <driver name='vfio'/> on PCI hostdevs.")
@click.option(
    "--force-gpu-aliases",
    is_flag=True,
    help="Alias every GPU ua-gpuN, also those virt-launcher rendered as ua-gpu-<name> (KubeVirt's lookups by "
    "alias then miss them).",
)
@click.option(
    "--pci-mmio64",
    type=click.Choice(PCI_MMIO64_CHOICES),
    default="auto",
    show_default=True,
    help="auto: an EFI domain whose devices' 64-bit BARs need more than OVMF's default window gets "
    "-fw_cfg name=opt/ovmf/X-PciMmio64Mb (sizes read under --sysfs-root); off: never.",
)
@click.option(
    "--sysfs-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_SYSFS_ROOT,
    show_default=True,
    help="Where BAR sizes (<root>/bus/pci/devices/<address>/resource) and the GPUs' places in the PCIe tree "
    "(for GPUDirect cliques, docs/p2p.md) are read (a fixture tree's sys/).",
)
@dra_metadata_option
@max_input_bytes_option
@user_errors
def render(
    domain_path: str | None,
    vmi_path: str | None,
    environ_file: str | None,
    managed: str,
    driver: str | None,
    force_gpu_aliases: bool,
    pci_mmio64: str,
    sysfs_root: Path,
    dra_metadata_root: Path,
    max_input_bytes: int,
) -> None:
    """Render the allocated GPUs as libvirt <hostdev> elements into a domain; the result goes to stdout."""
    if domain_path == "-" and vmi_path == "-":
        raise click.UsageError("only one of --domain and --vmi can read stdin")
    env = dict(os.environ)
    if environ_file is not None:
        env = {
            key: value for key, value in env.items() if not (is_allocation_variable(key) or is_companions_variable(key))
        }
        env.update(parse_environ(read_input(environ_file, "environ file", max_input_bytes)))
    domain = read_input(domain_path, "domain XML", max_input_bytes) if domain_path else None
    vmi = read_input(vmi_path, "VMI JSON", max_input_bytes) if vmi_path else None
    options = BuildOptions(
        managed=managed == "yes",
        driver=driver,
        max_input_bytes=max_input_bytes,
        force_gpu_aliases=force_gpu_aliases,
        bars=bar_source(pci_mmio64, sysfs_root),
        claims=claim_reader(dra_metadata_root),
        topology=SysfsTopology(sysfs_root),
    )
    result = build_domain(domain, vmi, env, options)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    for placement in result.placements:
        click.echo(f"companions: {placement.describe()}", err=True)
    for clique in result.cliques.cliques if result.cliques else ():
        click.echo(
            f"gpudirect clique {clique.number}: {', '.join(clique.aliases)} (below host switch {clique.switch})",
            err=True,
        )
    if not result.hostdevs:
        click.echo("warning: no PCI_RESOURCE_*/MDEV_PCI_RESOURCE_* variable requested any device", err=True)
    write_stdout(result.domain_xml)
