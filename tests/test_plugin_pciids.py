"""pci.ids: parsing, the search order, the explicit file, and the real file on this machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.pciids import SEARCH_PATHS, PciIds, locate_pci_ids
from schemas import InputError
from simkit.fixture_nodes import PCI_IDS_EXCERPT

REAL_PCI_IDS = Path("/usr/share/misc/pci.ids")

SAMPLE = """\
# comment
1002  Advanced Micro Devices, Inc. [AMD/ATI]
\t1f08  Not NVIDIA
10de  NVIDIA Corporation
\t1f08  TU106 [GeForce RTX 2060 Rev. A]
\t\t1043 8673  TURBO-RTX2070-8G
# a comment inside the section
\t2236  GA102GL [A10]
10df  Emulex Corporation
\t2fff  Not NVIDIA either
C 03  Display controller
\t00  VGA compatible controller
"""


def test_device_lines_of_the_vendor_only() -> None:
    ids = PciIds.from_text(SAMPLE)
    assert ids.device_name(0x10DE, 0x1F08) == "TU106 [GeForce RTX 2060 Rev. A]"
    assert ids.device_name(0x10DE, 0x2236) == "GA102GL [A10]"
    assert ids.device_name(0x10DE, 0x2FFF) is None  # belongs to 10df
    assert ids.device_name(0x10DE, 0x1043) is None  # a subsystem line is not a device
    assert ids.device_name(0x1002, 0x1F08) == "Not NVIDIA"
    assert ids.device_name(0x8086, 0x1572) is None


def test_first_vendor_at_the_start_of_the_file() -> None:
    assert PciIds.from_text("10de  NVIDIA\n\t1eb8  TU104GL [Tesla T4]\n").device_name(0x10DE, 0x1EB8) == (
        "TU104GL [Tesla T4]"
    )


def test_excerpt_lines_are_real_pci_ids_lines() -> None:
    real = set(REAL_PCI_IDS.read_text(encoding="utf-8").splitlines())
    for line in PCI_IDS_EXCERPT.splitlines():
        if not line.startswith("#"):
            assert line in real, line


def test_real_file_lookup() -> None:
    choice = locate_pci_ids(None, Path("/nonexistent-host-root"), Path("/"))
    assert choice.database is not None
    assert choice.database.path == str(REAL_PCI_IDS)
    assert choice.database.device_name(0x10DE, 0x1F08) == "TU106 [GeForce RTX 2060 Rev. A]"
    assert choice.database.device_name(0x10DE, 0x1EB8) == "TU104GL [Tesla T4]"
    assert choice.database.device_name(0x10DE, 0x10F9) == "TU106 High Definition Audio Controller"


def _place(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_search_order_hwdata_then_debian_then_nvidia_image_host_root_first(tmp_path: Path) -> None:
    host, image = tmp_path / "host", tmp_path / "image"
    for index, relative in enumerate(SEARCH_PATHS):
        _place(image, relative, f"10de  NVIDIA\n\t1f08  image {index}\n")
    _place(host, "usr/pci.ids", "10de  NVIDIA\n\t1f08  host usr\n")
    choice = locate_pci_ids(None, host, image)
    assert choice.database is not None
    assert choice.database.device_name(0x10DE, 0x1F08) == "host usr"
    _place(host, "usr/share/misc/pci.ids", "10de  NVIDIA\n\t1f08  host misc\n")
    assert locate_pci_ids(None, host, image).database.device_name(0x10DE, 0x1F08) == "host misc"  # type: ignore[union-attr]
    _place(host, "usr/share/hwdata/pci.ids", "10de  NVIDIA\n\t1f08  host hwdata\n")
    assert locate_pci_ids(None, host, image).database.device_name(0x10DE, 0x1F08) == "host hwdata"  # type: ignore[union-attr]
    empty_host = tmp_path / "empty"
    assert locate_pci_ids(None, empty_host, image).database.device_name(0x10DE, 0x1F08) == "image 0"  # type: ignore[union-attr]


def test_none_found_lists_every_place_searched(tmp_path: Path) -> None:
    choice = locate_pci_ids(None, tmp_path / "host", tmp_path / "image")
    assert choice.database is None
    assert len(choice.searched) == 2 * len(SEARCH_PATHS)
    assert choice.searched[0] == str(tmp_path / "host" / "usr/share/hwdata/pci.ids")


def test_explicit_file_wins_and_must_exist(tmp_path: Path) -> None:
    explicit = _place(tmp_path, "mine.ids", "10de  NVIDIA\n\t1f08  mine\n")
    _place(tmp_path / "host", "usr/share/misc/pci.ids", "10de  NVIDIA\n\t1f08  host\n")
    choice = locate_pci_ids(explicit, tmp_path / "host", tmp_path)
    assert choice.database is not None
    assert choice.database.device_name(0x10DE, 0x1F08) == "mine"
    with pytest.raises(InputError, match=r"missing\.ids"):
        locate_pci_ids(tmp_path / "missing.ids", tmp_path / "host", tmp_path)
    with pytest.raises(InputError, match="not a file"):
        locate_pci_ids(tmp_path, tmp_path / "host", tmp_path)


# -- what pciutils' own reader (lib/names-parse.c, id_parse_list) accepts ------------------------------------
# An ID is followed by one space or tab, then any run of spaces/tabs before the name; hex digits of either
# case; CRLF line ends; a line of only blanks or whose first non-blank is '#' is skipped; a trailing blank
# is dropped; the nesting is the number of leading tabs.


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # NVIDIA's own tests write the vendor line with one space
        ("10de NVIDIA Corporation\n\t1f08  TU106 [GeForce RTX 2060 Rev. A]\n", "TU106 [GeForce RTX 2060 Rev. A]"),
        ("10de\tNVIDIA Corporation\n\t1f08\tTU106\n", "TU106"),
        ("10de  NVIDIA Corporation\n\t1f08 TU106\n", "TU106"),
        ("10DE  NVIDIA Corporation\n\t1F08  TU106\n", "TU106"),
        ("10de  NVIDIA Corporation\r\n\t1f08  TU106\r\n", "TU106"),
        ("10de  NVIDIA Corporation\n\t1f08 \t  TU106 \n", "TU106"),
        ("10de  NVIDIA Corporation\n\n   \n  # indented comment\n\t1f08  TU106\n", "TU106"),
        ("1002  AMD\n\t1f08  Not NVIDIA\n10de NVIDIA Corporation\n\t1f08  TU106\n", "TU106"),
    ],
)
def test_lines_pciutils_accepts(text: str, expected: str) -> None:
    assert PciIds.from_text(text).device_name(0x10DE, 0x1F08) == expected


@pytest.mark.parametrize(
    "text",
    [
        "10de NVIDIA Corporation\n\t1f08\n",  # no name
        "10deNVIDIA Corporation\n\t1f08  TU106\n",  # no blank after the vendor ID
        "10de NVIDIA Corporation\n\t1f08TU106\n",  # no blank after the device ID
        "10de NVIDIA Corporation\n\t\t1f08 1234  a subsystem\n",  # nested twice: not a device
        "10dea NVIDIA\n\t1f08  TU106\n",  # a five-digit ID is no vendor 10de
        "10de NVIDIA Corporation\nC 03  Display controller\n\t1f08  not a device\n",  # another block
    ],
)
def test_lines_pciutils_refuses_or_reads_otherwise_name_nothing(text: str) -> None:
    assert PciIds.from_text(text).device_name(0x10DE, 0x1F08) is None


def test_single_space_vendor_lines_name_gpus_in_a_whole_file() -> None:
    """A whole excerpt rewritten with one space after every vendor ID names the same devices."""
    two = PciIds.from_text(SAMPLE)
    one = PciIds.from_text("\n".join(line.replace("  ", " ", 1) if line[:1].isalnum() else line
                                     for line in SAMPLE.splitlines()))  # fmt: skip
    for vendor, device in ((0x10DE, 0x1F08), (0x10DE, 0x2236), (0x1002, 0x1F08), (0x10DF, 0x2FFF)):
        assert one.device_name(vendor, device) == two.device_name(vendor, device)


def test_a_fifo_or_an_oversized_pci_ids_is_refused_not_read(tmp_path: Path) -> None:
    """A FIFO at the pci.ids path would block the plugin's start in open(); a huge file would bloat it."""
    from runtime.pciids import MAX_PCI_IDS_BYTES

    fifo = tmp_path / "pci.ids"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="is a FIFO, not a regular file"):
        PciIds.load(fifo)
    big = tmp_path / "big.ids"
    with big.open("wb") as handle:
        handle.truncate(MAX_PCI_IDS_BYTES + 1)
    with pytest.raises(InputError, match="over the"):
        PciIds.load(big)
