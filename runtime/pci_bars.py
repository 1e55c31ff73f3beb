"""Reading a PCI function's BARs from sysfs without leaving the sysfs root.

The root is configurable (``/sys``, a fixture tree's ``sys``, a host's sysfs mounted elsewhere), so the path
is resolved beneath it: ``bus/pci/devices/<address>`` is a relative link into ``devices/pci…``, and a link
that leads anywhere else is refused (:class:`runtime.sysfs_paths.SysfsView`: the kernel's ``openat2``
``RESOLVE_BENEATH``, or the same check in Python). The file is read as a regular file only (no FIFO, no
device, capped) and parsed strictly by :func:`schemas.pci_bars.parse_resource`. Any problem is an
``InputError`` naming the device and the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from runtime.sysfs_paths import SysfsView
from schemas.errors import InputError
from schemas.pci import PciAddress
from schemas.pci_bars import MAX_RESOURCE_BYTES, DeviceBars, parse_resource

DEFAULT_SYSFS_ROOT = "/sys"


class SysfsBars:
    """Reads BARs under one sysfs root (``/sys`` or a fixture's ``sys`` directory)."""

    def __init__(self, root: str | os.PathLike[str] = DEFAULT_SYSFS_ROOT) -> None:
        self.root = Path(root)

    def describe(self) -> str:
        return str(self.root)

    def read(self, address: PciAddress) -> DeviceBars:
        return self.read_all([address])[0]

    def _read(self, view: SysfsView, address: PciAddress) -> DeviceBars:
        data, shown = view.read(str(address), "resource", MAX_RESOURCE_BYTES, f"PCI device {address}: BAR list")
        where = f"PCI device {address}: {shown}"
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError as exc:
            raise InputError(f"{where} is not ASCII text (byte {exc.start})") from None
        return DeviceBars(address, parse_resource(text, where))

    def read_all(self, addresses: Iterable[PciAddress]) -> list[DeviceBars]:
        """The BARs of each address, in order (each address once), through one
        :class:`~runtime.sysfs_paths.SysfsView` of the root (this call's only)."""
        listed = list(dict.fromkeys(addresses))
        if not listed:
            return []
        with SysfsView(self.root, f"reading the BARs of {listed[0]}") as view:
            return [self._read(view, address) for address in listed]
