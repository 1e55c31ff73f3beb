"""Mediated device (vGPU) identifiers: the UUID the kernel names each mdev by."""

from __future__ import annotations

import re

from schemas.errors import InputError

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def parse_mdev_uuid(text: str) -> str:
    """Return the canonical (lower-case) form of an mdev UUID, or raise naming the value."""
    if _UUID.fullmatch(text) is None:
        raise InputError(
            f"malformed mdev UUID {text!r}: expected 8-4-4-4-12 hex digits, e.g. 4b20d080-1b54-4048-85b3-a6a62d165c01"
        )
    return text.lower()


def looks_like_mdev_uuid(text: str) -> bool:
    """True when ``text`` has the form of an mdev UUID (device IDs are either this or a PCI address)."""
    return _UUID.fullmatch(text) is not None
