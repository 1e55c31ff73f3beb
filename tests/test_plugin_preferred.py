"""Preferred allocation: examples on the fixture nodes and properties over generated topologies."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.inventory import Device
from plugin.preferred import PreferenceError, preferred_allocation
from schemas.naming import ResourceKind
from simkit.fixture_nodes import MIXED_NODE, NODE01, WORKSTATION_NODE
from tests.discovery_support import build_node, discover

RTX = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
# node01: two cards per socket, each under its own root complex.
N0 = ["0000:3b:00.0", "0000:5e:00.0"]
N1 = ["0000:86:00.0", "0000:af:00.0"]


def gpu(device_id: str, numa: int | None, root: str | None, healthy: bool = True) -> Device:
    return Device(
        id=device_id,
        kind=ResourceKind.PCI,
        vendor_device="10DE:2236",
        iommu_group=None,
        numa_node=numa,
        healthy=healthy,
        reason=None if healthy else "test",
        pcie_root=root,
    )


@pytest.fixture(scope="module")
def node01(tmp_path_factory: pytest.TempPathFactory) -> tuple[Device, ...]:
    root = build_node(NODE01, Path(tmp_path_factory.mktemp("pref")))
    return discover(root).resource(RTX).devices


def test_node01_topology_is_what_the_examples_assume(node01: tuple[Device, ...]) -> None:
    assert {d.id: d.numa_node for d in node01} == {N0[0]: 0, N0[1]: 0, N1[0]: 1, N1[1]: 1}
    assert len({d.pcie_root for d in node01}) == 4


def test_two_gpus_come_from_one_numa_node(node01: tuple[Device, ...]) -> None:
    everything = N0 + N1
    assert preferred_allocation(node01, everything, [], 2) == N0
    assert preferred_allocation(node01, [N0[0], *N1], [], 2) == N1  # NUMA 0 has only one left
    assert preferred_allocation(node01, everything, [], 1) == [N0[0]]


def test_must_include_comes_first_and_anchors_the_numa_node(node01: tuple[Device, ...]) -> None:
    assert preferred_allocation(node01, N0 + N1, [N1[1]], 2) == [N1[1], N1[0]]
    assert preferred_allocation(node01, N0 + N1, [N1[1], N0[1]], 3) == [N0[1], N1[1], N0[0]]
    # Must-include IDs the kubelet left out of ``available`` still count.
    assert preferred_allocation(node01, N0, [N1[0]], 2) == [N1[0], N0[0]]


def test_more_than_a_node_holds_takes_a_whole_node_then_part_of_another(node01: tuple[Device, ...]) -> None:
    result = preferred_allocation(node01, N0 + N1, [], 3)
    assert len(result) == 3
    assert set(N0) <= set(result)
    assert preferred_allocation(node01, N0 + N1, [], 4) == sorted(N0 + N1)


def test_one_pcie_root_is_preferred_within_a_node() -> None:
    devices = [
        gpu("0000:01:00.0", 0, "pci0000:00"),
        gpu("0000:41:00.0", 0, "pci0000:40"),
        gpu("0000:42:00.0", 0, "pci0000:40"),
        gpu("0000:81:00.0", 1, "pci0000:80"),
        gpu("0000:82:00.0", 1, "pci0000:80"),
        gpu("0000:83:00.0", 1, "pci0000:80"),
    ]
    ids = [d.id for d in devices]
    # Both nodes hold three; both have a root holding two; equal fits go to the lower node: 0000:41 and 0000:42.
    assert preferred_allocation(devices, ids, [], 2) == ["0000:41:00.0", "0000:42:00.0"]
    # Three under one root exist only on NUMA 1.
    assert preferred_allocation(devices, ids, [], 3) == ["0000:81:00.0", "0000:82:00.0", "0000:83:00.0"]
    # The must-include's root wins over a better fit.
    assert preferred_allocation(devices, ids, ["0000:83:00.0"], 2) == ["0000:83:00.0", "0000:81:00.0"]


def test_best_fit_keeps_the_larger_node_whole() -> None:
    devices = [gpu(f"0000:{bus:02x}:00.0", 0, f"pci0000:{bus:02x}") for bus in (1, 2, 3, 4)]
    devices += [gpu(f"0000:{bus:02x}:00.0", 1, f"pci0000:{bus:02x}") for bus in (0x81, 0x82)]
    ids = [d.id for d in devices]
    assert preferred_allocation(devices, ids, [], 2) == ["0000:81:00.0", "0000:82:00.0"]
    assert preferred_allocation(devices, ids, [], 4) == ids[:4]


def test_healthy_devices_first_then_unhealthy_and_never_unknown_ids() -> None:
    devices = [gpu("a", 0, "r0"), gpu("b", 0, "r0", healthy=False), gpu("c", 1, "r1")]
    assert preferred_allocation(devices, ["zz", "b", "c", "a"], [], 2) == ["a", "c"]
    assert preferred_allocation(devices, ["zz", "b", "c", "a"], [], 3) == ["a", "b", "c"]
    # issue 11 / 13: an ID the resource does not serve is never handed back, and a must-include one is refused
    unknown = r"more than the 3 available device IDs \(not devices of this resource: 'zz'\)"
    with pytest.raises(PreferenceError, match=unknown):
        preferred_allocation(devices, ["zz", "b", "c", "a"], [], 4)
    with pytest.raises(PreferenceError, match="must-include device ID 'zz' is not a device of this resource"):
        preferred_allocation(devices, ["zz", "yy"], ["zz"], 2)


def test_unknown_numa_comes_after_known_nodes(tmp_path: Path) -> None:
    root = build_node(MIXED_NODE, tmp_path)
    a10 = discover(root).resource("nvidia.com/GA102GL_A10").devices
    unknown = gpu("0000:5e:00.0", None, "pci0000:5d")
    devices = (*a10, unknown)
    ids = [d.id for d in devices]
    assert preferred_allocation(devices, ids, [], 1) == ["0000:3b:00.0"]
    assert preferred_allocation([unknown], [unknown.id], [], 1) == [unknown.id]


def test_duplicates_count_once() -> None:
    devices = [gpu("a", 0, "r0"), gpu("b", 0, "r0")]
    assert preferred_allocation(devices, ["a", "a", "b"], ["a", "a"], 2) == ["a", "b"]
    with pytest.raises(PreferenceError, match="more than the 2"):
        preferred_allocation(devices, ["a", "a", "b"], [], 3)


@pytest.mark.parametrize(
    ("available", "must", "size", "match"),
    [
        (["a", "b"], [], 3, "more than the 2 available"),
        (["a", "b"], ["a", "b"], 1, "2 must-include"),
        (["a"], [], -1, "negative"),
    ],
)
def test_impossible_requests_are_clear_errors(available: list[str], must: list[str], size: int, match: str) -> None:
    with pytest.raises(PreferenceError, match=match):
        preferred_allocation([gpu("a", 0, "r0"), gpu("b", 0, "r0")], available, must, size)
    assert issubclass(PreferenceError, ValueError)


def test_size_zero_is_empty() -> None:
    assert preferred_allocation([gpu("a", 0, "r0")], ["a"], [], 0) == []


# -- properties ------------------------------------------------------------------------------------------------

ROOTS = {"pci0000:00": 0, "pci0000:40": 0, "pci0000:80": 1, "pci0000:c0": 1, "pci0000:e0": None}
"""Each root complex belongs to one NUMA node (or to none known), as on real machines."""


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[Device], list[str], list[str], int]:
    count = draw(st.integers(min_value=1, max_value=12))
    devices = []
    for index in range(count):
        root = draw(st.sampled_from(sorted(ROOTS)))
        healthy = draw(st.booleans() | st.just(True))
        devices.append(gpu(f"0000:{index + 1:02x}:00.0", ROOTS[root], root, healthy))
    ids = [device.id for device in devices]
    available = draw(st.lists(st.sampled_from([*ids, "ghost-1", "ghost-2"]), unique=True))
    served = [device_id for device_id in available if device_id in ids]  # ghosts: IDs the resource lacks
    must = draw(st.lists(st.sampled_from(served), unique=True)) if served else []
    size = draw(st.integers(min_value=len(must), max_value=len(served)))
    return devices, available, must, size


@settings(max_examples=300, deadline=None)
@given(requests(), st.randoms(use_true_random=False))
def test_properties(request: tuple[list[Device], list[str], list[str], int], rng: random.Random) -> None:
    devices, available, must, size = request
    result = preferred_allocation(devices, available, must, size)
    assert len(result) == size
    assert len(set(result)) == size
    assert set(must) <= set(result)
    assert result[: len(must)] == sorted(must)
    assert set(result) <= set(available)
    assert set(result) <= {device.id for device in devices}  # never an ID the resource does not serve
    # Deterministic: the same answer for the same sets, whatever their order.
    shuffled_available, shuffled_must, shuffled_devices = list(available), list(must), list(devices)
    rng.shuffle(shuffled_available)
    rng.shuffle(shuffled_must)
    rng.shuffle(shuffled_devices)
    assert preferred_allocation(shuffled_devices, shuffled_available, shuffled_must, size) == result

    known = {device.id: device for device in devices}
    candidates = [known[i] for i in available if i in known and known[i].healthy and i not in must]
    picked = [known[i] for i in result[len(must) :] if i in known]
    need = size - len(must)
    # Healthy known devices are used before anything else.
    if len(candidates) >= need:
        assert all(device.healthy for device in picked)
        assert len(picked) == need
    # One NUMA node (and, when possible, one root) when one can hold all the picks.
    by_node: dict[int, int] = {}
    by_root: dict[str, int] = {}
    for device in candidates:
        if device.numa_node is not None:
            by_node[device.numa_node] = by_node.get(device.numa_node, 0) + 1
        by_root[device.pcie_root or ""] = by_root.get(device.pcie_root or "", 0) + 1
    if need and any(n >= need for n in by_node.values()):
        assert len({device.numa_node for device in picked}) == 1
        assert picked[0].numa_node is not None
    if need and not must and any(n >= need for root, n in by_root.items() if root and ROOTS[root] is not None):
        assert len({device.pcie_root for device in picked}) == 1


def _below(device_id: str, *path: str) -> Device:
    return replace(gpu(device_id, 0, "pci0000:00"), pcie_path=path)


def test_within_a_root_gpus_below_one_switch_come_first() -> None:
    """docs/p2p.md: the hook gives GPUs below one PCIe switch a GPUDirect clique, so the plugin offers them."""
    switch = ("0000:00:01.0", "0000:01:00.0")
    alone = _below("0000:00:03.0", "0000:00:03.0")  # (its ID sorts first: a choice by ID would take it)
    pair = [_below("0000:05:00.0", *switch, "0000:02:08.0"), _below("0000:06:00.0", *switch, "0000:02:10.0")]
    other = [_below("0000:0a:00.0", "0000:00:04.0", "0000:09:00.0", "0000:0b:08.0")]  # a switch of one GPU
    devices = [alone.id, *(d.id for d in pair), other[0].id]
    known = [alone, *pair, *other]
    assert preferred_allocation(known, devices, [], 2) == ["0000:05:00.0", "0000:06:00.0"]
    assert preferred_allocation(known, devices, ["0000:06:00.0"], 2) == ["0000:06:00.0", "0000:05:00.0"]
    assert preferred_allocation(known, devices, [], 3) == ["0000:00:03.0", "0000:05:00.0", "0000:06:00.0"]
    assert preferred_allocation(known, [alone.id, other[0].id], [], 2) == [alone.id, other[0].id]


def test_the_workstations_pair_is_found_below_its_switch(tmp_path: Path) -> None:
    devices = discover(build_node(WORKSTATION_NODE, tmp_path)).resources[0].devices
    assert {d.id: d.pcie_path for d in devices}["0000:03:00.0"] == ("0000:00:01.0", "0000:01:00.0", "0000:02:08.0")
    ids = [d.id for d in devices]
    assert preferred_allocation(devices, ids, ["0000:04:00.0"], 2) == ["0000:04:00.0", "0000:03:00.0"]
    assert preferred_allocation(devices, ids, ["0000:05:00.0"], 2) == ["0000:05:00.0", "0000:03:00.0"]


def test_when_no_switch_holds_them_all_whole_switches_go_first() -> None:
    """Three of 03 (switch S), 04, 05 (alone) and 06 (switch S): the pair below S, then one more by ID; a vGPU's
    path ends with its parent GPU, which is no switch port."""
    switch = ("0000:00:01.0", "0000:01:00.0")
    known = [
        _below("0000:03:00.0", *switch, "0000:02:08.0"),
        _below("0000:04:00.0", "0000:00:02.0"),
        _below("0000:05:00.0", "0000:00:03.0"),
        _below("0000:06:00.0", *switch, "0000:02:10.0"),
    ]
    ids = [device.id for device in known]
    assert preferred_allocation(known, ids, [], 3) == ["0000:03:00.0", "0000:04:00.0", "0000:06:00.0"]
    # vGPUs on GPUs X and Z behind one lone bridge, and on Y elsewhere: no switch (by ID), though their paths,
    # read with the parent GPU as a bridge, would look like one
    parents = {1: ("0000:00:01.0", "0000:10:00.0", "0000:11:00.0"), 2: ("0000:00:02.0", "0000:20:00.0", "0000:21:00.0")}
    parents[3] = ("0000:00:01.0", "0000:10:00.0", "0000:12:00.0")
    vgpus = [
        replace(_below(f"uuid-{i}", *parents[i]), kind=ResourceKind.MDEV, mdev_type="nvidia-1") for i in range(1, 4)
    ]
    assert preferred_allocation(vgpus, [d.id for d in vgpus], [], 2) == ["uuid-1", "uuid-2"]
