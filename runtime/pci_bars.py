"""Reading a PCI function's BARs from sysfs without leaving the sysfs root.

The root is configurable (``/sys``, a fixture tree's ``sys``, a host's sysfs mounted elsewhere), so the path
is resolved beneath it: ``bus/pci/devices/<address>`` is a relative link into ``devices/pci…``, and a link
that leads anywhere else is refused (:class:`runtime.sysfs_paths.SysfsView`: the kernel's ``openat2``
``RESOLVE_BENEATH``, or the same check in Python). The file is read as a regular file only (no FIFO, no
device, capped) and parsed strictly by :func:`schemas.pci_bars.parse_resource`. Any problem is an
``InputError`` naming the device and the file.

A reader made by :meth:`SysfsBars.keeping` (the one a ``HookService`` holds) keeps each function's BARs for its
own life (at most :data:`runtime.sysfs_paths.MAX_KEPT` functions): a function read before costs no system call,
an error is never kept. Why a function's BAR sizes cannot change while the pod holds it:
:mod:`runtime.sysfs_paths`.
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime.sysfs_paths import KeepingReader, SysfsView
from schemas.errors import InputError
from schemas.pci import PciAddress
from schemas.pci_bars import MAX_RESOURCE_BYTES, DeviceBars, parse_resource


class SysfsBars(KeepingReader[DeviceBars]):
    """Reads BARs under one sysfs root (``/sys`` or a fixture's ``sys`` directory); ``kept``: where each
    function's BARs are kept once read (:meth:`keeping`), None: every call reads."""

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
        """The BARs of each address, in order (each address once); those not kept read through one
        :class:`~runtime.sysfs_paths.SysfsView` of the root (none opened when every one is kept). The first
        that cannot be read raises its ``InputError``."""
        listed = list(dict.fromkeys(addresses))
        if not listed:
            return []
        kept = self.kept
        if kept is None:
            with SysfsView(self.root, f"reading the BARs of {listed[0]}") as view:
                return [self._read(view, address) for address in listed]
        found = kept.get_all(listed)
        if all(found):  # (a DeviceBars is always true: every one kept)
            return found  # type: ignore[return-value]
        missing = [address for address, bars in zip(listed, found, strict=True) if bars is None]
        read: dict[PciAddress, DeviceBars] = {}
        with SysfsView(self.root, f"reading the BARs of {missing[0]}") as view:
            for address in missing:
                bars = read[address] = self._read(view, address)
                kept.put(address, bars)
        return [bars if bars is not None else read[address] for address, bars in zip(listed, found, strict=True)]
