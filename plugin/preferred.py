"""Which devices to hand a container when the kubelet asks (``GetPreferredAllocation``): topology policy.

A VM with several GPUs runs best when they share a NUMA node (with its vCPUs and memory) and, better still,
a PCIe root complex (peer-to-peer traffic stays below one root). The kubelet asks the plugin to choose
``size`` of the ``available`` IDs, ``must_include`` first; it treats the answer as a hint and takes the rest
itself, so the answer must be exactly ``size`` IDs out of what it offered.

The choice, for the IDs left after ``must_include``:

1. healthy devices before unhealthy ones (those come only when nothing else is left); only IDs this resource
   serves: the kubelet sends only IDs it got from ``ListAndWatch`` and intersects the answer with what it
   offered (``pkg/kubelet/cm/devicemanager``, ``devicesToAllocate``), so an unknown ``must_include`` ID is
   refused (the kubelet's choice cannot be honoured) and an unknown offered ID is never chosen (a rescan
   may have just removed it; the kubelet learns that from the next ``ListAndWatch`` message);
2. all on one NUMA node when one can hold them: the must-include devices' node first, then a node where one
   PCIe root can hold them all, then the node with the fewest candidates (best fit, which keeps large nodes
   whole for large VMs), then the lower node number; devices with unknown NUMA node only after known nodes;
3. within that node, under one PCIe root when one can hold them (same order of preference); otherwise whole
   roots, largest first; within the root, below one PCIe switch when one can hold them (the must-include
   devices' switch first, then best fit): GPUs below one switch get a GPUDirect P2P clique in the VM
   (docs/p2p.md);
4. when no node can hold them, whole nodes, must-include's and then the largest first, the last one partly.

The result is the must-include IDs then the chosen ones, each part sorted by ID: the same answer for the
same sets whatever order they came in. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

from plugin.inventory import Device

K = TypeVar("K", bound=Hashable)
_NONE: set[str] = set()
"""No anchors (never changed)."""


class PreferenceError(ValueError):
    """The request cannot be answered (size out of range, more must-include IDs than the size)."""


def _unique(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def _groups(devices: Iterable[Device], key: Callable[[Device], K]) -> dict[K, list[Device]]:
    grouped: dict[K, list[Device]] = {}
    for device in devices:
        grouped.setdefault(key(device), []).append(device)
    return grouped


def _root_of(device: Device) -> str:
    return device.pcie_root or ""


def _switch_of(device: Device) -> str:
    return device.pcie_switch or ""


def _best_switch_fit(members: list[Device], count: int, anchors: set[str]) -> list[Device]:
    """``count`` of one root's ``members``: below one PCIe switch when one holds that many (anchored, then best
    fit, then name), else whole switches (anchored, then largest first; a switch of one GPU is none) and then
    the rest, each by ID."""
    by_id = sorted(members, key=lambda device: device.id)
    switches = _groups(by_id, _switch_of)
    fitting = [switch for switch, below in switches.items() if switch and len(below) >= count]
    if fitting:
        switch = min(fitting, key=lambda name: (name not in anchors, len(switches[name]), name))
        return switches[switch][:count]
    shared = [switch for switch, below in switches.items() if switch and len(below) > 1]
    shared.sort(key=lambda name: (name not in anchors, -len(switches[name]), name))
    chosen = [device for switch in shared for device in switches[switch]][:count]
    taken = {device.id for device in chosen}
    return chosen + [device for device in by_id if device.id not in taken][: count - len(chosen)]


def _best_root_fit(
    devices: list[Device], count: int, anchors: set[str], switch_anchors: set[str] = _NONE
) -> list[Device] | None:
    """``count`` devices under one PCIe root, if one root has that many (anchored, then best fit, then name),
    below one switch of it when one has that many (:func:`_best_switch_fit`)."""
    roots = _groups(devices, _root_of)
    fitting = [root for root, members in roots.items() if root and len(members) >= count]
    if not fitting:
        return None
    root = min(fitting, key=lambda name: (name not in anchors, len(roots[name]), name))
    return _best_switch_fit(roots[root], count, switch_anchors)


def _fill_by_roots(
    devices: list[Device], count: int, anchors: set[str], switch_anchors: set[str] = _NONE
) -> list[Device]:
    """``count`` of ``devices``, under one root if possible, else whole roots (anchored, largest first)."""
    if count >= len(devices):
        return list(devices)
    single = _best_root_fit(devices, count, anchors, switch_anchors)
    if single is not None:
        return single
    roots = _groups(devices, _root_of)
    order = sorted(roots, key=lambda name: (name not in anchors, name == "", -len(roots[name]), name))
    chosen: list[Device] = []
    for root in order:
        members = sorted(roots[root], key=lambda device: device.id)
        chosen.extend(members[: count - len(chosen)])
        if len(chosen) == count:
            break
    return chosen


def _choose(
    candidates: list[Device],
    count: int,
    numa_anchors: set[int],
    root_anchors: set[str],
    switch_anchors: set[str] = _NONE,
) -> list[Device]:
    """``count`` of the healthy known ``candidates`` (``count`` ≤ their number), topology first."""
    if count <= 0:
        return []
    nodes = _groups(candidates, lambda device: device.numa_node)

    def node_order(node: int | None) -> tuple[bool, bool, bool, int, int]:
        members = nodes[node]
        return (
            node is None,
            node not in numa_anchors,
            _best_root_fit(members, count, root_anchors) is None,
            len(members),
            -1 if node is None else node,
        )

    fitting = [node for node, members in nodes.items() if len(members) >= count]
    if fitting:
        node = min(fitting, key=node_order)
        return _fill_by_roots(nodes[node], count, root_anchors, switch_anchors)
    spill = sorted(
        nodes,
        key=lambda node: (node is None, node not in numa_anchors, -len(nodes[node]), -1 if node is None else node),
    )
    chosen: list[Device] = []
    for node in spill:
        chosen.extend(_fill_by_roots(nodes[node], count - len(chosen), root_anchors))
        if len(chosen) == count:
            break
    return chosen


def preferred_allocation(
    devices: Sequence[Device], available: Sequence[str], must_include: Sequence[str], size: int
) -> list[str]:
    """Exactly ``size`` IDs of ``available`` and ``must_include``: must-include first, then by topology (see module).

    ``devices`` are the resource's devices as the plugin knows them (health, NUMA node, PCIe root).
    Repeated IDs count once; the answer holds only IDs of ``devices``. Raises :class:`PreferenceError` when
    ``size`` is negative, smaller than the must-include IDs, larger than the known IDs offered, or when a
    must-include ID is not one of ``devices`` (the message names it).
    """
    known = {device.id: device for device in devices}
    must = sorted(_unique(must_include))
    if size < 0:
        raise PreferenceError(f"allocation size {size} is negative")
    for device_id in must:
        if device_id not in known:
            raise PreferenceError(f"must-include device ID {device_id[:63]!r} is not a device of this resource")
    if len(must) > size:
        raise PreferenceError(f"{len(must)} must-include device IDs do not fit an allocation of {size}")
    unknown_offered = [device_id for device_id in _unique(available) if device_id not in known]
    offered = _unique([*(device_id for device_id in available if device_id in known), *must])
    if len(offered) < size:
        ignored = f" (not devices of this resource: {', '.join(repr(i[:63]) for i in unknown_offered[:4])})"
        raise PreferenceError(
            f"allocation size {size} is more than the {len(offered)} available device IDs"
            + (ignored if unknown_offered else "")
        )
    must_set = set(must)
    rest = sorted(device_id for device_id in offered if device_id not in must_set)
    healthy = [known[device_id] for device_id in rest if known[device_id].healthy]
    count = size - len(must)
    anchors = [known[device_id] for device_id in must]
    numa_anchors = {device.numa_node for device in anchors if device.numa_node is not None}
    root_anchors = {device.pcie_root for device in anchors if device.pcie_root}
    switch_anchors = {switch for device in anchors if (switch := _switch_of(device))}
    picked = _choose(healthy, min(count, len(healthy)), numa_anchors, root_anchors, switch_anchors)
    chosen = [device.id for device in picked]
    if len(chosen) < count:
        unhealthy = [device_id for device_id in rest if not known[device_id].healthy]
        chosen.extend(unhealthy[: count - len(chosen)])
    return must + sorted(chosen)
