"""``xmlgen simulate``: see the whole path work on one machine, before touching a cluster."""

from __future__ import annotations

from typing import Literal

import click

from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from xmlgen.io import fail, read_input, user_errors, write_stdout
from xmlgen.libvirt_check import LibvirtRejected, LibvirtTimeout, LibvirtUnavailable, check_domain, qemu_sources
from xmlgen.simulate import BUNDLED_NODES, default_domain, default_vmi, simulate
from xmlgen.simulate_dra import default_dra_claims, default_dra_domain, default_dra_vmi, simulate_dra


def _log(line: str) -> None:
    click.echo(line, err=True)


@click.command()
@click.option(
    "--node",
    default="node01",
    show_default=True,
    metavar="|".join([*BUNDLED_NODES, "DIR"]),
    help="A bundled fixture node (node01: the seed's four TU106; vgpu: a T4 with GRID T4-1Q/2Q mdevs; mixed; "
    "sriov-vgpu: two L40S with NVIDIA L40S-1Q/1B vGPUs on SR-IOV VFs; a100: two A100 80GB, 128 GiB BAR1 each) "
    "or a directory holding a node's sys/ and dev/ tree.",
)
@click.option(
    "--vmi",
    "vmi_path",
    metavar="FILE|-",
    help="VMI JSON. Default: the seed's two-GPU VM (vgpu: a vGPU desktop; sriov-vgpu: one 1Q and one 1B; a100: an "
    "EFI VM with one A100).",
)
@click.option(
    "--domain",
    "domain_path",
    metavar="FILE|-",
    help="Domain XML as virt-launcher renders it. Default: the bundled one (a100: an EFI domain).",
)
@click.option(
    "--check", is_flag=True, help="Check the result with libvirt; print QEMU's vfio -device lines where libvirtd runs."
)
@click.option(
    "--hook-api",
    type=click.Choice(["hooks", "plugins"]),
    default="hooks",
    show_default=True,
    help="Call the hook as virt-launcher does for a hook sidecar (Info, OnDefineDomain) or for a KubeVirt "
    "Plugin's sidecar (MutateDomain, plugin API v1alpha1).",
)
@click.option(
    "--dra",
    is_flag=True,
    help="Through DRA claims instead of device-plugin resources: the DRA kubelet plugin, its ResourceSlices, a "
    "scheduler stand-in allocating the VMI's claims, NodePrepareResources (CDI and metadata files), the hook "
    "reading the metadata, NodeUnprepareResources. Default VMI: a DRA example for node01, vgpu and sriov-vgpu.",
)
@click.option(
    "--claims",
    "claims_path",
    metavar="FILE|-",
    help="With --dra: the ResourceClaimTemplates and ResourceClaims the VMI's spec.resourceClaims name (YAML or "
    "JSON). Default: the bundled DRA example's.",
)
@user_errors
def simulate_command(
    node: str,
    vmi_path: str | None,
    domain_path: str | None,
    check: bool,
    hook_api: Literal["hooks", "plugins"],
    dra: bool,
    claims_path: str | None,
) -> None:
    """Run the device plugin on a node against a kubelet stand-in, allocate the VMI's GPUs as the kubelet
    would, and call the hook like virt-launcher (--dra: through DRA claims). The final domain XML goes to
    stdout, the account of each step to stderr."""
    if claims_path and not dra:
        fail("--claims is for --dra (the claims a DRA VMI names)")
        return
    if dra:
        vmi = read_input(vmi_path, "VMI JSON", DEFAULT_MAX_INPUT_BYTES) if vmi_path else default_dra_vmi(node)
        domain = (
            read_input(domain_path, "domain XML", DEFAULT_MAX_INPUT_BYTES) if domain_path else default_dra_domain(node)
        )
        claims = read_input(claims_path, "claims", DEFAULT_MAX_INPUT_BYTES) if claims_path else default_dra_claims(node)
        domain_xml = simulate_dra(node, vmi, domain, claims, _log, hook_api=hook_api).domain_xml
    else:
        vmi = read_input(vmi_path, "VMI JSON", DEFAULT_MAX_INPUT_BYTES) if vmi_path else default_vmi(node)
        domain = read_input(domain_path, "domain XML", DEFAULT_MAX_INPUT_BYTES) if domain_path else default_domain(node)
        domain_xml = simulate(node, vmi, domain, _log, hook_api=hook_api).domain_xml
    if check:
        try:
            report = check_domain(domain_xml, qemu_optional=True)
        except (LibvirtRejected, LibvirtTimeout, LibvirtUnavailable) as exc:
            fail(f"libvirt check: {exc}")
            return
        _log(
            f"{8 if dra else 5}. libvirt: the RNG schema and the test driver accept the domain; aliases and sources "
            "read back as written"
        )
        if report.qemu_unavailable:
            _log(f"  QEMU argv not shown: {report.qemu_unavailable}")
        else:
            _log("  QEMU would get (domxml-to-native):")
            for line in report.qemu_lines():
                _log(f"    {line}")
            missing = set(report.hostdevs) - set(qemu_sources(report))
            if missing:
                fail(f"libvirt check: QEMU's command line lacks {', '.join(sorted(missing))}")
    write_stdout(domain_xml)
