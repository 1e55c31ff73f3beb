"""Reading a PCI function's BARs from sysfs without leaving the sysfs root.

The root is configurable (``/sys``, a fixture tree's ``sys``, a host's sysfs mounted elsewhere), so the path
is resolved and must stay inside it: ``bus/pci/devices/<address>`` is a relative link into ``devices/pci…``,
and a link that leads anywhere else is refused (:mod:`runtime.sysfs_paths`). The file is read with
:func:`runtime.files.read_regular_file` (no FIFO, no device, capped) and parsed strictly by
:func:`schemas.pci_bars.parse_resource`. Any problem is an ``InputError`` naming the device and the file. (The
check and the open are two steps: the root is sysfs, which only the kernel writes, or a tree of ours.)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from runtime.files import read_regular_file
from runtime.sysfs_paths import Resolver, resolve_under, resolved_root
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

    def resource_path(self, address: PciAddress) -> Path:
        """``<root>/bus/pci/devices/<address>/resource``, resolved; it must stay under the root."""
        root = resolved_root(self.root, f"reading the BARs of {address}")
        return resolve_under(self.root, root, f"bus/pci/devices/{address}/resource", f"PCI device {address}")

    def read(self, address: PciAddress) -> DeviceBars:
        return self._read(address, self.resource_path(address))

    def _read(self, address: PciAddress, path: Path) -> DeviceBars:
        data = read_regular_file(path, MAX_RESOURCE_BYTES, f"PCI device {address}: BAR list", shown=repr(str(path)))
        where = f"PCI device {address}: {str(path)!r}"
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError as exc:
            raise InputError(f"{where} is not ASCII text (byte {exc.start})") from None
        return DeviceBars(address, parse_resource(text, where))

    def read_all(self, addresses: Iterable[PciAddress]) -> list[DeviceBars]:
        """The BARs of each address, in order (each address once); the links resolved once for all of them
        (:class:`~runtime.sysfs_paths.Resolver`, kept for this call only)."""
        listed = list(dict.fromkeys(addresses))
        if not listed:
            return []
        paths = Resolver(self.root, f"reading the BARs of {listed[0]}")
        return [
            self._read(address, paths.resolve(f"bus/pci/devices/{address}/resource", f"PCI device {address}"))
            for address in listed
        ]
