"""What every xmlgen command shares: reading inputs with named errors, and one way to fail.

A command either writes its whole result to stdout or writes ``error: …`` to stderr and exits 1 with
nothing on stdout.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, ParamSpec, TypeVar

import click

from schemas import InputError
from schemas.clirun import escape_controls
from schemas.limits import DEFAULT_MAX_INPUT_BYTES

P = ParamSpec("P")
R = TypeVar("R")


def _read_bounded(handle: BinaryIO, max_bytes: int) -> bytes:
    """At most ``max_bytes`` + 1 bytes, read in 1 MiB chunks: a huge limit allocates nothing up front."""
    chunks: list[bytes] = []
    left = max_bytes + 1
    while left > 0:
        chunk = handle.read(min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_input(source: str, what: str, max_bytes: int) -> bytes:
    """Read a file, or stdin for ``-``; over ``max_bytes`` (+1 read to tell) or unreadable is an InputError."""
    try:
        if source == "-":
            data = _read_bounded(sys.stdin.buffer, max_bytes)
        else:
            with Path(source).open("rb") as handle:
                data = _read_bounded(handle, max_bytes)
    except OSError as exc:
        raise InputError(f"cannot read {what} {source!r}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise InputError(f"{what} {source!r} is over the {max_bytes}-byte limit")
    return data


def fail(message: str) -> None:
    click.echo(f"error: {escape_controls(message)}", err=True)
    sys.exit(1)


def user_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turn ``InputError`` into ``error: …`` on stderr and exit 1."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except InputError as exc:
            fail(str(exc))
            raise  # unreachable: fail() exits

    return wrapper


def write_stdout(data: bytes) -> None:
    """Write the whole result at once (nothing is written before the result is complete)."""
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


max_input_bytes_option = click.option(
    "--max-input-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_INPUT_BYTES,
    show_default=True,
    help="Refuse larger inputs.",
)
"""The input size cap every command that reads documents takes."""
