"""The node agent's state file, ``<state dir>/state.json``: its names and one pure parser, shared by the agent
(``node_agent.state`` writes it) and the device plugin (``plugin.source_sriov_vgpu`` reads the SR-IOV vGPU type
names from it), so the two cannot drift.

The file is one JSON object: ``{"version": 1, "bind": {…}, "unbind": {…}, "vgpu": {…}}``, a section per
agent command, each replaced whole by that command's latest run and stamped ``updated``. The plugin relies
on one field only, ``vgpu.type_names``: per SR-IOV GPU (its PCI address), the vGPU type IDs the agent saw
named in ``creatable_vgpu_types`` (``{"0000:3b:00.0": {"1147": "NVIDIA L40S-1Q"}}``). A VF that has a type
lists none, so once every VF of a GPU is in use this is the only place the names are left (docs/node.md,
"SR-IOV vGPUs"). Anything else in the file is the agent's own business and is ignored by readers.
"""

from __future__ import annotations

import json
from typing import Any

from schemas.errors import InputError

DEFAULT_STATE_DIR = "/run/kubevirt-gpu-passthrough/node-agent"
"""Where the agent keeps its state on the node (a hostPath both the agent and the plugin mount)."""
STATE_FILE = "state.json"
READY_FILE = "ready"
DEFAULT_STATE_PATH = f"{DEFAULT_STATE_DIR}/{STATE_FILE}"
MAX_STATE_BYTES = 4 * 1024 * 1024
"""Largest state file read (4 MiB; 8 GPUs of 32 vGPU VFs write a few tens of KiB)."""
STATE_VERSION = 1

VERSION = "version"
SECTION_BIND = "bind"
SECTION_UNBIND = "unbind"
SECTION_VGPU = "vgpu"
UPDATED = "updated"
TYPE_NAMES = "type_names"
"""In the ``vgpu`` section: ``{GPU address: {type ID (decimal string): type name}}``."""

MAX_TYPE_ID_DIGITS = 9
"""A vGPU type ID is a small decimal number (``1147``); anything longer is not one."""
MAX_TYPE_NAME_CHARS = 256
"""A vGPU type name is short (``NVIDIA L40S-48Q``); a longer string is not one."""
MAX_GPUS = 4096
MAX_TYPES_PER_GPU = 4096


def new_state() -> dict[str, Any]:
    """An empty state object (no command has run yet)."""
    return {VERSION: STATE_VERSION}


def parse_state(text: str | bytes, where: str) -> dict[str, Any]:
    """The state object in ``text``; an ``InputError`` naming ``where`` when it is not JSON, not an object
    or not of :data:`STATE_VERSION`. Sections are returned as found: read them with the helpers below."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise InputError(f"agent state file {where} is nested too deeply") from None
    except ValueError as exc:
        raise InputError(f"agent state file {where} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"agent state file {where} is not a JSON object")
    if data.get(VERSION) != STATE_VERSION:
        raise InputError(f"agent state file {where} is not a version-{STATE_VERSION} state object")
    return data


def encode_state(state: dict[str, Any]) -> str:
    """The file's text for ``state`` (what :func:`parse_state` reads back)."""
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


def section(state: dict[str, Any], name: str) -> dict[str, Any]:
    """A section of the state object; empty when absent or not an object."""
    found = state.get(name)
    return found if isinstance(found, dict) else {}


def encode_type_names(names: dict[str, dict[int, str]]) -> dict[str, dict[str, str]]:
    """``{GPU: {ID: name}}`` as the file holds it (IDs as decimal strings, in order)."""
    return {gpu: {str(number): name for number, name in sorted(table.items())} for gpu, table in sorted(names.items())}


def type_names(state: dict[str, Any]) -> dict[str, dict[int, str]]:
    """``vgpu.type_names`` as ``{GPU: {ID: name}}``, keeping only what has the right shape: a GPU key is a
    string, an ID a decimal of at most :data:`MAX_TYPE_ID_DIGITS` digits, a name a non-empty string of at most
    :data:`MAX_TYPE_NAME_CHARS` characters. Anything else (and anything past the bounds) is left out."""
    table = section(state, SECTION_VGPU).get(TYPE_NAMES)
    if not isinstance(table, dict):
        return {}
    result: dict[str, dict[int, str]] = {}
    for gpu, listed in list(table.items())[:MAX_GPUS]:
        if not isinstance(gpu, str) or not isinstance(listed, dict):
            continue
        names: dict[int, str] = {}
        for number, given in list(listed.items())[:MAX_TYPES_PER_GPU]:
            if not (isinstance(number, str) and number.isascii() and number.isdigit()):
                continue
            if len(number) > MAX_TYPE_ID_DIGITS or not isinstance(given, str):
                continue
            name = given.strip()
            if name and len(name) <= MAX_TYPE_NAME_CHARS and name.isprintable():
                names[int(number)] = name
        if names:
            result[gpu] = names
    return result
