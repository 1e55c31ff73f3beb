"""Discovery: read a node's sysfs (under a host root) and return the :class:`~plugin.inventory.Inventory`.

This is where the node's offer is decided, and where NVIDIA's plugin goes wrong (FACTS.md §6-7): it
advertises every vfio-bound NVIDIA function, audio included, and never checks that an IOMMU group is
viable. Here only selected GPU functions become devices; the rest of each GPU's group are its companions,
and a companion on a host driver (``snd_hda_intel``, ``xhci_hcd``…) makes the GPU unhealthy with a reason
that names it. GPUs on a host driver (``nvidia``) are listed as not offered. vGPUs come from
``/sys/bus/mdev/devices``, one resource per mdev type name.

The scan only reads (``listdir``, ``readlink``, small files) under the host root and returns a value; it is
cheap enough to rerun for health checks (see ``bench/``). Reading is linear in the number of functions:
non-selected vendors cost one ``vendor`` read each.

The node's files are not trusted (issue 11): every path is resolved inside the host root as a chroot would
(:class:`HostRoot`: ``openat2`` with ``RESOLVE_IN_ROOT``, or the same rules in Python where the kernel lacks
it), a read takes regular files only, opened without blocking and capped at :data:`MAX_ATTRIBUTE_BYTES`, and
a value out of range (a ``numa_node`` past :data:`MAX_NUMA_NODE`) is dropped. Each refusal is a warning
naming the file and the reason (the manager logs it); the function or device concerned is left out or loses
the attribute, never the whole scan.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from plugin.config import PluginConfig
from plugin.inventory import Companion, Device, Ignored, Inventory, Resource
from plugin.naming import mdev_resource_name, pci_resource_name
from plugin.pciids import PciIds, locate_pci_ids
from plugin.virtual_mdev import scan_virtual_mdev
from schemas.errors import InputError
from schemas.mdev import parse_mdev_uuid
from schemas.naming import ResourceKind, validate_resource_name
from schemas.pci import PciAddress

_CLASS_LABELS = {
    0x0300: "VGA",
    0x0302: "3D controller",
    0x0380: "display controller",
    0x0403: "audio",
    0x0C03: "USB",
    0x0C80: "serial bus",
    0x0604: "PCI bridge",
    0x0200: "Ethernet",
    0x0207: "InfiniBand",
    0x0108: "NVMe",
}


def class_label(pci_class: int) -> str:
    """A short human name for a PCI class code (``0x040300`` → ``audio``)."""
    return _CLASS_LABELS.get(pci_class >> 8, f"class {pci_class:06x}")


MAX_ATTRIBUTE_BYTES = 65536
"""The most a sysfs attribute file may hold (the kernel caps them at a page: 4 KiB, 64 KiB on some arm64)."""
MAX_LINKS = 40
"""Symlinks followed while resolving one path (the kernel's own limit); more is a loop."""
MAX_NUMA_NODE = 1023
"""The kernel has at most ``1 << CONFIG_NODES_SHIFT`` (≤ 1024) NUMA nodes; a larger ``numa_node`` is nonsense."""


_SYS_OPENAT2 = 437
"""``openat2(2)``'s number, the same on every Linux architecture (it came after the syscall tables were unified)."""
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_openat2() -> Callable[[int, bytes, int], int] | None:
    """``openat2(dirfd, path, flags)`` with ``RESOLVE_IN_ROOT`` (Linux ≥ 5.6), or None where it cannot be called.

    The kernel then resolves every link inside ``dirfd`` as a chroot would, in one call; where it is missing
    (``ENOSYS``, or refused by a seccomp profile) :class:`HostRoot` resolves the path itself.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    def openat2(dirfd: int, path: bytes, flags: int) -> int:
        how = _OpenHow(flags, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        descriptor = int(
            syscall(
                ctypes.c_long(_SYS_OPENAT2),
                ctypes.c_int(dirfd),
                ctypes.c_char_p(path),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
        )
        if descriptor < 0:
            number = ctypes.get_errno()
            raise OSError(number, os.strerror(number))
        return descriptor

    return openat2


class ReadError(Exception):
    """A node file that must not be used: not a regular file, too large, a link loop, unreadable (the reason)."""


_UNRESOLVED = ""


class HostRoot:
    """Reads under the host root as a chroot would: every path is resolved inside the root.

    The node's sysfs is full of symlinks, and the plugin follows them (``bus/pci/devices/<BDF>``,
    ``mdev_type``, ``iommu_group``). Left to the kernel, an absolute target (``/etc/...``) would be looked up
    in the plugin's own filesystem, outside the host root, and ``..`` could climb out of it. Here each
    component is resolved by hand: an absolute link target starts again at the host root, ``..`` stops at
    it, and more than :data:`MAX_LINKS` links is a loop. Resolved directories are cached for one scan (a
    scan reads the same ``/sys/devices/pci…`` prefixes many times). Paths given and returned are in-root
    (``/sys/…``); :attr:`root` is where the host's ``/`` is mounted.

    File reads are bounded: opened ``O_NONBLOCK | O_NOFOLLOW`` (a FIFO never blocks, a swapped-in link is
    not followed), ``fstat`` must say a regular file, and at most :data:`MAX_ATTRIBUTE_BYTES` are read.
    """

    openat2: ClassVar[Callable[[int, bytes, int], int] | None] = _load_openat2()
    """``openat2`` with ``RESOLVE_IN_ROOT`` for reads; None when unavailable (set on the first ``ENOSYS``)."""

    def __init__(self, root: str) -> None:
        self.root = "" if root == "/" else root.rstrip("/")
        self._resolved: dict[str, str] = {}
        self._root_fd: int | None = None

    def host_path(self, path: str) -> str:
        return self.root + path

    def resolve(self, path: str) -> str | None:
        """``path`` (in-root, absolute) with every symlink resolved inside the root; None if a component is
        missing or the links loop."""
        resolved = self._resolved.get(path)
        if resolved is None:
            resolved = self._resolve(path, 0)
            if resolved is not None:
                self._resolved[path] = resolved
        return resolved

    def _resolve(self, path: str, depth: int) -> str | None:
        if depth > MAX_LINKS:
            return None
        current = "/"
        for component in path.split("/"):
            if component in ("", "."):
                continue
            if component == "..":
                current = current.rpartition("/")[0] or "/"  # stops at the root
                continue
            candidate = f"{current.rstrip('/')}/{component}"
            resolved = self._resolved.get(candidate)
            if resolved is None:
                resolved = self._step(candidate, current, depth)
                if resolved is None:
                    return None
                self._resolved[candidate] = resolved
            current = resolved
        return current

    def _step(self, candidate: str, parent: str, depth: int) -> str | None:
        host = self.root + candidate
        try:
            info = os.lstat(host)
        except OSError:
            return None
        if not stat.S_ISLNK(info.st_mode):
            return candidate
        try:
            target = os.readlink(host)
        except OSError:
            return None
        base = "/" if target.startswith("/") else parent
        return self._resolve(f"{base.rstrip('/')}/{target}", depth + 1)

    def _split(self, path: str) -> tuple[str, str] | None:
        """(resolved parent directory, last component) of ``path``; None if the parent does not resolve."""
        parent, _, name = path.rpartition("/")
        resolved = self.resolve(parent or "/")
        if resolved is None or name in ("", ".", ".."):
            return None
        return resolved.rstrip("/"), name

    def read(self, path: str) -> str | None:
        """A small regular file's text; None if it does not exist. Raises :class:`ReadError` with the reason
        when it exists but must not be used (FIFO, device, directory, too large, a link loop, unreadable)."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
        try:
            descriptor = self._open(path, flags)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except ReadError:
            raise
        except OSError as exc:
            raise ReadError(f"{path}: cannot open: {exc.strerror or exc}") from None
        if descriptor is None:
            return None
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode):
                raise ReadError(f"{path}: not a regular file ({_file_kind(info.st_mode)})")
            chunks = []
            size = 0
            while chunk := os.read(descriptor, 4096):
                size += len(chunk)
                if size > MAX_ATTRIBUTE_BYTES:
                    raise ReadError(f"{path}: larger than {MAX_ATTRIBUTE_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks).decode("utf-8", errors="replace")
        except OSError as exc:
            raise ReadError(f"{path}: cannot read: {exc.strerror or exc}") from None
        finally:
            os.close(descriptor)

    def _kernel_open(self, path: str, flags: int) -> int | None:
        """``path`` opened by the kernel inside the root (``openat2`` ``RESOLVE_IN_ROOT``); None where that is
        unavailable (the caller resolves in Python). Raises ``OSError`` as ``open`` does."""
        openat2 = HostRoot.openat2
        if openat2 is None:
            return None
        if self._root_fd is None:
            self._root_fd = os.open(self.root or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return openat2(self._root_fd, os.fsencode(path.lstrip("/") or "."), flags | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            HostRoot.openat2 = None  # not on this kernel or refused by seccomp: resolve in Python from now on
            return None

    def _open(self, path: str, flags: int) -> int | None:
        """A descriptor for ``path`` resolved inside the root (None: a parent does not resolve)."""
        try:
            descriptor = self._kernel_open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ReadError(f"{path}: too many links (a loop?)") from None
            raise
        if descriptor is not None:
            return descriptor
        split = self._split(path)
        if split is None:
            return None
        parent, name = split
        target = f"{parent}/{name}"
        try:
            return os.open(self.root + target, flags | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
        resolved = self.resolve(target)  # the last component is a link: resolve it inside the root too
        if resolved is None:
            return None  # dangling inside the root (or a loop), as the kernel's ENOENT/ELOOP
        return os.open(self.root + resolved, flags | os.O_NOFOLLOW)

    def close(self) -> None:
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def readlink_name(self, path: str) -> str | None:
        """The last component of the symlink ``path``'s target (``driver`` → ``vfio-pci``); None when absent."""
        parent, _, name = path.rpartition("/")
        try:
            directory = self._kernel_open(parent or "/", os.O_PATH | os.O_DIRECTORY)
        except OSError:
            return None
        if directory is not None:
            try:
                return os.path.basename(os.path.normpath(os.readlink(name, dir_fd=directory)))
            except OSError:
                return None
            finally:
                os.close(directory)
        split = self._split(path)
        if split is None:
            return None
        parent, name = split
        try:
            target = os.readlink(f"{self.root}{parent}/{name}")
        except OSError:
            return None
        return os.path.basename(os.path.normpath(target))

    def listdir(self, path: str) -> list[str]:
        """Entries of the directory ``path`` (resolved inside the root); raises ``OSError`` as ``os.listdir``."""
        directory = self._kernel_open(path, os.O_RDONLY | os.O_DIRECTORY)
        if directory is not None:
            try:
                return os.listdir(directory)
            finally:
                os.close(directory)
        resolved = self.resolve(path)
        if resolved is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory inside the host root", path)
        return os.listdir(self.root + resolved)

    def exists(self, path: str) -> bool:
        try:
            descriptor = self._kernel_open(path, os.O_PATH)
        except OSError:
            return False
        if descriptor is not None:
            os.close(descriptor)
            return True
        return self.resolve(path) is not None

    def __enter__(self) -> HostRoot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return kind
    return f"mode {stat.S_IFMT(mode):o}"


@dataclass(frozen=True, slots=True)
class _Function:
    """One PCI function as read from sysfs."""

    name: str
    vendor: int
    device: int
    pci_class: int
    driver: str | None

    @property
    def vendor_device(self) -> str:
        return f"{self.vendor:04X}:{self.device:04X}"

    def describe(self) -> str:
        return f"{self.name} ({self.vendor_device} {class_label(self.pci_class)})"


@dataclass
class _Scan:
    """State of one scan; discarded when :func:`scan` returns."""

    root: str
    config: PluginConfig
    pci_ids: PciIds | None
    warnings: list[str]
    pci_dir: str = ""
    groups_dir: str = ""
    devices_dir: str = ""
    vfio_container: bool = True
    ignored: list[Ignored] = field(default_factory=list)
    devices: dict[tuple[str, ResourceKind], list[Device]] = field(default_factory=dict)
    selectors: dict[tuple[str, ResourceKind], set[str]] = field(default_factory=dict)
    names: dict[str, str | None] = field(default_factory=dict)
    group_members: dict[int, tuple[_Function, ...]] = field(default_factory=dict)
    functions: dict[str, _Function] = field(default_factory=dict)
    """Functions already read, by name: a GPU's group members were mostly read by the bus scan."""

    fs: HostRoot = field(init=False)

    def __post_init__(self) -> None:
        self.fs = HostRoot(self.root)
        self.pci_dir = "/sys/bus/pci/devices"
        self.groups_dir = "/sys/kernel/iommu_groups"
        self.devices_dir = "/sys/devices"
        self.vfio_container = self.fs.exists("/dev/vfio/vfio")

    # -- reading (in-root paths, through self.fs) ----------------------------------------------------------

    def shown(self, path: str) -> str:
        """A path for messages: as on the host (under the host root)."""
        return self.fs.host_path(path)

    def read_text(self, path: str) -> str | None:
        """A file's text, or None if absent or unusable (then a warning says why)."""
        try:
            return self.fs.read(path)
        except ReadError as exc:
            self.warnings.append(f"ignoring {self.root.rstrip('/')}{exc}")
            return None

    def read_int(self, path: str, base: int) -> int | None:
        text = self.read_text(path)
        if text is None:
            return None
        try:
            return int(text.strip(), base)
        except ValueError:
            return None

    def read_group(self, link: str) -> int | None:
        name = self.fs.readlink_name(link)
        if name is None or not name.isdigit() or len(name) > 9:
            return None
        return int(name)

    def link_target(self, path: str) -> str | None:
        """Where a symlink leads, resolved inside the host root (in-root path), or None."""
        return self.fs.resolve(path)

    def read_function(self, directory: str, name: str, vendor: int | None = None) -> _Function | None:
        cached = self.functions.get(name)
        if cached is not None:
            return cached
        if vendor is None:
            vendor = self.read_int(f"{directory}/vendor", 16)
        device = self.read_int(f"{directory}/device", 16)
        pci_class = self.read_int(f"{directory}/class", 16)
        if vendor is None or device is None or pci_class is None:
            self.warnings.append(
                f"PCI function {name}: cannot read vendor, device or class under {self.shown(directory)}"
            )
            return None
        function = _Function(name, vendor, device, pci_class, self.fs.readlink_name(f"{directory}/driver"))
        self.functions[name] = function
        return function

    def members(self, group: int) -> tuple[_Function, ...]:
        cached = self.group_members.get(group)
        if cached is not None:
            return cached
        directory = f"{self.groups_dir}/{group}/devices"
        try:
            names = sorted(self.fs.listdir(directory))
        except OSError:
            self.warnings.append(f"IOMMU group {group}: cannot list {self.shown(directory)}")
            names = []
        functions = []
        for name in names:
            function = self.read_function(f"{directory}/{name}", name)
            if function is not None:
                functions.append(function)
        members = tuple(functions)
        self.group_members[group] = members
        return members

    def topology(self, device_dir: str | None) -> tuple[str | None, tuple[str, ...]]:
        """The root complex (``pci0000:85``) and the bridges down to ``device_dir``'s parent."""
        prefix = self.devices_dir + "/"
        if device_dir is None or not device_dir.startswith(prefix):
            return None, ()
        parts = device_dir[len(prefix) :].split("/")
        if not parts[0].startswith("pci"):
            return None, ()
        return parts[0], tuple(parts[1:-1])

    def numa(self, directory: str) -> int | None:
        """The NUMA node of the device at ``directory``; None when unknown (``-1``) or out of range (warned)."""
        node = self.read_int(f"{directory}/numa_node", 10)
        if node is None or node < 0:
            return None
        if node > MAX_NUMA_NODE:
            self.warnings.append(
                f"{self.shown(directory)}/numa_node says {str(node)[:24]}, past the kernel's largest NUMA node "
                f"{MAX_NUMA_NODE}: no topology for its devices"
            )
            return None
        return node

    def vfio_problems(self, group: int | None) -> list[str]:
        problems = []
        if group is None:
            problems.append("no IOMMU group (is the IOMMU on? intel_iommu=on or amd_iommu=on)")
        elif not self.fs.exists(f"/dev/vfio/{group}"):
            problems.append(f"/dev/vfio/{group} is missing")
        if not self.vfio_container:
            problems.append("/dev/vfio/vfio is missing (is the vfio module loaded?)")
        return problems

    # -- naming --------------------------------------------------------------------------------------------

    def pci_name(self, function: _Function) -> str | None:
        key = function.vendor_device
        if key in self.names:
            return self.names[key]
        name = self.config.override_for(function.vendor, function.device)
        if name is None:
            known = self.pci_ids.device_name(function.vendor, function.device) if self.pci_ids else None
            name = pci_resource_name(known, function.device, self.config.resource_domain)
            if known is None and self.pci_ids is not None:
                self.warnings.append(
                    f"{key} is not in {self.pci_ids.path}: named {name}; "
                    f"set name_overrides {{{key}: NAME}} for a descriptive name"
                )
        checked = self.checked_name(name, f"set name_overrides {{{key}: NAME}}")
        self.names[key] = checked
        return checked

    def checked_name(self, name: str, fix: str) -> str | None:
        try:
            return validate_resource_name(name)
        except InputError as exc:
            self.warnings.append(f"{exc}; {fix}")
            return None

    def add(self, name: str, kind: ResourceKind, device: Device, selector: str) -> None:
        other = ResourceKind.MDEV if kind is ResourceKind.PCI else ResourceKind.PCI
        if (name, other) in self.devices:
            reason = f"resource {name} is already a {other} resource"
            self.ignored.append(Ignored(device.id, device.vendor_device, device.driver, reason))
            return
        self.devices.setdefault((name, kind), []).append(device)
        self.selectors.setdefault((name, kind), set()).add(selector)

    # -- the two device kinds ------------------------------------------------------------------------------

    def scan_pci(self) -> None:
        try:
            names = sorted(self.fs.listdir(self.pci_dir))
        except OSError:
            raise InputError(
                f"no PCI devices under {self.shown(self.pci_dir)!r}: is the host root {self.root!r} right "
                "(it must hold the node's /sys)?"
            ) from None
        vendors = self.config.selector_vendors()
        for name in names:
            directory = f"{self.pci_dir}/{name}"
            vendor = self.read_int(f"{directory}/vendor", 16)
            if vendor not in vendors:
                continue
            function = self.read_function(directory, name, vendor)
            if function is None or not self.config.selects(function.vendor, function.device, function.pci_class):
                continue
            try:
                PciAddress.parse(name)
            except InputError as exc:
                self.warnings.append(f"skipping {self.shown(directory)}: {exc}")
                continue
            self.scan_gpu(directory, function)

    def scan_gpu(self, directory: str, gpu: _Function) -> None:
        config = self.config
        if gpu.driver not in config.vfio_drivers:
            bound = f"bound to {gpu.driver}" if gpu.driver else "bound to no driver"
            self.ignored.append(
                Ignored(gpu.name, gpu.vendor_device, gpu.driver, f"{bound}, not to {' or '.join(config.vfio_drivers)}")
            )
            return
        name = self.pci_name(gpu)
        if name is None:
            self.ignored.append(Ignored(gpu.name, gpu.vendor_device, gpu.driver, "its resource name is invalid"))
            return
        group = self.read_group(f"{directory}/iommu_group")
        problems: list[str] = []
        companions: list[Companion] = []
        if group is not None:
            blocked: list[str] = []
            shared: list[str] = []
            for member in self.members(group):
                if member.name == gpu.name:
                    continue
                viable = (
                    member.driver is None
                    or member.driver in config.vfio_drivers
                    or member.driver in config.allowed_companion_drivers
                )
                if not viable:
                    blocked.append(f"{member.describe()} is bound to {member.driver}")
                elif member.driver is not None and config.selects(member.vendor, member.device, member.pci_class):
                    shared.append(member.name)
                companions.append(
                    Companion(
                        PciAddress.parse(member.name), member.vendor_device, member.pci_class, member.driver, viable
                    )
                )
            if blocked:
                problems.append(
                    f"IOMMU group {group} is not viable: {'; '.join(blocked)} "
                    f"(bind {'it' if len(blocked) == 1 else 'them'} to vfio-pci or unbind)"
                )
            if shared:
                problems.append(
                    f"IOMMU group {group} is shared with GPU {', '.join(shared)}: "
                    "GPUs of one group cannot go to different VMs"
                )
        problems.extend(self.vfio_problems(group))
        root, path = self.topology(self.link_target(directory))
        device = Device(
            id=gpu.name,
            kind=ResourceKind.PCI,
            vendor_device=gpu.vendor_device,
            iommu_group=group,
            numa_node=self.numa(directory),
            healthy=not problems,
            reason="; ".join(problems) or None,
            companions=tuple(companions),
            pcie_root=root,
            pcie_path=path,
            driver=gpu.driver,
        )
        self.add(name, ResourceKind.PCI, device, gpu.vendor_device)

    def scan_mdevs(self) -> None:
        bus = "/sys/bus/mdev/devices"
        try:
            entries = sorted(self.fs.listdir(bus))
        except OSError:
            return  # no mdev support loaded: no vGPUs
        for entry in entries:
            link = f"{bus}/{entry}"
            try:
                uuid = parse_mdev_uuid(entry)
            except InputError as exc:
                self.warnings.append(f"skipping {self.shown(link)}: {exc}")
                continue
            mdev_dir = self.link_target(link)
            # Relative links inside the mdev resolve from its real directory, not from the bus link.
            type_dir = self.link_target(f"{mdev_dir}/mdev_type") if mdev_dir else None
            # Only newlines are trimmed before naming, as NVIDIA's plugin does; the selector is fully trimmed.
            raw_name = self.read_text(f"{type_dir}/name") if type_dir else None
            type_name = raw_name.strip("\n") if raw_name is not None else None
            if mdev_dir is None or type_dir is None or not type_name or not type_name.strip():
                self.warnings.append(f"skipping mdev {uuid}: cannot read its mdev_type/name under {self.shown(link)}")
                continue
            parent_dir = os.path.dirname(mdev_dir)
            if not self.fs.exists(f"{parent_dir}/vendor"):
                # A real kernel's mdev parents need not be PCI functions (the kernel's samples mtty, mdpy and
                # mbochs are virtual devices): offered only by mdev_parent_selectors / mdev_type_selectors.
                scan_virtual_mdev(self, uuid, link, parent_dir, type_dir, type_name)
                continue
            parent = self.read_function(parent_dir, os.path.basename(parent_dir))
            if parent is None:
                continue
            try:
                parent_address = PciAddress.parse(parent.name)
            except InputError as exc:
                self.warnings.append(f"skipping mdev {uuid}: its parent {self.shown(parent_dir)}: {exc}")
                continue
            driver = self.fs.readlink_name(f"{link}/driver")
            if not self.config.selects(parent.vendor, parent.device, parent.pci_class):
                self.ignored.append(
                    Ignored(uuid, parent.vendor_device, driver, f"its parent {parent.describe()} is not a selected GPU")
                )
                continue
            name = self.checked_name(
                mdev_resource_name(type_name, self.config.resource_domain),
                f"mdev type {os.path.basename(type_dir)} ({type_name!r}) cannot be offered",
            )
            if name is None:
                self.ignored.append(Ignored(uuid, parent.vendor_device, driver, "its resource name is invalid"))
                continue
            group = self.read_group(f"{link}/iommu_group")
            problems = self.vfio_problems(group)
            root, path = self.topology(parent_dir)
            device = Device(
                id=uuid,
                kind=ResourceKind.MDEV,
                vendor_device=parent.vendor_device,
                iommu_group=group,
                numa_node=self.numa(parent_dir),
                healthy=not problems,
                reason="; ".join(problems) or None,
                pcie_root=root,
                pcie_path=(*path, parent.name),
                driver=driver,
                parent=parent_address,
                mdev_type=os.path.basename(type_dir),
            )
            self.add(name, ResourceKind.MDEV, device, type_name.strip())

    def inventory(self) -> Inventory:
        resources = [
            Resource(
                name=name,
                kind=kind,
                devices=tuple(sorted(devices, key=lambda device: device.id)),
                selectors=tuple(sorted(self.selectors[name, kind])),
            )
            for (name, kind), devices in self.devices.items()
        ]
        resources.sort(key=lambda resource: (resource.name, resource.kind.value))
        return Inventory(
            resources=tuple(resources),
            ignored=tuple(sorted(self.ignored, key=lambda item: item.id)),
            warnings=tuple(self.warnings),
            pci_ids_path=self.pci_ids.path if self.pci_ids else None,
        )


def scan(host_root: Path, config: PluginConfig, pci_ids: PciIds | None, warnings: Iterable[str] = ()) -> Inventory:
    """Read ``<host_root>/sys`` and ``<host_root>/dev/vfio`` and return what the node offers.

    ``pci_ids`` names passthrough resources (None: hex names). ``warnings`` are carried into the result
    (e.g. from locating pci.ids). A host root without ``sys/bus/pci/devices`` is an ``InputError``.
    """
    state = _Scan(os.path.abspath(host_root), config, pci_ids, list(warnings))
    try:
        state.scan_pci()
        state.scan_mdevs()
    finally:
        state.fs.close()
    return state.inventory()


def discover_node(config: PluginConfig, image_root: Path = Path("/")) -> Inventory:
    """Locate pci.ids (``config.pci_ids``, else under the host root, else under ``image_root``) and scan."""
    host_root = Path(config.host_root)
    explicit = Path(config.pci_ids) if config.pci_ids else None
    choice = locate_pci_ids(explicit, host_root, image_root)
    warnings = []
    if choice.database is None:
        warnings.append(
            f"no pci.ids found (looked at {', '.join(choice.searched)}): resources are named by hex device ID "
            "(nvidia.com/1f08); pass --pci-ids or set name_overrides"
        )
    return scan(host_root, config, choice.database, warnings)
