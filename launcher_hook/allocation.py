"""What the device plugin allocated to this pod, read from its env.

The kubelet puts the plugin's ``PCI_RESOURCE_<NAME>`` / ``MDEV_PCI_RESOURCE_<NAME>`` variables into the
``compute`` container. This module turns an env mapping (the process env, a copy of ``/proc/<pid>/environ``
or anything else) into validated address pools, refusing a malformed value with the variable's name. The
plugin's ``PCI_COMPANIONS_<NAME>`` variables (each GPU's companion functions, :mod:`schemas.companions`) and
``PCI_NVSWITCHES_<NAME>`` variables (a whole HGX board's NVSwitches, :mod:`schemas.fabric`) are read with them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from schemas import DeviceId, InputError, PciAddress, ResourceKind
from schemas.companions import COMPANIONS_ENV_PREFIX, parse_companions
from schemas.fabric import SWITCHES_ENV_PREFIX, gpu_variable_for, parse_switches, switches_variable_for
from schemas.kinds import ENV_PREFIXES, env_name_part, kind_of_variable

USB_ENV_PREFIX = "USB_RESOURCE"
"""KubeVirt's prefix for USB host devices (``USB_RESOURCE_<NAME>=<bus>:<device>``): virt-launcher renders those
itself as ``<hostdev type='usb'>``; the hook only notes them."""


@dataclass(frozen=True)
class Pool:
    """One allocation variable: its name, kind and device IDs in Allocate order."""

    variable: str
    kind: ResourceKind
    ids: tuple[DeviceId, ...]


@dataclass(frozen=True)
class EnvAllocation:
    """The allocation the hook reads from a pod env: every allocation variable found, keyed by variable name."""

    pools: Mapping[str, Pool] = field(default_factory=dict)
    usb_variables: frozenset[str] = frozenset()
    """The ``USB_RESOURCE_*`` names in the env (their values are virt-launcher's business, not parsed here)."""
    companions: Mapping[str, Mapping[PciAddress, tuple[PciAddress, ...]]] = field(default_factory=dict)
    """Each ``PCI_COMPANIONS_*`` variable, parsed: GPU → its companion functions."""
    switches: Mapping[str, tuple[PciAddress, ...]] = field(default_factory=dict)
    """Each ``PCI_NVSWITCHES_*`` variable, parsed, by its GPUs' ``PCI_RESOURCE_*`` variable: the NVSwitches that
    came with the whole board (:mod:`schemas.fabric`)."""

    def pool(self, variable: str) -> Pool | None:
        return self.pools.get(variable)

    @functools.cached_property
    def derived(self) -> dict[object, Any]:
        """Views of this allocation its users compute once and keep here (the matcher's per-resource pools);
        the allocation itself never changes, and the last one read is kept for the process's calls."""
        return {}


def usb_env_var_for(resource_name: str) -> str:
    """The ``USB_RESOURCE_<NAME>`` variable virt-launcher reads for a USB resource (same name rules as PCI)."""
    return f"{USB_ENV_PREFIX}_{env_name_part(resource_name)}"


def is_allocation_variable(name: str) -> bool:
    """True for ``PCI_RESOURCE_*`` and ``MDEV_PCI_RESOURCE_*`` names."""
    return name.startswith(ENV_PREFIXES)


def parse_pool(variable: str, value: str) -> Pool:
    """Parse one variable's value as KubeVirt does (one trailing comma dropped, split on ``,``), strictly."""
    kind = kind_of_variable(variable)
    if kind is None:
        raise InputError(f"{variable} is not an allocation variable ({', '.join(ENV_PREFIXES)}…)")
    text = value.removesuffix(",")
    if text:
        fast = kind.parse_id_list(text)
        if fast is not None and len(set(fast)) == len(fast):
            return Pool(variable, kind.key, tuple(fast))
    items = text.split(",") if text else []
    ids: list[DeviceId] = []
    seen: set[DeviceId] = set()
    for position, item in enumerate(items, start=1):
        if not item:
            raise InputError(f"{variable}={value!r}: entry {position} is empty")
        try:
            device_id = kind.parse_id(item)
        except InputError as exc:
            raise InputError(f"{variable}: {exc}") from None
        if device_id in seen:
            raise InputError(f"{variable}: {item!r} is listed twice")
        seen.add(device_id)
        ids.append(device_id)
    return Pool(variable, kind.key, tuple(ids))


def allocation_from_env(env: Mapping[str, str]) -> EnvAllocation:
    """Collect and validate every allocation variable in ``env``; other variables are ignored.

    The last allocation read is kept with the variables it was read from: the hook's env (or environ file) is
    the same on every call for the pod's life, so a call whose variables are the same as the last one's takes
    that result instead of parsing the IDs again. An env that fails is not kept: every call with it fails with
    the same message.
    """
    relevant = tuple(sorted(allocation_variables(env).items()))
    last = _last
    if last is not None and last[0] == relevant:
        return last[1]
    allocation = _read_allocation(relevant)
    globals()["_last"] = (relevant, allocation)  # one tuple replaced at once: safe from any thread
    return allocation


def allocation_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that :func:`allocation_from_env` reads (allocation, ``PCI_COMPANIONS_*``,
    ``PCI_NVSWITCHES_*`` and ``USB_RESOURCE_*``)."""
    return {name: env[name] for name in env if name.startswith(_PREFIXES)}


def _read_allocation(relevant: tuple[tuple[str, str], ...]) -> EnvAllocation:
    pools: dict[str, Pool] = {}
    usb: list[str] = []
    companions: dict[str, Mapping[PciAddress, tuple[PciAddress, ...]]] = {}
    switches: dict[str, tuple[PciAddress, ...]] = {}
    for name, value in relevant:
        if name.startswith(_USB):
            usb.append(name)
        elif name.startswith(_COMPANIONS):
            companions[name] = MappingProxyType(parse_companions(name, value))
        elif name.startswith(_SWITCHES):
            gpus = gpu_variable_for(name)
            if gpus is None:
                raise InputError(f"{name} names no resource")
            switches[gpus] = parse_switches(name, value)
        else:
            pools[name] = parse_pool(name, value)
    for gpus in switches:
        if gpus not in pools:
            raise InputError(f"{switches_variable_for(gpus)} is set but {gpus} is not: NVSwitches come only with GPUs")
    return EnvAllocation(
        MappingProxyType(pools), frozenset(usb), MappingProxyType(companions), MappingProxyType(switches)
    )


_last: tuple[tuple[tuple[str, str], ...], EnvAllocation] | None = None


_USB = f"{USB_ENV_PREFIX}_"
_COMPANIONS = f"{COMPANIONS_ENV_PREFIX}_"
_SWITCHES = f"{SWITCHES_ENV_PREFIX}_"
_PREFIXES = (*ENV_PREFIXES, _USB, _COMPANIONS, _SWITCHES)


def parse_environ(data: bytes) -> dict[str, str]:
    """Read ``/proc/<pid>/environ`` (NUL-separated) or ``KEY=VALUE`` lines (``#`` comments, blank lines).

    A NUL anywhere means the environ format. Values are taken verbatim; a line without ``=`` is an error.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"environ file is not valid UTF-8: byte {exc.start}") from None
    nul_separated = "\0" in text
    entries = text.split("\0") if nul_separated else text.splitlines()
    env: dict[str, str] = {}
    for number, entry in enumerate(entries, start=1):
        line = entry if nul_separated else entry.strip()
        if not line or (not nul_separated and line.startswith("#")):
            continue
        key, equals, value = line.partition("=")
        if not equals or not key:
            where = f"entry {number}" if nul_separated else f"line {number}"
            raise InputError(f"environ file {where} is not KEY=VALUE: {line[:80]!r}")
        env[key] = value
    return env
