"""The guest's 64-bit PCI window for large-BAR GPUs (docs/large-bar.md): the pure sizing, reading the domain,
and writing ``-fw_cfg name=opt/ovmf/X-PciMmio64Mb`` into EFI domains without disturbing anything else."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

from launcher_hook import BuildOptions, build_domain
from launcher_hook.domain import parse_domain
from launcher_hook.mmio_window import (
    FW_CFG_NAME,
    GIB,
    HOTPLUG_PADDING_DIVISOR,
    HOTPLUG_PORTS,
    MIB,
    OVMF_DEFAULT_WINDOW,
    PLANS_KEPT,
    _plans,
    explicit_window,
    guest_firmware,
    insert_qemu_args_text,
    insert_qemu_args_tree,
    kept_plan,
    needed_bytes,
    plan_window,
)
from runtime.pci_bars import SysfsBars
from schemas import InputError
from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from schemas.pci import PciAddress
from schemas.pci_bars import Bar, DeviceBars
from simkit.fixture_nodes import A100_NODE
from simkit.sysfs_fixture import build
from tests.test_hook_cli import shim
from xmlgen.cli import cli

EXAMPLES = Path(__file__).parent.parent / "xmlgen" / "examples"
EFI_DOMAIN = (EXAMPLES / "a100-efi" / "domain.xml").read_bytes()
SEED_DOMAIN = (EXAMPLES / "seed-node01" / "domain.xml").read_bytes()
A100_VAR = "PCI_RESOURCE_NVIDIA_COM_GA100_A100_PCIE_80GB"
FIRST, SECOND = "0000:3b:00.0", "0000:d8:00.0"
MEM32, MEM64_PREF, IO = 0x00040200, 0x0014220C, 0x00040101


def device(address: str, *bars: tuple[int, int, int]) -> DeviceBars:
    return DeviceBars(PciAddress.parse(address), tuple(Bar(index, size, flags) for index, size, flags in bars))


# BAR layouts of public lspci listings (docs/large-bar.md, "BAR sizes").
A100_80GB = ((0, 16 * MIB, MEM32), (1, 128 * GIB, MEM64_PREF), (3, 32 * MIB, MEM64_PREF))
H100_80GB = ((0, 16 * MIB, MEM64_PREF), (2, 128 * GIB, MEM64_PREF), (4, 32 * MIB, MEM64_PREF))
L40S = ((0, 16 * MIB, MEM32), (1, 64 * GIB, MEM64_PREF), (3, 32 * MIB, MEM64_PREF))
A30 = ((0, 16 * MIB, MEM32), (1, 32 * GIB, MEM64_PREF), (3, 32 * MIB, MEM64_PREF))
TU106 = ((0, 16 * MIB, MEM32), (1, 256 * MIB, MEM64_PREF), (3, 32 * MIB, MEM64_PREF), (5, 128, IO))


@pytest.mark.parametrize(
    ("cards", "needed", "window_mib", "writes"),
    [
        ([A100_80GB], 128 * GIB + 32 * MIB, 262144, True),
        # The second card's 128 GiB-aligned port starts at 256 GiB: its neighbour's 32 MiB BAR pushed it.
        ([A100_80GB, A100_80GB], 384 * GIB + 32 * MIB, 524288, True),
        ([H100_80GB], 128 * GIB + 48 * MIB, 262144, True),
        ([L40S], 64 * GIB + 32 * MIB, 131072, True),
        ([A30], 32 * GIB + 32 * MIB, 65536, True),  # a 32 GiB BAR1 overflows OVMF's 32 GiB default (#11093)
        ([TU106, TU106], 800 * MIB, 1024, False),  # the seed's RTX 2060s fit the default easily
        ([], 0, 1024, False),
    ],
)
def test_real_cards_get_the_window_they_need(
    cards: list[tuple[tuple[int, int, int], ...]], needed: int, window_mib: int, writes: bool
) -> None:
    plan = plan_window(device(f"0000:{0x3B + n:02x}:00.0", *bars) for n, bars in enumerate(cards))
    assert (plan.needed, plan.window_mib, plan.writes) == (needed, window_mib, writes)


def test_the_threshold_is_ovmfs_default_window() -> None:
    assert OVMF_DEFAULT_WINDOW == 32 * GIB
    assert not plan_window([device(FIRST, (1, 16 * GIB, MEM64_PREF), (3, 8 * GIB, MEM64_PREF))]).writes  # 24 GiB
    assert plan_window([device(FIRST, (1, 32 * GIB, MEM64_PREF))]).writes  # 32 GiB: no room left for the rest


def test_32bit_and_io_bars_do_not_count() -> None:
    plan = plan_window([device(FIRST, (0, 256 * MIB, MEM32), (5, 128, IO), (6, 512 * MIB, 0x00042208))])
    assert plan.needed == 0


def test_past_16_tib_the_value_is_capped_with_a_warning_and_past_512_gib_phys_bits_are_named() -> None:
    huge = plan_window([device(f"0000:{n:02x}:00.0", (1, 8 << 40, MEM64_PREF)) for n in range(1, 4)])
    assert huge.window_mib == 0x1000000
    assert "more than the 16 TiB OVMF accepts" in huge.warnings()[0]
    two = plan_window([device(FIRST, *A100_80GB), device(SECOND, *A100_80GB)])
    assert two.warnings() == []  # 512 GiB: still within 40 address bits
    four = plan_window([device(f"0000:{n:02x}:00.0", *A100_80GB) for n in range(1, 5)])
    assert four.window_mib == 1 << 20
    assert "more than 40 physical address bits" in four.warnings()[0]


sizes = st.integers(min_value=12, max_value=40).map(lambda bits: 1 << bits)
devices = st.lists(
    st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 4, 5]), sizes), max_size=3).map(
        lambda bars: tuple(Bar(index, size, MEM64_PREF) for index, size in bars)
    ),
    max_size=6,
).map(lambda lists: [DeviceBars(PciAddress(0, n + 1, 0, 0), bars) for n, bars in enumerate(lists)])


@settings(max_examples=300, deadline=None)
@given(devices)
def test_the_window_is_the_smallest_power_of_two_with_room_for_the_bars_and_the_hotplug_padding(
    found: list[DeviceBars],
) -> None:
    plan = plan_window(found)
    window = plan.window
    assert window >= GIB and window & (window - 1) == 0
    ports = max(HOTPLUG_PORTS - sum(1 for one in found if one.bars_64bit), 0)
    assert plan.needed + ports * window // HOTPLUG_PADDING_DIVISOR <= window
    if window > GIB:
        half = window // 2
        assert plan.needed + ports * half // HOTPLUG_PADDING_DIVISOR > half
    assert plan.writes == (window > 32 * GIB)


@settings(max_examples=300, deadline=None)
@given(devices)
def test_the_span_holds_every_bar_and_wastes_less_than_it_uses(found: list[DeviceBars]) -> None:
    total = sum(bar.size for one in found for bar in one.bars_64bit)
    rounded = sum(-(-sum(bar.size for bar in one.bars_64bit) // MIB) * MIB for one in found)
    needed = needed_bytes(found)
    assert total <= needed < 2 * rounded or needed == total == 0
    for order in itertools.islice(itertools.permutations(found), 6):
        assert needed_bytes(list(order)) == needed  # OVMF sorts; so does the computation


@settings(max_examples=200, deadline=None)
@given(devices, devices)
def test_more_devices_never_need_a_smaller_window(first: list[DeviceBars], more: list[DeviceBars]) -> None:
    assert needed_bytes(first + more) >= needed_bytes(first)
    assert plan_window(first + more).window >= plan_window(first).window


# ---- the domain ----------------------------------------------------------------------------------------


class Bars:
    """A BAR source of fixed devices that records what it was asked."""

    def __init__(self, *found: DeviceBars) -> None:
        self.found = {one.address: one for one in found}
        self.asked: list[PciAddress] = []

    def read_all(self, addresses: Iterable[PciAddress]) -> list[DeviceBars]:
        listed = list(dict.fromkeys(addresses))
        self.asked += listed
        return [self.found.get(address, DeviceBars(address, ())) for address in listed]

    def describe(self) -> str:
        return "/test/sys"


def a100s(*addresses: str) -> Bars:
    return Bars(*(device(address, *A100_80GB) for address in addresses))


def env(*addresses: str) -> dict[str, str]:
    return {A100_VAR: ",".join(addresses)}


ARGS_262144 = (
    b'\n\t\t<qemu:arg value="-fw_cfg"></qemu:arg>'
    b'\n\t\t<qemu:arg value="name=opt/ovmf/X-PciMmio64Mb,string=262144"></qemu:arg>'
)


def test_an_efi_kubevirt_domain_gets_two_args_and_nothing_else_changes() -> None:
    plain = build_domain(EFI_DOMAIN, None, env(FIRST)).domain_xml
    result = build_domain(EFI_DOMAIN, None, env(FIRST), BuildOptions(bars=a100s(FIRST)))
    assert result.domain_xml == plain.replace(b"\n\t</qemu:commandline>", ARGS_262144 + b"\n\t</qemu:commandline>")
    assert result.mmio is not None and result.mmio.written_mib == 262144
    assert result.mmio.describe() == (
        "0000:3b:00.0 BAR1 128 GiB, BAR3 32 MiB: 64-bit BARs span 131104 MiB, window 256 GiB → "
        "opt/ovmf/X-PciMmio64Mb=262144 (EFI guest, loader /usr/share/OVMF/OVMF_CODE.fd)"
    )
    assert result.warnings == []
    found = explicit_window(parse_domain(result.domain_xml, DEFAULT_MAX_INPUT_BYTES).root)
    assert found is not None and found.mib == 262144
    # Building again keeps the value and writes nothing more.
    again = build_domain(result.domain_xml, None, env(FIRST), BuildOptions(bars=a100s(FIRST)))
    assert again.domain_xml == result.domain_xml


def test_two_a100s_and_the_fixture_trees_sysfs(tmp_path: Path) -> None:
    reader = SysfsBars(build(A100_NODE, tmp_path / "node") / "sys")
    result = build_domain(EFI_DOMAIN, None, env(FIRST, SECOND), BuildOptions(bars=reader))
    assert b'<qemu:arg value="name=opt/ovmf/X-PciMmio64Mb,string=524288"></qemu:arg>' in result.domain_xml


def test_a_bios_guest_is_left_byte_for_byte_and_no_bar_is_read() -> None:
    seed_env = {"PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A": "0000:86:00.0"}
    bars = a100s("0000:86:00.0")
    result = build_domain(SEED_DOMAIN, None, seed_env, BuildOptions(bars=bars))
    assert result.domain_xml == build_domain(SEED_DOMAIN, None, seed_env).domain_xml
    assert bars.asked == []
    assert result.mmio is not None and result.mmio.describe().startswith("not an OVMF (x86 EFI) guest")


def test_small_bars_write_nothing() -> None:
    bars = Bars(device(FIRST, *TU106))
    result = build_domain(EFI_DOMAIN, None, env(FIRST), BuildOptions(bars=bars))
    assert result.domain_xml == build_domain(EFI_DOMAIN, None, env(FIRST)).domain_xml
    assert result.mmio is not None and "within OVMF's default 32 GiB, nothing written" in result.mmio.describe()


@pytest.mark.parametrize(
    ("os_element", "firmware"),
    [
        (
            '<os><type arch="x86_64">hvm</type><loader type="pflash">/x/OVMF_CODE.fd</loader></os>',
            "loader /x/OVMF_CODE.fd",
        ),
        ('<os firmware="efi"><type arch="x86_64">hvm</type></os>', "firmware='efi'"),
        (
            '<os><type>hvm</type><loader type="rom">/usr/share/OVMF/OVMF.amdsev.fd</loader></os>',
            "loader /usr/share/OVMF/OVMF.amdsev.fd",
        ),
        ('<os><type arch="x86_64">hvm</type><loader type="rom">/usr/share/seabios/bios.bin</loader></os>', None),
        ('<os><type arch="x86_64">hvm</type></os>', None),
        ('<os firmware="efi"><type arch="aarch64">hvm</type></os>', None),
        ('<os><type arch="aarch64">hvm</type><loader type="pflash">/AAVMF_CODE.fd</loader></os>', None),
        ("", None),
    ],
)
def test_which_guests_boot_ovmf(os_element: str, firmware: str | None) -> None:
    assert guest_firmware(etree.fromstring(f"<domain>{os_element}</domain>")) == firmware


def with_commandline(*args: str) -> bytes:
    inner = "".join(f'\n\t\t<qemu:arg value="{value}"></qemu:arg>' for value in args)
    return EFI_DOMAIN.replace(b"\n\t</qemu:commandline>", inner.encode() + b"\n\t</qemu:commandline>")


@pytest.mark.parametrize(
    ("args", "mib", "warned"),
    [
        (("-fw_cfg", "name=opt/ovmf/X-PciMmio64Mb,string=65536"), 65536, True),
        (("-fw_cfg", "opt/ovmf/X-PciMmio64Mb,string=0x80000"), 524288, False),
        (("--fw_cfg", "string=1048576,name=opt/ovmf/X-PciMmio64Mb"), 1048576, False),
        (("-fw_cfg", "name=opt/ovmf/X-PciMmio64Mb,file=/etc/size"), None, False),
    ],
)
def test_an_explicit_value_is_kept_and_a_smaller_one_warned_about(
    args: tuple[str, str], mib: int | None, warned: bool
) -> None:
    domain = with_commandline(*args)
    plain = build_domain(domain, None, env(FIRST)).domain_xml
    result = build_domain(domain, None, env(FIRST), BuildOptions(bars=a100s(FIRST)))
    assert result.domain_xml == plain
    assert result.mmio is not None and result.mmio.explicit is not None and result.mmio.explicit.mib == mib
    assert result.mmio.written_mib is None
    smaller = [warning for warning in result.warnings if "smaller than the 262144 MiB" in warning]
    assert bool(smaller) == warned
    assert "kept" in result.mmio.describe()


def test_other_fw_cfg_items_are_not_the_window() -> None:
    domain = with_commandline("-fw_cfg", "name=opt/com.coreos/config,file=/ign.json")
    result = build_domain(domain, None, env(FIRST), BuildOptions(bars=a100s(FIRST)))
    assert result.mmio is not None and result.mmio.written_mib == 262144


def test_a_sysinfo_fwcfg_entry_is_kept_and_said_to_be_refused_by_libvirt() -> None:
    domain = EFI_DOMAIN.replace(
        b"\t<devices>",
        b'\t<sysinfo type="fwcfg">\n\t\t<entry name="opt/ovmf/X-PciMmio64Mb">262144</entry>\n\t</sysinfo>\n\t<devices>',
    )
    result = build_domain(domain, None, env(FIRST), BuildOptions(bars=a100s(FIRST)))
    assert result.domain_xml == build_domain(domain, None, env(FIRST)).domain_xml
    assert result.mmio is not None and result.mmio.explicit is not None and result.mmio.explicit.mib == 262144
    assert any("That firmware name is reserved" in warning for warning in result.warnings)


def test_unreadable_bars_fail_the_call_naming_the_device_file_and_the_way_out(tmp_path: Path) -> None:
    with pytest.raises(InputError) as caught:
        build_domain(EFI_DOMAIN, None, env(FIRST), BuildOptions(bars=SysfsBars(tmp_path)))
    message = str(caught.value)
    assert "PCI device 0000:3b:00.0: BAR list" in message and "/bus/pci/devices/0000:3b:00.0/resource" in message
    assert "--pci-mmio64 off" in message and "--sysfs-root" in message


# ---- text insertion and tree edit give the same bytes ------------------------------------------------------

ARGS = ("-fw_cfg", "name=opt/ovmf/X-PciMmio64Mb,string=262144")
OS = '<os><type arch="x86_64" machine="q35">hvm</type><loader type="pflash">/OVMF_CODE.fd</loader></os>'
SHAPES = {
    "kubevirt": EFI_DOMAIN,
    "no commandline, no namespace, two spaces": (
        f'<?xml version="1.0"?>\n<domain type="kvm">\n  <name>a</name>\n  {OS}\n'
        "  <devices>\n    <disk/>\n  </devices>\n</domain>\n"
    ).encode(),
    "compact": f'<domain type="kvm"><name>a</name>{OS}<devices><disk/></devices></domain>'.encode(),
    "namespace, no commandline": (
        f'<domain type="kvm" xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0">\n\t<name>a</name>\n\t{OS}\n'
        "</domain>"
    ).encode(),
    "another prefix": (
        f'<domain type="kvm" xmlns:q="http://libvirt.org/schemas/domain/qemu/1.0">\n  <name>a</name>\n  {OS}\n'
        '  <q:commandline>\n    <q:env name="A" value="b"/>\n  </q:commandline>\n</domain>\n'
    ).encode(),
    "qemu taken": (f'<domain type="kvm" xmlns:qemu="urn:other">\n  <name>a</name>\n  {OS}\n</domain>\n').encode(),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_the_text_insertion_and_the_tree_edit_give_the_same_bytes(shape: str) -> None:
    domain = SHAPES[shape]
    parsed = parse_domain(domain, DEFAULT_MAX_INPUT_BYTES)
    text = insert_qemu_args_text(parsed, domain, ARGS)
    assert text is not None
    assert text == insert_qemu_args_tree(domain, ARGS, DEFAULT_MAX_INPUT_BYTES)
    root = etree.fromstring(text)
    found = explicit_window(root)
    assert found is not None and found.mib == 262144
    # Nothing else changed: the original bytes are the output without one inserted block (and the namespace).
    declared = re.search(rb' xmlns:qemu\d*="http://libvirt.org/schemas/domain/qemu/1.0"', text)
    if declared is not None and declared.group() not in domain:
        text = text[: declared.start()] + text[declared.end() :]
    prefix = next((n for n, (a, b) in enumerate(zip(text, domain, strict=False)) if a != b), len(domain))
    inserted = text[prefix : prefix + len(text) - len(domain)]
    assert text[prefix + len(inserted) :] == domain[prefix:]
    assert inserted.count(b":arg ") == 2 and b"X-PciMmio64Mb" in inserted


def test_comments_take_the_tree_path_and_are_kept() -> None:
    domain = EFI_DOMAIN.replace(b"<devices>", b"<!-- the VM's devices --><devices>", 1)
    result = build_domain(domain, None, env(FIRST), BuildOptions(bars=a100s(FIRST)))
    assert insert_qemu_args_text(parse_domain(domain, DEFAULT_MAX_INPUT_BYTES), domain, ARGS) is None
    assert b"<!-- the VM's devices -->" in result.domain_xml
    found = explicit_window(etree.fromstring(result.domain_xml))
    assert found is not None and found.mib == 262144
    assert result.domain_xml.count(b"<qemu:commandline>") == 1


def test_an_empty_commandline_element_is_filled_by_the_tree_edit() -> None:
    domain = (
        '<domain type="kvm" xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0">\n'
        f"  <name>a</name>\n  {OS}\n  <qemu:commandline/>\n</domain>\n"
    ).encode()
    assert insert_qemu_args_text(parse_domain(domain, DEFAULT_MAX_INPUT_BYTES), domain, ARGS) is None
    assert insert_qemu_args_tree(domain, ARGS, DEFAULT_MAX_INPUT_BYTES) == domain.replace(
        b"  <qemu:commandline/>\n",
        b'  <qemu:commandline>\n    <qemu:arg value="-fw_cfg"/>\n'
        b'    <qemu:arg value="name=opt/ovmf/X-PciMmio64Mb,string=262144"/>\n  </qemu:commandline>\n',
    )


def test_the_name_is_the_one_ovmf_reads() -> None:
    assert FW_CFG_NAME == "opt/ovmf/X-PciMmio64Mb"


# ---- the programs' options ---------------------------------------------------------------------------------


def test_the_shim_reads_bars_under_the_sysfs_root_its_env_names(tmp_path: Path) -> None:
    sys_root = build(A100_NODE, tmp_path / "node") / "sys"
    vmi = (EXAMPLES / "a100-efi" / "vmi.json").read_text()
    args = ("--vmi", vmi, "--domain", EFI_DOMAIN.decode())
    done = shim(*args, **env(FIRST), LAUNCHER_HOOK_SYSFS_ROOT=str(sys_root))
    assert done.returncode == 0, done.stderr.decode()
    assert b"name=opt/ovmf/X-PciMmio64Mb,string=262144" in done.stdout
    assert '"pci_mmio64_mib":262144' in done.stderr.decode()
    off = shim(*args, **env(FIRST), LAUNCHER_HOOK_SYSFS_ROOT=str(sys_root), LAUNCHER_HOOK_PCI_MMIO64="off")
    assert off.returncode == 0 and b"X-PciMmio64Mb" not in off.stdout
    missing = shim(*args, **env(FIRST), LAUNCHER_HOOK_SYSFS_ROOT=str(tmp_path / "empty"))
    assert missing.returncode == 1 and missing.stdout == b""
    assert "INVALID_ARGUMENT: sysfs root" in missing.stderr.decode()


def test_xmlgen_render_takes_the_sysfs_root(tmp_path: Path) -> None:
    sys_root = build(A100_NODE, tmp_path / "node") / "sys"
    (tmp_path / "env").write_text(f"{A100_VAR}={FIRST},{SECOND}\n")
    domain = str(EXAMPLES / "a100-efi" / "domain.xml")
    common = ["render", "--domain", domain, "--environ-file", str(tmp_path / "env")]
    done = CliRunner().invoke(cli, [*common, "--sysfs-root", str(sys_root)])
    assert done.exit_code == 0, done.output
    assert 'name=opt/ovmf/X-PciMmio64Mb,string=524288"' in done.stdout
    off = CliRunner().invoke(cli, [*common, "--pci-mmio64", "off"])
    assert off.exit_code == 0 and "X-PciMmio64Mb" not in off.stdout


def test_companions_count_with_their_gpu_and_the_window_is_written_after_their_slot() -> None:
    """A card's companion functions are PCI functions the guest maps too: their BARs are read with the GPU's
    (the window is decided after the companions are placed, over every function the hook passes)."""
    companion = "0000:3b:00.1"
    bars = Bars(device(FIRST, *A100_80GB), device(companion, *A100_80GB))
    allocation = {A100_VAR: FIRST, "PCI_COMPANIONS_NVIDIA_COM_GA100_A100_PCIE_80GB": f"{FIRST}={companion}"}
    result = build_domain(EFI_DOMAIN, None, allocation, BuildOptions(bars=bars))
    assert bars.asked == [PciAddress.parse(FIRST), PciAddress.parse(companion)]
    assert [placement.gpu_alias for placement in result.placements] == ["ua-gpu0"]
    assert result.mmio is not None and result.mmio.written_mib == 524288  # two 128 GiB BARs need 512 GiB
    assert b"ua-gpu0-fn1" in result.domain_xml and b"string=524288" in result.domain_xml


def test_a_domain_within_the_cap_gets_its_window_by_the_tree_edit_too() -> None:
    """The tree edit re-reads the hook's output (the GPU's hostdev added), which may outgrow the input cap."""
    domain = EFI_DOMAIN.replace(b"<devices>", b"<!-- the VM's devices --><devices>", 1)
    capped = build_domain(domain, None, env(FIRST), BuildOptions(bars=a100s(FIRST), max_input_bytes=len(domain)))
    assert capped.domain_xml == build_domain(domain, None, env(FIRST), BuildOptions(bars=a100s(FIRST))).domain_xml
    assert b"string=262144" in capped.domain_xml and b"<!-- the VM's devices -->" in capped.domain_xml


def test_a_plan_is_kept_for_the_very_same_bars_objects_only() -> None:
    """The BARs a service keeps are the same objects on every call: their plan is worked out once. Equal BARs in
    other objects (a reader that keeps nothing) get a plan worked out for them, the same as plan_window's."""
    bars = [device(FIRST, *A100_80GB), device(SECOND, *H100_80GB)]
    first = kept_plan(bars)
    assert first == plan_window(bars) and kept_plan(list(bars)) is first
    equal = [device(FIRST, *A100_80GB), device(SECOND, *H100_80GB)]
    again = kept_plan(equal)
    assert again == first and again is not first and again.devices[0] is equal[0]
    other = kept_plan([device(FIRST, *A30)])
    assert other.needed < first.needed and other == plan_window([device(FIRST, *A30)])
    for n in range(PLANS_KEPT + 1):  # more plans than kept: the store is bounded, answers stay right
        many = [device(f"0000:{n + 1:02x}:00.0", *L40S)]
        assert kept_plan(many) == plan_window(many)
    assert len(_plans) <= PLANS_KEPT


def test_an_efi_domain_without_the_qemu_namespace_and_with_a_comment_gets_its_window() -> None:
    """The tree path declares the namespace on the serialised root before it adds the arguments: the bound of
    that re-parse allows the declaration's bytes (it once refused the hook's own output as over its limit)."""
    domain = re.sub(rb"\t<qemu:commandline>.*</qemu:commandline>\n", b"", EFI_DOMAIN, flags=re.DOTALL)
    domain = re.sub(rb' xmlns:qemu="[^"]*"', b"", domain, count=1).replace(b"<devices>", b"<!-- c --><devices>", 1)
    assert b"xmlns:qemu" not in domain
    out = build_domain(domain, None, env(FIRST), BuildOptions(bars=a100s(FIRST))).domain_xml
    assert b"<!-- c -->" in out and b"X-PciMmio64Mb" in out and b"xmlns:qemu" in out
