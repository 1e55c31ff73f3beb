"""A PCI function's BARs as the kernel reports them in sysfs, read without leaving the sysfs root.

The launcher hook sizes the guest's 64-bit PCI MMIO window from the BARs of the devices it passes through
(docs/large-bar.md). The kernel's ``/sys/bus/pci/devices/<address>/resource`` holds one line per resource,
``0x<start> 0x<end> 0x<flags>`` (lines 0-5 the BARs, 6 the expansion ROM, then SR-IOV and bridge windows).
The root is configurable (a fixture tree, a host's sysfs mounted elsewhere), so the path is resolved and must
stay inside it: ``bus/pci/devices/<address>`` is a relative link into ``devices/pci…``, and a link that
leads anywhere else is refused. The file is read with :func:`runtime.files.read_regular_file` (no FIFO, no
device, capped). Any problem is an ``InputError`` naming the device and the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from runtime.files import read_regular_file
from schemas.errors import InputError
from schemas.pci import PciAddress

DEFAULT_SYSFS_ROOT = "/sys"

IORESOURCE_IO = 0x00000100
IORESOURCE_MEM = 0x00000200
IORESOURCE_PREFETCH = 0x00002000
IORESOURCE_MEM_64 = 0x00100000
"""The ``flags`` bits of include/linux/ioport.h that matter here."""

BAR_COUNT = 6
"""Standard BARs of a type-0 header (lines 0-5 of ``resource``; line 6 is the ROM)."""
MAX_RESOURCE_BYTES = 4096
"""The largest ``resource`` file read: the kernel writes at most 17 lines of 57 bytes (under 1 KiB)."""
MAX_RESOURCE_LINES = 32


@dataclass(frozen=True, slots=True)
class Bar:
    """One implemented BAR: its index (0-5), size in bytes and the kernel's resource flags."""

    index: int
    size: int
    flags: int

    @property
    def is_memory(self) -> bool:
        return bool(self.flags & IORESOURCE_MEM)

    @property
    def is_64bit(self) -> bool:
        """A 64-bit memory BAR: the only kind OVMF may place in its 64-bit window."""
        return self.is_memory and bool(self.flags & IORESOURCE_MEM_64)

    @property
    def prefetchable(self) -> bool:
        return bool(self.flags & IORESOURCE_PREFETCH)

    def describe(self) -> str:
        """``BAR1 128 GiB 64-bit prefetchable`` (``BAR5 128 B I/O``)."""
        if not self.is_memory:
            return f"BAR{self.index} {format_size(self.size)} I/O"
        width = "64-bit" if self.is_64bit else "32-bit"
        return f"BAR{self.index} {format_size(self.size)} {width}{' prefetchable' if self.prefetchable else ''}"


@dataclass(frozen=True, slots=True)
class DeviceBars:
    """A PCI function and its implemented BARs."""

    address: PciAddress
    bars: tuple[Bar, ...]

    @property
    def bars_64bit(self) -> tuple[Bar, ...]:
        return tuple(bar for bar in self.bars if bar.is_64bit)


def format_size(size: int) -> str:
    """``128 GiB``, ``32 MiB``, ``128 B``: the largest binary unit that divides ``size``."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def parse_resource(text: str, where: str) -> tuple[Bar, ...]:
    """The implemented BARs (0-5) of a ``resource`` file's ``text``; ``where`` names it in errors.

    A line of zeros is a BAR the device does not implement. A BAR the kernel could not assign keeps its size
    with start 0 (``IORESOURCE_UNSET``), so size is ``end - start + 1`` whenever ``end`` is non-zero.
    """
    lines = text.splitlines()
    if len(lines) > MAX_RESOURCE_LINES:
        raise InputError(f"{where}: {len(lines)} lines, more than a PCI function has resources")
    if len(lines) < BAR_COUNT:
        raise InputError(f"{where}: {len(lines)} lines; a PCI function's resource file lists at least 6 BARs")
    bars: list[Bar] = []
    for index, line in enumerate(lines[:BAR_COUNT]):
        fields = line.split()
        if len(fields) != 3 or not all(field.lower().startswith("0x") for field in fields):
            raise InputError(f"{where}: line {index + 1} is not '0x<start> 0x<end> 0x<flags>': {line[:80]!r}")
        try:
            start, end, flags = (int(field, 16) for field in fields)
        except ValueError:
            raise InputError(f"{where}: line {index + 1} has a number that is not hex: {line[:80]!r}") from None
        if max(start, end, flags) >= 1 << 64:
            raise InputError(f"{where}: line {index + 1} has a number wider than 64 bits")
        if start == 0 and end == 0:
            continue  # not implemented
        if end < start:
            raise InputError(f"{where}: line {index + 1} ends ({end:#x}) before it starts ({start:#x})")
        if not flags & (IORESOURCE_MEM | IORESOURCE_IO):
            raise InputError(
                f"{where}: line {index + 1} (BAR{index}) has a range but flags {flags:#x} say neither I/O nor memory"
            )
        bars.append(Bar(index, end - start + 1, flags))
    return tuple(bars)


class SysfsBars:
    """Reads BARs under one sysfs root (``/sys`` or a fixture's ``sys`` directory)."""

    def __init__(self, root: str | os.PathLike[str] = DEFAULT_SYSFS_ROOT) -> None:
        self.root = Path(root)

    def describe(self) -> str:
        return str(self.root)

    def resource_path(self, address: PciAddress) -> Path:
        """``<root>/bus/pci/devices/<address>/resource``, resolved; it must stay under the root."""
        shown = f"bus/pci/devices/{address}/resource"
        root = Path(os.path.realpath(self.root))
        if not root.is_dir():
            raise InputError(f"sysfs root {str(self.root)!r} is not a directory (reading the BARs of {address})")
        resolved = Path(os.path.realpath(root / "bus" / "pci" / "devices" / str(address) / "resource"))
        if resolved != root and root not in resolved.parents:
            raise InputError(
                f"PCI device {address}: {shown} under {str(self.root)!r} leads out of that root "
                f"(to {str(resolved)!r}); refusing to read it"
            )
        return resolved

    def read(self, address: PciAddress) -> DeviceBars:
        path = self.resource_path(address)
        data = read_regular_file(path, MAX_RESOURCE_BYTES, f"PCI device {address}: BAR list", shown=repr(str(path)))
        where = f"PCI device {address}: {str(path)!r}"
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError as exc:
            raise InputError(f"{where} is not ASCII text (byte {exc.start})") from None
        return DeviceBars(address, parse_resource(text, where))

    def read_all(self, addresses: Iterable[PciAddress]) -> list[DeviceBars]:
        """The BARs of each address, in order (each address once)."""
        return [self.read(address) for address in dict.fromkeys(addresses)]
