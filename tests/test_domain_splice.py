"""Splicing hostdevs into a domain, and refusing dangerous or broken domain XML."""

from __future__ import annotations

import pytest
from lxml import etree

from launcher_hook import BuildOptions, build_domain
from schemas import InputError
from tests.conftest import EXAMPLES
from tests.libvirt_support import libvirt_verdict

PCI = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
ENV = {PCI: "0000:86:00.0,0000:af:00.0"}
SEED = (EXAMPLES / "seed-node01" / "domain.xml").read_bytes()
BASICS = b"<name>x</name><memory>1048576</memory><os><type arch='x86_64' machine='q35'>hvm</type></os>"


def hostdev_aliases(xml: bytes) -> list[str | None]:
    return [alias.get("name") for alias in etree.fromstring(xml).iterfind("devices/hostdev/alias")]


def test_everything_but_the_added_hostdevs_is_kept_byte_for_byte() -> None:
    out = build_domain(SEED, None, ENV).domain_xml
    tree = etree.fromstring(out)
    devices = tree.find("devices")
    assert devices is not None
    for hostdev in devices.findall("hostdev"):
        previous = hostdev.getprevious()
        assert previous is not None
        previous.tail = hostdev.tail
        devices.remove(hostdev)
    stripped = etree.tostring(tree)
    assert stripped == etree.tostring(etree.fromstring(SEED))
    assert out.startswith(b'<domain type="kvm" xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0">\n')
    assert b"<qemu:env " in out and out.endswith(b"</domain>\n")
    assert out.count(b"/>") == 0  # Go-style empty elements stay <x></x>


def test_comments_cdata_and_foreign_namespaces_survive() -> None:
    domain = (
        b"<?xml version='1.0'?>\n<!-- top -->\n<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>"
        + BASICS
        + b"<!-- inside --><description><![CDATA[a <b> & c]]></description>"
        b"<devices><memballoon model='none'/></devices><qemu:commandline><qemu:arg value='-s'/></qemu:commandline>"
        b"</domain>"
    )
    out = build_domain(domain, None, {PCI: "0000:86:00.0"}).domain_xml
    libvirt_verdict(out, {"ua-gpu0": "0000:86:00.0"})
    assert out.startswith(b"<?xml version='1.0'?>\n<!-- top -->\n<domain type='kvm' xmlns:qemu=")
    assert b"<!-- inside -->" in out and b"<![CDATA[a <b> & c]]>" in out
    assert b'<qemu:arg value="-s"/></qemu:commandline>' in out
    # comments force the general path, which re-serialises attributes with double quotes
    assert b'<memballoon model="none"/><hostdev mode="subsystem" type="pci" managed="no">' in out


def test_devices_element_is_created_when_absent() -> None:
    out = build_domain(b"<domain type='kvm'><name>x</name></domain>", None, {PCI: "0000:86:00.0"}).domain_xml
    assert hostdev_aliases(out) == ["ua-gpu0"]
    assert out.endswith(b"</hostdev></devices></domain>")


def test_hostdev_with_same_source_is_merged_not_duplicated() -> None:
    domain = (
        b"<domain type='kvm'>" + BASICS + b"<devices>"
        b"<hostdev mode='subsystem' type='pci' managed='no'><source><address type='pci' domain='0' bus='134' slot='0'"
        b" function='0'/></source><alias name='ua-gpu-gpu0'/></hostdev>"
        b"<interface type='ethernet'><target dev='tap0' managed='no'/></interface>"
        b"<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x0000' bus='0x86' slot='0x00'"
        b" function='0x0'/></source></hostdev>"
        b"<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x0000' bus='0x3b' slot='0x00'"
        b" function='0x0'/></source><alias name='ua-sriov-nic'/></hostdev>"
        b"</devices></domain>"
    )
    result = build_domain(domain, None, {PCI: "0000:86:00.0"})
    out = result.domain_xml
    # virt-launcher's element keeps its alias; its source address loses type= and is written in 0x hex (the
    # same numbers as libvirt reads them); the second hostdev for the same source is removed, with a warning
    libvirt_verdict(out, {"ua-gpu-gpu0": "0000:86:00.0"})
    assert result.aliases == {"ua-gpu-gpu0": "0000:86:00.0"}
    root = etree.fromstring(out)
    assert [child.tag for child in root.find("devices")] == ["hostdev", "interface", "hostdev"]  # type: ignore[union-attr]
    assert hostdev_aliases(out) == ["ua-gpu-gpu0", "ua-sriov-nic"]
    assert b'<address domain="0x0000" bus="0x86" slot="0x00" function="0x0"/>' in out
    assert any("libvirt refuses that, so the second is removed" in warning for warning in result.warnings)


def test_octal_looking_numbers_are_read_as_libvirt_does() -> None:
    # bus='010' is octal 8 for libvirt, so it is not 0000:10:00.0 and is not merged
    domain = (
        b"<domain><devices><hostdev mode='subsystem' type='pci'><source><address domain='0' bus='010' slot='0'"
        b" function='0'/></source><alias name='ua-other'/></hostdev></devices></domain>"
    )
    out = build_domain(domain, None, {PCI: "0000:10:00.0"}).domain_xml
    assert hostdev_aliases(out) == ["ua-other", "ua-gpu0"]
    out = build_domain(domain, None, {PCI: "0000:08:00.0"}).domain_xml
    assert hostdev_aliases(out) == ["ua-other"]  # the same device: merged, its alias kept, numbers in 0x hex
    assert b'<address domain="0x0000" bus="0x08" slot="0x00" function="0x0"/>' in out


def test_mdev_hostdev_with_same_uuid_in_other_case_is_merged() -> None:
    uuid = "4b20d080-1b54-4048-85b3-a6a62d165c01"
    domain = (
        "<domain><devices><hostdev mode='subsystem' type='mdev' model='vfio-pci'>"
        f"<source><address uuid='{uuid.upper()}'/>"
        "</source><alias name='ua-gpu-vgpu'/></hostdev></devices></domain>"
    ).encode()
    out = build_domain(domain, None, {"MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q": uuid}).domain_xml
    assert hostdev_aliases(out) == ["ua-gpu-vgpu"]
    assert out.count(b"<hostdev ") == 1


def test_alias_held_by_another_element_is_an_error_and_nothing_is_returned() -> None:
    domain = b"<domain><devices><disk type='file'>\n<alias name='ua-gpu1'/></disk></devices></domain>"
    with pytest.raises(InputError, match=r"alias 'ua-gpu1' is already used by <disk> at line 2"):
        build_domain(domain, None, ENV)


def test_building_twice_is_idempotent_on_an_indented_domain() -> None:
    once = build_domain(SEED, None, ENV, BuildOptions(driver="vfio")).domain_xml
    assert build_domain(once, None, ENV, BuildOptions(driver="vfio")).domain_xml == once


def test_without_domain_a_devices_element_holds_just_the_hostdevs() -> None:
    out = build_domain(None, None, ENV).domain_xml
    assert out.startswith(b"<devices>\n\t<hostdev ") and out.endswith(b"</devices>\n")
    assert hostdev_aliases(b"<domain>" + out + b"</domain>") == ["ua-gpu0", "ua-gpu1"]


BILLION_LAUGHS = b"""<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]>
<domain><name>&lol2;</name></domain>"""
XXE = b"""<?xml version="1.0"?>
<!DOCTYPE d [<!ENTITY xxe SYSTEM "file:///etc/passwd">]><domain><name>&xxe;</name></domain>"""
EXTERNAL_DTD = b"""<?xml version="1.0"?><!DOCTYPE domain SYSTEM "http://127.0.0.1:9/x.dtd"><domain/>"""


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (BILLION_LAUGHS, "DOCTYPE"),
        (XXE, "DOCTYPE"),
        (EXTERNAL_DTD, "DOCTYPE"),
        (b"<domain><name>&undefined;</name></domain>", "not well-formed XML: Entity 'undefined' not defined"),
        (b"", "not well-formed XML"),
        (b"<domain>", "not well-formed XML"),
        (b"<domain></domian>", "not well-formed XML"),
        (b"not xml at all", "not well-formed XML"),
        (b"<vm><devices/></vm>", "the root element is <vm>, expected <domain>"),
        (b"<domain><name>\xff</name></domain>", "not valid UTF-8: byte 14"),
        (b"<?xml version='1.0' encoding='ISO-8859-1'?><domain/>", "declares encoding 'ISO-8859-1'"),
        (b"<domain>" + b"<a>" * 300 + b"</a>" * 300 + b"</domain>", "not well-formed XML"),
    ],
)
def test_bad_domain_xml_is_refused_naming_the_problem(data: bytes, message: str) -> None:
    with pytest.raises(InputError, match="domain XML") as error:
        build_domain(data, None, ENV)
    assert message in str(error.value)


def test_oversized_domain_is_refused() -> None:
    with pytest.raises(InputError, match="domain XML is 1025 bytes, over the 1024-byte limit"):
        build_domain(b"<domain>" + b" " * 1000 + b"</domain>".ljust(17), None, ENV, BuildOptions(max_input_bytes=1024))


SPLICE_VARIANTS = [
    SEED,
    SEED.replace(b"\t", b"  "),
    b"<domain type='kvm'>" + BASICS + b"<devices><memballoon model='none'/></devices></domain>",
    b"<domain type='kvm'>\n  " + BASICS + b"\n  <devices>\n    <memballoon model='none'/>\n  </devices>\n</domain>\n",
    b"<?xml version='1.0' encoding='utf-8'?>\n<domain type='kvm'>\n\t" + BASICS + b"\n\t<devices>\n"
    b'\t\t<memballoon model="none"></memballoon>\n\t</devices>\n</domain>',
    b"<domain type='kvm'> " + BASICS + b" <devices> <memballoon model='none'/> </devices> </domain>",
    b'<domain type="kvm" xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0"><name>x</name><memory>1048576</memory>'
    b'<os><type arch="x86_64" machine="q35">hvm</type></os><devices><video/></devices><qemu:commandline/></domain>',
]


@pytest.mark.parametrize("domain", SPLICE_VARIANTS)
def test_fast_and_general_splice_give_the_same_bytes(domain: bytes) -> None:
    from launcher_hook.builder import plan_hostdevs
    from launcher_hook.domain import parse_domain, splice_hostdevs

    env = {
        PCI: "0000:86:00.0,0000:af:00.0",
        "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q": "4b20d080-1b54-4048-85b3-a6a62d165c01",
    }
    graphics = parse_domain(domain, 1 << 20).root.find("devices/graphics") is not None
    specs, _ = plan_hostdevs(None, env, BuildOptions(driver="vfio"), graphics=graphics)
    fast = splice_hostdevs(parse_domain(domain, 1 << 20), specs)
    general = splice_hostdevs(parse_domain(domain, 1 << 20), specs, allow_fast=False)
    for output in (fast, general):
        libvirt_verdict(output, {spec.alias: spec.source_text for spec in specs})
    assert etree.tostring(etree.fromstring(fast), method="c14n") == etree.tostring(
        etree.fromstring(general), method="c14n"
    )
    if b"'" not in domain:  # re-serialising writes attributes with double quotes; the fast path keeps them
        assert fast == general
    assert fast.count(b"<hostdev ") == 3


def test_vgpu_display_needs_a_graphics_device() -> None:
    uuid = "4b20d080-1b54-4048-85b3-a6a62d165c01"
    env = {"MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q": uuid}
    headless = b"<domain type='kvm'>" + BASICS + b"<devices><memballoon model='none'/></devices></domain>"
    with_vnc = headless.replace(b"<memballoon", b"<graphics type='vnc'/><memballoon")
    # the default display: on with a graphics device, off without one (libvirt refuses it there)
    assert b'display="on" ramfb="on"' in build_domain(with_vnc, None, env).domain_xml
    out = build_domain(headless, None, env).domain_xml
    assert b"display=" not in out
    libvirt_verdict(out, {"ua-gpu0": uuid})
    # a display asked for explicitly on a domain without graphics is an error naming the GPU
    vmi = (
        b'{"spec": {"domain": {"devices": {"gpus": [{"name": "desk", "deviceName": "nvidia.com/GRID_T4-1Q",'
        b' "virtualGPUOptions": {"display": {"enabled": true}}}]}}}}'
    )
    with pytest.raises(
        InputError, match=r"gpus\[0\] 'desk' .* asks for a vGPU display, but the domain has no <graphics>"
    ):
        build_domain(headless, vmi, env)
    assert b'display="on"' in build_domain(with_vnc, vmi, env).domain_xml
