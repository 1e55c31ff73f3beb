"""Where a PCI function sits in the host's PCIe tree, read from sysfs: which GPUs share a PCIe switch.

GPUs below one PCIe switch can send each other's memory traffic through the switch, without the root complex
(NVIDIA's ``nvidia-smi topo -m`` calls that ``PIX``, one switch, or ``PXB``, several switches below one host
bridge). In a VM, NVIDIA's guest driver tries such GPUDirect peer-to-peer transfers only between GPUs QEMU puts
in one *clique* (``vfio-pci``'s ``x-nv-gpudirect-clique``, docs/p2p.md); the hook gives the GPUs that share a
switch one clique (:mod:`launcher_hook.cliques`). This module reads what it needs for each GPU:

- ``bus/pci/devices/<address>`` is a relative link into ``devices/pci<domain>:<bus>/<root port>/…/<address>``;
  its target's components are the function's upstream bridges, root port first. The link is read, never
  followed, and only its PCI-address components are taken (anything else in it makes the place unknown);
- the function's ``vendor`` and ``class`` (QEMU takes the clique property only on an NVIDIA display-class
  function) and whether it is an SR-IOV virtual function (``physfn``): a vGPU's VF gets no clique.

Every read is confined to the root as :mod:`runtime.sysfs_paths` confines it, and bounded. A reader made by
:meth:`SysfsTopology.keeping` (the one a hook service holds) keeps each function's :class:`PciPlace` for its
life (why that is safe: :mod:`runtime.sysfs_paths`), a function absent from sysfs too (an absent device cannot
appear in the tree while a pod holds it); an error is never kept.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from runtime.sysfs_paths import KeepingReader, SysfsView
from schemas.pci import PciAddress
from schemas.pci_topology import ABSENT, PciPlace, bridges_from_link

NVIDIA_VENDOR = 0x10DE
DISPLAY_CLASS = 0x03
MAX_ID_BYTES = 64
"""Longest ``vendor`` or ``class`` file read (the kernel writes ``0x10de\\n``, ``0x030200\\n``)."""


def _number(data: bytes) -> int | None:
    try:
        return int(data.strip(), 16)
    except ValueError:
        return None


class SysfsTopology(KeepingReader[PciPlace]):
    """Reads functions' :class:`PciPlace` under one sysfs root; ``kept``: where each is kept (:meth:`keeping`),
    None: every call reads."""

    def read_all(self, addresses: Sequence[PciAddress]) -> list[PciPlace]:
        """The place of each of ``addresses``, in order; ``InputError`` naming the device and the file for one
        that cannot be read (a link out of the root, an unreadable ``class``)."""
        kept = self.kept
        found: list[PciPlace | None] = kept.get_all(addresses) if kept is not None else [None] * len(addresses)
        if all(found):  # (a PciPlace is a non-empty tuple: true)
            return found  # type: ignore[return-value]
        with SysfsView(self.root, f"reading where {addresses[0]} sits in the PCIe tree") as view:
            for index, address in enumerate(addresses):
                if found[index] is None:
                    place = found[index] = self._read(view, address)
                    if kept is not None:
                        kept.put(address, place)
        return found  # type: ignore[return-value]

    def _read(self, view: SysfsView, address: PciAddress) -> PciPlace:
        name = str(address)
        target = view.device_link(name)
        if target is None:
            return ABSENT
        bridges = bridges_from_link(target, address)
        directory = view.open_function(name)
        if directory is None:
            return ABSENT
        try:
            vendor = _number(view.read_in(directory, name, "vendor", MAX_ID_BYTES, f"PCI device {name}: vendor")[0])
            pci_class = _number(view.read_in(directory, name, "class", MAX_ID_BYTES, f"PCI device {name}: class")[0])
            virtual = view.has(directory, "physfn")
        finally:
            os.close(directory)
        gpu = vendor == NVIDIA_VENDOR and pci_class is not None and pci_class >> 16 == DISPLAY_CLASS and not virtual
        return PciPlace(bridges or (), gpu)
