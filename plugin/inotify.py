"""A tiny ctypes wrapper over Linux inotify: know at once when a directory's entries change, without polling.

The device plugin must react within a second to a ``/dev/vfio/<group>`` node vanishing (the group's devices
become unhealthy), to a new ``kubelet.sock`` (the kubelet restarted: register again) and to its own socket
being deleted (serve again). Rescanning or stat-ing in a loop would either be slow or burn CPU on an idle
node; inotify wakes us exactly when something happens. The standard library has no inotify and a new
dependency for three syscalls is not worth it, so this calls libc through ctypes.

:class:`DirectoryWatch` watches one directory: :meth:`~DirectoryWatch.fileno` for ``select``/``poll`` in an
event loop, :meth:`~DirectoryWatch.read` to wait (up to a timeout, via ``poll``) and drain pending events.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

IN_ACCESS = 0x00000001
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_CLOSE_NOWRITE = 0x00000010
IN_OPEN = 0x00000020
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000

IN_MOVE = IN_MOVED_FROM | IN_MOVED_TO
ENTRIES_CHANGED = IN_CREATE | IN_DELETE | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO
"""A directory's entries appeared, went, were renamed or changed their attributes."""
SELF_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_UNMOUNT
"""The watched directory itself went away (or the watch ended): watch it again once it is back."""

_ALWAYS = IN_DELETE_SELF | IN_MOVE_SELF
_IN_CLOEXEC = os.O_CLOEXEC
_IN_NONBLOCK = os.O_NONBLOCK
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name
_BUFFER = 64 * 1024

_MASK_NAMES = {
    IN_ACCESS: "ACCESS",
    IN_MODIFY: "MODIFY",
    IN_ATTRIB: "ATTRIB",
    IN_CLOSE_WRITE: "CLOSE_WRITE",
    IN_CLOSE_NOWRITE: "CLOSE_NOWRITE",
    IN_OPEN: "OPEN",
    IN_MOVED_FROM: "MOVED_FROM",
    IN_MOVED_TO: "MOVED_TO",
    IN_CREATE: "CREATE",
    IN_DELETE: "DELETE",
    IN_DELETE_SELF: "DELETE_SELF",
    IN_MOVE_SELF: "MOVE_SELF",
    IN_UNMOUNT: "UNMOUNT",
    IN_Q_OVERFLOW: "Q_OVERFLOW",
    IN_IGNORED: "IGNORED",
    IN_ISDIR: "ISDIR",
}


class _Libc:
    """The three inotify calls, loaded once."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int


_libc: _Libc | None = None


def _calls() -> _Libc:
    global _libc  # noqa: PLW0603 - loaded on first use, then shared
    if _libc is None:
        _libc = _Libc()
    return _libc


def describe_mask(mask: int) -> str:
    """``CREATE|ISDIR`` for a mask, for logs and test messages."""
    names = [name for bit, name in _MASK_NAMES.items() if mask & bit]
    return "|".join(names) or "0"


@dataclass(frozen=True, slots=True)
class Event:
    """One inotify event: the entry's name in the directory (empty for the directory itself) and the mask."""

    name: str
    mask: int
    cookie: int = 0
    """Pairs a ``MOVED_FROM`` with its ``MOVED_TO``."""

    @property
    def is_dir(self) -> bool:
        return bool(self.mask & IN_ISDIR)

    def __str__(self) -> str:
        return f"{self.name or '.'}: {describe_mask(self.mask)}"


def parse_events(data: bytes) -> list[Event]:
    """Decode a buffer of ``struct inotify_event`` records."""
    events: list[Event] = []
    offset = 0
    while offset + _EVENT.size <= len(data):
        _wd, mask, cookie, length = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size
        raw = data[offset : offset + length]
        offset += length
        events.append(Event(os.fsdecode(raw.split(b"\0", 1)[0]), mask, cookie))
    return events


class DirectoryWatch:
    """An inotify instance watching one directory for ``mask`` (``IN_*`` bits; ``ENTRIES_CHANGED`` is typical).

    The directory must exist (``FileNotFoundError``) and be a directory (``NotADirectoryError``).
    ``IN_DELETE_SELF`` and ``IN_MOVE_SELF`` are always watched too (and the kernel always reports
    ``IN_IGNORED``, ``IN_UNMOUNT`` and ``IN_Q_OVERFLOW``): once the directory is deleted, moved away (the watch
    would follow it elsewhere) or unmounted, the watch is over (:attr:`ended`) and a new one must be made on
    the path when it is back. An ``IN_Q_OVERFLOW`` event means events were lost: rescan.
    """

    def __init__(self, path: Path | str, mask: int = ENTRIES_CHANGED) -> None:
        self.path = Path(path)
        self.mask = mask
        self.ended = False
        calls = _calls()
        descriptor = calls.init1(_IN_CLOEXEC | _IN_NONBLOCK)
        if descriptor < 0:
            number = ctypes.get_errno()
            raise OSError(number, f"inotify_init1: {os.strerror(number)}")
        self._fd: int | None = descriptor
        watch = calls.add_watch(descriptor, os.fsencode(self.path), mask | _ALWAYS | IN_ONLYDIR)
        if watch < 0:
            number = ctypes.get_errno()
            os.close(descriptor)
            self._fd = None
            raise OSError(number, os.strerror(number), str(self.path))
        self._poll = select.poll()
        self._poll.register(descriptor, select.POLLIN)

    def fileno(self) -> int:
        """The inotify descriptor: readable when events are pending (for ``select``/``poll``/``selectors``)."""
        if self._fd is None:
            raise ValueError(f"inotify watch on {self.path} is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def read(self, timeout: float | None = 0) -> list[Event]:
        """Wait up to ``timeout`` seconds (None: for ever; 0: not at all) for events, then return all pending.

        Returns ``[]`` when none came in time. Waiting is ``poll`` on the descriptor, never a sleep loop.
        """
        descriptor = self.fileno()
        wait_ms = -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))
        if not self._poll.poll(wait_ms):
            return []
        events: list[Event] = []
        while True:
            try:
                data = os.read(descriptor, _BUFFER)
            except BlockingIOError:
                break
            except OSError as error:
                if error.errno == errno.EINTR:
                    continue
                raise
            if not data:
                break
            events.extend(parse_events(data))
        if any(event.mask & SELF_GONE for event in events):
            self.ended = True
        return events

    def close(self) -> None:
        """Release the descriptor (and with it the watch); safe to call twice."""
        descriptor, self._fd = self._fd, None
        if descriptor is not None:
            self._poll.unregister(descriptor)
            os.close(descriptor)

    def __enter__(self) -> DirectoryWatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        descriptor = getattr(self, "_fd", None)
        if descriptor is not None:
            os.close(descriptor)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("ended" if self.ended else "open")
        return f"DirectoryWatch({str(self.path)!r}, {describe_mask(self.mask)}, {state})"
