"""plugin.dra.slices: the node's devices as resource.k8s.io/v1 ResourceSlices, valid for Kubernetes 1.34+.

The objects are checked against Kubernetes' own OpenAPI schema (kubernetes-validate, strict: an unknown field
is an error), and against the limits of k8s.io/api/resource/v1 that a schema does not carry (128 devices per
slice, 64-character string values, device names as DNS labels, unique within the pool).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from plugin.dra.slices import (
    MAX_DEVICES_PER_SLICE,
    MAX_STRING_VALUE,
    build_slices,
    check_node_name,
    device_attributes,
    slice_devices,
)
from plugin.inventory import Device, Inventory, Resource
from schemas.dra import DRIVER_NAME, device_id_of
from schemas.errors import InputError
from schemas.kinds import ResourceKind
from simkit.fixture_nodes import MIXED_NODE, NODE01, SRIOV_VGPU_NODE, T4_2Q, VGPU_NODE, WORKSTATION_NODE
from tests.dra_cluster_support import (
    DRA_OLDEST_KUBERNETES,
    NEWEST_KUBERNETES,
    all_fixture_slices,
    many_gpus,
    node_slices,
    validate_strictly,
)

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
QUALIFIED = re.compile(r"([a-z0-9.-]{1,63}/)?[A-Za-z_][A-Za-z0-9_]{0,31}")


def devices_of(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {device["name"]: device["attributes"] for obj in slices for device in obj["spec"]["devices"]}


def test_node01_passthrough_gpu_attributes(tmp_path: Path) -> None:
    (obj,) = node_slices(NODE01, tmp_path)
    assert obj["apiVersion"] == "resource.k8s.io/v1" and obj["kind"] == "ResourceSlice"
    assert obj["metadata"] == {"generateName": f"node01-{DRIVER_NAME}-"}
    spec = obj["spec"]
    assert spec["driver"] == DRIVER_NAME and spec["nodeName"] == "node01"
    assert spec["pool"] == {"name": "node01", "generation": 1, "resourceSliceCount": 1}
    devices = devices_of([obj])
    assert sorted(devices) == ["pci-0000-3b-00-0", "pci-0000-5e-00-0", "pci-0000-86-00-0", "pci-0000-af-00-0"]
    assert devices["pci-0000-86-00-0"] == {
        "kind": {"string": "passthrough"},
        "resourceName": {"string": "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"},
        "productName": {"string": "TU106 [GeForce RTX 2060 Rev. A]"},
        "vendorID": {"string": "10de"},
        "deviceID": {"string": "1f08"},
        "numaNode": {"int": 1},
        "iommuGroup": {"int": 74},
        "healthy": {"bool": True},
        "resource.kubernetes.io/pciBusID": {"string": "0000:86:00.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:85"},
    }


def test_mdev_vgpu_attributes(tmp_path: Path) -> None:
    devices = devices_of(node_slices(VGPU_NODE, tmp_path))
    assert len(devices) == 3
    attributes = devices[f"mdev-{T4_2Q}"]
    assert attributes["kind"] == {"string": "mdev-vgpu"}
    assert attributes["mdevUUID"] == {"string": T4_2Q}
    assert attributes["vgpuType"] == {"string": "nvidia-231"}
    assert attributes["parentPciBusID"] == {"string": "0000:d8:00.0"}
    assert attributes["resourceName"] == {"string": "nvidia.com/GRID_T4-2Q"}
    assert attributes["productName"] == {"string": "TU104GL [Tesla T4]"}  # the parent GPU's name
    assert "resource.kubernetes.io/pciBusID" not in attributes  # an mdev is not a PCI function
    assert device_id_of(f"mdev-{T4_2Q}") == ("mdev", T4_2Q)


def test_sriov_vgpu_is_a_pci_function_with_a_parent(tmp_path: Path) -> None:
    devices = devices_of(node_slices(SRIOV_VGPU_NODE, tmp_path))
    assert sorted(devices) == ["pci-0000-3b-00-4", "pci-0000-3b-00-5", "pci-0000-d8-00-4"]
    attributes = devices["pci-0000-d8-00-4"]
    assert attributes["kind"] == {"string": "sriov-vgpu"}
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:d8:00.4"}
    assert attributes["parentPciBusID"] == {"string": "0000:d8:00.0"}
    assert attributes["vgpuType"] == {"string": "1145"}
    assert attributes["resourceName"] == {"string": "nvidia.com/NVIDIA_L40S-1B"}


def test_unknowns_are_left_out_and_unhealthy_devices_say_so(tmp_path: Path) -> None:
    devices = devices_of(node_slices(MIXED_NODE, tmp_path))
    unnamed = devices["pci-0000-5e-00-0"]  # 10de:2fff: no pci.ids name, NUMA node -1
    assert "productName" not in unnamed and "numaNode" not in unnamed
    assert unnamed["resourceName"] == {"string": "nvidia.com/2fff"}
    assert devices["pci-0000-86-00-0"]["healthy"] == {"bool": False}  # its audio function is on snd_hda_intel
    assert devices["pci-0000-3b-00-0"]["healthy"] == {"bool": True}


@pytest.mark.parametrize("version", [DRA_OLDEST_KUBERNETES, NEWEST_KUBERNETES])
def test_every_fixture_node_validates_strictly(tmp_path: Path, version: str) -> None:
    kinds = set()
    for name, slices in all_fixture_slices(tmp_path).items():
        assert slices, name
        for obj in slices:
            validate_strictly(obj, version)
            for device in obj["spec"]["devices"]:
                assert DNS_LABEL.fullmatch(device["name"]), device["name"]
                kinds.add(device["attributes"]["kind"]["string"])
    assert kinds == {"passthrough", "mdev-vgpu", "sriov-vgpu"}


def test_strict_validation_refuses_a_wrong_attribute_form(tmp_path: Path) -> None:
    """The schema check means something: ``{"str": …}`` (not the v1 wire form) and an unknown field fail."""
    (obj,) = node_slices(NODE01, tmp_path)
    wrong_form = copy.deepcopy(obj)
    wrong_form["spec"]["devices"][0]["attributes"]["kind"] = {"str": "passthrough"}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_strictly(wrong_form, DRA_OLDEST_KUBERNETES)
    unknown = copy.deepcopy(obj)
    unknown["spec"]["pool"]["generations"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_strictly(unknown, DRA_OLDEST_KUBERNETES)


def test_names_and_values_keep_to_the_v1_limits(tmp_path: Path) -> None:
    for slices in all_fixture_slices(tmp_path).values():
        names = [device["name"] for obj in slices for device in obj["spec"]["devices"]]
        assert len(names) == len(set(names))
        for attributes in devices_of(slices).values():
            assert len(attributes) <= 32
            for name, value in attributes.items():
                assert QUALIFIED.fullmatch(name), name
                assert len(value) == 1 and next(iter(value)) in {"string", "int", "bool"}
                if "string" in value:
                    assert 0 < len(value["string"]) <= MAX_STRING_VALUE


def test_a_big_pool_is_split_into_slices_of_at_most_128() -> None:
    slices = build_slices(many_gpus(300), "node-big", generation=7)
    assert [len(obj["spec"]["devices"]) for obj in slices] == [128, 128, 44]
    assert all(obj["spec"]["pool"] == {"name": "node-big", "generation": 7, "resourceSliceCount": 3} for obj in slices)
    names = [device["name"] for obj in slices for device in obj["spec"]["devices"]]
    assert len(set(names)) == 300 and names == sorted(names)
    for obj in slices:
        validate_strictly(obj, DRA_OLDEST_KUBERNETES)
    assert len(build_slices(many_gpus(MAX_DEVICES_PER_SLICE), "n")) == 1
    assert len(build_slices(many_gpus(MAX_DEVICES_PER_SLICE + 1), "n")) == 2
    assert build_slices(Inventory(()), "n") == []  # nothing to offer: no slice
    with pytest.raises(ValueError, match="max_devices"):
        build_slices(many_gpus(1), "n", max_devices=129)


def test_a_string_over_64_characters_is_left_out_not_cut() -> None:
    long_name = "nvidia.com/" + "X" * 60
    device = Device("0000:86:00.0", ResourceKind.PCI, "10DE:1F08", 74, 1, True, None)
    resource = Resource(long_name, ResourceKind.PCI, (device,), ("10DE:1F08",))
    attributes = device_attributes(device, resource, lambda vendor, product: "Y" * 65)
    assert "resourceName" not in attributes and "productName" not in attributes
    assert attributes["vendorID"] == {"string": "10de"}


def test_a_device_in_two_resources_is_published_once() -> None:
    device = Device("0000:86:00.0", ResourceKind.PCI, "10DE:1F08", 74, 1, True, None)
    first = Resource("nvidia.com/A", ResourceKind.PCI, (device,), ())
    second = Resource("nvidia.com/B", ResourceKind.PCI, (device,), ())
    (only,) = slice_devices(Inventory((first, second)))
    assert only["attributes"]["resourceName"] == {"string": "nvidia.com/A"}


@pytest.mark.parametrize("name", ["", "Node01", "node_01", "-node", "node.", "a" * 254, "nöde"])
def test_a_node_name_that_cannot_name_a_pool_is_refused(name: str) -> None:
    with pytest.raises(InputError, match="not a DNS subdomain"):
        check_node_name(name)
    with pytest.raises(InputError):
        build_slices(many_gpus(1), name)


def test_a_good_node_name_passes() -> None:
    assert check_node_name("worker-1.example.com") == "worker-1.example.com"


def test_a_gpu_below_a_pcie_switch_publishes_the_switch(tmp_path: Path) -> None:
    """docs/p2p.md: a claim whose GPUs match on ``pcieSwitch`` gets GPUs the hook puts in one GPUDirect clique."""
    devices = devices_of(node_slices(WORKSTATION_NODE, tmp_path))
    assert devices["pci-0000-03-00-0"]["pcieSwitch"] == {"string": "0000:01:00.0"}
    assert devices["pci-0000-04-00-0"]["pcieSwitch"] == {"string": "0000:01:00.0"}
    assert "pcieSwitch" not in devices["pci-0000-05-00-0"]  # on a root port of its own
    assert all(
        "pcieSwitch" not in attributes for attributes in devices_of(node_slices(NODE01, tmp_path / "n")).values()
    )
