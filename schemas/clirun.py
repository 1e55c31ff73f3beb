"""How every console entry point ends: its result, or one ``error: …`` line and an exit code, never a traceback.

:func:`run_cli` runs a click command outside click's standalone mode and maps what escapes it:

- a usage error (unknown flag, bad value): the usage line, then ``error: …``, exit 2;
- :class:`~schemas.errors.InputError` and click's own exceptions: ``error: …``, exit 1;
- ``RecursionError`` (input nested past Python's limit somewhere a parser recursed): ``error: … nested too
  deeply …``, exit 1; ``MemoryError`` likewise;
- anything else is a bug: ``error: internal error: <type>: <message>``, exit 1 (still no traceback; set
  ``$CLI_TRACEBACK=1`` to see it).

Messages are made single lines by :func:`escape_controls`: input such as a NUL byte in XML, an ANSI escape
in a file name, or a library's own newline cannot split the line or drive the terminal.
"""

from __future__ import annotations

import os
import sys
import traceback
import unicodedata
from typing import NoReturn

import click

from schemas.errors import InputError

_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    """``text`` with control characters (C0, DEL, C1) and line/paragraph separators written as escapes
    (``\\x00``, ``\\n``, ``\\u2028``); everything else, non-ASCII letters included, is kept."""
    if text.isprintable():
        return text
    out = []
    for char in text:
        if char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif unicodedata.category(char) in ("Cc", "Zl", "Zp"):
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)


def error_exit(message: str, code: int = 1) -> NoReturn:
    """``error: <message>`` (one line) on stderr, then exit ``code``."""
    sys.stderr.write(f"error: {escape_controls(message)}\n")
    sys.stderr.flush()
    sys.exit(code)


def run_cli(command: click.Command, prog_name: str, args: list[str] | None = None, obj: object = None) -> NoReturn:
    """Run ``command`` (a click group or command) as the program ``prog_name`` and exit; ``obj`` is click's
    context object (the node agent's tests pass their simulated kernel through it)."""
    try:
        result = command.main(args=args, prog_name=prog_name, standalone_mode=False, obj=obj)
    except click.UsageError as exc:
        if exc.ctx is not None:
            sys.stderr.write(f"{exc.ctx.get_usage()}\nTry '{exc.ctx.command_path} --help' for help.\n")
        error_exit(exc.format_message(), exc.exit_code)
    except click.ClickException as exc:
        error_exit(exc.format_message(), exc.exit_code)
    except click.Abort:
        error_exit("aborted", 1)
    except InputError as exc:
        error_exit(str(exc), 1)
    except RecursionError:
        error_exit("the input is nested too deeply to read (past Python's recursion limit)", 1)
    except MemoryError:
        error_exit("out of memory reading the input", 1)
    except BrokenPipeError:
        # stdout's reader went away (e.g. `xmlgen … | head`): nothing more to say, and nothing to flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except Exception as exc:  # a bug: still one line, the traceback only when asked for
        if os.environ.get("CLI_TRACEBACK") == "1":
            traceback.print_exc()
        error_exit(f"internal error: {type(exc).__name__}: {exc}", 1)
    sys.exit(result if isinstance(result, int) else 0)
