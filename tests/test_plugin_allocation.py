"""Allocate's policy on the fixture nodes: env var, VFIO device nodes, refusals and the host re-check."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from plugin.allocation import (
    DEFAULT_RULE,
    AllocationError,
    DeviceSpec,
    DeviceUnavailable,
    InvalidRequest,
    allocate,
    recheck_device,
    vfio_cdev,
)
from plugin.inventory import Inventory, Resource
from simkit.fixture_nodes import MIXED_NODE, NODE01, T4_1Q_A, T4_1Q_B, T4_2Q, VGPU_NODE
from simkit.sysfs_fixture import Function, Mdev, Node, build
from tests.discovery_support import build_node, discover

RTX = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
RTX_ENV = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
COMPANIONS_ENV = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
GPU_3B, GPU_5E, GPU_86, GPU_AF = "0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0"
# node01's groups: a card below root bus B sits in group (root port group + 2).
GROUP = {GPU_3B: 30, GPU_5E: 50, GPU_86: 74, GPU_AF: 96}


def node_and_resource(node: Node, tmp_path: Path, name: str = RTX) -> tuple[Path, Resource]:
    root = build_node(node, tmp_path)
    return root, discover(root).resource(name)


def specs(*paths: str) -> tuple[DeviceSpec, ...]:
    return tuple(DeviceSpec(path, path, "mrw") for path in paths)


def refusal(resource: Resource, ids: list[str], root: Path) -> AllocationError:
    with pytest.raises(AllocationError) as caught:
        allocate(resource, ids, root)
    return caught.value


def test_env_holds_exactly_the_requested_ids_in_request_order(tmp_path: Path) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    result = allocate(resource, [GPU_AF, GPU_3B], root)
    assert dict(result.envs) == {
        RTX_ENV: f"{GPU_AF},{GPU_3B}",
        COMPANIONS_ENV: "0000:af:00.0=0000:af:00.1+0000:af:00.2+0000:af:00.3,"
        "0000:3b:00.0=0000:3b:00.1+0000:3b:00.2+0000:3b:00.3",
    }
    assert result.device_specs == specs("/dev/vfio/vfio", f"/dev/vfio/{GROUP[GPU_AF]}", f"/dev/vfio/{GROUP[GPU_3B]}")
    assert result.devices == result.device_specs
    assert result.device_ids == (GPU_AF, GPU_3B)
    single = allocate(resource, [GPU_86], root)
    assert dict(single.envs) == {RTX_ENV: GPU_86, COMPANIONS_ENV: "0000:86:00.0=0000:86:00.1+0000:86:00.2+0000:86:00.3"}
    assert single.device_specs == specs("/dev/vfio/vfio", f"/dev/vfio/{GROUP[GPU_86]}")


def test_paths_are_the_nodes_own_not_under_the_host_root(tmp_path: Path) -> None:
    root, resource = node_and_resource(dataclasses.replace(NODE01, iommufd=True), tmp_path)
    result = allocate(resource, [GPU_3B, GPU_5E, GPU_86, GPU_AF], root)
    for spec in result.device_specs:
        assert spec.host_path == spec.container_path
        assert spec.host_path.startswith("/dev/")
        assert str(root) not in spec.host_path
        assert spec.permissions == "mrw"
        assert os.path.exists(f"{root}{spec.host_path}")  # it names a node that the host really has


def test_a_group_needed_twice_is_mounted_once(tmp_path: Path) -> None:
    # Two GPU functions of one card in one group (as on some dual-GPU boards), each allocatable.
    node = Node(
        name="dual",
        functions=(
            Function("0000:3b:00.0", 0x10DE, 0x2236, 0x030200, "vfio-pci", 30, 0),
            Function("0000:3b:00.1", 0x10DE, 0x2236, 0x030200, "vfio-pci", 30, 0),
        ),
    )
    root = build(node, tmp_path / "dual")
    discovered = discover(root).resources[0]
    assert not any(device.healthy for device in discovered.devices)  # discovery refuses a shared group ...
    resource = dataclasses.replace(
        discovered, devices=tuple(dataclasses.replace(d, healthy=True, reason=None) for d in discovered.devices)
    )
    error = refusal(resource, ["0000:3b:00.1", "0000:3b:00.0"], root)  # ... and so does the re-check (one rule)
    assert isinstance(error, DeviceUnavailable)
    assert "IOMMU group 30 is shared with GPU" in error.message
    sharing = dataclasses.replace(DEFAULT_RULE, selects=lambda vendor, device, pci_class: False)
    result = allocate(resource, ["0000:3b:00.1", "0000:3b:00.0"], root, sharing)  # a rule that lets them share
    assert result.device_specs == specs("/dev/vfio/vfio", "/dev/vfio/30")
    assert list(result.envs.values()) == ["0000:3b:00.1,0000:3b:00.0"]


@pytest.mark.parametrize("bad", ["0000:d8:00.0", "0000:18:00.0", "nonsense", "0000:3B:00.0", ""])
def test_an_unknown_id_is_invalid_argument_naming_it(tmp_path: Path, bad: str) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    error = refusal(resource, [GPU_3B, bad], root)
    assert isinstance(error, InvalidRequest)
    assert repr(bad) in error.message
    assert RTX in error.message
    assert error.device_id == bad


def test_an_unknown_id_wins_over_an_unhealthy_one(tmp_path: Path) -> None:
    root = build_node(MIXED_NODE, tmp_path)
    resource = discover(root).resource("nvidia.com/GA102_GEFORCE_RTX_3090")
    assert isinstance(refusal(resource, [GPU_86, "0000:01:00.0"], root), InvalidRequest)


def test_empty_and_repeated_requests_are_invalid_argument(tmp_path: Path) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    assert isinstance(refusal(resource, [], root), InvalidRequest)
    error = refusal(resource, [GPU_3B, GPU_86, GPU_3B], root)
    assert isinstance(error, InvalidRequest)
    assert GPU_3B in error.message


def test_an_unhealthy_device_is_failed_precondition_with_its_reason(tmp_path: Path) -> None:
    root = build_node(MIXED_NODE, tmp_path)
    resource = discover(root).resource("nvidia.com/GA102_GEFORCE_RTX_3090")
    error = refusal(resource, [GPU_86], root)
    assert isinstance(error, DeviceUnavailable)
    assert GPU_86 in error.message
    assert "snd_hda_intel" in error.message
    assert "0000:86:00.1" in error.message


def test_a_group_node_removed_after_the_scan_is_failed_precondition(tmp_path: Path) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    (root / "dev" / "vfio" / str(GROUP[GPU_86])).unlink()
    error = refusal(resource, [GPU_3B, GPU_86], root)
    assert isinstance(error, DeviceUnavailable)
    assert GPU_86 in error.message
    assert f"/dev/vfio/{GROUP[GPU_86]}" in error.message
    # The other devices are still fine.
    assert allocate(resource, [GPU_3B], root).device_ids == (GPU_3B,)


def test_a_changed_iommu_group_is_failed_precondition(tmp_path: Path) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    (root / "sys" / "kernel" / "iommu_groups" / "200" / "devices").mkdir(parents=True)
    real_link = Path(os.path.realpath(root / "sys" / "bus" / "pci" / "devices" / GPU_AF)) / "iommu_group"
    real_link.unlink()
    real_link.symlink_to(os.path.relpath(root / "sys" / "kernel" / "iommu_groups" / "200", real_link.parent))
    error = refusal(resource, [GPU_AF], root)
    assert isinstance(error, DeviceUnavailable)
    assert GPU_AF in error.message
    assert f"from {GROUP[GPU_AF]} to 200" in error.message


def test_a_group_that_gained_a_member_is_failed_precondition(tmp_path: Path) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    members = root / "sys" / "kernel" / "iommu_groups" / str(GROUP[GPU_5E]) / "devices"
    (members / "0000:5e:00.4").symlink_to(os.path.relpath(root / "sys" / "devices", members))
    error = refusal(resource, [GPU_5E], root)
    assert isinstance(error, DeviceUnavailable)
    assert "now also holds 0000:5e:00.4" in error.message
    (members / "0000:5e:00.2").unlink()
    (members / "0000:5e:00.4").unlink()
    assert "no longer holds 0000:5e:00.2" in refusal(resource, [GPU_5E], root).message


def test_a_gpu_rebound_to_nvidia_is_failed_precondition(tmp_path: Path) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    device_dir = Path(os.path.realpath(root / "sys" / "bus" / "pci" / "devices" / GPU_3B))
    nvidia = root / "sys" / "bus" / "pci" / "drivers" / "nvidia"
    (device_dir / "driver").unlink()
    (device_dir / "driver").symlink_to(os.path.relpath(nvidia, device_dir))
    error = refusal(resource, [GPU_3B], root)
    assert isinstance(error, DeviceUnavailable)
    assert "bound to nvidia" in error.message
    (device_dir / "driver").unlink()
    assert "no driver" in refusal(resource, [GPU_3B], root).message


def test_a_removed_device_is_failed_precondition(tmp_path: Path) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    (root / "sys" / "bus" / "pci" / "devices" / GPU_3B).unlink()
    error = refusal(resource, [GPU_3B], root)
    assert isinstance(error, DeviceUnavailable)
    assert "removed" in error.message


def test_a_missing_vfio_container_is_failed_precondition(tmp_path: Path) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    (root / "dev" / "vfio" / "vfio").unlink()
    error = refusal(resource, [GPU_3B], root)
    assert isinstance(error, DeviceUnavailable)
    assert "/dev/vfio/vfio" in error.message


def test_iommufd_adds_dev_iommu_and_each_devices_cdev(tmp_path: Path) -> None:
    root, resource = node_and_resource(dataclasses.replace(NODE01, iommufd=True), tmp_path)
    cdevs = {device.id: vfio_cdev(device, root) for device in resource.devices}
    assert all(cdev is not None and cdev.startswith("/dev/vfio/devices/vfio") for cdev in cdevs.values())
    assert len(set(cdevs.values())) == 4
    result = allocate(resource, [GPU_86, GPU_3B], root)
    assert result.device_specs == specs(
        "/dev/vfio/vfio",
        f"/dev/vfio/{GROUP[GPU_86]}",
        f"/dev/vfio/{GROUP[GPU_3B]}",
        "/dev/iommu",
        str(cdevs[GPU_86]),
        str(cdevs[GPU_3B]),
    )


def test_without_iommufd_there_is_no_dev_iommu_or_cdev(tmp_path: Path) -> None:
    root, resource = node_and_resource(NODE01, tmp_path)
    assert not (root / "dev" / "iommu").exists()
    assert all(vfio_cdev(device, root) is None for device in resource.devices)
    paths = [spec.host_path for spec in allocate(resource, [GPU_3B], root).device_specs]
    assert "/dev/iommu" not in paths


def test_iommufd_without_a_device_cdev_still_gives_dev_iommu_and_the_group(tmp_path: Path) -> None:
    # A kernel with iommufd but without VFIO device cdevs: only the group node and /dev/iommu exist.
    root, resource = node_and_resource(NODE01, tmp_path)
    (root / "dev" / "iommu").write_text("")
    result = allocate(resource, [GPU_3B], root)
    assert result.device_specs == specs("/dev/vfio/vfio", f"/dev/vfio/{GROUP[GPU_3B]}", "/dev/iommu")


def test_mdevs_get_the_mdev_variable_with_uuids_and_their_own_groups(tmp_path: Path) -> None:
    root = build_node(VGPU_NODE, tmp_path)
    inventory = discover(root)
    one_q = inventory.resource("nvidia.com/GRID_T4-1Q")
    result = allocate(one_q, [T4_1Q_B, T4_1Q_A], root)
    assert dict(result.envs) == {"MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q": f"{T4_1Q_B},{T4_1Q_A}"}
    assert result.device_specs == specs("/dev/vfio/vfio", "/dev/vfio/141", "/dev/vfio/140")
    two_q = allocate(inventory.resource("nvidia.com/GRID_T4-2Q"), [T4_2Q], root)
    assert dict(two_q.envs) == {"MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-2Q": T4_2Q}
    assert two_q.device_specs == specs("/dev/vfio/vfio", "/dev/vfio/142")


def test_an_mdev_whose_group_node_went_is_refused(tmp_path: Path) -> None:
    root = build_node(VGPU_NODE, tmp_path)
    resource = discover(root).resource("nvidia.com/GRID_T4-1Q")
    (root / "dev" / "vfio" / "140").unlink()
    error = refusal(resource, [T4_1Q_A], root)
    assert isinstance(error, DeviceUnavailable)
    assert T4_1Q_A in error.message
    assert recheck_device(resource.device(T4_1Q_B), root) is None


def test_mdevs_with_iommufd_get_their_cdevs(tmp_path: Path) -> None:
    node = dataclasses.replace(
        VGPU_NODE, iommufd=True, mdevs=(*VGPU_NODE.mdevs[:2], dataclasses.replace(VGPU_NODE.mdevs[2], vfio_dev=7))
    )
    root = build_node(node, tmp_path)
    inventory = discover(root)
    result = allocate(inventory.resource("nvidia.com/GRID_T4-2Q"), [T4_2Q], root)
    assert result.device_specs == specs("/dev/vfio/vfio", "/dev/vfio/142", "/dev/iommu", "/dev/vfio/devices/vfio7")
    one_q = allocate(inventory.resource("nvidia.com/GRID_T4-1Q"), [T4_1Q_A, T4_1Q_B], root)
    assert [spec.host_path for spec in one_q.device_specs][-2:] == [
        "/dev/vfio/devices/vfio0",
        "/dev/vfio/devices/vfio1",
    ]


def test_recheck_is_none_for_every_healthy_device_of_the_fixture_nodes(tmp_path: Path) -> None:
    for node in (NODE01, VGPU_NODE, MIXED_NODE, dataclasses.replace(NODE01, iommufd=True)):
        root = build(node, tmp_path / f"{node.name}-{node.iommufd}")
        inventory: Inventory = discover(root)
        for resource in inventory.resources:
            for device in resource.devices:
                if device.healthy:
                    assert recheck_device(device, root) is None, device.id


# -- the fixture builder's iommufd additions ------------------------------------------------------------------


def test_fixture_iommufd_numbers_vfio_bound_functions_and_skips_others(tmp_path: Path) -> None:
    root = build(dataclasses.replace(NODE01, iommufd=True), tmp_path / "n")
    assert (root / "dev" / "iommu").is_file()
    cdevs = sorted(os.listdir(root / "dev" / "vfio" / "devices"))
    # 4 cards x 4 functions on vfio-pci; the NIC and the T4 on nvidia get none.
    assert cdevs == sorted(f"vfio{n}" for n in range(16))
    pci = root / "sys" / "bus" / "pci" / "devices"
    assert os.listdir(pci / GPU_3B / "vfio-dev") == ["vfio0"]
    assert os.listdir(pci / GPU_5E / "vfio-dev") == ["vfio4"]  # after the first card's four functions
    assert (pci / GPU_5E / "vfio-dev" / "vfio4" / "dev").read_text().endswith(":4\n")
    assert not (pci / "0000:d8:00.0" / "vfio-dev").exists()
    assert not (pci / "0000:18:00.0" / "vfio-dev").exists()


def test_fixture_explicit_vfio_dev_numbers_are_kept_and_must_be_unique(tmp_path: Path) -> None:
    functions = (
        Function("0000:3b:00.0", 0x10DE, 0x2236, 0x030200, "vfio-pci", 30, 0, vfio_dev=0),
        Function("0000:d8:00.0", 0x10DE, 0x2236, 0x030200, "vfio-pci", 31, 1),
    )
    root = build(Node("two", functions, iommufd=True), tmp_path / "a")
    pci = root / "sys" / "bus" / "pci" / "devices"
    assert os.listdir(pci / "0000:3b:00.0" / "vfio-dev") == ["vfio0"]
    assert os.listdir(pci / "0000:d8:00.0" / "vfio-dev") == ["vfio1"]
    # An explicit number without iommufd: the cdev exists, /dev/iommu does not.
    only = build(Node("one", (dataclasses.replace(functions[1], vfio_dev=9),)), tmp_path / "b")
    assert os.listdir(only / "dev" / "vfio" / "devices") == ["vfio9"]
    assert not (only / "dev" / "iommu").exists()
    with pytest.raises(ValueError, match="vfio_dev"):
        build(Node("clash", (functions[0], dataclasses.replace(functions[1], vfio_dev=0))), tmp_path / "c")


def test_fixture_without_iommufd_is_unchanged_and_discovery_ignores_the_cdevs(tmp_path: Path) -> None:
    plain = build(NODE01, tmp_path / "plain")
    assert not (plain / "dev" / "vfio" / "devices").exists()
    assert not (plain / "dev" / "iommu").exists()
    with_cdevs = build(dataclasses.replace(NODE01, iommufd=True), tmp_path / "cdevs")
    assert discover(plain).to_json() == discover(with_cdevs).to_json()


def test_fixture_unbound_mdevs_get_no_cdev(tmp_path: Path) -> None:
    node = dataclasses.replace(
        VGPU_NODE, iommufd=True, mdevs=(Mdev(T4_1Q_A, "0000:3b:00.0", "nvidia-230", 140, driver=None),)
    )
    root = build(node, tmp_path / "v")
    assert not (root / "dev" / "vfio" / "devices").exists()
    assert (root / "dev" / "iommu").exists()
