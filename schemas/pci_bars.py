"""A PCI function's BARs as the kernel reports them in sysfs ``resource``: the types and the strict parser.

The launcher hook sizes the guest's 64-bit PCI MMIO window from the BARs of the devices it passes through
(docs/large-bar.md). The kernel's ``/sys/bus/pci/devices/<address>/resource`` holds one line per resource,
``0x<start> 0x<end> 0x<flags>`` (lines 0-5 the BARs, 6 the expansion ROM, then SR-IOV and bridge windows).
Reading the file is :mod:`runtime.pci_bars`'s job; these are shared by the reader, the hook's pure window
computation and the fixture builder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from schemas.errors import InputError
from schemas.pci import PciAddress

IORESOURCE_IO = 0x00000100
IORESOURCE_MEM = 0x00000200
IORESOURCE_PREFETCH = 0x00002000
IORESOURCE_MEM_64 = 0x00100000
_MEM_64 = IORESOURCE_MEM | IORESOURCE_MEM_64
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
        return self.flags & _MEM_64 == _MEM_64

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
    bars_64bit: tuple[Bar, ...] = field(init=False, repr=False, compare=False)
    """The 64-bit memory BARs among ``bars`` (worked out once: the window's plan asks for them thrice)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "bars_64bit", tuple(bar for bar in self.bars if bar.flags & _MEM_64 == _MEM_64))


def format_size(size: int) -> str:
    """``128 GiB``, ``32 MiB``, ``128 B``: the largest binary unit that divides ``size``."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


_KERNEL_LINE = re.compile(r"0x([0-9a-f]{16}) 0x([0-9a-f]{16}) 0x([0-9a-f]{16})")
_KERNEL_ZERO = " ".join(["0x" + "0" * 16] * 3)


def _fields(line: str, index: int, where: str) -> tuple[int, int, int]:
    """A line in any other spelling: three whitespace-separated ``0x`` hex numbers of at most 64 bits."""
    fields = line.split()
    if len(fields) != 3 or not all(field.lower().startswith("0x") for field in fields):
        raise InputError(f"{where}: line {index + 1} is not '0x<start> 0x<end> 0x<flags>': {line[:80]!r}")
    try:
        start, end, flags = (int(field, 16) for field in fields)
    except ValueError:
        raise InputError(f"{where}: line {index + 1} has a number that is not hex: {line[:80]!r}") from None
    if max(start, end, flags) >= 1 << 64:
        raise InputError(f"{where}: line {index + 1} has a number wider than 64 bits")
    return start, end, flags


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
        if line == _KERNEL_ZERO:
            continue  # not implemented
        kernel = _KERNEL_LINE.fullmatch(line)
        if kernel is not None:  # the kernel's own "0x%016llx 0x%016llx 0x%016llx": 64-bit hex by its form
            start, end, flags = int(kernel[1], 16), int(kernel[2], 16), int(kernel[3], 16)
        else:
            start, end, flags = _fields(line, index, where)
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
