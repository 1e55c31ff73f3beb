"""Reading files below a directory someone else fills, without a link leading anywhere outside it.

The hook reads the DRA driver's metadata files (docs/dra.md, "Hook side") from a tree the driver and the
kubelet build, possibly seen through ``/proc/<pid>/root``. A symbolic link in that tree is resolved *inside*
the root, as a chroot would (an absolute target starts at the root, ``..`` stops at it), so no name in the
tree reaches a file outside. Each component is looked at with ``lstat`` relative to an open directory and
opened with ``O_NOFOLLOW``: a component swapped for a link between the two fails the open instead of being
followed. Listings and reads are bounded (entry count, bytes; :mod:`runtime.files`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from runtime.files import read_open_file
from schemas.errors import InputError

MAX_LINKS = 40
"""Links followed in one path before giving up (the kernel's own limit)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotInRoot(InputError):
    """The path does not exist below the root (or resolves to nothing there)."""


class ConfinedRoot:
    """A directory whose paths are resolved inside it; ``what`` names it in messages (``DRA metadata root``)."""

    def __init__(self, root: Path, what: str) -> None:
        self.root = root
        self.what = what

    def _shown(self, relative: PurePosixPath) -> str:
        return repr(str(self.root / relative))

    def _open_root(self) -> int:
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotInRoot(f"{self.what} {str(self.root)!r} does not exist") from None
        except OSError as exc:
            raise InputError(f"{self.what} {str(self.root)!r} cannot be opened: {exc.strerror or exc}") from None

    def _resolve(self, relative: PurePosixPath, what: str) -> tuple[int, str | None]:
        """An open descriptor of the directory holding the last component, and that component (None: the root
        itself). Links are resolved inside the root; every directory on the way is opened ``O_NOFOLLOW``."""
        shown = f"{what} {self._shown(relative)}"
        pending = [part for part in relative.parts if part not in ("/", ".", "")]
        resolved: list[str] = []
        links = 0
        root_fd = self._open_root()
        current = os.dup(root_fd)
        try:
            while pending:
                part = pending.pop(0)
                if part == "..":
                    if resolved:
                        resolved.pop()
                        os.close(current)
                        current = -1
                        current = self._walk(root_fd, resolved, shown)
                    continue
                info = self._lstat(current, part, shown)
                if stat.S_ISLNK(info.st_mode):
                    links += 1
                    if links > MAX_LINKS:
                        raise InputError(f"{shown}: more than {MAX_LINKS} symbolic links on the way")
                    target = self._readlink(current, part, shown)
                    if target.startswith("/"):
                        resolved = []
                        os.close(current)
                        current = -1
                        current = self._walk(root_fd, resolved, shown)
                    pending[:0] = [p for p in PurePosixPath(target).parts if p not in ("/", ".", "")]
                    continue
                if not pending:
                    return current, part
                if not stat.S_ISDIR(info.st_mode):
                    raise NotInRoot(f"{shown} does not exist: {'/'.join([*resolved, part])} is not a directory")
                following = self._open_dir(current, part, shown)
                os.close(current)
                current = following
                resolved.append(part)
            return current, None
        except BaseException:
            if current >= 0:
                os.close(current)
            raise
        finally:
            os.close(root_fd)

    @staticmethod
    def _lstat(current: int, part: str, shown: str) -> os.stat_result:
        try:
            return os.lstat(part, dir_fd=current)
        except FileNotFoundError:
            raise NotInRoot(f"{shown} does not exist") from None
        except OSError as exc:
            raise InputError(f"{shown} cannot be read: {exc.strerror or exc}") from None

    @staticmethod
    def _readlink(current: int, part: str, shown: str) -> str:
        try:
            return os.readlink(part, dir_fd=current)
        except OSError as exc:
            raise InputError(f"{shown} cannot be read at {part!r}: {exc.strerror or exc}") from None

    @staticmethod
    def _open_dir(current: int, part: str, shown: str) -> int:
        """``part`` below the directory ``current`` opened as a directory, never through a link."""
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=current)
        except FileNotFoundError:
            raise NotInRoot(f"{shown} does not exist") from None
        except OSError as exc:
            raise InputError(f"{shown} cannot be read at {part!r}: {exc.strerror or exc}") from None

    def _walk(self, root_fd: int, resolved: list[str], shown: str) -> int:
        """A new descriptor of the directory ``resolved`` (components known not to be links) below the root."""
        fd = os.dup(root_fd)
        for part in resolved:
            try:
                following = self._open_dir(fd, part, shown)
            finally:
                os.close(fd)
            fd = following
        return fd

    def list_dir(self, relative: PurePosixPath, max_entries: int) -> list[str]:
        """The names in the directory ``relative`` (sorted), at most ``max_entries``; NotInRoot when absent."""
        shown = self._shown(relative)
        parent, last = self._resolve(relative, "directory")
        try:
            if last is None:
                fd = parent
            else:
                try:
                    fd = self._open_dir(parent, last, shown)
                finally:
                    os.close(parent)
            try:
                names: list[str] = []
                with os.scandir(fd) as entries:
                    for entry in entries:
                        names.append(entry.name)
                        if len(names) > max_entries:
                            raise InputError(f"{shown} has more than {max_entries} entries")
            finally:
                os.close(fd)
        except OSError as exc:
            raise InputError(f"{shown} cannot be listed: {exc.strerror or exc}") from None
        return sorted(names)

    def read_file(self, relative: PurePosixPath, max_bytes: int, what: str) -> bytes:
        """The bytes of the regular file ``relative`` (at most ``max_bytes``); NotInRoot when it is absent,
        InputError naming ``what`` and the file when it is not a regular file, unreadable or too large."""
        shown = self._shown(relative)
        parent, last = self._resolve(relative, what)
        try:
            if last is None:
                raise InputError(f"{what} {shown} is a directory, not a regular file")
            fd = os.open(last, _FILE_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            raise NotInRoot(f"{what} {shown} does not exist") from None
        except OSError as exc:
            raise InputError(f"{what} {shown} cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(parent)
        return read_open_file(fd, max_bytes, what, shown)
