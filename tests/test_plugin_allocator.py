"""The server's Allocator (issue 12): what the scan knows is worked out once, what the host says is read every call.

A server answers Allocate through one :class:`~plugin.allocation.Allocator` for its life: the host root's
descriptor and each resource's plan are kept between requests. Nothing the host said may be kept: every change
the re-check exists for (a group node removed, a member added, a driver rebound, a companion on a host driver, a
device removed, the container gone, iommufd cdevs) must be refused, or answered, by the very Allocator that
answered before it, exactly as :func:`~plugin.allocation.allocate` (a fresh read of everything) answers.

Each runs with the kernel resolving (``openat2``) and with the Python resolver.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from plugin.allocation import Allocation, Allocator, allocate
from plugin.config import PluginConfig
from plugin.health import UsabilityRule
from plugin.inventory import Resource
from simkit.fixture_nodes import MIXED_NODE, NODE01, VGPU_NODE
from simkit.sysfs_fixture import Node
from tests.discovery_support import build_node, discover
from tests.plugin_support import Refusal, outcome, rebind

RTX = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
COMPANIONS_ENV = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
GPU_3B, GPU_5E, GPU_86, GPU_AF = "0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0"
GROUP = {GPU_3B: 30, GPU_5E: 50, GPU_86: 74, GPU_AF: 96}


@pytest.fixture
def allocator(tmp_path: Path, resolver: str) -> Iterator[Allocator]:
    root = build_node(NODE01, tmp_path)
    served = Allocator(root)
    try:
        yield served
    finally:
        served.close()


def both(allocator: Allocator, resource: Resource, ids: list[str]) -> Allocation | Refusal:
    """The server's answer, checked to be the one a fresh ``allocate`` gives."""
    served = outcome(lambda: allocator.allocate(resource, ids))
    assert served == outcome(lambda: allocate(resource, ids, allocator.root, allocator.rule))
    return served


def _move_to_group_200(root: Path) -> None:
    (root / "sys" / "kernel" / "iommu_groups" / "200" / "devices").mkdir(parents=True)
    link = (root / "sys" / "bus" / "pci" / "devices" / GPU_AF).resolve() / "iommu_group"
    link.unlink()
    link.symlink_to(os.path.relpath(root / "sys" / "kernel" / "iommu_groups" / "200", link.parent))


CHANGES: dict[str, tuple[list[str], Callable[[Path], None], str]] = {
    "group node removed": (
        [GPU_3B, GPU_86],
        lambda root: (root / "dev" / "vfio" / "74").unlink(),
        "/dev/vfio/74 is missing",
    ),
    "container removed": ([GPU_3B], lambda root: (root / "dev" / "vfio" / "vfio").unlink(), "/dev/vfio/vfio"),
    "member added": (
        [GPU_5E],
        lambda root: (root / "sys" / "kernel" / "iommu_groups" / "50" / "devices" / "0000:5e:00.4").symlink_to(
            "../../../../devices"
        ),
        "now also holds 0000:5e:00.4",
    ),
    "member removed": (
        [GPU_5E],
        lambda root: (root / "sys" / "kernel" / "iommu_groups" / "50" / "devices" / "0000:5e:00.2").unlink(),
        "no longer holds 0000:5e:00.2",
    ),
    "group changed": ([GPU_AF], _move_to_group_200, f"from {GROUP[GPU_AF]} to 200"),
    "gpu rebound": ([GPU_3B], lambda root: rebind(root, GPU_3B, "nvidia"), "bound to nvidia"),
    "gpu unbound": ([GPU_3B], lambda root: rebind(root, GPU_3B, None), "no driver"),
    "companion on a host driver": (
        [GPU_86],
        lambda root: rebind(root, "0000:86:00.1", "snd_hda_intel"),
        "0000:86:00.1 (10DE:10F9 audio) is bound to snd_hda_intel",
    ),
    "device removed": (
        [GPU_3B],
        lambda root: (root / "sys" / "bus" / "pci" / "devices" / GPU_3B).unlink(),
        "the device was removed?",
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_after_an_answer_is_refused_by_the_same_allocator(allocator: Allocator, change: str) -> None:
    ids, make, expected = CHANGES[change]
    root = Path(allocator.root)
    resource = discover(root).resource(RTX)
    assert isinstance(both(allocator, resource, ids), Allocation)
    make(root)
    refused = both(allocator, resource, ids)  # the same allocator, the same resource: only the host changed
    assert isinstance(refused, Refusal), change
    assert refused.kind == "DeviceUnavailable"
    assert expected in refused.message
    assert refused.device_id is None or refused.device_id in ids


def test_a_companion_rebound_between_calls_changes_the_companion_variable(allocator: Allocator) -> None:
    root = Path(allocator.root)
    resource = discover(root).resource(RTX)
    values = []
    for driver in ("vfio-pci", None, "pci-stub", "vfio-pci"):  # no driver / an allowed host driver: left out
        rebind(root, "0000:86:00.2", driver)
        result = both(allocator, resource, [GPU_86, GPU_3B])
        assert isinstance(result, Allocation)
        values.append(result.envs[COMPANIONS_ENV])
    full = "0000:86:00.0=0000:86:00.1+0000:86:00.2+0000:86:00.3,0000:3b:00.0=0000:3b:00.1+0000:3b:00.2+0000:3b:00.3"
    without = full.replace("+0000:86:00.2", "")
    assert values == [full, without, without, full]


def test_iommufd_nodes_appearing_later_are_given(tmp_path: Path, resolver: str) -> None:
    root = build_node(dataclasses.replace(NODE01, iommufd=True), tmp_path)
    resource = discover(root).resource(RTX)
    iommu = root / "dev" / "iommu"
    iommu.rename(root / "dev" / "iommu.away")
    with Allocator(root) as served:
        before = both(served, resource, [GPU_86])
        iommu.with_name("iommu.away").rename(iommu)
        after = both(served, resource, [GPU_86])
    assert isinstance(before, Allocation) and isinstance(after, Allocation)
    paths = [[spec.host_path for spec in answer.device_specs] for answer in (before, after)]
    assert "/dev/iommu" not in paths[0]
    assert "/dev/iommu" in paths[1] and any(path.startswith("/dev/vfio/devices/vfio") for path in paths[1])


@pytest.mark.parametrize("node", [NODE01, MIXED_NODE, VGPU_NODE], ids=lambda node: node.name)
def test_every_request_answers_as_a_fresh_allocate(tmp_path: Path, node: Node, resolver: str) -> None:
    """Each device alone and all of a resource's devices together, healthy or not, unknown IDs and repeats."""
    root = build_node(node, tmp_path)
    config = PluginConfig(host_root=str(root))
    rule = UsabilityRule.from_config(config)
    with Allocator(root, rule) as served:
        for resource in discover(root).resources:
            ids = [device.id for device in resource.devices]
            for request in [*([device_id] for device_id in ids), ids, [*ids, ids[0]], ["nope"], []]:
                both(served, resource, request)


def test_a_new_scan_s_resource_is_planned_anew(tmp_path: Path, resolver: str) -> None:
    root = build_node(NODE01, tmp_path)
    with Allocator(root) as served:
        first = discover(root).resource(RTX)
        assert isinstance(both(served, first, [GPU_3B]), Allocation)
        rebind(root, "0000:3b:00.1", "snd_hda_intel")
        rescanned = discover(root).resource(RTX)  # the scan now calls it unhealthy: refused before any read
        refused = both(served, rescanned, [GPU_3B])
        assert isinstance(refused, Refusal) and "is unhealthy" in refused.message


def test_closing_the_allocator_keeps_it_answering_and_leaks_no_descriptor(tmp_path: Path, resolver: str) -> None:
    root = build_node(NODE01, tmp_path)
    resource = discover(root).resource(RTX)
    descriptors = len(os.listdir("/proc/self/fd"))
    served = Allocator(root)
    for _ in range(20):
        both(served, resource, [GPU_3B, GPU_86])
    served.close()
    assert isinstance(both(served, resource, [GPU_86]), Allocation)  # a request after stop still reads the host
    assert len(os.listdir("/proc/self/fd")) == descriptors
