"""A PCI function's ``uevent`` attacked (issue 12 names functions by it): whatever it is, the scan reads what
the ``vendor``, ``device`` and ``class`` files say, resolves it inside the host root, never blocks or traces back.

Each variant is written as every PCI function's ``uevent`` of the fixture node; the scan's resources and ignored
functions must be those of the intact tree (whose ``uevent`` files agree with the files).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from plugin.hostroot import MAX_ATTRIBUTE_BYTES
from plugin.inventory import Inventory
from simkit.fixture_nodes import NODE01
from tests.discovery_support import build_node, discover

SCAN_BOUND = 10.0


def _function_dirs(root: Path) -> list[Path]:
    return sorted(link.resolve() for link in (root / "sys/bus/pci/devices").iterdir())


def _bounded(root: Path) -> Inventory:
    found: list[Inventory] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            found.append(discover(root))
        except BaseException as exc:  # re-raised below, on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(SCAN_BOUND)
    assert not thread.is_alive(), f"discovery still running after {SCAN_BOUND} s"
    if errors:
        raise errors[0]
    return found[0]


def _text(body: bytes) -> Callable[[Path, Path], None]:
    def write(directory: Path, outside: Path) -> None:
        (directory / "uevent").unlink()
        (directory / "uevent").write_bytes(body)

    return write


def _link(target: Callable[[Path, Path], str]) -> Callable[[Path, Path], None]:
    def write(directory: Path, outside: Path) -> None:
        (directory / "uevent").unlink()
        (directory / "uevent").symlink_to(target(directory, outside))

    return write


GPU_LIKE = b"PCI_CLASS=30000\nPCI_ID=10DE:2204\n"
"""What the outside file says: an RTX 3090 the node does not have."""

VARIANTS: dict[str, Callable[[Path, Path], None]] = {
    "absolute link out of the root": _link(lambda directory, outside: str(outside)),
    "relative link climbing out": _link(lambda directory, outside: "../" * 40 + str(outside).lstrip("/")),
    "link to a directory": _link(lambda directory, outside: "."),
    "NUL-filled": _text(b"\0" * 4096),
    "binary": _text(bytes(range(256)) * 16),
    "NUL inside the lines": _text(b"PCI_CLASS=30000\0\nPCI_ID=10DE:2204\0\n"),
    "64 KiB of lines": _text((b"X=" + b"Y" * 60 + b"\n") * (MAX_ATTRIBUTE_BYTES // 63)),
    "64 KiB then the lines": _text(b"Z" * (MAX_ATTRIBUTE_BYTES - 10) + GPU_LIKE),
    "duplicate class": _text(b"PCI_CLASS=30000\nPCI_CLASS=30000\nPCI_ID=10DE:2204\n"),
    "lower-case hex": _text(b"PCI_CLASS=30000\nPCI_ID=10de:2204\n"),
    "lines apart": _text(b"PCI_CLASS=30000\nDRIVER=vfio-pci\nPCI_ID=10DE:2204\n"),
    "CRLF": _text(b"PCI_CLASS=30000\r\nPCI_ID=10DE:2204\r\n"),
    "another vendor": _text(b"PCI_CLASS=30000\nPCI_ID=1002:73BF\n"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_any_uevent_scans_as_the_files_say(tmp_path: Path, resolver: str, variant: str) -> None:
    intact = discover(build_node(NODE01, tmp_path / "intact"))
    root = build_node(NODE01, tmp_path / "attacked")
    outside = tmp_path / "outside-uevent"
    outside.write_bytes(GPU_LIKE)
    for directory in _function_dirs(root):
        VARIANTS[variant](directory, outside)
    inventory = _bounded(root)
    assert inventory.resources == intact.resources
    assert inventory.ignored == intact.ignored


def test_a_fifo_uevent_on_every_function_never_blocks(tmp_path: Path, resolver: str) -> None:
    intact = discover(build_node(NODE01, tmp_path / "intact"))
    root = build_node(NODE01, tmp_path / "attacked")
    for directory in _function_dirs(root):
        (directory / "uevent").unlink()
        os.mkfifo(directory / "uevent")
    inventory = _bounded(root)
    assert inventory.resources == intact.resources
    assert any("uevent: not a regular file (a FIFO)" in warning for warning in inventory.warnings)
