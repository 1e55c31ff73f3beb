"""The rules of launcher_hook.validate, one by one: numbers as libvirt reads them, live vs configuration
aliases, every hostdev type, and libvirt's domain-level rules in the pure ``domain_rules``."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from lxml import etree

from launcher_hook.validate import (
    Severity,
    ambiguous_number,
    c_number,
    domain_rules,
    hostdev_schema,
    is_live,
    review_domain,
    validate_domain,
)
from xmlgen.cli import cli

pytestmark = pytest.mark.filterwarnings("error")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0x86", 0x86),
        ("0X1f", 0x1F),
        ("222", 222),
        ("010", 8),
        ("0", 0),
        ("00", 0),
        (" 7", 7),
        ("+5", 5),
        ("08", None),  # octal with an 8: strtoul stops at it, libvirt refuses
        ("1f", None),  # hex without 0x: libvirt's RNG pattern allows it, its parser refuses
        ("-1", None),
        ("1_0", None),
        ("0x", None),
        ("", None),
        ("7 ", None),
        ("4294967296", None),
        ("4294967295", 0xFFFFFFFF),
    ],
)
def test_c_number_reads_as_strtoul_with_base_0(text: str, value: int | None) -> None:
    assert c_number(text) == value


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0x10", None),
        ("7", None),
        ("00", None),
        ("10", "libvirt reads '10' as decimal 10 (0xa), not hex 10"),
        ("010", "libvirt reads '010' as octal 8 (0x8), not hex 010"),
        ("222", "libvirt reads '222' as decimal 222 (0xde), not hex 222"),
    ],
)
def test_ambiguous_forms_are_named(text: str, why: str | None) -> None:
    assert ambiguous_number(text) == why


def domain(devices: str, *, attributes: str = "") -> etree._Element:
    return etree.fromstring(
        f"<domain type='kvm'{attributes}><name>t</name><os><type arch='x86_64'>hvm</type></os>"
        f"<devices>{devices}</devices></domain>"
    )


def pci(bus: str, alias: str | None = None) -> str:
    alias_xml = f"<alias name='{alias}'/>" if alias else ""
    return (
        f"<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x0000' bus='{bus}' "
        f"slot='0x00' function='0x0'/></source>{alias_xml}</hostdev>"
    )


MDEV = (
    "<hostdev mode='subsystem' type='mdev' model='vfio-pci'{extra}><source><address uuid='{uuid}'/></source></hostdev>"
)
UUID1 = "4b20d080-1b54-4048-85b3-a6a62d165c01"
UUID2 = "4b20d080-1b54-4048-85b3-a6a62d165c02"


def messages(root: etree._Element) -> list[tuple[Severity, str]]:
    return [(problem.severity, problem.message) for problem in review_domain(root, hostdev_schema())]


@pytest.mark.libvirt
def test_a_decimal_bus_is_accepted_with_a_warning_and_compared_as_libvirt_reads_it() -> None:
    root = domain(pci("222") + pci("0xde"))
    found = messages(root)
    assert (
        Severity.WARNING,
        "<hostdev type='pci'> without alias: source address bus='222': libvirt reads "
        "'222' as decimal 222 (0xde), not hex 222; write 0xde",
    ) in found
    assert any(
        severity is Severity.ERROR and "PCI 0000:de:00.0 is passed through again" in message
        for severity, message in found
    )


@pytest.mark.libvirt
def test_unreadable_numbers_are_errors() -> None:
    for bus in ("1f", "08", "256", "-1"):
        errors = validate_domain(domain(pci(bus, "ua-gpu0")), hostdev_schema())
        assert [error.message for error in errors] == [
            f"<hostdev type='pci'> 'ua-gpu0': source address bus='{bus}' is not a number libvirt reads in 0..0xff "
            "(0x hex, 0-prefixed octal or decimal)"
        ]


@pytest.mark.libvirt
def test_live_xml_allows_libvirts_aliases_a_configuration_does_not() -> None:
    live = domain(pci("0x86", "hostdev0"), attributes=" id='3'")
    config = domain(pci("0x86", "hostdev0"))
    assert is_live(live) and not is_live(config)
    assert validate_domain(live, hostdev_schema()) == []
    assert [p.message for p in validate_domain(config, hostdev_schema())] == [
        "hostdev alias 'hostdev0' does not start with 'ua-': libvirt drops it from a configuration (only live "
        "XML, with id= on <domain>, carries libvirt's own aliases)"
    ]
    assert validate_domain(config, hostdev_schema(), live=True) == []
    twice = domain(pci("0x86", "hostdev0") + pci("0x87", "hostdev0"), attributes=" id='3'")
    assert [p.message for p in validate_domain(twice, hostdev_schema())] == [
        "alias 'hostdev0' is used again (first at line 1)"
    ]


@pytest.mark.libvirt
@pytest.mark.parametrize(
    "hostdev",
    [
        "<hostdev mode='subsystem' type='usb'><source><vendor id='0x1234'/><product id='0xbeef'/></source></hostdev>",
        "<hostdev mode='subsystem' type='scsi'><source protocol='iscsi' name='iqn.1992-01.com.example:storage/1'>"
        "<host name='example.org' port='3260'/></source></hostdev>",
        "<hostdev mode='subsystem' type='scsi_host'><source protocol='vhost' wwpn='naa.5123456789abcde0'/></hostdev>",
        "<hostdev mode='subsystem' type='scsi'><source><adapter name='scsi_host0'/>"
        "<address bus='0' target='0' unit='0'/></source></hostdev>",
    ],
)
def test_hostdevs_of_other_types_without_a_source_address_are_valid(hostdev: str) -> None:
    assert validate_domain(domain(hostdev), hostdev_schema()) == []


def test_display_needs_graphics_and_one_ramfb_in_the_pure_domain_rules() -> None:
    root = domain(
        MDEV.format(extra=" display='on' ramfb='on'", uuid=UUID1)
        + MDEV.format(extra=" display='on' ramfb='on'", uuid=UUID2)
    )
    found = [problem.message for problem in domain_rules(root)]
    assert found == [
        "<hostdev type='mdev'> without alias: display='on' needs a <graphics> device in the domain, which has "
        "none (libvirt's QEMU driver refuses it)",
        "<hostdev type='mdev'> without alias: display='on' needs a <graphics> device in the domain, which has "
        "none (libvirt's QEMU driver refuses it)",
        "<hostdev type='mdev'> without alias: ramfb='on' again (first at line 1); only one vGPU may have ramfb",
    ]
    with_graphics = domain("<graphics type='vnc'/>" + MDEV.format(extra=" display='on' ramfb='on'", uuid=UUID1))
    assert domain_rules(with_graphics) == []


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (pci("0x86"), pci("134")),
        (MDEV.format(extra="", uuid=UUID1), MDEV.format(extra="", uuid=UUID1)),
        (
            "<hostdev mode='subsystem' type='usb'><source><address bus='14' device='6'/></source></hostdev>",
            "<hostdev mode='subsystem' type='usb'><source><address bus='0xe' device='6'/></source></hostdev>",
        ),
        (
            "<hostdev mode='subsystem' type='scsi'><source><adapter name='scsi_host0'/>"
            "<address bus='0' target='0' unit='0'/></source></hostdev>",
            "<hostdev mode='subsystem' type='scsi'><source><adapter name='scsi_host0'/>"
            "<address bus='0' target='0' unit='0'/></source></hostdev>",
        ),
        (
            "<hostdev mode='subsystem' type='usb'><source><vendor id='0x1234'/><product id='0xbeef'/></source>"
            "</hostdev>",
            "<hostdev mode='subsystem' type='usb'><source><vendor id='4660'/><product id='0xBEEF'/>"
            "<address bus='1' device='2'/></source></hostdev>",
        ),
        (
            pci("0x86"),
            "<interface type='hostdev'><source><address type='pci' domain='0' bus='0x86' slot='0' function='0'/>"
            "</source></interface>",
        ),
    ],
)
def test_the_same_source_twice_is_an_error(first: str, second: str) -> None:
    found = [problem.message for problem in domain_rules(domain(first + second))]
    assert len(found) == 1 and "is passed through again" in found[0], found


def test_usb_devices_are_matched_by_the_earlier_ones_form() -> None:
    """libvirt compares by the first device's form: an address there is compared with the later device's
    address only (so the same IDs at another form are not a duplicate that way round)."""
    by_address = (
        "<hostdev mode='subsystem' type='usb'><source><vendor id='0x1234'/><product id='0xbeef'/>"
        "<address bus='1' device='2'/></source></hostdev>"
    )
    by_ids = (
        "<hostdev mode='subsystem' type='usb'><source><vendor id='0x1234'/><product id='0xbeef'/></source></hostdev>"
    )
    assert domain_rules(domain(by_address + by_ids)) == []
    assert len(domain_rules(domain(by_ids + by_address))) == 1


def test_a_scsi_drive_address_taken_by_a_disk_or_hostdev_is_an_error() -> None:
    scsi = (
        "<hostdev mode='subsystem' type='scsi'><source><adapter name='scsi_host0'/><address bus='0' target='0' "
        "unit='{unit}'/></source><address type='drive' controller='0' bus='0' target='0' unit='0'/></hostdev>"
    )
    disk = "<disk type='block' device='disk'><source dev='/dev/x'/><target dev='sda' bus='scsi'/></disk>"
    assert [p.message for p in domain_rules(domain(disk + scsi.format(unit=1)))] == [
        "<hostdev type='scsi'> without alias: guest drive address controller=0 bus=0 target=0 unit=0 is used by "
        "the SCSI disk 'sda' (line 1)"
    ]
    assert "is taken already" in domain_rules(domain(scsi.format(unit=1) + scsi.format(unit=2)))[0].message
    assert domain_rules(domain(disk.replace("sda", "sdb") + scsi.format(unit=1))) == []


@pytest.mark.libvirt
def test_validate_prints_warnings_and_exits_0_without_errors() -> None:
    xml = etree.tostring(domain(pci("10", "ua-gpu0")))
    result = CliRunner().invoke(cli, ["validate", "-"], input=xml, catch_exceptions=False)
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [
        "line 1: warning: <hostdev type='pci'> 'ua-gpu0': source address bus='10': libvirt reads '10' as "
        "decimal 10 (0xa), not hex 10; write 0x0a",
        "ok: 1 hostdev valid (configuration), 1 warning",
    ]


USB = "<hostdev mode='subsystem' type='usb'><source>{source}</source>{guest}</hostdev>"
SCSI = (
    "<hostdev mode='subsystem' type='scsi'><source><adapter name='scsi_host0'/>"
    "<address bus='0' target='0' unit='{unit}'/></source>{guest}</hostdev>"
)
CRAFTED = {
    # name: (devices, accepted by libvirt, a phrase of xmlgen validate's output)
    "usb bus in octal": (
        USB.format(source="<address bus='014' device='6'/>", guest=""),
        True,
        "warning: <hostdev type='usb'> without alias: source <address> bus='014': libvirt reads '014' as octal 12",
    ),
    "usb ids in decimal": (
        USB.format(source="<vendor id='4660'/><product id='0xbeef'/>", guest=""),
        True,
        "source <vendor> id='4660': libvirt reads '4660' as decimal 4660 (0x1234), not hex 4660",
    ),
    "usb id not a number": (
        USB.format(source="<vendor id='0x12g4'/><product id='0xbeef'/>", guest=""),
        False,
        "error: <hostdev type='usb'> without alias",
    ),
    "drive unit in hex": (
        SCSI.format(unit="1", guest="<address type='drive' controller='0' bus='0' target='0' unit='0x1'/>"),
        False,
        "guest <address> unit='0x1' is not decimal digits libvirt reads",
    ),
    "drive unit with leading zero": (
        SCSI.format(unit="1", guest="<address type='drive' controller='0' bus='0' target='0' unit='010'/>"),
        True,
        "ok: 1 hostdev valid",
    ),
    "guest pci slot in hex without 0x": (
        pci("0x86", "ua-gpu0").replace(
            "</source>", "</source><address type='pci' domain='0' bus='0' slot='1f' function='0'/>"
        ),
        False,
        "guest <address> slot='1f' is not a number (0x hex, 0-prefixed octal or decimal) libvirt reads",
    ),
    "scsi unit in octal": (
        SCSI.format(unit="010", guest=""),
        True,
        "source <address> unit='010': libvirt reads '010' as octal 8 (0x8), not decimal 010",
    ),
}


@pytest.mark.libvirt
@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_numbers_get_libvirts_verdict(name: str) -> None:
    """Each crafted domain gets the same verdict from libvirt (its test driver, live) and xmlgen validate."""
    from tests.libvirt_support import missing
    from xmlgen.libvirt_check import LibvirtUnavailable, generic_refusal

    devices, accepted, phrase = CRAFTED[name]
    xml = (
        "<domain type='test'><name>crafted</name><memory>1024</memory><os><type>hvm</type></os>"
        f"<devices>{devices}</devices></domain>"
    )
    try:
        refusal = generic_refusal(xml)
    except LibvirtUnavailable as exc:
        missing(str(exc))
    assert (refusal is None) == accepted, refusal
    result = CliRunner().invoke(cli, ["validate", "-"], input=xml.encode(), catch_exceptions=False)
    assert result.exit_code == (0 if accepted else 1), result.stdout
    assert phrase in result.stdout, result.stdout
