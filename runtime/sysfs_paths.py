"""Resolving a path under a configurable sysfs root without ever leaving it.

The hook reads sysfs under ``--sysfs-root`` (``/sys``, a fixture tree's ``sys``, a host's sysfs mounted
elsewhere): a PCI function's BARs (:mod:`runtime.pci_bars`) and its slot's functions, IOMMU group and drivers
(:mod:`runtime.pci_companions`). ``bus/pci/devices/<address>`` is a relative link into ``devices/pci…``, and
``iommu_group`` and ``driver`` are links too. Each path is resolved beneath the root, so a link that leads
anywhere else is refused, naming the device and the file: by the kernel (:class:`SysfsView`, ``openat2`` with
``RESOLVE_BENEATH``: one call per path, the check and the open one step), or where it lacks that by
:class:`Resolver` in Python (the check and the use are then two steps: the root is sysfs, which only the kernel
writes, or a tree of ours).

**Kept for the serving process's life.** What the hook reads here about the devices allocated to its pod is
kept by the reader a :class:`launcher_hook.service.HookService` holds (:class:`KeptFacts`, one per reader, so
per service, never module-wide): per PCI address the facts the companion rule needs
(:class:`runtime.pci_companions.SysfsCompanions`), the BARs (:class:`runtime.pci_bars.SysfsBars`) and the
function's place in the PCIe tree (:class:`runtime.pci_topology.SysfsTopology`). A device
found there costs no system call; one that is not is read as described above (confined, bounded, the same
errors), and an error is never kept. Why that is safe: one sidecar process serves one virt-launcher pod (KubeVirt
starts a hook sidecar per VMI pod; a migration target is a new pod with a new sidecar), and the devices it is
asked about are the ones the kubelet allocated to that pod, which no other pod gets while this one holds them.
The facts read (a function's IOMMU group, its driver, its class, whether it is a virtual function, its slot's
other functions, its BAR sizes) change only through a driver rebind, a hot-unplug or a BAR resize; the node
agent refuses to unbind a group a process holds (docs/node-agent.md, "Refusals"), and any of the three done to
a device while its VM starts breaks that VM whatever the hook reads (virt-launcher's own domain and QEMU name
the same address). KubeVirt calls
``OnDefineDomain`` two or three times per VM start on q35 with the same devices (docs/kubevirt-harness.md): the
calls after the first read nothing. docs/kubevirt-hostdevs.md ("Without the variable") says more.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import ClassVar, Generic, NamedTuple, Self, TypeVar

from runtime.files import read_open_file, read_regular_file
from runtime.hostroot import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, last_component, load_openat2
from schemas.errors import InputError
from schemas.pci import PciAddress

MAX_KEPT = 256
"""Entries one :class:`KeptFacts` holds at most (devices, or DRA request directories); beyond, the oldest goes.
A VM gets at most 64 GPUs read for companions (``schemas.companions.MAX_GPUS``) and a pod's allocation rarely
changes, so a hook process normally holds a few dozen."""

_Key = TypeVar("_Key", bound=Hashable)
_Value = TypeVar("_Value")


class KeptFacts(Generic[_Key, _Value]):
    """What a reader read about a device (or a file), kept for the life of the reader that owns it: at most
    ``bound`` entries (:data:`MAX_KEPT`), the oldest stored evicted first; thread-safe (a gRPC server calls
    from several threads). Only successful reads are stored: an error is never kept, so the next call reads
    again. ``reads`` counts the entries stored (what the owner had to read), for tests and benchmarks."""

    def __init__(self, bound: int = MAX_KEPT) -> None:
        if bound < 1:
            raise ValueError(f"a bound of {bound} keeps nothing")
        self.bound = bound
        self._entries: dict[_Key, _Value] = {}
        self._lock = threading.Lock()
        self.reads = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: _Key) -> _Value | None:
        return self._entries.get(key)  # (one dict lookup: atomic under the GIL)

    def get_all(self, keys: Iterable[_Key]) -> list[_Value | None]:
        """:meth:`get` of each of ``keys``, in order (one C loop: a VM's every device on every call). The values
        are truthy (``all()`` of the answer says whether each key was found) when, as the readers' are, they are
        objects without a ``__bool__`` or ``__len__`` that makes them false."""
        return list(map(self._entries.get, keys))

    def put(self, key: _Key, value: _Value) -> None:
        with self._lock:
            entries = self._entries
            entries.pop(key, None)  # a re-read entry counts as the newest
            entries[key] = value
            self.reads += 1
            while len(entries) > self.bound:
                del entries[next(iter(entries))]

    def keys(self) -> list[_Key]:
        """The keys held, oldest first."""
        with self._lock:
            return list(self._entries)


DEFAULT_SYSFS_ROOT = "/sys"


class KeepingReader(Generic[_Value]):
    """A reader of per-device facts under one sysfs root (``/sys`` or a fixture's ``sys`` directory); ``kept``:
    where what it read of each PCI function is kept (:meth:`keeping`), None: every call reads."""

    def __init__(
        self, root: str | os.PathLike[str] = DEFAULT_SYSFS_ROOT, kept: KeptFacts[PciAddress, _Value] | None = None
    ) -> None:
        self.root = Path(root)
        self.kept = kept

    def keeping(self, bound: int = MAX_KEPT) -> Self:
        """This reader with a store of its own (at most ``bound`` functions, the oldest evicted)."""
        return type(self)(self.root, KeptFacts(bound))

    def describe(self) -> str:
        return str(self.root)


def resolved_root(root: Path, reading: str) -> Path:
    """``root`` resolved; an ``InputError`` naming it and what was being read when it is not a directory."""
    resolved = Path(os.path.realpath(root))
    if not resolved.is_dir():
        raise InputError(f"sysfs root {str(root)!r} is not a directory ({reading})")
    return resolved


class _Unusual(Exception):
    """A path :class:`Resolver` leaves to ``os.path.realpath`` (a link loop, an absolute or odd link target)."""


MAX_LINKS = 40
"""Links one resolution follows at most before it is left to ``os.path.realpath`` (Linux's own limit)."""


class Resolver:
    """:func:`os.path.realpath` for many paths under one root, each of which must stay under it (where the
    kernel lacks ``openat2``: :class:`SysfsView`), the directories it resolved remembered while it lives (one
    read: a GPU's functions share their root, ``bus/pci/devices`` and their IOMMU group and driver directories;
    nothing is kept beyond the reader's call).

    Each path resolves as ``os.path.realpath`` resolves it: component by component, a link replaced by its
    target read relative to the link's (resolved) directory. Only what that takes one ``lstat`` (and for a link
    one ``readlink``) per new component is done here; anything else (a loop, an absolute target, ``..`` after a
    name in a target) is given to ``os.path.realpath`` itself, so the result is always the same.
    """

    def __init__(self, root: Path, reading: str) -> None:
        self.root = root
        self.resolved = resolved_root(root, reading)
        base = str(self.resolved)
        self._base = base
        self._real: dict[str, str] = {base: base}
        self._there: dict[str, bool] = {base: True}
        """Paths looked up (``lstat`` of their name in their resolved parent): whether they are there."""
        self._modes: dict[str, int] = {}
        """``st_mode`` of resolved paths that are no link."""

    def resolve(self, relative: str, device: str) -> Path:
        """``<root>/<relative>`` resolved, which must stay under the root (else ``InputError`` naming
        ``device`` and ``relative``)."""
        return Path(self._resolve(relative, device))

    def link(self, relative: str, device: str) -> tuple[Path, bool] | None:
        """``<root>/<relative>`` resolved (as :meth:`resolve`) and whether that is a directory, or None when
        ``<root>/<relative>`` is not there (``os.path.lexists``: a dangling link is there)."""
        found = self.link_text(relative, device)
        return (Path(found[0]), found[1]) if found is not None else None

    def link_text(self, relative: str, device: str) -> tuple[str, bool] | None:
        """:meth:`link` with the path as text."""
        full = f"{self._base}/{relative}"
        try:
            real = self._realpath(full, 0)
            there = self._there[full]
        except _Unusual:
            real, there = os.path.realpath(full), os.path.lexists(full)
        if not there:
            return None
        self._check(real, relative, device)
        mode = self._modes.get(real)
        if mode is None:
            try:
                mode = os.stat(real).st_mode
            except OSError:
                mode = 0
        return real, stat.S_ISDIR(mode)

    def _resolve(self, relative: str, device: str) -> str:
        full = f"{self._base}/{relative}"
        try:
            real = self._realpath(full, 0)
        except _Unusual:
            real = os.path.realpath(full)
        self._check(real, relative, device)
        return real

    def _check(self, real: str, relative: str, device: str) -> None:
        base = self._base
        if real != base and not real.startswith(base + "/"):
            raise InputError(
                f"{device}: {relative} under {str(self.root)!r} leads out of that root (to {real!r}); "
                "refusing to read it"
            )

    def _realpath(self, path: str, links: int) -> str:
        found = self._real.get(path)
        if found is not None:
            return found
        parent, _, name = path.rpartition("/")
        if not parent or name in ("", ".", ".."):
            raise _Unusual(path)
        base = self._realpath(parent, links)
        candidate = f"{base}/{name}"
        try:
            mode = os.lstat(candidate).st_mode
        except OSError:
            mode = None  # not there: kept as it is, as realpath keeps it
        self._there[path] = mode is not None  # what ``lstat(path)`` (``os.path.lexists``) says
        if mode is None or not stat.S_ISLNK(mode):
            result = candidate
            if mode is not None:
                self._modes[candidate] = mode
        else:
            if links >= MAX_LINKS:
                raise _Unusual(path)
            result = self._realpath(self._joined(base, os.readlink(candidate), path), links + 1)
        self._real[path] = result
        return result

    @staticmethod
    def _joined(base: str, target: str, path: str) -> str:
        """``target`` read from the resolved directory ``base``, its leading ``..`` taken off ``base``."""
        if target.startswith("/"):
            raise _Unusual(path)
        parts = [part for part in target.split("/") if part not in ("", ".")]
        while parts and parts[0] == "..":
            parts.pop(0)
            base = base.rpartition("/")[0] or "/"
        if not parts or ".." in parts or base == "/":
            raise _Unusual(path)
        return f"{base}/{'/'.join(parts)}"


class _Kernel:
    """``openat2`` that never leaves its directory (``RESOLVE_BENEATH``: ``EXDEV`` instead), while the kernel
    has it; tried once per process (:meth:`resolves`): ``ENOSYS`` (an old kernel) or ``EPERM`` (a seccomp
    profile that refuses it) leave the rest of the process to :class:`Resolver`."""

    openat2: ClassVar[Callable[[int, bytes, int], int] | None] = load_openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    checked: ClassVar[bool] = False

    @classmethod
    def resolves(cls) -> bool:
        if cls.openat2 is None or cls.checked:
            return cls.openat2 is not None
        here = os.open("/", _DIRECTORY)
        try:
            os.close(cls.openat2(here, b".", _DIRECTORY))
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            cls.openat2 = None
        finally:
            os.close(here)
        cls.checked = True
        return cls.openat2 is not None


_DIRECTORY = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
MAX_DEVICES = 65536
"""Most entries ``bus/pci/devices`` may list (PCI has 65,536 functions per segment; a host has a few hundred)."""
_FILE = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW | os.O_CLOEXEC


class FunctionLinks(NamedTuple):
    """What a PCI function's directory says by its links: the last component of ``iommu_group`` (the group's
    number) and of ``driver`` (the driver's name); None where there is no such link."""

    group: str | None
    driver: str | None


def _link_name(directory: int, name: str) -> str | None:
    try:
        return last_component(os.readlink(name, dir_fd=directory))
    except OSError:
        return None


class SysfsView:
    """One reader's call under a sysfs root: PCI functions' directories opened, their links' names and their
    attribute files read, every path resolved beneath the root.

    The kernel resolves each path in one ``openat2`` with ``RESOLVE_BENEATH`` (a link that would leave the root,
    absolute or by ``..``, fails with ``EXDEV`` and is refused naming the device and the file); where the kernel
    has no ``openat2`` (``ENOSYS``, a seccomp ``EPERM``), :class:`Resolver` resolves the same paths in Python.
    A name in an open function directory is taken as it is there (``O_NOFOLLOW``): a link such as ``driver``
    or ``iommu_group`` is only read, never followed, and its last component is the name (the device plugin
    reads them the same way, ``plugin.node_scan``). The view's own descriptors end with :meth:`close` (or
    ``with``); a directory :meth:`open_function` gives is the caller's to close.
    """

    def __init__(self, root: Path, reading: str) -> None:
        self.root = root
        self._resolver: Resolver | None = None
        self._root_fd: int | None = None
        self._listed: frozenset[str] | None = None
        if _Kernel.resolves():
            try:
                self._root_fd = os.open(root, _DIRECTORY)
            except OSError:
                raise InputError(f"sysfs root {str(root)!r} is not a directory ({reading})") from None
        else:
            self._resolver = Resolver(root, reading)

    def __enter__(self) -> SysfsView:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def _beneath(self, relative: str, flags: int) -> int:
        """``relative`` opened beneath the root; ``OSError`` as ``openat2`` fails."""
        openat2 = _Kernel.openat2
        assert openat2 is not None
        assert self._root_fd is not None
        return openat2(self._root_fd, relative.encode(), flags)

    def function(self, address: str) -> FunctionLinks | None:
        """The links of the directory ``bus/pci/devices/<address>`` leads to; None when there is no such entry
        (:meth:`open_function`)."""
        directory = self.open_function(address)
        if directory is None:
            return None
        try:
            return self.links(directory)
        finally:
            os.close(directory)

    def links(self, directory: int) -> FunctionLinks:
        """The links of a directory :meth:`open_function` opened."""
        return FunctionLinks(_link_name(directory, "iommu_group"), _link_name(directory, "driver"))

    def has(self, directory: int, name: str) -> bool:
        """Whether ``name`` is there in a directory :meth:`open_function` opened (``os.path.lexists``)."""
        try:
            os.lstat(name, dir_fd=directory)
        except OSError:
            return False
        return True

    def open_function(self, address: str) -> int | None:
        """A descriptor (``O_PATH``, the caller's to close) of the directory ``bus/pci/devices/<address>`` leads
        to, or None when there is no such entry (a dangling link is one: ``os.path.lexists``); ``InputError``
        when it is no directory or leads out of the root."""
        relative = f"bus/pci/devices/{address}"
        if self._resolver is not None:
            found = self._resolver.link_text(relative, f"PCI device {address}")
            if found is None:
                return None
            if not found[1]:
                raise self._not_a_directory(address, relative)
            return os.open(found[0], _DIRECTORY)
        listed = self._listed
        if listed is None:
            listed = self._listed = self._list_devices(address)
        if address not in listed:
            return None
        try:
            return self._beneath(relative, _DIRECTORY)
        except OSError as exc:
            raise self._failed(address, relative, exc) from None

    def device_link(self, address: str) -> str | None:
        """The target of the link ``bus/pci/devices/<address>`` (read, not followed), or None when there is no
        such entry or it is no link."""
        listed = self._listed
        if self._resolver is None:
            if listed is None:
                listed = self._listed = self._list_devices(address)
            if address not in listed:
                return None
        try:
            if self._resolver is not None:
                devices = self._resolver.resolve("bus/pci/devices", f"PCI device {address}")
                return os.readlink(devices / address)
            directory = self._beneath("bus/pci/devices", _DIRECTORY)
        except OSError:
            return None
        try:
            return os.readlink(address, dir_fd=directory)
        except OSError:
            return None
        finally:
            os.close(directory)

    def _list_devices(self, address: str) -> frozenset[str]:
        """The names in ``bus/pci/devices`` (links and all, as ``os.path.lexists`` sees them), listed once per view:
        a function that is not there then costs nothing (most of a slot's eight are not)."""
        try:
            directory = self._beneath("bus/pci/devices", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return frozenset()
        except OSError as exc:
            raise self._failed(address, "bus/pci/devices", exc) from None
        try:
            names = os.listdir(directory)
        except OSError as exc:
            raise self._failed(address, "bus/pci/devices", exc) from None
        finally:
            os.close(directory)
        if len(names) > MAX_DEVICES:
            raise InputError(
                f"bus/pci/devices under {str(self.root)!r} lists {len(names)} entries, more than {MAX_DEVICES}"
            )
        return frozenset(names)

    def read(self, address: str, name: str, max_bytes: int, what: str) -> tuple[bytes, str]:
        """The regular file ``bus/pci/devices/<address>/<name>`` (at most ``max_bytes``) and how it is shown in
        messages; ``InputError`` naming ``what`` otherwise."""
        relative = f"bus/pci/devices/{address}/{name}"
        if self._resolver is not None:
            path = self._resolver.resolve(relative, f"PCI device {address}")
            shown = repr(str(path))
            return read_regular_file(path, max_bytes, what, shown=shown), shown
        shown = repr(f"{self.root}/{relative}")
        try:
            descriptor = self._beneath(relative, _FILE)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise self._failed(address, relative, exc) from None
            raise _unreadable(what, shown, exc) from None
        return read_open_file(descriptor, max_bytes, what, shown), shown

    def read_in(self, directory: int, address: str, name: str, max_bytes: int, what: str) -> tuple[bytes, str]:
        """:meth:`read` of ``name`` in a directory :meth:`open_function` opened for ``address``."""
        shown = repr(f"{self.root}/bus/pci/devices/{address}/{name}")
        try:
            descriptor = os.open(name, _FILE, dir_fd=directory)
        except OSError as exc:
            raise _unreadable(what, shown, exc) from None
        return read_open_file(descriptor, max_bytes, what, shown), shown

    def _not_a_directory(self, address: str, relative: str) -> InputError:
        return InputError(f"PCI device {address}: {relative} under {str(self.root)!r} is not a directory")

    def _failed(self, address: str, relative: str, exc: OSError) -> InputError:
        if exc.errno == errno.EXDEV:
            return InputError(
                f"PCI device {address}: {relative} under {str(self.root)!r} leads out of that root; refusing to read it"
            )
        if exc.errno in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):  # (ENOENT: a dangling link)
            return self._not_a_directory(address, relative)
        return InputError(f"PCI device {address}: {relative} under {str(self.root)!r} cannot be opened: {exc.strerror}")


def _unreadable(what: str, shown: str, exc: OSError) -> InputError:
    if isinstance(exc, FileNotFoundError):
        return InputError(f"{what} {shown} cannot be read: it does not exist")
    return InputError(f"{what} {shown} cannot be read: {exc.strerror or exc}")
