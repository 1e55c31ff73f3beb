"""PCI addresses as the kernel prints them and libvirt reads them.

The kernel names functions ``DDDD:BB:SS.F`` (a 5-hex-digit domain behind Intel VMD); the device plugin
publishes those strings and the hook turns them into libvirt's ``0x`` hex attributes. Parsing is strict so
that a typo in an env var is an error that names the value, not a VM with the wrong card.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.errors import InputError

_BDF = re.compile(r"([0-9a-fA-F]{4,5}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-9a-fA-F])")

MAX_BUS = 0xFF
MAX_SLOT = 0x1F
MAX_FUNCTION = 0x7


@dataclass(frozen=True, order=True, slots=True)
class PciAddress:
    """One PCI function: domain, bus, slot (device) and function numbers."""

    domain: int
    bus: int
    slot: int
    function: int

    def __post_init__(self) -> None:
        for field, value, top in (
            ("domain", self.domain, 0xFFFFF),
            ("bus", self.bus, MAX_BUS),
            ("slot", self.slot, MAX_SLOT),
            ("function", self.function, MAX_FUNCTION),
        ):
            if not 0 <= value <= top:
                raise InputError(f"PCI {field} {value:#x} is out of range (0x0..{top:#x})")

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """Parse ``DDDD:BB:SS.F`` (hex, any case; 4 or 5 domain digits); refuse anything else."""
        match = _BDF.fullmatch(text)
        if match is None:
            raise InputError(f"malformed PCI address {text!r}: expected DDDD:BB:SS.F in hex, e.g. 0000:86:00.0")
        domain, bus, slot, function = (int(group, 16) for group in match.groups())
        if slot > MAX_SLOT:
            raise InputError(f"malformed PCI address {text!r}: slot {slot:#04x} is above {MAX_SLOT:#04x}")
        if function > MAX_FUNCTION:
            raise InputError(f"malformed PCI address {text!r}: function {function} is above {MAX_FUNCTION}")
        return cls(domain, bus, slot, function)

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"

    def libvirt_attributes(self) -> dict[str, str]:
        """The four attributes of libvirt's ``<address>``, each as ``0x`` hex (libvirt reads C-style)."""
        return {
            "domain": f"0x{self.domain:04x}",
            "bus": f"0x{self.bus:02x}",
            "slot": f"0x{self.slot:02x}",
            "function": f"0x{self.function:x}",
        }

    @property
    def slot_address(self) -> str:
        """``DDDD:BB:SS``, the physical slot shared by a card's functions."""
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}"
