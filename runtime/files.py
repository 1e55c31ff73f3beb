"""Reading a file an operator or the node names, without letting it hang or bloat the process.

Config files, pci.ids and environ files come from paths someone else controls (a host root, a flag, a
mount). Opening a FIFO blocks, ``/dev/zero`` never ends, and a file can be swapped between a ``stat`` and an
``open``. So the file is opened ``O_NONBLOCK``, ``fstat`` on the open descriptor must say it is a regular file,
and the read stops as soon as it passes the limit (``/proc`` files report size 0: the size is not trusted).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from schemas.errors import InputError

_READ_CHUNK = 64 * 1024
_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def read_regular_file(path: Path, max_bytes: int, what: str, *, shown: str | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes``; an ``InputError`` naming ``what`` and the
    path (as ``shown``, default quoted) otherwise: missing, unreadable, not a regular file, too large."""
    name = repr(str(path)) if shown is None else shown
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError(f"{what} {name} cannot be read: it does not exist") from None
    except OSError as exc:
        raise InputError(f"{what} {name} cannot be read: {exc.strerror or exc}") from None
    return read_open_file(fd, max_bytes, what, name)


def read_open_file(fd: int, max_bytes: int, what: str, name: str) -> bytes:
    """:func:`read_regular_file` for a descriptor the caller opened (``O_NONBLOCK``); closes it."""
    try:
        info = os.fstat(fd)
        mode = info.st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
            raise InputError(f"{what} {name} is {kind}, not a regular file; refusing to read it")
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise InputError(f"{what} {name} is over the {max_bytes}-byte limit")
    except OSError as exc:
        raise InputError(f"{what} {name} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)
