"""The vGPU configuration file, in NVIDIA vgpu-device-manager's ``v1`` format, accepted as is.

::

    version: v1
    vgpu-configs:
      <name>:                       # what --select (or the node's label) picks
        - devices: all | [0, 2]     # GPU indexes (docs/node-agent.md: how GPUs are numbered)
          device-filter: "0x1EB810DE" | ["0x1EB810DE", …]   # optional: PCI (device << 16 | vendor)
          vgpu-devices: {T4-1Q: 4}  # vGPU type → count on each matching GPU

Unknown fields are refused, as NVIDIA's parser refuses them; a spec needs ``devices`` and ``vgpu-devices``;
every count is a positive integer. Parsing is pure (text in, :class:`VgpuSpec` lists out).
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from node_agent.kernel import AgentError
from node_agent.mig import mig_backed
from runtime.files import read_regular_file

MAX_CONFIG_BYTES = 1024 * 1024
MAX_COUNT = 4096
"""More vGPUs of one type on one GPU than any GPU supports (a bound against typos such as 40000)."""

_TIME_SLICED = re.compile(r"^[A-Z0-9]+(-[a-zA-Z]+)*-(0|[1-9][0-9]*)[ABCQ]$")
"""A time-sliced vGPU type name (``A100-40C``, ``T4-1Q``), as NVIDIA's vgpu-device-manager reads one."""

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 2, 4, 4, 60, 60


def shown(value: Any) -> str:
    """A config value as an error names it, bounded: YAML aliases can make a value of a few hundred bytes
    megabytes long (nested lists of aliases), which ``repr`` would spell out whole."""
    return _SHOWN.repr(value)


@dataclass(frozen=True, slots=True)
class VgpuSpec:
    """One entry of a named config: which GPUs, and how many vGPUs of which types on each."""

    devices: tuple[int, ...] | None
    """GPU indexes; None for ``all``."""
    device_filter: tuple[int, ...]
    """PCI IDs as ``device << 16 | vendor`` (``0x1EB810DE``: a T4); empty matches every GPU."""
    vgpu_devices: tuple[tuple[str, int], ...]

    def matches(self, index: int, device_id: int | None) -> bool:
        if self.devices is not None and index not in self.devices:
            return False
        return not self.device_filter or device_id in self.device_filter


def _device_id(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise AgentError(f"{where}: device-filter entry {shown(value)} is not a PCI device ID such as 0x1EB810DE")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value, 0)
        except ValueError:
            raise AgentError(
                f"{where}: device-filter entry {shown(value)} is not a PCI device ID such as 0x1EB810DE"
            ) from None
    else:
        raise AgentError(f"{where}: device-filter entry {shown(value)} is not a PCI device ID such as 0x1EB810DE")
    if not 0 <= number <= 0xFFFFFFFF:
        raise AgentError(f"{where}: device-filter entry {shown(value)} is not a 32-bit PCI device ID")
    return number


def _spec(raw: Any, where: str) -> VgpuSpec:
    if not isinstance(raw, dict):
        raise AgentError(f"{where}: expected a mapping with devices and vgpu-devices, got {type(raw).__name__}")
    unknown = sorted(str(key) for key in raw if key not in ("devices", "device-filter", "vgpu-devices"))
    if unknown:
        raise AgentError(f"{where}: unexpected field {unknown[0]!r} (known: devices, device-filter, vgpu-devices)")
    for required in ("devices", "vgpu-devices"):
        if required not in raw:
            raise AgentError(f"{where}: missing required field {required!r}")
    devices_raw = raw["devices"]
    devices: tuple[int, ...] | None
    if devices_raw == "all":
        devices = None
    elif isinstance(devices_raw, list) and all(
        isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in devices_raw
    ):
        devices = tuple(devices_raw)
    else:
        raise AgentError(f"{where}: devices must be 'all' or a list of GPU indexes, not {shown(devices_raw)}")
    filter_raw = raw.get("device-filter", [])
    filters = filter_raw if isinstance(filter_raw, list) else [filter_raw]
    if filter_raw == "":
        filters = []
    device_filter = tuple(_device_id(item, where) for item in filters)
    vgpus_raw = raw["vgpu-devices"]
    if not isinstance(vgpus_raw, dict):
        raise AgentError(f"{where}: vgpu-devices must map vGPU types to counts, not {shown(vgpus_raw)}")
    vgpus: list[tuple[str, int]] = []
    for name, count in vgpus_raw.items():
        if not isinstance(name, str) or not name.strip():
            raise AgentError(f"{where}: vGPU type {shown(name)} is not a type name")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= MAX_COUNT:
            raise AgentError(f"{where}: count {shown(count)} for {name} is not a whole number from 1 to {MAX_COUNT}")
        vgpus.append((name, count))
    backed = [name for name, _ in vgpus if mig_backed(name) is not None]
    sliced = [name for name, _ in vgpus if _TIME_SLICED.match(name.removeprefix("NVIDIA ").removeprefix("GRID "))]
    if backed and sliced:
        raise AgentError(
            f"{where}: {backed[0]} is MIG-backed and {sliced[0]} is time-sliced: one GPU cannot hold both "
            "(in MIG mode a GPU offers only MIG-backed vGPU types)"
        )
    return VgpuSpec(devices, device_filter, tuple(vgpus))


def parse_config(text: str, source: str) -> dict[str, tuple[VgpuSpec, ...]]:
    """Every named config of the file ``source`` (named in errors)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AgentError(f"vGPU config {source} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise AgentError(f"vGPU config {source}: expected a mapping with version and vgpu-configs")
    unknown = sorted(str(key) for key in data if key not in ("version", "vgpu-configs"))
    if unknown:
        raise AgentError(f"vGPU config {source}: unexpected field {unknown[0]!r} (known: version, vgpu-configs)")
    if "version" not in data:
        raise AgentError(f"vGPU config {source}: missing 'version' (this agent reads version v1)")
    if data["version"] != "v1":
        raise AgentError(f"vGPU config {source}: unknown version {shown(data['version'])} (this agent reads v1)")
    configs = data.get("vgpu-configs")
    if not isinstance(configs, dict) or not configs:
        raise AgentError(f"vGPU config {source}: at least one entry in 'vgpu-configs' is required")
    parsed: dict[str, tuple[VgpuSpec, ...]] = {}
    for name, specs in configs.items():
        if not isinstance(specs, list) or not specs:
            raise AgentError(f"vGPU config {source}: config {shown(name)} needs at least one entry")
        parsed[str(name)] = tuple(_spec(spec, f"vGPU config {source}, {name}[{i}]") for i, spec in enumerate(specs))
    return parsed


def select_config(configs: dict[str, tuple[VgpuSpec, ...]], name: str, source: str) -> tuple[VgpuSpec, ...]:
    if name not in configs:
        raise AgentError(f"vGPU config {source} has no config named {name!r} (it has: {', '.join(sorted(configs))})")
    return configs[name]


def load_specs(path: Path, name: str) -> tuple[VgpuSpec, ...]:
    """The config ``name`` of the file at ``path`` (a regular file, at most :data:`MAX_CONFIG_BYTES`); errors
    name the file and the config."""
    text = read_regular_file(path, MAX_CONFIG_BYTES, "vGPU config").decode(errors="replace")
    return select_config(parse_config(text, str(path)), name, str(path))
