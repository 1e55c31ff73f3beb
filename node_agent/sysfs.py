"""Reading the node's sysfs, ``/dev/vfio`` and ``/proc`` under a host root (reads only; writes are
:mod:`node_agent.kernel`'s, opened through :meth:`Sysfs.open_write`).

Every path the agent reads or writes goes through one resolver, :class:`runtime.hostroot.HostRoot` (the
device plugin's, shared through ``runtime/``): links are resolved inside the host root (``openat2`` with
``RESOLVE_IN_ROOT``, or the same rules in Python), and for everything under the root's ``sys`` and ``dev``
a link pointing out of the root (an absolute target, ``..`` above it) is refused by name
(:meth:`~runtime.hostroot.HostRoot.confine`): sysfs's own links are relative and stay in it. Attributes are
read as bounded regular files. ``/proc`` (the host root's, or ``proc`` given apart) is read the same way,
its links (``/proc/<pid>/fd/<n>``) only read, never followed.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from node_agent.kernel import AgentError
from runtime.files import read_open_file
from runtime.hostroot import HostRoot, ReadError
from schemas.errors import InputError
from schemas.pci import PciAddress

MAX_ATTRIBUTE = 65536
"""A sysfs attribute is at most a page (4 KiB; 64 KiB on some arm64 kernels)."""
MAX_PROC_ENTRIES = 1_000_000
"""The most ``/proc/<pid>/fd`` entries one holder scan looks at (a bound, far above any real node); past it the
nodes count as held, so a scan cut short never lets a device in use be unbound."""
MAX_PROC_FILE = 16 * 1024 * 1024
"""The most read of one ``/proc`` table (``mountinfo`` with thousands of container mounts is a few MiB)."""
MAX_LISTING = 100_000
"""The most entries one sysfs directory listing may have (``/sys/bus/pci/devices`` has hundreds)."""
NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)
"""Display class / subclass pairs (``class >> 8``) a GPU has: VGA controller, 3D controller."""
BRIDGE_CLASS = 0x0604
"""PCI-to-PCI bridges share groups with the devices behind them; VFIO accepts them on their own driver."""


class Sysfs:
    """The node whose ``/`` is :attr:`root`: paths are built under it (as :class:`~pathlib.Path` s) and every
    one is resolved inside it by the one resolver (see the module doc)."""

    def __init__(self, root: Path, proc: Path | None = None) -> None:
        self.root = root
        self.sys = root / "sys"
        self.pci_devices = self.sys / "bus" / "pci" / "devices"
        self.pci_drivers = self.sys / "bus" / "pci" / "drivers"
        self.dev_vfio = root / "dev" / "vfio"
        self.proc = root / "proc" if proc is None else proc
        self._host = HostRoot(str(root))
        self._proc_root = None if proc is None else HostRoot(str(proc))

    def _where(self, path: Path) -> tuple[HostRoot, str, bool]:
        """The resolver for ``path``, its in-root path, and whether it is held to :meth:`HostRoot.confine`."""
        if self._proc_root is not None and path.is_relative_to(self.proc):
            return self._proc_root, "/" + str(path.relative_to(self.proc)).lstrip("."), False
        if not path.is_relative_to(self.root):
            raise AgentError(f"{path} is not under the host root {self.root}; refusing to use it")
        inner = "/" + str(path.relative_to(self.root)).lstrip(".")
        strict = path.is_relative_to(self.sys) or path.is_relative_to(self.root / "dev")
        return self._host, inner, strict

    def _confined(self, path: Path) -> tuple[HostRoot, str | None]:
        """The resolver and ``path`` resolved in it (None: missing); AgentError when a link leads out of it."""
        host, inner, strict = self._where(path)
        try:
            return host, host.confine(inner) if strict else host.resolve(inner)
        except ReadError as exc:
            raise AgentError(str(exc)) from None

    def inside(self, path: Path) -> Path:
        """``path`` with its links resolved inside the host root; :class:`AgentError` when one leads out of it
        or the path does not exist."""
        host, resolved = self._confined(path)
        if resolved is None:
            raise AgentError(f"{path} does not exist inside the host root {self.root}")
        return Path(host.root or "/") / resolved.lstrip("/")

    def read(self, path: Path, limit: int = MAX_ATTRIBUTE) -> str | None:
        """The stripped text of the attribute ``path``; None when it does not exist."""
        host, resolved = self._confined(path)
        if resolved is None:
            return None
        try:
            text = host.read(resolved, limit)
        except ReadError as exc:
            raise AgentError(f"sysfs attribute {path}: {exc}") from None
        return None if text is None else text.strip()

    def read_table(self, path: Path, limit: int = MAX_PROC_FILE) -> str | None:
        """The whole text of a ``/proc`` table (``mountinfo``, ``swaps``) read to its end, at most ``limit``
        bytes; None when it does not exist. (A seq_file hands over a page or less per read, so one short read
        is not its end, unlike a sysfs attribute's.)"""
        host, inner, _ = self._where(path)
        try:
            descriptor = host.open_confined(inner, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ReadError) as exc:
            raise AgentError(f"{path} cannot be read: {exc}") from None
        try:
            return read_open_file(descriptor, limit, "host table", str(path)).decode(errors="replace")
        except InputError as exc:
            raise AgentError(str(exc)) from None

    def lexists(self, path: Path) -> bool:
        """Whether ``path`` exists itself (a link, even dangling, counts), its parent resolved inside the root."""
        host, inner, _ = self._where(path)
        try:
            return host.lstat(inner) is not None
        except ReadError as exc:
            raise AgentError(str(exc)) from None

    def is_dir(self, path: Path) -> bool:
        host, resolved = self._confined(path)
        if resolved is None:
            return False
        info = host.lstat(resolved)
        return info is not None and stat.S_ISDIR(info.st_mode)

    def is_link(self, path: Path) -> bool:
        host, inner, _ = self._where(path)
        info = host.lstat(inner)
        return info is not None and stat.S_ISLNK(info.st_mode)

    def readlink(self, path: Path) -> str | None:
        """The link ``path``'s target as written (read, never followed); None when absent or no link."""
        host, inner, _ = self._where(path)
        return host.readlink(inner)

    def link_name(self, path: Path) -> str | None:
        """The last component of the link ``path``'s target (``driver`` → ``vfio-pci``); None when absent."""
        target = self.readlink(path)
        return None if target is None else os.path.basename(os.path.normpath(target))

    def listdir(self, path: Path) -> list[str]:
        """The sorted names in the directory ``path`` (resolved inside the root); empty when it is missing."""
        host, resolved = self._confined(path)
        if resolved is None:
            return []
        try:
            names = host.listdir(resolved)
        except OSError:
            return []
        if len(names) > MAX_LISTING:
            raise AgentError(f"{path} has {len(names)} entries, more than the {MAX_LISTING} the agent reads")
        return sorted(names)

    def entries(self, path: Path) -> list[tuple[str, bool]]:
        """(name, is a directory) of each entry of the directory ``path`` (resolved inside the root), links
        reported as no directory (not followed); empty when it is missing."""
        host, resolved = self._confined(path)
        if resolved is None:
            return []
        found: list[tuple[str, bool]] = []
        try:
            with os.scandir(host.host_path(resolved)) as listing:
                for entry in listing:
                    found.append((entry.name, entry.is_dir(follow_symlinks=False)))
                    if len(found) > MAX_LISTING:
                        raise AgentError(f"{path} has more than the {MAX_LISTING} entries the agent reads")
        except OSError:
            return []
        return sorted(found)

    def open_write(self, path: Path) -> int:
        """The existing regular file ``path`` opened write-only inside the root (see the module doc); AgentError
        naming it when it is missing, not a regular file, or a link on its way leads out of the root."""
        host, inner, _ = self._where(path)
        try:
            return host.open_write(inner)
        except FileNotFoundError:
            raise AgentError(f"{path} does not exist inside the host root {self.root}; not writing it") from None
        except ReadError as exc:
            raise AgentError(f"{exc} (not writing it)") from None
        except OSError as exc:
            raise AgentError(f"cannot open {path} to write: {exc.strerror or exc}") from None

    def open_node(self, path: Path, flags: int) -> int:
        """A device node (``/dev/vfio/<N>``) opened with ``flags`` inside the root; ``OSError`` as ``open``."""
        host, inner, _ = self._where(path)
        try:
            return host.open_confined(inner, flags)
        except ReadError as exc:
            raise AgentError(str(exc)) from None

    def check_writable(self, path: Path) -> None:
        """Refuse (AgentError naming it) an attribute that could not be written inside the root, writing nothing."""
        os.close(self.open_write(path))

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
    if not fs.lexists(link):
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
            if seen > MAX_PROC_ENTRIES:  # cannot tell who holds what: count the nodes as held, never as free
                found.append(f"more than {MAX_PROC_ENTRIES} open files under {fs.proc} to look at: counted as held")
                return found
            target = fs.readlink(fd_dir / fd)
            if target is not None and target in nodes:
                try:
                    comm = fs.read(fs.proc / pid / "comm")
                except AgentError:  # the process ended meanwhile
                    comm = None
                found.append(f"pid {pid} ({comm or '?'}) holds {target}")
    return found
