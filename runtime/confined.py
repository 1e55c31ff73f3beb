"""Reading files below a directory someone else fills, without a link leading anywhere outside it.

The hook reads the DRA driver's metadata files (docs/dra.md, "Hook side") from a tree the driver and the
kubelet build, possibly seen through ``/proc/<pid>/root``. A symbolic link in that tree is resolved *inside*
the root, as a chroot would (an absolute target starts at the root, ``..`` stops at it), so no name in the
tree reaches a file outside. That rule is exactly ``openat2(2)`` with ``RESOLVE_IN_ROOT``: where the kernel has
it (Linux ≥ 5.6; the loader and its on/off switch are :attr:`runtime.hostroot.HostRoot.openat2`, shared with the
device plugin) a path is resolved in one system call relative to the root's descriptor. Where it lacks it
(``ENOSYS``, or a seccomp profile's ``EPERM``), and for every refusal but "no such file" (a loop, a file where a
directory belongs, a race the kernel would not vouch for), the same rule is walked in Python: each component
looked at with ``lstat`` relative to an open directory and opened with ``O_NOFOLLOW``, so a component swapped
for a link between the two fails the open instead of being followed; the walk also names the culprit in the
error. Listings and reads are bounded (entry count, bytes, regular files only, opened ``O_NONBLOCK``;
:mod:`runtime.files`).

One call (one VMI's claims) opens the root once (:meth:`ConfinedRoot.open`) and reads every file through that
descriptor. Nothing is kept here; a caller that keeps what it read (``launcher_hook.dra.MetadataFiles``) gets each
listed directory's and each read file's ``fstat``, taken before the listing or the first byte, to tell later
whether the file is still the one it read (:func:`identity`).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from runtime.files import read_open_file
from runtime.hostroot import HostRoot
from schemas.errors import InputError

MAX_LINKS = 40
"""Links followed in one path before giving up (the kernel's own limit)."""
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW | os.O_CLOEXEC
_KERNEL_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
"""Through ``openat2`` a last component that is a link is followed, inside the root, as the walk follows it."""
_KERNEL_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_UNAVAILABLE = (errno.ENOSYS, errno.EPERM)
"""``openat2`` missing (an old kernel) or refused by a seccomp profile: walk in Python from then on."""


class NotInRoot(InputError):
    """The path does not exist below the root (or resolves to nothing there)."""


def _parts(relative: str) -> list[str]:
    """The components of ``relative`` to resolve (``//``, ``.`` and empty ones dropped: ``//x`` is ``/x``)."""
    return [part for part in relative.split("/") if part and part != "."]


class ConfinedRoot:
    """A directory whose paths are resolved inside it; ``what`` names it in messages (``DRA metadata root``)."""

    def __init__(self, root: Path, what: str) -> None:
        self.root = root
        self.what = what
        text = str(root)
        self._prefix = "" if text == "." else text if text.endswith("/") else f"{text}/"

    def path_text(self, relative: str) -> str:
        """Where ``relative`` (plain components joined by ``/``) is, as ``str(root / relative)`` says it."""
        return str(self.root) if relative in ("", ".") else self._prefix + relative

    def open(self) -> OpenRoot:
        """The root opened once, for the reads of one call (close it, or use ``with``); NotInRoot when the root
        does not exist, InputError when it cannot be opened."""
        try:
            descriptor = os.open(self.root, _ROOT_FLAGS)
        except FileNotFoundError:
            raise NotInRoot(f"{self.what} {str(self.root)!r} does not exist") from None
        except OSError as exc:
            raise InputError(f"{self.what} {str(self.root)!r} cannot be opened: {exc.strerror or exc}") from None
        return OpenRoot(self, descriptor)

    def list_dir(self, relative: PurePosixPath, max_entries: int) -> list[str]:
        """The names in the directory ``relative`` (sorted), at most ``max_entries``; NotInRoot when absent."""
        shown = repr(str(self.root / relative))
        with self.open() as opened, opened.directory(str(relative), max_entries, shown) as listing:
            return listing.names

    def read_file(self, relative: PurePosixPath, max_bytes: int, what: str) -> bytes:
        """The bytes of the regular file ``relative`` (at most ``max_bytes``); NotInRoot when it is absent,
        InputError naming ``what`` and the file when it is not a regular file, unreadable or too large."""
        shown = repr(str(self.root / relative))
        with self.open() as opened:
            return opened.read_file(str(relative), max_bytes, what, shown)


class OpenRoot:
    """A :class:`ConfinedRoot`'s directory, opened for one call: every path below it resolved relative to this
    one descriptor (by the kernel where it can, else by the walk). Paths are text, components joined by ``/``."""

    __slots__ = ("_fd", "confined")

    def __init__(self, confined: ConfinedRoot, descriptor: int) -> None:
        self.confined = confined
        self._fd = descriptor

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> OpenRoot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _kernel(self, relative: str, flags: int) -> int | None:
        """``relative`` opened by ``openat2`` ``RESOLVE_IN_ROOT`` relative to the root; None where the walk must
        decide (no ``openat2``, or any refusal but ``ENOENT``, which is raised as ``FileNotFoundError``)."""
        openat2 = HostRoot.openat2
        if openat2 is None or "\0" in relative:  # a NUL would cut the C string short: the walk refuses it
            return None
        try:
            return openat2(self._fd, os.fsencode(relative or "."), flags)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno in _UNAVAILABLE:
                HostRoot.openat2 = None  # as HostRoot does: not on this kernel, or refused by seccomp
            return None

    def directory(self, relative: str, max_entries: int, shown: str | None = None) -> Listing:
        """The directory ``relative`` opened inside the root and listed (sorted, at most ``max_entries`` names;
        InputError beyond); NotInRoot when absent. ``shown`` (default: its path, quoted) names it in messages.
        Close the listing (or use ``with``)."""
        if shown is None:
            shown = repr(self.confined.path_text(relative))
        try:
            descriptor = self._kernel(relative, _KERNEL_DIR_FLAGS)
        except FileNotFoundError:
            raise NotInRoot(f"directory {shown} does not exist") from None
        if descriptor is None:
            descriptor = self._walk_dir(relative, shown)
        try:
            names: list[str] = []
            with os.scandir(descriptor) as entries:
                for entry in entries:
                    names.append(entry.name)
                    if len(names) > max_entries:
                        raise InputError(f"{shown} has more than {max_entries} entries")
        except OSError as exc:
            os.close(descriptor)
            raise InputError(f"{shown} cannot be listed: {exc.strerror or exc}") from None
        except BaseException:
            os.close(descriptor)
            raise
        names.sort()
        return Listing(self, relative, descriptor, names)

    def read_file(self, relative: str, max_bytes: int, what: str, shown: str | None = None) -> bytes:
        """The bytes of the regular file ``relative`` (at most ``max_bytes``); NotInRoot when it is absent,
        InputError naming ``what`` and the file (``shown``, default its path quoted) when it is not a regular
        file, unreadable or too large."""
        if shown is None:
            shown = repr(self.confined.path_text(relative))
        try:
            descriptor = self._kernel(relative, _KERNEL_FILE_FLAGS)
        except FileNotFoundError:
            raise NotInRoot(f"{what} {shown} does not exist") from None
        if descriptor is None:
            descriptor = self._walk_file(relative, what, shown)
        return read_open_file(descriptor, max_bytes, what, shown)

    # ------------------------------------------------------------------------------ the walk, in Python

    def _walk_dir(self, relative: str, shown: str) -> int:
        label = f"directory {shown}"
        parent, last = self._resolve(relative, label)
        if last is None:
            return parent
        try:
            return _open_dir(parent, last, label)
        finally:
            os.close(parent)

    def _walk_file(self, relative: str, what: str, shown: str) -> int:
        label = f"{what} {shown}"
        parent, last = self._resolve(relative, label)
        try:
            if last is None:
                raise InputError(f"{label} is a directory, not a regular file; refusing to read it")
            return os.open(last, _FILE_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            raise NotInRoot(f"{label} does not exist") from None
        except OSError as exc:
            raise InputError(f"{label} cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(parent)

    def _resolve(self, relative: str, shown: str) -> tuple[int, str | None]:
        """An open descriptor of the directory holding the last component, and that component (None: the root
        itself). Links are resolved inside the root; every directory on the way is opened ``O_NOFOLLOW``."""
        pending = _parts(relative)
        pending.reverse()  # popped from the end: the next component last
        resolved: list[str] = []
        links = 0
        current = os.dup(self._fd)
        try:
            while pending:
                part = pending.pop()
                if part == "..":
                    if resolved:
                        resolved.pop()
                        os.close(current)
                        current = -1
                        current = self._walk(resolved, shown)
                    continue
                info = _lstat(current, part, shown)
                if stat.S_ISLNK(info.st_mode):
                    links += 1
                    if links > MAX_LINKS:
                        raise InputError(f"{shown}: more than {MAX_LINKS} symbolic links on the way")
                    target = _readlink(current, part, shown)
                    if target.startswith("/"):
                        resolved = []
                        os.close(current)
                        current = -1
                        current = os.dup(self._fd)
                    followed = _parts(target)
                    followed.reverse()
                    pending += followed
                    continue
                if not pending:
                    return current, part
                if not stat.S_ISDIR(info.st_mode):
                    raise NotInRoot(f"{shown} does not exist: {'/'.join([*resolved, part])} is not a directory")
                following = _open_dir(current, part, shown)
                os.close(current)
                current = following
                resolved.append(part)
            return current, None
        except BaseException:
            if current >= 0:
                os.close(current)
            raise

    def _walk(self, resolved: list[str], shown: str) -> int:
        """A new descriptor of the directory ``resolved`` (components known not to be links) below the root."""
        fd = os.dup(self._fd)
        for part in resolved:
            try:
                following = _open_dir(fd, part, shown)
            finally:
                os.close(fd)
            fd = following
        return fd


class Listing:
    """A directory opened inside the root (:meth:`OpenRoot.directory`) and its sorted ``names``; reads a name
    without resolving the directory again."""

    __slots__ = ("_fd", "_root", "names", "relative")

    def __init__(self, root: OpenRoot, relative: str, descriptor: int, names: list[str]) -> None:
        self._root = root
        self.relative = relative
        self.names = names
        self._fd = descriptor

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Listing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def read(self, name: str, max_bytes: int, what: str, shown: str | None = None) -> bytes:
        """The file ``name`` of this directory, as :meth:`OpenRoot.read_file` reads ``<relative>/<name>``
        (``shown``, default its path quoted, names it in messages).

        One component opened ``O_NOFOLLOW`` relative to the directory's descriptor: it cannot lead out of the
        root (no ``/``, no ``..``, a link is not followed). A name that is a link, or any other refusal, is read
        the careful way, resolved inside the root from its start."""
        relative = name if self.relative in ("", ".") else f"{self.relative}/{name}"
        if shown is None:
            shown = repr(self._root.confined.path_text(relative))
        if not name or "/" in name or "\0" in name or name in (".", "..") or self._fd < 0:
            return self._root.read_file(relative, max_bytes, what, shown)
        try:
            descriptor = os.open(name, _FILE_FLAGS, dir_fd=self._fd)
        except FileNotFoundError:
            raise NotInRoot(f"{what} {shown} does not exist") from None
        except OSError:
            return self._root.read_file(relative, max_bytes, what, shown)  # a link (ELOOP) or another refusal
        return read_open_file(descriptor, max_bytes, what, shown)


def _lstat(current: int, part: str, shown: str) -> os.stat_result:
    try:
        return os.lstat(part, dir_fd=current)
    except FileNotFoundError:
        raise NotInRoot(f"{shown} does not exist") from None
    except OSError as exc:
        raise InputError(f"{shown} cannot be read: {exc.strerror or exc}") from None


def _readlink(current: int, part: str, shown: str) -> str:
    try:
        return os.readlink(part, dir_fd=current)
    except OSError as exc:
        raise InputError(f"{shown} cannot be read at {part!r}: {exc.strerror or exc}") from None


def _open_dir(current: int, part: str, shown: str) -> int:
    """``part`` below the directory ``current`` opened as a directory, never through a link."""
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=current)
    except FileNotFoundError:
        raise NotInRoot(f"{shown} does not exist") from None
    except OSError as exc:
        raise InputError(f"{shown} cannot be read at {part!r}: {exc.strerror or exc}") from None
