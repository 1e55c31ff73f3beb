"""Reading a passthrough GPU's companion functions from sysfs, for allocation sources that do not carry them.

The device plugin lists each GPU's companions in ``PCI_COMPANIONS_<NAME>`` (:mod:`schemas.companions`), but
that variable reaches the hook only through the env or an environ file. The kubelet's PodResources API reports
device IDs only, and so will a DRA claim's device metadata (issue 16); a hook reading those derives the
companions itself, here, from the sysfs it can see (its own read-only ``/sys``, or ``--sysfs-root``), by the
plugin's own rule (:func:`schemas.companions.select_companions`):

- the GPU must look like one of the plugin's passthrough GPUs: a display-class function (``class`` 0x03xxxx)
  on a VFIO driver that is not an SR-IOV virtual function (no ``physfn`` link). An SR-IOV vGPU's VF (on
  ``nvidia``, and a VF) or any other device the VM gets (a NIC, an NVMe drive) has no companions;
- its companions are the other functions of its bus and slot (at most seven: ``<domain>:<bus>:<slot>.0-7``)
  whose ``iommu_group`` link leads to the GPU's group and whose ``driver`` link names a VFIO driver
  (:data:`runtime.node.VFIO_DRIVERS`, the plugin's default ``vfio_drivers``).

Reads are few and bounded (per GPU: its directory, two links, ``physfn`` and its 10-byte ``class`` file; per
other function of the slot: its directory and two links) and confined to the root (:mod:`runtime.sysfs_paths`:
the kernel resolves each path beneath it). ``iommu_group`` and ``driver`` are read as the plugin reads them,
by their target's last component (the group's number, the driver's name), never followed.
Any problem is an ``InputError`` naming the device and the file; the hook then places the GPU alone.

A reader made by :meth:`SysfsCompanions.keeping` (the one a ``HookService`` holds) keeps what it read of each
GPU (:class:`SlotFacts`: whether it is a passthrough GPU and its slot's functions in its group with their
drivers, and the rule's choice among them, :func:`schemas.companions.select_companions`) for its own life, at
most :data:`runtime.sysfs_paths.MAX_KEPT` GPUs: a GPU read before costs no system call; the VM's other GPUs,
which are never companions, are taken out of the kept choice on every call. Why the facts cannot change while
the pod holds the GPU: :mod:`runtime.sysfs_paths`.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import NamedTuple

from runtime.node import VFIO_DRIVERS
from runtime.sysfs_paths import DEFAULT_SYSFS_ROOT, MAX_KEPT, KeptFacts, SysfsView
from schemas.companions import select_companions
from schemas.errors import InputError
from schemas.pci import MAX_FUNCTION, PciAddress

MAX_CLASS_BYTES = 64
"""Longest ``class`` file read (the kernel writes ``0x030000\\n``, 9 bytes)."""
DISPLAY_CLASS = 0x03


class SlotFacts(NamedTuple):
    """What sysfs says of one GPU for the companion rule: ``members``, the other functions of its slot in its
    IOMMU group with their drivers' names (function order), and ``companions``, the rule's choice among them
    when the VM has no other GPU there; both empty when it is no passthrough GPU (not on a VFIO driver, a virtual
    function, or not display-class)."""

    members: tuple[tuple[PciAddress, str | None], ...]
    companions: tuple[PciAddress, ...]


_NO_GPU = SlotFacts((), ())


class SysfsCompanions:
    """Reads GPUs' companions under one sysfs root (``/sys`` or a fixture's ``sys`` directory); ``kept``: where
    what was read of each GPU is kept (:meth:`keeping`), None: every call reads."""

    def __init__(
        self,
        root: str | os.PathLike[str] = DEFAULT_SYSFS_ROOT,
        vfio_drivers: Collection[str] = VFIO_DRIVERS,
        kept: KeptFacts[PciAddress, SlotFacts] | None = None,
    ) -> None:
        self.root = Path(root)
        self.vfio_drivers = frozenset(vfio_drivers)
        self.kept = kept

    def keeping(self, bound: int = MAX_KEPT) -> SysfsCompanions:
        """This reader with a store of its own: each GPU's :class:`SlotFacts` kept once read (at most ``bound``
        GPUs, the oldest evicted), errors never."""
        return SysfsCompanions(self.root, self.vfio_drivers, KeptFacts(bound))

    def describe(self) -> str:
        return str(self.root)

    def read(self, gpu: PciAddress, gpus: Collection[PciAddress] = ()) -> tuple[PciAddress, ...]:
        """The companions of ``gpu`` in function order (none when it is not a passthrough GPU); ``gpus``: the
        VM's other GPUs, never companions. Raises ``InputError`` naming the device and the file."""
        found = self.read_all([gpu], gpus)[0]
        if isinstance(found, InputError):
            raise found
        return found

    def read_all(
        self, wanted: Sequence[PciAddress], gpus: Collection[PciAddress] = ()
    ) -> list[tuple[PciAddress, ...] | InputError]:
        """:meth:`read` of each of ``wanted`` (its companions, or the ``InputError`` its read raised), the GPUs
        not kept read through one :class:`~runtime.sysfs_paths.SysfsView` of the root (none opened when every
        one is kept)."""
        if not wanted:
            return []
        kept = self.kept
        facts: list[SlotFacts | InputError | None] = (
            [*kept.get_all(wanted)] if kept is not None else [None] * len(wanted)
        )
        # (a SlotFacts is a non-empty tuple: true; all() finds a missing one without a Python-level loop)
        missing = [] if all(facts) else [index for index, found in enumerate(facts) if found is None]
        if missing:
            try:
                view = SysfsView(self.root, f"reading the companions of {wanted[missing[0]]}")
            except InputError as exc:
                for index in missing:
                    facts[index] = exc
            else:
                with view:
                    for index in missing:
                        gpu = wanted[index]
                        try:
                            read = self._facts(view, gpu)
                        except InputError as exc:
                            facts[index] = exc
                            continue
                        facts[index] = read
                        if kept is not None:
                            kept.put(gpu, read)
        found_all: list[tuple[PciAddress, ...] | InputError] = []
        others = gpus if isinstance(gpus, (set, frozenset)) else frozenset(gpus)
        for each in facts:
            if each is None or isinstance(each, InputError):
                found_all.append(each or ())  # (None: never, every GPU was found or read)
            elif others and not others.isdisjoint(each.companions):
                # select_companions with ``gpus`` is its choice without them, less the VM's GPUs
                found_all.append(tuple(address for address in each.companions if address not in gpus))
            else:
                found_all.append(each.companions)
        return found_all

    def _facts(self, view: SysfsView, gpu: PciAddress) -> SlotFacts:
        name = str(gpu)
        directory = view.open_function(name)
        if directory is None:
            raise InputError(f"PCI device {gpu}: bus/pci/devices/{gpu} does not exist under {str(self.root)!r}")
        try:
            found = view.links(directory)
            if found.driver not in self.vfio_drivers or view.has(directory, "physfn"):
                return _NO_GPU
            data, shown = view.read_in(directory, name, "class", MAX_CLASS_BYTES, f"PCI device {gpu}: class")
        finally:
            os.close(directory)
        if _pci_class(data, shown, name) >> 16 != DISPLAY_CLASS:
            return _NO_GPU
        if found.group is None:
            raise InputError(f"PCI device {gpu}: bus/pci/devices/{gpu}/iommu_group does not exist")
        members: list[tuple[PciAddress, str | None]] = []
        slot = name[:-1]  # "<domain>:<bus>:<slot>."
        for function in range(MAX_FUNCTION + 1):
            if function == gpu.function:
                continue
            facts = view.function(f"{slot}{function}")
            if facts is not None and facts.group == found.group:
                members.append((PciAddress(gpu.domain, gpu.bus, gpu.slot, function), facts.driver))
        return SlotFacts(tuple(members), select_companions(gpu, members, self.vfio_drivers))


def _pci_class(data: bytes, shown: str, address: str) -> int:
    text = data.decode("ascii", "replace").strip()
    try:
        if not text.startswith("0x"):
            raise ValueError(text)
        value = int(text, 16)
    except ValueError:
        raise InputError(f"PCI device {address}: {shown} says {text[:24]!r}, not a class code") from None
    return value
