"""Write realistic fake sysfs trees on disk, for tests, benchmarks and ``xmlgen simulate``.

A test aid, not used in production: discovery must be tested against the shapes the kernel really makes
(relative symlinks from ``sys/bus/pci/devices`` into ``sys/devices/pci…``, ``driver`` and ``iommu_group``
links, ``iommu_groups/N/devices``, ``/dev/vfio/N``, mdev trees), not against mocks of its own reads. A
:class:`Node` describes a machine declaratively; :func:`build` writes it under any directory (only writes
under that directory, nothing else). Device nodes (``/dev/vfio/*``) are plain empty files: creating character
devices needs privileges, and discovery only checks that they exist.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from runtime.node import VFIO_DRIVERS
from schemas.pci import PciAddress

_VFIO_CDEV_MAJOR = 236  # dynamic; a typical value

# The ``flags`` column the kernel writes in ``resource`` for each kind of BAR (include/linux/ioport.h: MEM 0x200,
# PREFETCH 0x2000, SIZEALIGN 0x40000, MEM_64 0x100000, IO 0x100; the low bits are the BAR's own type bits),
# as read on real hosts.
BAR_MEM32 = 0x00040200
BAR_MEM32_PREFETCH = 0x00042208
BAR_MEM64 = 0x00140204
BAR_MEM64_PREFETCH = 0x0014220C
BAR_IO = 0x00040101
_RESOURCE_LINES_ENDPOINT = 13
"""Lines of ``resource`` for an endpoint: BARs 0-5, the ROM, six SR-IOV BARs (``PCI_BRIDGE_RESOURCES``)."""
_RESOURCE_LINES_BRIDGE = 17
"""For a bridge, four window lines more (``DEVICE_COUNT_RESOURCE``)."""


class BarSpec(NamedTuple):
    """One implemented BAR of a :class:`Function`: its number (0-5), size in bytes and flags (``BAR_*``)."""

    number: int
    size: int
    flags: int


@dataclass(frozen=True, slots=True)
class Function:
    """One PCI function. ``parent`` is the upstream bridge's address (None: on the root bus)."""

    address: str
    vendor: int
    device: int
    pci_class: int
    driver: str | None = None
    iommu_group: int | None = None
    numa_node: int = -1
    parent: str | None = None
    subsystem_vendor: int = 0
    subsystem_device: int = 0
    revision: int = 0xA1
    vfio_dev: int | None = None
    """N of the iommufd cdev (``vfio-dev/vfioN``, ``/dev/vfio/devices/vfioN``) when on a VFIO driver; with
    :attr:`Node.iommufd` and None, a number is picked."""
    bars: tuple[BarSpec, ...] = ()
    """The implemented BARs, written to ``resource`` (every function gets that file; without BARs, all zeros)."""


@dataclass(frozen=True, slots=True)
class MdevType:
    """One ``mdev_supported_types/<type_id>`` directory of a parent GPU."""

    parent: str
    type_id: str
    name: str
    available_instances: int = 0
    device_api: str = "vfio-pci"
    description: str = ""


@dataclass(frozen=True, slots=True)
class Mdev:
    """One created mediated device (``/sys/bus/mdev/devices/<uuid>``) with its own IOMMU group."""

    uuid: str
    parent: str
    type_id: str
    iommu_group: int
    driver: str | None = "vfio_mdev"
    vfio_dev: int | None = None
    """N of the iommufd cdev when bound to a driver; with :attr:`Node.iommufd` and None, a number is picked."""


@dataclass(frozen=True, slots=True)
class SriovVgpuGpu:
    """An NVIDIA GPU split into SR-IOV virtual functions for vGPUs (vGPU 17+ on Ada/Hopper/Blackwell).

    The PF and its VFs are :class:`Function` s of the node (see :func:`sriov_vfs`); this adds what the kernel and
    NVIDIA's driver write for them (docs/node.md, "SR-IOV vGPUs"): the PF's ``sriov_totalvfs``,
    ``sriov_numvfs`` and ``virtfn<i>`` links, each VF's ``physfn`` link and ``nvidia/current_vgpu_type`` and
    ``nvidia/creatable_vgpu_types``, and (the driver serving each VF through VFIO) ``/dev/vfio/<group>``.
    """

    pf: str
    vfs: tuple[str, ...]
    """The VF addresses, in ``virtfn`` order."""
    total_vfs: int
    types: tuple[tuple[int, str], ...]
    """What a VF without a type lists in ``creatable_vgpu_types`` now, as ``(ID, name)``."""
    current: tuple[int, ...] = ()
    """Each VF's ``current_vgpu_type`` (``0``: none), in ``vfs`` order; missing entries are ``0``."""
    full: bool = False
    """The GPU can take no more vGPUs: VFs without a type list no types either (the header only)."""

    def current_type(self, index: int) -> int:
        return self.current[index] if index < len(self.current) else 0


CREATABLE_HEADER = "ID    : vGPU Name\n"
"""The first line of ``creatable_vgpu_types`` (then one ``ID : name`` line per type)."""


def creatable_text(types: Iterable[tuple[int, str]]) -> str:
    """``creatable_vgpu_types`` as the driver writes it: the header, then ``ID : name`` lines."""
    return CREATABLE_HEADER + "".join(f"{type_id:<6}: {name}\n" for type_id, name in types)


def sriov_vfs(pf: Function, count: int, first_group: int) -> tuple[Function, ...]:
    """``count`` VFs of ``pf`` as the kernel places them: routing IDs after the PF's at offset 4, stride 1
    (``0000:3b:00.4`` …), same IDs and class as the PF, on ``nvidia``, each in its own IOMMU group from
    ``first_group``, under the PF's bridge."""
    address = PciAddress.parse(pf.address)
    functions = []
    for index in range(count):
        devfn = (address.slot << 3 | address.function) + 4 + index
        vf = PciAddress(address.domain, address.bus, devfn >> 3, devfn & 7)
        functions.append(
            Function(
                str(vf),
                pf.vendor,
                pf.device,
                pf.pci_class,
                "nvidia",
                first_group + index,
                pf.numa_node,
                parent=pf.parent,
                subsystem_vendor=pf.subsystem_vendor,
                subsystem_device=pf.subsystem_device,
                revision=pf.revision,
            )
        )
    return tuple(functions)


@dataclass(frozen=True, slots=True)
class Node:
    """A whole machine: its PCI functions, mdev types and mdevs, and optionally its pci.ids text."""

    name: str
    functions: tuple[Function, ...]
    mdev_types: tuple[MdevType, ...] = ()
    mdevs: tuple[Mdev, ...] = ()
    pci_ids: str | None = None
    """Written to ``usr/share/misc/pci.ids`` under the root when set (where Debian keeps it)."""
    vfio_container: bool = True
    """Whether ``dev/vfio/vfio`` exists (the vfio module is loaded)."""
    iommufd: bool = False
    """Whether ``dev/iommu`` exists; then every function on a VFIO driver and every bound mdev gets a VFIO
    device cdev (``<sysfs device>/vfio-dev/vfioN`` and ``dev/vfio/devices/vfioN``), numbered in order unless
    its ``vfio_dev`` says."""
    sriov_vgpus: tuple[SriovVgpuGpu, ...] = ()
    """GPUs split into SR-IOV vGPU VFs (their PF and VFs are among :attr:`functions`)."""

    def function(self, address: str) -> Function:
        for function in self.functions:
            if function.address == address:
                return function
        raise KeyError(address)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _link(link: Path, target: Path) -> None:
    """A relative symlink ``link`` → ``target``, as sysfs makes them."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _device_dirs(node: Node, sys: Path) -> dict[str, Path]:
    by_address = {function.address: function for function in node.functions}
    dirs: dict[str, Path] = {}

    def resolve(address: str, seen: tuple[str, ...]) -> Path:
        if address in dirs:
            return dirs[address]
        if address in seen:
            raise ValueError(f"bridge loop through {address}")
        function = by_address[address]
        if function.parent is None:
            parsed = PciAddress.parse(address)
            path = sys / "devices" / f"pci{parsed.domain:04x}:{parsed.bus:02x}" / address
        else:
            if function.parent not in by_address:
                raise ValueError(f"{address}: parent bridge {function.parent} is not among the node's functions")
            path = resolve(function.parent, (*seen, address)) / address
        dirs[address] = path
        return path

    for function in node.functions:
        resolve(function.address, ())
    return dirs


def _uevent(lines: Iterable[tuple[str, str]]) -> str:
    return "".join(f"{key}={value}\n" for key, value in lines)


def _write_function(function: Function, path: Path, sys: Path, vfio_groups: set[int]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (
        ("vendor", f"0x{function.vendor:04x}"),
        ("device", f"0x{function.device:04x}"),
        ("class", f"0x{function.pci_class:06x}"),
        ("subsystem_vendor", f"0x{function.subsystem_vendor:04x}"),
        ("subsystem_device", f"0x{function.subsystem_device:04x}"),
        ("revision", f"0x{function.revision:02x}"),
        ("numa_node", str(function.numa_node)),
        ("enable", "0"),
    ):
        _write(path / name, value + "\n")
    event = [
        ("PCI_CLASS", f"{function.pci_class:X}"),
        ("PCI_ID", f"{function.vendor:04X}:{function.device:04X}"),
        ("PCI_SUBSYS_ID", f"{function.subsystem_vendor:04X}:{function.subsystem_device:04X}"),
        ("PCI_SLOT_NAME", function.address),
    ]
    if function.driver is not None:
        event.insert(0, ("DRIVER", function.driver))
        driver_dir = sys / "bus" / "pci" / "drivers" / function.driver
        driver_dir.mkdir(parents=True, exist_ok=True)
        _link(path / "driver", driver_dir)
        _link(driver_dir / function.address, path)
    _write(path / "uevent", _uevent(event))
    _write(path / "resource", resource_text(function))
    _link(path / "subsystem", sys / "bus" / "pci")
    _link(sys / "bus" / "pci" / "devices" / function.address, path)
    if function.iommu_group is not None:
        group_dir = sys / "kernel" / "iommu_groups" / str(function.iommu_group)
        _link(path / "iommu_group", group_dir)
        _link(group_dir / "devices" / function.address, path)
        _write(group_dir / "type", "DMA\n")
        if function.driver in VFIO_DRIVERS:
            vfio_groups.add(function.iommu_group)


def resource_text(function: Function) -> str:
    """``resource`` as the kernel prints it: ``0x<start> 0x<end> 0x<flags>`` per line, zeros for what is not
    implemented. Each BAR gets a naturally aligned address in a region of its own function (32-bit BARs below
    4 GiB, 64-bit ones above), largest first, as firmware packs them."""
    address = PciAddress.parse(function.address)
    ordinal = address.bus << 8 | address.slot << 3 | address.function
    bases = {False: 0x8000_0000 + (ordinal % 32) * (64 << 20), True: (0x20 + ordinal) << 40}
    starts: dict[int, int] = {}
    for bar in sorted(function.bars, key=lambda bar: bar.size, reverse=True):
        if not 0 <= bar.number < 6 or bar.size <= 0 or bar.size & (bar.size - 1):
            raise ValueError(f"{function.address}: BAR{bar.number} of {bar.size} bytes is not a BAR")
        wide = bool(bar.flags & 0x00100000)
        start = -(-bases[wide] // bar.size) * bar.size
        starts[bar.number] = start
        bases[wide] = start + bar.size
    by_index = {bar.number: bar for bar in function.bars}
    count = _RESOURCE_LINES_BRIDGE if function.pci_class >> 8 == 0x0604 else _RESOURCE_LINES_ENDPOINT
    lines = []
    for index in range(count):
        found = by_index.get(index)
        start, end, flags = (starts[index], starts[index] + found.size - 1, found.flags) if found else (0, 0, 0)
        lines.append(f"0x{start:016x} 0x{end:016x} 0x{flags:016x}\n")
    return "".join(lines)


def _write_mdev_type(mdev_type: MdevType, parent_dir: Path) -> None:
    type_dir = parent_dir / "mdev_supported_types" / mdev_type.type_id
    _write(type_dir / "name", f"{mdev_type.name}\n")
    _write(type_dir / "available_instances", f"{mdev_type.available_instances}\n")
    _write(type_dir / "device_api", f"{mdev_type.device_api}\n")
    _write(type_dir / "description", f"{mdev_type.description}\n")
    (type_dir / "devices").mkdir(exist_ok=True)


def _write_mdev(mdev: Mdev, parent_dir: Path, sys: Path, vfio_groups: set[int]) -> None:
    mdev_dir = parent_dir / mdev.uuid
    type_dir = parent_dir / "mdev_supported_types" / mdev.type_id
    if not type_dir.is_dir():
        raise ValueError(f"mdev {mdev.uuid}: {mdev.parent} has no mdev type {mdev.type_id}")
    mdev_dir.mkdir(parents=True, exist_ok=True)
    _link(mdev_dir / "mdev_type", type_dir)
    _link(type_dir / "devices" / mdev.uuid, mdev_dir)
    _link(sys / "bus" / "mdev" / "devices" / mdev.uuid, mdev_dir)
    _link(mdev_dir / "subsystem", sys / "bus" / "mdev")
    _write(mdev_dir / "remove", "")
    group_dir = sys / "kernel" / "iommu_groups" / str(mdev.iommu_group)
    _link(mdev_dir / "iommu_group", group_dir)
    _link(group_dir / "devices" / mdev.uuid, mdev_dir)
    event = [("MDEV_TYPE", mdev.type_id)]
    if mdev.driver is not None:
        event.insert(0, ("DRIVER", mdev.driver))
        driver_dir = sys / "bus" / "mdev" / "drivers" / mdev.driver
        driver_dir.mkdir(parents=True, exist_ok=True)
        _link(mdev_dir / "driver", driver_dir)
        _link(driver_dir / mdev.uuid, mdev_dir)
        vfio_groups.add(mdev.iommu_group)
    _write(mdev_dir / "uevent", _uevent(event))


def _vfio_cdevs(node: Node, dirs: dict[str, Path]) -> dict[Path, int]:
    """Where each VFIO device cdev goes (sysfs device dir → N): explicit numbers first, then the next free."""
    bound: list[tuple[Path, int | None]] = [
        (dirs[function.address], function.vfio_dev)
        for function in node.functions
        if function.driver in VFIO_DRIVERS and (node.iommufd or function.vfio_dev is not None)
    ]
    bound.extend(
        (dirs[mdev.parent] / mdev.uuid, mdev.vfio_dev)
        for mdev in node.mdevs
        if mdev.driver is not None and (node.iommufd or mdev.vfio_dev is not None)
    )
    taken = {number for _, number in bound if number is not None}
    if len(taken) != sum(1 for _, number in bound if number is not None):
        raise ValueError(f"node {node.name}: two devices share a vfio_dev number")
    numbers: dict[Path, int] = {}
    following = 0
    for path, explicit in bound:
        if explicit is None:
            while following in taken:
                following += 1
            taken.add(following)
        numbers[path] = following if explicit is None else explicit
    return numbers


def build(node: Node, root: Path) -> Path:
    """Write ``node`` under ``root`` (created if needed) and return ``root``, usable as a host root.

    ``dev/vfio/<N>`` is written for every group with a function on a VFIO driver or a bound mdev, as the
    kernel creates it; ``dev/vfio/vfio`` when :attr:`Node.vfio_container`; ``dev/iommu`` and the VFIO device
    cdevs when :attr:`Node.iommufd` (or a device's ``vfio_dev`` is set).
    """
    sys = root / "sys"
    dirs = _device_dirs(node, sys)
    vfio_groups: set[int] = set()
    (sys / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
    for function in node.functions:
        _write_function(function, dirs[function.address], sys, vfio_groups)
    for mdev_type in node.mdev_types:
        _write_mdev_type(mdev_type, dirs[mdev_type.parent])
    for mdev in node.mdevs:
        _write_mdev(mdev, dirs[mdev.parent], sys, vfio_groups)
    dev_vfio = root / "dev" / "vfio"
    dev_vfio.mkdir(parents=True, exist_ok=True)
    if node.vfio_container:
        _write(dev_vfio / "vfio", "")
    for group in sorted(vfio_groups):
        _write(dev_vfio / str(group), "")
    for device_dir, number in _vfio_cdevs(node, dirs).items():
        cdev_dir = device_dir / "vfio-dev" / f"vfio{number}"
        _write(cdev_dir / "dev", f"{_VFIO_CDEV_MAJOR}:{number}\n")
        _write(dev_vfio / "devices" / f"vfio{number}", "")
    if node.sriov_vgpus:
        numbers = _vfio_cdevs(node, dirs).values()
        _write_sriov_vgpus(node, dirs, root, max(numbers, default=-1) + 1)
    if node.iommufd:
        _write(root / "dev" / "iommu", "")
    if node.pci_ids is not None:
        _write(root / "usr" / "share" / "misc" / "pci.ids", node.pci_ids)
    return root


def _write_sriov_vgpus(node: Node, dirs: dict[str, Path], root: Path, next_cdev: int) -> None:
    """The SR-IOV and ``nvidia/`` files of each :class:`SriovVgpuGpu`, its VFs' ``/dev/vfio/<group>`` nodes and
    (with :attr:`Node.iommufd`) their VFIO device cdevs, numbered from ``next_cdev``."""
    dev_vfio = root / "dev" / "vfio"
    for gpu in node.sriov_vgpus:
        if gpu.pf not in dirs or any(vf not in dirs for vf in gpu.vfs):
            raise ValueError(f"SR-IOV GPU {gpu.pf}: its PF and VFs must be among the node's functions")
        if len(gpu.vfs) > gpu.total_vfs:
            raise ValueError(f"SR-IOV GPU {gpu.pf}: {len(gpu.vfs)} VFs, more than sriov_totalvfs {gpu.total_vfs}")
        pf_dir = dirs[gpu.pf]
        _write(pf_dir / "sriov_totalvfs", f"{gpu.total_vfs}\n")
        _write(pf_dir / "sriov_numvfs", f"{len(gpu.vfs)}\n")
        for index, address in enumerate(gpu.vfs):
            vf_dir = dirs[address]
            function = node.function(address)
            _link(pf_dir / f"virtfn{index}", vf_dir)
            _link(vf_dir / "physfn", pf_dir)
            current = gpu.current_type(index)
            _write(vf_dir / "nvidia" / "current_vgpu_type", f"{current}\n")
            listed = () if current or gpu.full else gpu.types
            _write(vf_dir / "nvidia" / "creatable_vgpu_types", creatable_text(listed))
            if function.driver == "nvidia" and function.iommu_group is not None:
                _write(dev_vfio / str(function.iommu_group), "")
                if node.iommufd:
                    cdev_dir = vf_dir / "vfio-dev" / f"vfio{next_cdev}"
                    _write(cdev_dir / "dev", f"{_VFIO_CDEV_MAJOR}:{next_cdev}\n")
                    _write(dev_vfio / "devices" / f"vfio{next_cdev}", "")
                    next_cdev += 1
