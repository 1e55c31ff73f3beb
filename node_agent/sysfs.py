"""Reading the node's sysfs, ``/dev/vfio`` and ``/proc`` under a host root (reads only; writes are
:mod:`node_agent.kernel`'s).

Every attribute is read as a bounded regular file (:func:`runtime.files.read_regular_file`); every link
the agent follows (``driver``, ``iommu_group``, ``bus/pci/devices/<BDF>``) must resolve inside the host root:
sysfs's own links are relative and stay in it, anything else is refused by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from node_agent.kernel import AgentError
from runtime.files import read_regular_file
from schemas.errors import InputError
from schemas.pci import PciAddress

MAX_ATTRIBUTE = 65536
"""A sysfs attribute is at most a page (4 KiB; 64 KiB on some arm64 kernels)."""
MAX_PROC_ENTRIES = 1_000_000
"""The most ``/proc/<pid>/fd`` entries one holder scan looks at (a bound, far above any real node)."""
NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)
"""Display class / subclass pairs (``class >> 8``) a GPU has: VGA controller, 3D controller."""
BRIDGE_CLASS = 0x0604
"""PCI-to-PCI bridges share groups with the devices behind them; VFIO accepts them on their own driver."""


class Sysfs:
    """The node whose ``/`` is :attr:`root`: paths are built under it and links must stay inside it."""

    def __init__(self, root: Path, proc: Path | None = None) -> None:
        self.root = root
        self.sys = root / "sys"
        self.pci_devices = self.sys / "bus" / "pci" / "devices"
        self.pci_drivers = self.sys / "bus" / "pci" / "drivers"
        self.dev_vfio = root / "dev" / "vfio"
        self.proc = root / "proc" if proc is None else proc
        self._real_root = os.path.realpath(root)

    def inside(self, path: Path) -> Path:
        """``path`` with its links resolved; :class:`AgentError` when that leads outside the host root."""
        real = os.path.realpath(path)
        if os.path.commonpath([real, self._real_root]) != self._real_root:
            raise AgentError(f"{path} resolves to {real}, outside the host root {self.root}; refusing to use it")
        return Path(real)

    def read(self, path: Path) -> str | None:
        """The stripped text of the attribute ``path``; None when it does not exist."""
        if not os.path.lexists(path):
            return None
        try:
            return read_regular_file(path, MAX_ATTRIBUTE, "sysfs attribute").decode(errors="replace").strip()
        except InputError as exc:
            raise AgentError(str(exc)) from None

    def link_name(self, path: Path) -> str | None:
        """The last component of the link ``path``'s target (``driver`` → ``vfio-pci``); None when absent."""
        try:
            return os.path.basename(os.readlink(path))
        except OSError:
            return None

    def listdir(self, path: Path) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return []

    def group_node(self, group: int) -> Path:
        return self.dev_vfio / str(group)

    def group_members(self, group: int) -> list[str]:
        return self.listdir(self.sys / "kernel" / "iommu_groups" / str(group) / "devices")


@dataclass(frozen=True, slots=True)
class PciFunction:
    """One PCI function as sysfs shows it now."""

    address: str
    vendor: int
    device: int
    pci_class: int
    driver: str | None
    driver_override: str | None
    iommu_group: int | None
    modalias: str
    device_nodes: tuple[str, ...] = ()
    """``/dev`` nodes its host driver made (DRM cards, sound controls): whoever holds one uses the device."""

    @property
    def is_bridge(self) -> bool:
        return self.pci_class >> 8 == BRIDGE_CLASS

    @property
    def is_gpu(self) -> bool:
        return self.pci_class >> 8 in GPU_CLASSES

    @property
    def vendor_device(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"


def _hex(text: str | None, what: str, address: str) -> int:
    try:
        return int(text or "", 16)
    except ValueError:
        raise AgentError(f"{address}: {what} reads {text!r}, not a hex number") from None


def modalias_of(vendor: int, device: int, sub_vendor: int, sub_device: int, pci_class: int) -> str:
    """The ``pci:`` modalias the kernel prints for these IDs (used when sysfs has no ``modalias`` file)."""
    base, sub, interface = pci_class >> 16, (pci_class >> 8) & 0xFF, pci_class & 0xFF
    return f"pci:v{vendor:08X}d{device:08X}sv{sub_vendor:08X}sd{sub_device:08X}bc{base:02X}sc{sub:02X}i{interface:02X}"


def read_function(fs: Sysfs, address: str) -> PciFunction:
    """The function ``address`` now; :class:`AgentError` when there is no such PCI function."""
    PciAddress.parse(address)
    link = fs.pci_devices / address
    if not os.path.lexists(link):
        raise AgentError(f"no PCI function {address} on this node ({link} does not exist)")
    directory = fs.inside(link)
    vendor = _hex(fs.read(directory / "vendor"), "vendor", address)
    device = _hex(fs.read(directory / "device"), "device", address)
    pci_class = _hex(fs.read(directory / "class"), "class", address)
    modalias = fs.read(directory / "modalias") or modalias_of(
        vendor,
        device,
        _hex(fs.read(directory / "subsystem_vendor") or "0", "subsystem_vendor", address),
        _hex(fs.read(directory / "subsystem_device") or "0", "subsystem_device", address),
        pci_class,
    )
    override = fs.read(directory / "driver_override")
    group = fs.link_name(directory / "iommu_group")
    nodes = [f"/dev/dri/{name}" for name in fs.listdir(directory / "drm") if name.startswith(("card", "renderD"))]
    for card in fs.listdir(directory / "sound"):
        if card.startswith("card") and card[4:].isdigit():
            number = card[4:]
            nodes.append(f"/dev/snd/controlC{number}")
            nodes.extend(
                f"/dev/snd/{name}"
                for name in fs.listdir(directory / "sound" / card)
                if name.startswith(("pcmC", "hwC"))
            )
    return PciFunction(
        address=address,
        vendor=vendor,
        device=device,
        pci_class=pci_class,
        driver=fs.link_name(directory / "driver"),
        driver_override=None if override in (None, "", "(null)") else override,
        iommu_group=None if group is None or not group.isdigit() else int(group),
        modalias=modalias,
        device_nodes=tuple(nodes),
    )


def all_addresses(fs: Sysfs) -> list[str]:
    return fs.listdir(fs.pci_devices)


def holders(fs: Sysfs, nodes: set[str]) -> list[str]:
    """Processes holding any of the device ``nodes`` (``/dev/vfio/12``…) open, as ``pid 4242 (qemu-kvm)``:
    read from ``/proc/<pid>/fd`` (a process in another PID namespace may be missing; the group's EBUSY still
    tells that someone holds it)."""
    found: list[str] = []
    seen = 0
    for pid in fs.listdir(fs.proc):
        if not pid.isdigit():
            continue
        fd_dir = fs.proc / pid / "fd"
        for fd in fs.listdir(fd_dir):
            seen += 1
            if seen > MAX_PROC_ENTRIES:
                return found
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target in nodes:
                try:
                    comm = fs.read(fs.proc / pid / "comm")
                except AgentError:  # the process ended meanwhile
                    comm = None
                found.append(f"pid {pid} ({comm or '?'}) holds {target}")
    return found
