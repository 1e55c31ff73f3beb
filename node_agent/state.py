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
from schemas.errors import InputError

DEFAULT_STATE_DIR = Path("/run/kubevirt-gpu-passthrough/node-agent")
STATE_FILE = "state.json"
READY_FILE = "ready"
MAX_STATE_BYTES = 4 * 1024 * 1024
STATE_VERSION = 1


def _atomic_write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with temporary.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.replace(path)
    except OSError as exc:
        raise AgentError(f"cannot write {path}: {exc.strerror or exc}") from None


def read_state(directory: Path) -> dict[str, Any]:
    """The state file's object; empty when there is none yet. A damaged one is an error naming it."""
    path = directory / STATE_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(read_regular_file(path, MAX_STATE_BYTES, "agent state file"))
    except (InputError, ValueError) as exc:
        raise AgentError(f"agent state file {path} cannot be used: {exc}") from None
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise AgentError(f"agent state file {path} is not a version-{STATE_VERSION} state object")
    return data


def write_section(directory: Path, section: str, content: dict[str, Any]) -> None:
    """Replace ``section`` of the state file with ``content`` (stamped with the time), atomically."""
    state = read_state(directory) or {"version": STATE_VERSION}
    state[section] = {**content, "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _atomic_write(directory / STATE_FILE, json.dumps(state, indent=2, sort_keys=True) + "\n")


def set_ready(directory: Path, ready: bool, detail: dict[str, Any]) -> None:
    """Create (ready) or remove (not ready) the readiness file a DaemonSet's probe checks."""
    path = directory / READY_FILE
    if ready:
        _atomic_write(path, json.dumps(detail, sort_keys=True) + "\n")
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        raise AgentError(f"cannot remove {path}: {exc.strerror or exc}") from None
