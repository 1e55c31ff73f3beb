"""Real libvirt's verdict on the 64-bit PCI window the hook writes for large-BAR GPUs (docs/large-bar.md).

An EFI KubeVirt-shaped domain with one or two A100 80GB from the fixture node's sysfs: libvirt's RNG schema and
test driver accept it, and the QEMU driver's command line carries ``-fw_cfg name=opt/ovmf/X-PciMmio64Mb,string=N``
with the computed N beside the GPUs' ``vfio-pci`` devices. The form the issue first named,
``<sysinfo type='fwcfg'>``, passes the schema but libvirt's QEMU driver refuses names under ``opt/ovmf/``: that
is why the hook writes ``<qemu:commandline>``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher_hook import BuildOptions, build_domain
from runtime.pci_bars import SysfsBars
from simkit.fixture_nodes import A100_NODE
from simkit.sysfs_fixture import build
from tests.libvirt_support import libvirt_verdict, missing, qemu_argv
from xmlgen.libvirt_check import (
    LibvirtRejected,
    LibvirtUnavailable,
    generic_refusal,
    qemu_sources,
)

EXAMPLE = Path(__file__).parent.parent / "xmlgen" / "examples" / "a100-efi"
A100_VAR = "PCI_RESOURCE_NVIDIA_COM_GA100_A100_PCIE_80GB"
FW_CFG = re.compile(r"-fw_cfg\s+'?name=opt/ovmf/X-PciMmio64Mb,string=(\d+)'?")

pytestmark = pytest.mark.libvirt


EMPTY_SMBIOS = b"\t\t<bios></bios>\n\t\t<baseBoard></baseBoard>\n\t\t<chassis></chassis>\n"
"""virt-launcher's empty SMBIOS groups: libvirt's parser takes them, its RNG schema wants an entry in each."""


def schema_refusal(domain_xml: bytes) -> str | None:
    """Why libvirt's RNG schema or generic parser refuses the domain (KubeVirt's empty SMBIOS groups aside)."""
    assert EMPTY_SMBIOS in domain_xml
    try:
        return generic_refusal(domain_xml.replace(EMPTY_SMBIOS, b"").decode())
    except LibvirtUnavailable as exc:
        missing(str(exc))
        raise  # unreachable


@pytest.mark.parametrize(("addresses", "mib"), [(["0000:3b:00.0"], 262144), (["0000:3b:00.0", "0000:d8:00.0"], 524288)])
def test_the_window_reaches_qemus_command_line(tmp_path: Path, addresses: list[str], mib: int) -> None:
    reader = SysfsBars(build(A100_NODE, tmp_path / "node") / "sys")
    result = build_domain(
        (EXAMPLE / "domain.xml").read_bytes(), None, {A100_VAR: ",".join(addresses)}, BuildOptions(bars=reader)
    )
    assert result.mmio is not None and result.mmio.written_mib == mib
    assert schema_refusal(result.domain_xml) is None  # RNG schema and generic parser (VIR_DOMAIN_DEFINE_VALIDATE)
    report = libvirt_verdict(result.domain_xml, result.aliases)
    assert sorted(qemu_sources(report).values()) == addresses
    command_line = qemu_argv(result.domain_xml)
    assert FW_CFG.findall(command_line) == [str(mib)]
    assert "/OVMF_CODE.fd" in command_line  # the guest boots OVMF, which reads the item


def test_libvirts_fwcfg_sysinfo_cannot_carry_the_item() -> None:
    domain = (
        (EXAMPLE / "domain.xml")
        .read_bytes()
        .replace(
            b"\t<devices>",
            b'\t<sysinfo type="fwcfg">\n\t\t<entry name="opt/ovmf/X-PciMmio64Mb">262144</entry>\n\t</sysinfo>\n'
            b"\t<devices>",
        )
    )
    assert schema_refusal(domain) is None  # the schema and the test driver take it ...
    with pytest.raises(LibvirtRejected, match="That firmware name is reserved"):
        qemu_argv(domain)  # ... the QEMU driver does not
    allowed = domain.replace(b"opt/ovmf/X-PciMmio64Mb", b"opt/com.example/size")
    assert "-fw_cfg name=opt/com.example/size,string=262144" in qemu_argv(allowed)  # other names pass as -fw_cfg
