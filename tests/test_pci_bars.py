"""BAR sizes from sysfs ``resource`` (docs/large-bar.md, "Reading the BARs"): the strict parser, the confined
reader, and the fixture trees' files (real sizes of TU106, A100 80GB and L40S)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.pci_bars import SysfsBars
from schemas import InputError
from schemas.pci import PciAddress
from schemas.pci_bars import MAX_RESOURCE_BYTES, Bar, format_size, parse_resource
from simkit.fixture_nodes import A100_NODE, NODE01, SRIOV_VGPU_NODE
from simkit.sysfs_fixture import build

GIB = 1 << 30
MIB = 1 << 20
A100 = PciAddress.parse("0000:3b:00.0")
ZERO = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"


def resource(*lines: str, count: int = 13) -> str:
    return "".join(lines) + ZERO * (count - len(lines))


# An A100 80GB on a host (sysfs resource as the kernel prints it: BAR0 32-bit, BAR1 and BAR3 64-bit prefetchable).
A100_RESOURCE = resource(
    "0x00000000e0000000 0x00000000e0ffffff 0x0000000000040200\n",
    "0x0000380000000000 0x0000381fffffffff 0x000000000014220c\n",
    ZERO,
    "0x0000382000000000 0x0000382001ffffff 0x000000000014220c\n",
)


def test_an_a100_resource_file_gives_its_three_bars() -> None:
    bars = parse_resource(A100_RESOURCE, "test")
    assert [(bar.index, bar.size, bar.is_64bit, bar.prefetchable) for bar in bars] == [
        (0, 16 * MIB, False, False),
        (1, 128 * GIB, True, True),
        (3, 32 * MIB, True, True),
    ]
    assert [bar.describe() for bar in bars] == [
        "BAR0 16 MiB 32-bit",
        "BAR1 128 GiB 64-bit prefetchable",
        "BAR3 32 MiB 64-bit prefetchable",
    ]


def test_io_bars_the_rom_and_sriov_lines_are_not_64bit_memory() -> None:
    text = resource(
        ZERO,
        ZERO,
        ZERO,
        ZERO,
        ZERO,
        "0x0000000000003000 0x000000000000307f 0x0000000000040101\n",  # BAR5 I/O 128 bytes
        "0x00000000e1000000 0x00000000e107ffff 0x0000000000046200\n",  # the ROM: not a BAR
        "0x0000390000000000 0x00000390ffffffff 0x000000000014220c\n",  # an SR-IOV BAR: not the function's
    )
    (io_bar,) = parse_resource(text, "test")
    assert (io_bar.index, io_bar.size, io_bar.is_memory, io_bar.is_64bit) == (5, 128, False, False)
    assert io_bar.describe() == "BAR5 128 B I/O"


def test_a_bar_the_kernel_could_not_assign_keeps_its_size() -> None:
    text = resource(ZERO, "0x0000000000000000 0x0000001fffffffff 0x000000002014220c\n")  # IORESOURCE_UNSET, start 0
    (bar,) = parse_resource(text, "test")
    assert (bar.index, bar.size, bar.is_64bit) == (1, 128 * GIB, True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ZERO * 5, "5 lines; a PCI function's resource file lists at least 6 BARs"),
        (ZERO * 40, "40 lines, more than a PCI function has resources"),
        (resource("0x0 0x1\n"), "line 1 is not '0x<start> 0x<end> 0x<flags>'"),
        (resource("1000 1fff 200\n"), "line 1 is not '0x<start> 0x<end> 0x<flags>'"),
        (resource("0x1000 0xzz 0x200\n"), "line 1 has a number that is not hex"),
        (resource(ZERO, "0x2000 0x1000 0x200\n"), "line 2 ends (0x1000) before it starts (0x2000)"),
        (resource("0x1000 0x1fff 0x0\n"), "line 1 (BAR0) has a range but flags 0x0 say neither I/O nor memory"),
        (resource("0x1 0x10000000000000000 0x200\n"), "line 1 has a number wider than 64 bits"),
    ],
)
def test_malformed_content_is_refused_naming_the_file_and_line(text: str, message: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_resource(text, "PCI device 0000:3b:00.0: '/sys/x/resource'")
    assert str(caught.value).startswith("PCI device 0000:3b:00.0: '/sys/x/resource': ")
    assert message in str(caught.value)


def test_sizes_are_told_in_the_largest_unit_that_divides_them() -> None:
    assert [format_size(size) for size in (128 * GIB, 32 * MIB, 16 << 10, 128, 3 * MIB + 1)] == [
        "128 GiB",
        "32 MiB",
        "16 KiB",
        "128 B",
        f"{3 * MIB + 1} B",
    ]


def test_fixture_trees_carry_the_real_bar_sizes(tmp_path: Path) -> None:
    a100 = SysfsBars(build(A100_NODE, tmp_path / "a100") / "sys")
    assert [bar.describe() for bar in a100.read(A100).bars] == [
        "BAR0 16 MiB 32-bit",
        "BAR1 128 GiB 64-bit prefetchable",
        "BAR3 32 MiB 64-bit prefetchable",
    ]
    seed = SysfsBars(build(NODE01, tmp_path / "node01") / "sys")
    assert [bar.describe() for bar in seed.read(PciAddress.parse("0000:86:00.0")).bars] == [
        "BAR0 16 MiB 32-bit",
        "BAR1 256 MiB 64-bit prefetchable",
        "BAR3 32 MiB 64-bit prefetchable",
        "BAR5 128 B I/O",
    ]
    assert seed.read(PciAddress.parse("0000:86:00.1")).bars == ()  # the audio function: no BAR given
    root_port = (tmp_path / "node01" / "sys" / "bus" / "pci" / "devices" / "0000:85:00.0" / "resource").read_text()
    assert root_port.count("\n") == 17  # a bridge has its four window lines too
    l40s = SysfsBars(build(SRIOV_VGPU_NODE, tmp_path / "l40s") / "sys").read(PciAddress.parse("0000:3b:00.0"))
    assert Bar(1, 64 * GIB, 0x0014220C) in l40s.bars


def test_read_all_reads_each_address_once_in_order(tmp_path: Path) -> None:
    reader = SysfsBars(build(A100_NODE, tmp_path / "a100") / "sys")
    other = PciAddress.parse("0000:d8:00.0")
    assert [device.address for device in reader.read_all([other, A100, other])] == [other, A100]


def test_a_missing_device_names_the_device_and_the_file(tmp_path: Path) -> None:
    reader = SysfsBars(build(A100_NODE, tmp_path / "a100") / "sys")
    with pytest.raises(
        InputError, match=r"PCI device 0000:5e:00\.0: BAR list '.*/0000:5e:00\.0/resource'.*does not exist"
    ):
        reader.read(PciAddress.parse("0000:5e:00.0"))


def test_a_link_out_of_the_root_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "resource").write_text(A100_RESOURCE)
    root = tmp_path / "root" / "sys"
    devices = root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    (devices / str(A100)).symlink_to(os.path.relpath(outside, devices))
    with pytest.raises(InputError, match="leads out of that root"):
        SysfsBars(root).read(A100)
    (devices / str(A100)).unlink()
    (devices / str(A100)).symlink_to(outside)  # absolute
    with pytest.raises(InputError, match="leads out of that root"):
        SysfsBars(root).read(A100)


def test_a_fifo_or_an_oversized_file_is_not_read(tmp_path: Path) -> None:
    device = tmp_path / "sys" / "bus" / "pci" / "devices" / str(A100)
    device.mkdir(parents=True)
    os.mkfifo(device / "resource")
    with pytest.raises(InputError, match="is a FIFO, not a regular file"):
        SysfsBars(tmp_path / "sys").read(A100)
    (device / "resource").unlink()
    (device / "resource").write_text(ZERO * (MAX_RESOURCE_BYTES // len(ZERO) + 1))
    with pytest.raises(InputError, match=f"over the {MAX_RESOURCE_BYTES}-byte limit"):
        SysfsBars(tmp_path / "sys").read(A100)
    (device / "resource").write_bytes(b"\xff" * 100)
    with pytest.raises(InputError, match=r"is not ASCII text \(byte 0\)"):
        SysfsBars(tmp_path / "sys").read(A100)


def test_a_root_that_is_not_a_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"sysfs root .* is not a directory"):
        SysfsBars(tmp_path / "nowhere").read(A100)


@settings(max_examples=500, deadline=None)
@given(
    st.text(max_size=2000) | st.lists(st.sampled_from([ZERO, "0x1000 0x1fff 0x200\n", "0x 0x 0x\n", "\n"])).map("".join)
)
def test_any_text_is_bars_or_an_input_error(text: str) -> None:
    message = ""
    bars: tuple[Bar, ...] = ()
    try:
        bars = parse_resource(text, "fuzz")
    except InputError as exc:
        message = str(exc)
    assert message.startswith("fuzz") if message else all(0 <= bar.index < 6 and bar.size > 0 for bar in bars)


_U64 = st.integers(0, (1 << 64) - 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_U64, _U64, _U64), min_size=6, max_size=13))
def test_the_kernels_spelling_reads_as_any_other_spelling(lines: list[tuple[int, int, int]]) -> None:
    """A file in the kernel's own form (``0x%016llx`` three times) is read by a shortcut; the same numbers
    spelled otherwise (upper-case digits, tabs) go the general way: both give the same BARs or the same error."""
    kernel = "".join(f"0x{start:016x} 0x{end:016x} 0x{flags:016x}\n" for start, end, flags in lines)
    other = "".join(f"0x{start:X}\t0X{end:x}  0x{flags:X}\n" for start, end, flags in lines)

    def outcome(text: str) -> object:
        try:
            return parse_resource(text, "f")
        except InputError as exc:
            return str(exc).split(":", 2)[-1].split("(")[0]  # the line's fault, without the spelled line

    assert outcome(kernel) == outcome(other)
