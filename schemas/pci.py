"""PCI addresses as the kernel prints them and libvirt reads them.

The kernel names functions ``DDDD:BB:SS.F`` (a 5-hex-digit domain behind Intel VMD); the device plugin
publishes those strings and the hook turns them into libvirt's ``0x`` hex attributes. Parsing is strict so
that a typo in an env var is an error that names the value, not a VM with the wrong card.

``PciAddress`` is a tuple underneath (cheap to build, hash and order: it sits on the Allocate and
OnDefineDomain paths); its constructor still refuses out-of-range fields.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from schemas.errors import InputError

_BDF = re.compile(r"([0-9a-fA-F]{4,5}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-9a-fA-F])")
# Only in-range addresses match this one, so the common case needs no further checks.
_BDF_IN_RANGE = re.compile(r"([0-9a-fA-F]{4,5}):([0-9a-fA-F]{2}):([01][0-9a-fA-F])\.([0-7])")

_IN_RANGE = r"([0-9a-fA-F]{4,5}):([0-9a-fA-F]{2}):([01][0-9a-fA-F])\.([0-7])"
_LIST_IN_RANGE = re.compile(rf"{_IN_RANGE}(?:,{_IN_RANGE})*".replace("(", "(?:").replace("(?:?:", "(?:"))
_ITEM_IN_RANGE = re.compile(_IN_RANGE)

MAX_DOMAIN = 0xFFFFF
MAX_BUS = 0xFF
MAX_SLOT = 0x1F
MAX_FUNCTION = 0x7


class _Fields(NamedTuple):
    domain: int
    bus: int
    slot: int
    function: int


class PciAddress(_Fields):
    """One PCI function: domain, bus, slot (device) and function numbers."""

    __slots__ = ()

    def __new__(cls, domain: int, bus: int, slot: int, function: int) -> PciAddress:
        for field, value, top in (
            ("domain", domain, MAX_DOMAIN),
            ("bus", bus, MAX_BUS),
            ("slot", slot, MAX_SLOT),
            ("function", function, MAX_FUNCTION),
        ):
            if not 0 <= value <= top:
                raise InputError(f"PCI {field} {value:#x} is out of range (0x0..{top:#x})")
        return super().__new__(cls, domain, bus, slot, function)

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """Parse ``DDDD:BB:SS.F`` (hex, any case; 4 or 5 domain digits); refuse anything else."""
        fast = _BDF_IN_RANGE.fullmatch(text)
        if fast is not None:
            domain, bus, slot, function = fast.groups()
            return tuple.__new__(cls, (int(domain, 16), int(bus, 16), int(slot, 16), int(function)))
        match = _BDF.fullmatch(text)
        if match is None:
            raise InputError(f"malformed PCI address {text!r}: expected DDDD:BB:SS.F in hex, e.g. 0000:86:00.0")
        slot, function = int(match.group(3), 16), int(match.group(4), 16)
        if slot > MAX_SLOT:
            raise InputError(f"malformed PCI address {text!r}: slot {slot:#04x} is above {MAX_SLOT:#04x}")
        raise InputError(f"malformed PCI address {text!r}: function {function} is above {MAX_FUNCTION}")

    @classmethod
    def parse_list(cls, text: str) -> list[PciAddress] | None:
        """All addresses of a comma-separated list in one pass, or None if any item needs a closer look
        (then parse each with ``parse`` for the precise error)."""
        if _LIST_IN_RANGE.fullmatch(text) is None:
            return None
        new = tuple.__new__
        return [
            new(cls, (int(domain, 16), int(bus, 16), int(slot, 16), int(function)))
            for domain, bus, slot, function in _ITEM_IN_RANGE.findall(text)
        ]

    def __str__(self) -> str:
        return "%04x:%02x:%02x.%x" % self  # noqa: UP031 - formats the tuple in C; it is on the hot paths

    def __repr__(self) -> str:
        return f"PciAddress({str(self)!r})"

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
