"""The agent's per-GPU workload file: which GPUs keep their host driver for containers and which go to VMs.

::

    version: v1
    gpus:
      - address: "0000:3b:00.0"     # one GPU, by PCI address ...
        workload: container
      - device: "10de:2236"         # ... or every GPU with these IDs (VENDOR:DEVICE, hex)
        workload: vm-passthrough

A GPU no entry names takes the node's workload (the ``nvidia.com/gpu.workload.config`` label, or
``--workload``); an address wins over a selector (docs/node-agent.md, "Per-GPU workloads"). Unknown fields, a
second entry for the same address or selector, and a workload that is none of ``container``,
``vm-passthrough``, ``vm-vgpu`` are errors naming the file and the entry; so is (when planning) an address
that is no GPU of the node. Parsing is pure; :func:`load_workload_config` reads the file, bounded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from node_agent.bind import parse_selector
from node_agent.kernel import AgentError
from node_agent.vgpu_config import shown
from node_agent.workload import WORKLOADS, GpuOverride
from runtime.files import read_regular_file
from schemas.errors import InputError
from schemas.pci import PciAddress

MAX_CONFIG_BYTES = 1024 * 1024
MAX_ENTRIES = 4096
"""More entries than GPUs on any node (a bound, not a limit anyone meets)."""


def _entry(raw: Any, where: str) -> GpuOverride:
    if not isinstance(raw, dict):
        raise AgentError(f"{where}: expected a mapping with address or device, and workload; got {shown(raw)}")
    unknown = sorted(str(key) for key in raw if key not in ("address", "device", "workload"))
    if unknown:
        raise AgentError(f"{where}: unexpected field {unknown[0]!r} (known: address, device, workload)")
    if "workload" not in raw:
        raise AgentError(f"{where}: missing required field 'workload'")
    workload = raw["workload"]
    if not isinstance(workload, str) or workload not in WORKLOADS:
        raise AgentError(f"{where}: workload {shown(workload)} is none of {', '.join(WORKLOADS)}")
    if ("address" in raw) == ("device" in raw):
        raise AgentError(f"{where}: name the GPU by 'address' or by 'device', exactly one of them")
    if "address" in raw:
        address = raw["address"]
        if not isinstance(address, str):
            raise AgentError(f"{where}: address {shown(address)} is not a PCI address such as 0000:3b:00.0")
        try:
            parsed = str(PciAddress.parse(address.strip().lower()))
        except InputError as exc:
            raise AgentError(f"{where}: {exc}") from None
        return GpuOverride(workload, address=parsed, source=f"{where} (address {parsed})")
    device = raw["device"]
    if not isinstance(device, str):
        raise AgentError(f"{where}: device {shown(device)} is not VENDOR:DEVICE in hex, e.g. 10de:2236")
    try:
        selector = parse_selector(device.strip())
    except AgentError as exc:
        raise AgentError(f"{where}: {exc}") from None
    return GpuOverride(workload, device=selector, source=f"{where} (device {device.strip().lower()})")


def parse_workload_config(text: str, source: str) -> tuple[GpuOverride, ...]:
    """The overrides of the workload file ``source`` (named in every error), in file order."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AgentError(f"workload config {source} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise AgentError(f"workload config {source}: expected a mapping with version and gpus")
    unknown = sorted(str(key) for key in data if key not in ("version", "gpus"))
    if unknown:
        raise AgentError(f"workload config {source}: unexpected field {unknown[0]!r} (known: version, gpus)")
    if data.get("version") != "v1":
        found = "missing 'version'" if "version" not in data else f"unknown version {shown(data['version'])}"
        raise AgentError(f"workload config {source}: {found} (this agent reads v1)")
    entries = data.get("gpus", [])
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise AgentError(f"workload config {source}: gpus must be a list of entries, not {shown(entries)}")
    if len(entries) > MAX_ENTRIES:
        raise AgentError(f"workload config {source}: {len(entries)} gpus entries, more than {MAX_ENTRIES}")
    overrides: list[GpuOverride] = []
    seen: dict[object, str] = {}
    for index, raw in enumerate(entries):
        where = f"workload config {source}, gpus[{index}]"
        override = _entry(raw, where)
        key: object = override.address if override.address is not None else override.device
        if key in seen:
            raise AgentError(f"{where}: names the same GPU(s) as {seen[key]}; one entry each")
        seen[key] = f"gpus[{index}]"
        overrides.append(override)
    return tuple(overrides)


def load_workload_config(path: Path) -> tuple[GpuOverride, ...]:
    """:func:`parse_workload_config` of the regular file ``path`` (at most :data:`MAX_CONFIG_BYTES`)."""
    try:
        data = read_regular_file(path, MAX_CONFIG_BYTES, "workload config")
    except InputError as exc:
        raise AgentError(str(exc)) from None
    return parse_workload_config(data.decode(errors="replace"), str(path))
