"""What the agent last did, where a probe and the plugin can read it: ``<state dir>/state.json`` and the
readiness file ``<state dir>/ready``.

``state.json`` is one JSON object with a section per command (``bind``, ``vgpu``), each replaced whole by
the command's latest run; it is written to a temporary file in the same directory, flushed and renamed
over the old one, so a reader sees the old state or the new one, never half of one. ``ready`` exists
exactly while the last ``validate`` (or a command run with ``--validate``) found the node ready.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from node_agent.kernel import AgentError
from runtime.files import read_regular_file
from schemas import node_agent_state as schema
from schemas.errors import InputError
from schemas.node_agent_state import MAX_STATE_BYTES, READY_FILE, STATE_FILE

DEFAULT_STATE_DIR = Path(schema.DEFAULT_STATE_DIR)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its directory, flushed and renamed over it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.unlink(missing_ok=True)  # a stale one, or a link planted at the predictable name: never followed
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.replace(path)
    except OSError as exc:
        raise AgentError(f"cannot write {path}: {exc.strerror or exc}") from None


def read_state(directory: Path) -> dict[str, Any]:
    """The state file's object (:func:`schemas.node_agent_state.parse_state`); empty when there is none yet. A
    damaged one is an error naming it."""
    path = directory / STATE_FILE
    if not path.exists():
        return {}
    try:
        return schema.parse_state(read_regular_file(path, MAX_STATE_BYTES, "agent state file"), str(path))
    except InputError as exc:
        raise AgentError(str(exc)) from None  # it names the file


def write_section(directory: Path, section: str, content: dict[str, Any]) -> None:
    """Replace ``section`` of the state file with ``content`` (stamped with the time), atomically."""
    state = read_state(directory) or schema.new_state()
    state[section] = {**content, schema.UPDATED: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write(directory / STATE_FILE, schema.encode_state(state))


def set_ready(directory: Path, ready: bool, detail: dict[str, Any]) -> None:
    """Create (ready) or remove (not ready) the readiness file a DaemonSet's probe checks."""
    path = directory / READY_FILE
    if ready:
        atomic_write(path, json.dumps(detail, sort_keys=True) + "\n")
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        raise AgentError(f"cannot remove {path}: {exc.strerror or exc}") from None
