"""Reading (and writing) a node's files under a host root as a chroot would: the one safe way the device
plugin's discovery and Allocate read and the node agent reads and writes (``plugin.hostroot`` re-exports it).

The node's files are not trusted (issue 11): every path is resolved inside the host root (``openat2`` with
``RESOLVE_IN_ROOT``, or the same rules in Python where the kernel lacks it), a read takes regular files only,
opened without blocking and capped at :data:`MAX_ATTRIBUTE_BYTES`. Kept apart from the scan so that the scan's
per-kind sources and Allocate's re-check share it without importing each other.

For the node agent, which writes sysfs attributes (issue 22), two stricter calls: :meth:`HostRoot.confine`
refuses (:class:`LeavesRoot`) a path one of whose links points out of the root (an absolute target or ``..``
above the root: sysfs's own links are relative and never do), and :meth:`HostRoot.open_write` opens an
existing regular file for writing only after that check, through the same in-root resolution.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
import threading
from collections.abc import Callable
from typing import ClassVar

MAX_ATTRIBUTE_BYTES = 65536
"""The most a sysfs attribute file may hold (the kernel caps them at a page: 4 KiB, 64 KiB on some arm64)."""
MAX_LINKS = 40
"""Symlinks followed while resolving one path (the kernel's own limit); more is a loop."""


_SYS_OPENAT2 = 437
"""``openat2(2)``'s number, the same on every Linux architecture (it came after the syscall tables were unified)."""
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
"""``openat2``: fail (``EXDEV``) rather than leave the directory, by an absolute link or ``..`` above it."""
RESOLVE_IN_ROOT = 0x10
"""``openat2``: resolve as if the directory were ``/`` (a chroot's rules)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def load_openat2(resolve: int = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) -> Callable[[int, bytes, int], int] | None:
    """``openat2(dirfd, path, flags)`` with the ``resolve`` rules (Linux ≥ 5.6), or None where it cannot be called.

    With ``RESOLVE_IN_ROOT`` (the default) the kernel resolves every link inside ``dirfd`` as a chroot would, in
    one call; where it is missing (``ENOSYS``, or refused by a seccomp profile) :class:`HostRoot` resolves the
    path itself. (The hook's sysfs reads use ``RESOLVE_BENEATH``: :mod:`runtime.sysfs_paths`.)
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    # The arguments are passed as ready-made C values (no argtypes to convert them on every call: a scan opens
    # thousands of files and the conversion was a sixth of each open). The path is bytes (char *); dirfd an int,
    # which the kernel reads as an int whatever the upper half of its register holds.
    number = ctypes.c_long(_SYS_OPENAT2)
    size = ctypes.c_size_t(ctypes.sizeof(_OpenHow))
    hows: dict[int, tuple[_OpenHow, ctypes.c_void_p]] = {}
    """One ``open_how`` (and its address) per flags value, built once: the kernel only reads it."""

    def openat2(dirfd: int, path: bytes, flags: int) -> int:
        entry = hows.get(flags)
        if entry is None:
            how = _OpenHow(flags, 0, resolve)
            entry = hows.setdefault(flags, (how, ctypes.c_void_p(ctypes.addressof(how))))
        descriptor = int(syscall(number, dirfd, path, entry[1], size))
        if descriptor < 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        return descriptor

    return openat2


_DIRENT_BUFFER = 4096
"""Bytes handed to one ``getdents64`` call (an IOMMU group's few entries, ≈32 bytes each, fit many times over)."""
_DIRENT_MANY = _DIRENT_BUFFER // 2
"""A first ``getdents64`` call returning more than this is a big directory (``/sys/bus/pci/devices``): listed
by ``os.listdir``, whose loop in C reads thousands of entries about three times faster than parsing them here."""


def _load_getdents64() -> Callable[[int], list[str]] | None:
    """The names in the directory open at a descriptor, read with libc's ``getdents64`` (glibc ≥ 2.30); None
    where it is missing (then ``os.listdir``).

    ``os.listdir`` of a descriptor costs eight system calls (it duplicates the descriptor, fixes its flags,
    rewinds it); this costs the two ``getdents64`` calls (the second says the end), measured where Allocate
    lists each device's IOMMU group. Records are ``linux_dirent64`` (getdents(2)): inode and offset (8 bytes
    each), the record's length (2, native order), the type (1), the NUL-terminated name. A big directory is
    handed to ``os.listdir`` after the first call (rewound first: ``os.listdir`` reads on from the offset).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        getdents64 = ctypes.CDLL(None, use_errno=True).getdents64
    except (OSError, AttributeError):
        return None
    getdents64.restype = ctypes.c_ssize_t
    getdents64.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    order = sys.byteorder
    encoding, errors = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()  # os.fsdecode's

    def list_entries(descriptor: int) -> list[str]:
        buffer = ctypes.create_string_buffer(_DIRENT_BUFFER)
        names: list[str] = []
        first = True
        while True:
            size = int(getdents64(descriptor, buffer, _DIRENT_BUFFER))
            if size < 0:
                error = ctypes.get_errno()
                raise OSError(error, os.strerror(error))
            if size == 0:
                return names
            if first and size > _DIRENT_MANY:
                os.lseek(descriptor, 0, os.SEEK_SET)
                return os.listdir(descriptor)
            first = False
            data = ctypes.string_at(buffer, size)  # only the bytes filled in (``raw`` would copy the whole buffer)
            position = 0
            while position < size:
                length = int.from_bytes(data[position + 16 : position + 18], order)
                end = data.find(b"\0", position + 19, position + length)
                if length < 20 or end < 0:  # never from a kernel: refuse rather than loop or misread
                    raise OSError(errno.EIO, "malformed directory record")
                name = data[position + 19 : end]
                if name not in (b".", b".."):
                    names.append(name.decode(encoding, errors))
                position += length

    return list_entries


class ReadError(Exception):
    """A node file that must not be used: not a regular file, too large, a link loop, unreadable (the reason)."""


class LeavesRoot(ReadError):
    """A path one of whose links points out of the host root (:meth:`HostRoot.confine`); the message names it."""


_UNRESOLVED = ""
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
"""How node files are opened for reading: a FIFO never blocks, a terminal never becomes ours."""
_READ_CHUNK = 4096
"""A sysfs attribute is at most a page; the kernel hands it over whole in the first read."""
_WRITE_FLAGS = os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
"""How an attribute is opened for writing: never created, never truncated, a FIFO never blocks."""


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

    openat2: ClassVar[Callable[[int, bytes, int], int] | None] = load_openat2()
    """``openat2`` with ``RESOLVE_IN_ROOT`` for reads; None when unavailable (set on the first ``ENOSYS``)."""
    list_entries: ClassVar[Callable[[int], list[str]] | None] = _load_getdents64()
    """Lists a directory descriptor in fewer system calls than ``os.listdir``; None when unavailable."""

    def __init__(self, root: str) -> None:
        self.root = "" if root == "/" else root.rstrip("/")
        self._resolved: dict[str, str] = {}
        self._root_fd: int | None = None
        self._root_path: str | None = None

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

    def read(self, path: str, limit: int = MAX_ATTRIBUTE_BYTES) -> str | None:
        """A small regular file's text (at most ``limit`` bytes); None if it does not exist. Raises
        :class:`ReadError` with the reason when it exists but must not be used (FIFO, device, directory, larger
        than ``limit``, a link loop, unreadable)."""
        openat2 = HostRoot.openat2
        if openat2 is not None and self._root_fd is not None:
            # The common case in one call, no layers: a scan reads every PCI function's vendor this way.
            try:
                opened = openat2(self._root_fd, path.lstrip("/").encode("utf-8", "surrogateescape"), _READ_FLAGS)
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise ReadError(f"{path}: too many links (a loop?)") from None
                if exc.errno not in (errno.ENOSYS, errno.EPERM):
                    raise ReadError(f"{path}: cannot open: {exc.strerror or exc}") from None
            else:
                return _read_bounded(opened, path, limit)
        try:
            descriptor = self._open(path, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except ReadError:
            raise
        except OSError as exc:
            raise ReadError(f"{path}: cannot open: {exc.strerror or exc}") from None
        if descriptor is None:
            return None
        return _read_bounded(descriptor, path, limit)

    def directory(self, path: str) -> Directory:
        """A handle on the directory ``path`` (resolved inside the root once) to read several of its files.

        Reading ``vendor``, ``device``, ``class``, ``driver``… of one device through it costs one path
        resolution for all of them instead of one each; see :class:`Directory`. Close it (or use ``with``).
        """
        descriptor: int | None = None
        try:
            descriptor = self._kernel_open(path, os.O_PATH | os.O_DIRECTORY)
        except OSError:
            descriptor = None  # missing or not a directory: every read through the handle says so as read() does
        return Directory(self, path, descriptor)

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

    def confine(self, path: str) -> str | None:
        """``path`` (in-root, absolute) with every link resolved, never cached; None when a component is missing.

        Stricter than :meth:`resolve`: a link whose target is absolute, or whose ``..`` would climb above the
        root, is not re-rooted but refused with :class:`LeavesRoot` naming the link and its target (the node
        agent's paths are all in sysfs, whose links are relative and stay below ``/sys``)."""
        return self._confine(path, path, 0)

    def _confine(self, path: str, shown: str, depth: int) -> str | None:
        if depth > MAX_LINKS:
            raise ReadError(f"{self.host_path(shown)}: more than {MAX_LINKS} links on the way (a loop?)")
        current = "/"
        for component in path.split("/"):
            if component in ("", "."):
                continue
            if component == "..":
                if current == "/":
                    raise LeavesRoot(
                        f"{self.host_path(shown)}: a link on the way climbs above, outside the host root "
                        f"{self.root or '/'}; refusing to use it"
                    )
                current = current.rpartition("/")[0] or "/"
                continue
            candidate = f"{current.rstrip('/')}/{component}"
            try:
                info = os.lstat(self.root + candidate)
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as exc:
                raise ReadError(f"{self.host_path(candidate)}: cannot look at it: {exc.strerror or exc}") from None
            if not stat.S_ISLNK(info.st_mode):
                current = candidate
                continue
            try:
                target = os.readlink(self.root + candidate)
            except OSError as exc:
                raise ReadError(f"{self.host_path(candidate)}: cannot read the link: {exc.strerror or exc}") from None
            if target.startswith("/"):
                raise LeavesRoot(
                    f"{self.host_path(shown)}: {self.host_path(candidate)} is a link to {target!r}, outside the "
                    f"host root {self.root or '/'}; refusing to use it"
                )
            followed = self._confine(f"{current.rstrip('/')}/{target}", shown, depth + 1)
            if followed is None:
                return None
            current = followed
        return current

    def open_confined(self, path: str, flags: int) -> int:
        """``path`` opened with ``flags`` after :meth:`confine` (its links resolved, none leading out), through
        ``openat2`` ``RESOLVE_IN_ROOT`` where the kernel has it. Raises :class:`LeavesRoot`, ``FileNotFoundError``
        (missing inside the root) or ``OSError`` as ``open`` does."""
        resolved = self.confine(path)
        descriptor = None if resolved is None else self._open(resolved, flags)
        if descriptor is None:
            raise FileNotFoundError(errno.ENOENT, "no such file inside the host root", self.host_path(path))
        return descriptor

    def open_write(self, path: str) -> int:
        """The existing regular file ``path`` opened write-only (never created nor truncated), as
        :meth:`open_confined` resolves it; :class:`ReadError` naming it when it is anything but a regular file."""
        descriptor = self.open_confined(path, _WRITE_FLAGS)
        try:
            mode = os.fstat(descriptor).st_mode
        except OSError:
            os.close(descriptor)
            raise
        if not stat.S_ISREG(mode):
            os.close(descriptor)
            raise ReadError(f"{self.host_path(path)}: not a regular file ({_file_kind(mode)}); refusing to write it")
        return descriptor

    def lstat(self, path: str) -> os.stat_result | None:
        """``path``'s own status (a link is not followed), its parent resolved by :meth:`confine`; None if absent."""
        parent, _, name = path.rpartition("/")
        resolved = self.confine(parent or "/")
        if resolved is None or name in ("", ".", ".."):
            return None
        try:
            return os.lstat(f"{self.root}{resolved.rstrip('/')}/{name}")
        except (FileNotFoundError, NotADirectoryError):
            return None

    def readlink(self, path: str) -> str | None:
        """The target of the link ``path`` as written (its parent resolved by :meth:`resolve`, inside the root);
        None when it is absent or no link. Only read, never followed: ``/proc/<pid>/fd/<n>`` name open files."""
        split = self._split(path)
        if split is None:
            return None
        try:
            return os.readlink(f"{self.root}{split[0]}/{split[1]}")
        except OSError:
            return None

    def close(self) -> None:
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def in_root_path(self, descriptor: int) -> str | None:
        """Where the directory open at ``descriptor`` (opened inside the root) is, as an in-root path; None when
        the kernel cannot say (no ``/proc``, a deleted directory, a root outside our view): resolve instead.

        The kernel names an open file's path in ``/proc/self/fd`` (proc(5)); one ``readlink`` there replaces
        resolving every component again. The root's own path is read the same way, once.
        """
        if self._root_fd is None:
            return None
        try:
            if self._root_path is None:
                self._root_path = os.readlink(f"/proc/self/fd/{self._root_fd}").rstrip("/")
            target = os.readlink(f"/proc/self/fd/{descriptor}")
        except OSError:
            return None
        prefix = self._root_path
        if not target.startswith("/") or target.endswith(" (deleted)"):
            return None
        if not prefix:
            return target
        if target == prefix:
            return "/"
        if not target.startswith(prefix + "/"):
            return None
        return target[len(prefix) :]

    def readlink_name(self, path: str) -> str | None:
        """The last component of the symlink ``path``'s target (``driver`` → ``vfio-pci``); None when absent."""
        parent, _, name = path.rpartition("/")
        try:
            directory = self._kernel_open(parent or "/", os.O_PATH | os.O_DIRECTORY)
        except OSError:
            return None
        if directory is not None:
            try:
                return last_component(os.readlink(name, dir_fd=directory))
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
        return last_component(target)

    def listdir(self, path: str) -> list[str]:
        """Entries of the directory ``path`` (resolved inside the root); raises ``OSError`` as ``os.listdir``."""
        directory = self._kernel_open(path, os.O_RDONLY | os.O_DIRECTORY)
        if directory is not None:
            try:
                list_entries = HostRoot.list_entries
                return os.listdir(directory) if list_entries is None else list_entries(directory)
            finally:
                os.close(directory)
        resolved = self.resolve(path)
        if resolved is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory inside the host root", path)
        return os.listdir(self.root + resolved)

    def listdir_few(self, path: str) -> list[str]:
        """Entries of a directory of a few entries (an IOMMU group's ``devices``), as :meth:`listdir` gives them.

        ``os.listdir`` on the descriptor: for a handful of names its parsing in C costs less than
        :attr:`list_entries`'s in Python (measured on Allocate's path), for six more system calls that cost a
        fraction of a microsecond each (it duplicates the descriptor, checks and fixes its flags, rewinds it).
        """
        directory = self._kernel_open(path, os.O_RDONLY | os.O_DIRECTORY)
        if directory is None:
            return self.listdir(path)  # resolved in Python
        try:
            return os.listdir(directory)
        finally:
            os.close(directory)

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


class Directory:
    """Files of one directory, resolved inside the host root once (:meth:`HostRoot.directory`).

    Each read opens one name relative to the directory's descriptor with ``O_NOFOLLOW``: a single component,
    never ``..``, and a link is not followed, so nothing can lead out of the root; a name that is a link (or
    any refusal to open it that way) is read through :meth:`HostRoot.read`, which resolves it inside the root.
    The bounds on reading are :meth:`HostRoot.read`'s. Without ``openat2`` every read is :meth:`HostRoot.read`.
    """

    def __init__(self, fs: HostRoot, path: str, descriptor: int | None) -> None:
        self.fs = fs
        self.path = path
        self._descriptor = descriptor

    def read(self, name: str) -> str | None:
        """``name``'s text, as :meth:`HostRoot.read` of ``<path>/<name>`` gives it."""
        if self._descriptor is None:
            return self.fs.read(f"{self.path}/{name}")
        try:
            descriptor = os.open(name, _READ_FLAGS | os.O_NOFOLLOW, dir_fd=self._descriptor)
        except FileNotFoundError:
            return None
        except OSError:
            return self.fs.read(f"{self.path}/{name}")  # a link (ELOOP) or another refusal: the careful way
        return _read_bounded(descriptor, f"{self.path}/{name}")

    def readlink_name(self, name: str) -> str | None:
        """The last component of the symlink ``name``'s target, as :meth:`HostRoot.readlink_name` gives it."""
        if self._descriptor is None:
            return self.fs.readlink_name(f"{self.path}/{name}")
        try:
            return last_component(os.readlink(name, dir_fd=self._descriptor))
        except OSError:
            return None

    def exists(self, name: str) -> bool:
        """Whether ``<path>/<name>`` exists, as :meth:`HostRoot.exists` says, in one ``fstatat`` of the single
        component relative to the handle that never follows a link; a link (or any doubt) is asked of
        :meth:`HostRoot.exists`, which resolves it inside the root. Allocate checks ``/dev/vfio``'s nodes so."""
        if self._descriptor is None or name in ("", ".", "..") or "/" in name:
            return self.fs.exists(f"{self.path}/{name}")
        try:
            info = os.stat(name, dir_fd=self._descriptor, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            return self.fs.exists(f"{self.path}/{name}")
        return not stat.S_ISLNK(info.st_mode) or self.fs.exists(f"{self.path}/{name}")

    def resolved(self) -> str | None:
        """This directory's in-root path with every link resolved (``/sys/devices/pci0000:3a/…``), or None if
        it does not exist; as :meth:`HostRoot.resolve` gives it, but read from the open handle when it can be."""
        if self._descriptor is not None:
            path = self.fs.in_root_path(self._descriptor)
            if path is not None:
                return path
        return self.fs.resolve(self.path)

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> Directory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SharedRoot:
    """One descriptor on the host root, opened once and lent to a :class:`HostRoot` per request.

    Allocate reads the node on every call; opening and closing the root for each one was two of its system
    calls. A server keeps one of these for its life: :meth:`borrow` gives a :class:`HostRoot` reading through the
    shared descriptor, with its own (empty) resolution cache, so nothing the node said is kept from one request
    to the next; only the root directory itself is held (the host's ``/``, a mount that does not change under
    the plugin). The descriptor is only ever read (``openat2`` relative to it), so requests on several threads
    share it; :meth:`close` closes it once the last borrower has given it back, never under a request still
    reading through it (its number could otherwise be reused by another open).

    A held directory is not a path: if the root is replaced (a directory deleted and made again, a mount
    replaced), the descriptor still reads the old one while a fresh :class:`HostRoot` (the scan's) reads the new
    one. :meth:`renew` says so and lets the next borrower open the new root; the caller asks it when a read
    through the descriptor found something missing (Allocate's refusals), so the check costs nothing otherwise.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._descriptor: int | None = None
        self._borrowers: dict[int, int] = {}
        """Borrowers per descriptor lent: the current one, and any retired (closed, replaced) still in use."""
        self._closed = False

    def borrow(self) -> HostRoot:
        """A :class:`HostRoot` on the shared descriptor (close it, or use ``with``, to give it back).

        Where the descriptor cannot be had (no ``openat2``: the Python resolution does not use it; the root
        cannot be opened; closed), a plain :class:`HostRoot` of the same root, which behaves exactly as before.
        """
        with self._lock:
            if self._closed or HostRoot.openat2 is None:
                return HostRoot(self.root)
            descriptor = self._descriptor
            if descriptor is None:
                try:
                    descriptor = self._descriptor = os.open(self.root or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError:
                    return HostRoot(self.root)  # each read says so, as HostRoot's own open does
            self._borrowers[descriptor] = self._borrowers.get(descriptor, 0) + 1
            return _BorrowedRoot(self, descriptor)

    def renew(self) -> bool:
        """Whether the root was replaced since the descriptor was opened (it names another directory than the
        root's path does now); if so, later borrowers get the new root and the old descriptor is closed once
        given back. False when nothing is held, the root's path is missing, or it is the same directory."""
        with self._lock:
            descriptor = self._descriptor
            if descriptor is None:
                return False
            try:
                held, now = os.fstat(descriptor), os.stat(self.root or "/")
            except OSError:
                return False  # no root at its path: a fresh HostRoot finds nothing either
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                return False
            self._descriptor = None
            if descriptor not in self._borrowers:
                os.close(descriptor)
            return True

    def _give_back(self, descriptor: int) -> None:
        with self._lock:
            left = self._borrowers[descriptor] - 1
            if left:
                self._borrowers[descriptor] = left
                return
            del self._borrowers[descriptor]
            if descriptor != self._descriptor:  # retired (closed or replaced): its last borrower is gone
                os.close(descriptor)

    def close(self) -> None:
        """Close the descriptor now, or when the last borrower gives it back; later borrows open their own."""
        with self._lock:
            self._closed = True
            descriptor, self._descriptor = self._descriptor, None
            if descriptor is not None and descriptor not in self._borrowers:
                os.close(descriptor)

    def __enter__(self) -> SharedRoot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _BorrowedRoot(HostRoot):
    """A :class:`HostRoot` reading through a :class:`SharedRoot`'s descriptor; closing it gives it back."""

    def __init__(self, shared: SharedRoot, descriptor: int) -> None:
        super().__init__(shared.root)
        self._root_fd = descriptor
        self._lent = descriptor
        self._shared: SharedRoot | None = shared

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is None:  # given back already: a descriptor opened since is this object's own
            super().close()
            return
        self._root_fd = None
        shared._give_back(self._lent)


def last_component(target: str) -> str:
    """A link target's last component after normalising (``../../bus/pci/drivers/vfio-pci`` → ``vfio-pci``)."""
    name = target.rpartition("/")[2]
    if name in ("", ".", ".."):  # the rare target that needs normalising first (``…/vfio-pci/``, ``…/x/..``)
        name = os.path.basename(os.path.normpath(target))
    return name


def _read_bounded(descriptor: int, path: str, limit: int = MAX_ATTRIBUTE_BYTES) -> str:
    """The text of the regular file open at ``descriptor`` (closed here), at most ``limit`` bytes."""
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ReadError(f"{path}: not a regular file ({_file_kind(info.st_mode)})")
        chunk = os.read(descriptor, _READ_CHUNK)
        if len(chunk) < _READ_CHUNK:  # a regular file's short read is its end: one read for a sysfs attribute
            return chunk.decode("utf-8", errors="replace")
        chunks = [chunk]
        size = len(chunk)
        while chunk := os.read(descriptor, _READ_CHUNK):
            size += len(chunk)
            if size > limit:
                raise ReadError(f"{path}: larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")
    except OSError as exc:
        raise ReadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(descriptor)


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
