"""SR-IOV vGPUs (vGPU 17+): discovery, naming, health, Allocate over the kubelet stand-in, the hook and libvirt.

The node is :data:`~simkit.fixture_nodes.SRIOV_VGPU_NODE` (two L40S split into VFs, shaped as docs/node.md,
"SR-IOV vGPUs" describes the driver's files); changes the kernel and the driver would make are made on the tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from launcher_hook.hostdevs import HOSTDEV_MODELS
from plugin.allocation import DeviceSpec, DeviceUnavailable, allocate, recheck_device
from plugin.hostroot import HostRoot
from plugin.inventory import Inventory
from plugin.source_sriov_vgpu import parse_creatable_types, parse_type_id
from plugin.sources import permitted_host_devices
from schemas import DEVICE_KINDS, VM_KINDS, ResourceKind, kind_of_variable
from simkit.fixture_nodes import L40S_1B, L40S_1Q, SRIOV_VGPU_NODE
from simkit.kubelet_standin import KubeletStandIn
from simkit.sysfs_fixture import Function, Node, SriovVgpuGpu, build, creatable_text, sriov_vfs
from tests.discovery_support import build_node, discover
from tests.plugin_support import build_tree, manager_for, running, short_dir
from xmlgen.discover_cmd import render_permitted_host_devices, render_table

L40S_1Q_NAME, L40S_1B_NAME = "nvidia.com/NVIDIA_L40S-1Q", "nvidia.com/NVIDIA_L40S-1B"
L40S_1Q_ENV = "PCI_RESOURCE_NVIDIA_COM_NVIDIA_L40S-1Q"
VF_A0, VF_A1, VF_A2, VF_B0 = "0000:3b:00.4", "0000:3b:00.5", "0000:3b:00.6", "0000:d8:00.4"
PF_A, PF_B = "0000:3b:00.0", "0000:d8:00.0"
GROUP = {VF_A0: 31, VF_A1: 32, VF_A2: 33, VF_B0: 119}


def pci(root: Path, address: str) -> Path:
    return root / "sys" / "bus" / "pci" / "devices" / address


def with_gpus(*gpus: SriovVgpuGpu) -> Node:
    return dataclasses.replace(SRIOV_VGPU_NODE, sriov_vgpus=gpus)


def test_the_kind_is_a_plugin_kind_that_reaches_the_vm_as_a_pci_function() -> None:
    kind = DEVICE_KINDS[ResourceKind.SRIOV_VGPU]
    assert kind.reaches_vm_as is ResourceKind.PCI
    assert (kind.env_prefix, kind.hostdev_type, kind.needs_vfio_pci) == ("PCI_RESOURCE", "pci", False)
    assert ResourceKind.SRIOV_VGPU not in VM_KINDS
    assert set(HOSTDEV_MODELS) == set(VM_KINDS)  # the hook writes it with the PCI model
    assert kind_of_variable(L40S_1Q_ENV) is DEVICE_KINDS[ResourceKind.PCI]


def test_creatable_types_and_current_type_parse_as_the_driver_writes_them() -> None:
    text = creatable_text([L40S_1B, L40S_1Q])
    assert text.splitlines()[0] == "ID    : vGPU Name"
    assert parse_creatable_types(text) == {1145: "NVIDIA L40S-1B", 1147: "NVIDIA L40S-1Q"}
    assert parse_creatable_types(creatable_text([])) == {}
    assert parse_creatable_types("garbage\n12x : A\n : B\n1 :\n99999999999 : C\n") == {}
    assert [parse_type_id(text) for text in ("0\n", "1147\n", "", "-1", "1e3", None)] == [
        0,
        1147,
        None,
        None,
        None,
        None,
    ]


def test_discovery_offers_typed_vfs_named_after_their_vgpu_type(tmp_path: Path) -> None:
    inventory = discover(build_node(SRIOV_VGPU_NODE, tmp_path))
    assert inventory.resource_names == (L40S_1B_NAME, L40S_1Q_NAME)
    one_q = inventory.resource(L40S_1Q_NAME)
    assert (one_q.kind, one_q.env, one_q.selectors) == (ResourceKind.SRIOV_VGPU, L40S_1Q_ENV, ("10DE:26B9",))
    assert [(d.id, d.iommu_group, d.healthy, d.mdev_type, str(d.parent)) for d in one_q.devices] == [
        (VF_A0, 31, True, "1147", PF_A),
        (VF_A1, 32, True, "1147", PF_A),
    ]
    assert [(d.id, d.mdev_type, d.numa_node) for d in inventory.resource(L40S_1B_NAME).devices] == [(VF_B0, "1145", 1)]
    ignored = {item.id: item.reason for item in inventory.ignored}
    assert VF_A0 not in ignored and VF_B0 not in ignored  # offered, so not "bound to nvidia" as well
    assert {PF_A, PF_B, VF_A2} <= set(ignored)
    assert ignored[VF_A2] == "an SR-IOV vGPU VF with no vGPU type yet (nvidia/current_vgpu_type is 0)"
    # The GPUs themselves are on nvidia because they are split into vGPUs, not for want of vfio-pci.
    assert ignored[PF_A] == (
        "a GPU split into SR-IOV vGPU VFs (4 enabled): its VFs are offered as vGPUs, not the GPU itself"
    )
    assert "VGPU TYPE" in render_table(inventory) and "1147 on 0000:3b:00.0" in render_table(inventory)


def test_permitted_host_devices_lists_each_type_under_pci_host_devices(tmp_path: Path) -> None:
    inventory = discover(build_node(SRIOV_VGPU_NODE, tmp_path))
    block = permitted_host_devices(inventory)["permittedHostDevices"]
    assert block["mediatedDevices"] == []
    assert block["pciHostDevices"] == [
        {"pciVendorSelector": "10DE:26B9", "resourceName": name, "externalResourceProvider": True}
        for name in (L40S_1B_NAME, L40S_1Q_NAME)
    ]
    yaml_text = render_permitted_host_devices(inventory)
    assert '- pciVendorSelector: "10DE:26B9"\n      resourceName: "nvidia.com/NVIDIA_L40S-1Q"' in yaml_text


def test_a_full_gpu_borrows_names_from_a_gpu_of_the_same_model_else_is_not_offered(tmp_path: Path) -> None:
    first, second = SRIOV_VGPU_NODE.sriov_vgpus
    full_first = dataclasses.replace(first, full=True)
    borrowed = discover(
        build(with_gpus(full_first, dataclasses.replace(second, types=(L40S_1B, L40S_1Q))), tmp_path / "a")
    )
    assert [d.id for d in borrowed.resource(L40S_1Q_NAME).devices] == [VF_A0, VF_A1]

    alone = discover(build(with_gpus(full_first, second), tmp_path / "b"))
    assert L40S_1Q_NAME not in alone.resource_names
    reasons = {item.id: item.reason for item in alone.ignored}
    assert "its vGPU type 1147 is named by no creatable_vgpu_types of its GPU 0000:3b:00.0" in reasons[VF_A0]


def test_a_vf_whose_type_is_reset_or_which_leaves_nvidia_is_withdrawn(tmp_path: Path) -> None:
    root = build_node(SRIOV_VGPU_NODE, tmp_path)
    (pci(root, VF_A0) / "nvidia" / "current_vgpu_type").write_text("0\n")
    (pci(root, VF_A1) / "driver").unlink()
    (root / "sys" / "bus" / "pci" / "drivers" / "nvidia" / VF_A1).unlink()
    inventory = discover(root)
    assert L40S_1Q_NAME not in inventory.resource_names
    assert inventory.resource_names == (L40S_1B_NAME,)


def test_a_vf_without_its_vfio_group_node_is_unhealthy(tmp_path: Path) -> None:
    root = build_node(SRIOV_VGPU_NODE, tmp_path)
    (root / "dev" / "vfio" / str(GROUP[VF_A1])).unlink()
    devices = {d.id: d for d in discover(root).resource(L40S_1Q_NAME).devices}
    assert devices[VF_A0].healthy
    assert not devices[VF_A1].healthy and devices[VF_A1].reason == "/dev/vfio/32 is missing"


def test_a_vf_of_a_gpu_not_selected_is_not_offered(tmp_path: Path) -> None:
    inventory = discover(build_node(SRIOV_VGPU_NODE, tmp_path), pci_selectors=("10DE:1EB8",))
    assert inventory.resources == ()
    assert "is not a selected GPU" in {item.id: item.reason for item in inventory.ignored}[VF_A0]
    assert PF_A not in {item.id for item in inventory.ignored}  # a GPU not asked for is not listed itself


def test_allocate_publishes_vf_addresses_and_rechecks_driver_and_type(tmp_path: Path) -> None:
    root = build_node(SRIOV_VGPU_NODE, tmp_path)
    resource = discover(root).resource(L40S_1Q_NAME)
    result = allocate(resource, [VF_A1, VF_A0], root)
    assert dict(result.envs) == {L40S_1Q_ENV: f"{VF_A1},{VF_A0}"}
    assert result.device_specs == tuple(
        DeviceSpec.node(path) for path in ("/dev/vfio/vfio", f"/dev/vfio/{GROUP[VF_A1]}", f"/dev/vfio/{GROUP[VF_A0]}")
    )
    device = resource.device(VF_A0)
    assert recheck_device(device, root) is None
    type_file = pci(root, VF_A0) / "nvidia" / "current_vgpu_type"
    type_file.write_text("1145\n")
    assert recheck_device(device, root) == "its vGPU type is now 1145 (was 1147)"
    type_file.write_text("0\n")
    assert recheck_device(device, root) == "its vGPU was removed (current_vgpu_type is 0, was 1147)"
    with pytest.raises(DeviceUnavailable, match=f"{L40S_1Q_NAME}: device {VF_A0}: its vGPU was removed"):
        allocate(resource, [VF_A0], root)
    driver = pci(root, VF_A1) / "driver"
    driver.unlink()
    driver.symlink_to(os.path.relpath(root / "sys" / "bus" / "pci" / "drivers" / "vfio-pci", driver.parent))
    assert (
        recheck_device(resource.device(VF_A1), root) == "it is now bound to vfio-pci, not to nvidia (its vGPU is gone)"
    )


def test_allocate_refuses_a_vf_that_is_gone(tmp_path: Path) -> None:
    root = build_node(SRIOV_VGPU_NODE, tmp_path)
    resource = discover(root).resource(L40S_1Q_NAME)
    (pci(root, VF_A0) / "iommu_group").unlink()  # what disabling the VFs (sriov_numvfs 0) leaves of it
    assert "iommu_group is gone" in str(recheck_device(resource.device(VF_A0), root))


@pytest.fixture
def served() -> Iterator[tuple[KubeletStandIn, Path]]:
    with short_dir() as base:
        root = build_tree(SRIOV_VGPU_NODE, base)
        with KubeletStandIn(base / "kubelet") as kubelet, running(manager_for(root, base / "kubelet", scan_interval=5)):
            yield kubelet, root


def test_the_kubelet_gets_the_vfs_over_the_plugins_sockets(served: tuple[KubeletStandIn, Path]) -> None:
    kubelet, _ = served
    kubelet.wait_for_registration(L40S_1Q_NAME)
    seen = kubelet.wait_for_devices(L40S_1Q_NAME, lambda devices: len(devices) == 2)
    assert seen == {VF_A0: "Healthy", VF_A1: "Healthy"}
    response = kubelet.allocate(L40S_1Q_NAME, [VF_A1])
    container = response.container_responses[0]
    assert dict(container.envs) == {L40S_1Q_ENV: VF_A1}
    assert [spec.host_path for spec in container.devices] == ["/dev/vfio/vfio", f"/dev/vfio/{GROUP[VF_A1]}"]


def test_a_rescan_withdraws_a_vf_whose_type_was_reset(served: tuple[KubeletStandIn, Path]) -> None:
    kubelet, root = served
    kubelet.wait_for_devices(L40S_1Q_NAME, lambda devices: len(devices) == 2)
    (pci(root, VF_A0) / "nvidia" / "current_vgpu_type").write_text("0\n")
    # No uevent on a fixture tree: the manager's periodic rescan (5 s here) finds it.
    seen = kubelet.wait_for_devices(L40S_1Q_NAME, lambda devices: VF_A0 not in devices, timeout=15)
    assert set(seen) == {VF_A1}


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xmlgen", "simulate", "--node", "sriov-vgpu", *args],
        capture_output=True,
        input="",
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _hostdevs(domain: str) -> list[tuple[str | None, str | None, str | None, str]]:
    root = etree.fromstring(domain.encode())
    found = []
    for hostdev in root.iterfind("devices/hostdev"):
        address = hostdev.find("source/address")
        alias = hostdev.find("alias")
        assert address is not None and alias is not None
        source = "{}:{}:{}.{}".format(
            *(str(address.get(p)).removeprefix("0x") for p in ("domain", "bus", "slot", "function"))
        )
        found.append((hostdev.get("type"), hostdev.get("managed"), alias.get("name"), source))
    return found


def test_simulate_takes_the_vfs_through_the_plugin_and_the_hook_into_pci_hostdevs() -> None:
    done = simulate()
    assert done.returncode == 0, done.stderr
    assert _hostdevs(done.stdout) == [("pci", "no", "ua-gpu0", VF_A0), ("pci", "no", "ua-gpu1", VF_B0)]
    assert f"env {L40S_1Q_ENV}={VF_A0}" in done.stderr
    assert f"devices /dev/vfio/vfio (mrw), /dev/vfio/{GROUP[VF_A0]} (mrw)" in done.stderr
    assert "nvidia.com/NVIDIA_L40S-1Q (sriov_vgpu, 2/2 healthy)" in done.stderr
    # Step 3 reads as what the VMI asks for against what is healthy, not as "1 of 2 (devices) healthy".
    step3 = "nvidia.com/NVIDIA_L40S-1Q: the VMI asks for 1, the kubelet sees 2 healthy; the plugin prefers"
    assert step3 in done.stderr


@pytest.mark.libvirt
def test_simulate_check_gets_the_vfs_into_qemus_argv_as_vfio_pci_hosts() -> None:
    from tests.test_xmlgen_simulate import qemu_devices

    done = simulate("--check")
    assert done.returncode == 0, done.stderr
    assert qemu_devices(done.stderr) == {"ua-gpu0": VF_A0, "ua-gpu1": VF_B0}
    assert '"driver":"vfio-pci","host":"0000:3b:00.4"' in done.stderr


def test_inventory_json_names_the_kind(tmp_path: Path) -> None:
    inventory: Inventory = discover(build_node(SRIOV_VGPU_NODE, tmp_path))
    kinds = {resource["name"]: resource["kind"] for resource in json.loads(inventory.to_json_text())["resources"]}
    assert kinds == {L40S_1B_NAME: "sriov_vgpu", L40S_1Q_NAME: "sriov_vgpu"}


def test_doctor_never_advises_binding_a_vgpu_vf_to_vfio_pci(tmp_path: Path) -> None:
    from plugin.config import PluginConfig
    from xmlgen.doctor import Status, run_checks

    root = build_node(SRIOV_VGPU_NODE, tmp_path)
    (tmp_path / "image").mkdir()
    found = {
        check.name: check for check in run_checks(PluginConfig(host_root=str(root)), image_root=tmp_path / "image")
    }
    free = found[f"GPU {VF_A2}"]
    assert free.status is Status.WARN and free.fix is not None
    assert "never bind it to vfio-pci" in free.fix and "driver_override" not in free.fix
    assert found[f"vGPU {VF_A0}"].status is Status.OK
    assert "vGPU parent of 2 vGPU(s) (nvidia.com/NVIDIA_L40S-1Q)" in found[f"GPU {PF_A}"].detail
    assert "serves vGPUs only" in found["vfio-pci driver"].detail


@pytest.mark.parametrize("target", ["/etc", "../../../../../../..", "../0000:3b:00.0x"])
def test_a_physfn_link_naming_no_pci_function_costs_that_vf_only(tmp_path: Path, target: str) -> None:
    root = build_node(SRIOV_VGPU_NODE, tmp_path)
    link = pci(root, VF_A0) / "physfn"
    link.unlink()
    link.symlink_to(target)
    inventory = discover(root)  # the scan goes on: one odd link does not take every GPU off the node
    assert [d.id for d in inventory.resource(L40S_1Q_NAME).devices] == [VF_A1]
    assert [d.id for d in inventory.resource(L40S_1B_NAME).devices] == [VF_B0]
    reason = {item.id: item.reason for item in inventory.ignored}[VF_A0]
    assert reason == "it has a vGPU type but no physfn link naming a PCI function (its GPU is unknown)"


def _rebind(root: Path, address: str, driver: str) -> None:
    """What unbinding ``address`` from nvidia and binding it to ``driver`` leaves in the tree (nvidia/ goes)."""
    link = pci(root, address) / "driver"
    link.unlink()
    drivers = root / "sys" / "bus" / "pci" / "drivers"
    link.symlink_to(os.path.relpath(drivers / driver, link.parent))
    (drivers / VF_DRIVER_NAME / address).unlink()
    (drivers / driver).mkdir(exist_ok=True)
    target = pci(root, address).resolve()
    (drivers / driver / address).symlink_to(os.path.relpath(target, drivers / driver))
    shutil.rmtree(target / "nvidia")


VF_DRIVER_NAME = "nvidia"


def test_a_vgpu_vf_moved_to_vfio_pci_is_not_offered_as_a_whole_gpu(tmp_path: Path) -> None:
    root = build_node(SRIOV_VGPU_NODE, tmp_path)
    before = discover(root)
    _rebind(root, VF_A0, "vfio-pci")
    inventory = discover(root)
    # Gone from its vGPU resource, and not back under a passthrough resource named after the L40S either.
    assert [d.id for d in inventory.resource(L40S_1Q_NAME).devices] == [VF_A1]
    assert [(r.name, r.kind) for r in inventory.resources] == [(r.name, r.kind) for r in before.resources]
    ignored = {item.id: item for item in inventory.ignored}[VF_A0]
    assert ignored.reason == (
        f"an SR-IOV VF of {PF_A}, a GPU on nvidia: "
        "a vGPU VF works only on nvidia with a vGPU type, never as a whole GPU"
    )
    assert ignored.fix is not None and "drivers_probe" in ignored.fix


def test_a_type_name_whose_variable_another_resource_has_is_not_offered(tmp_path: Path) -> None:
    # KubeVirt reads PCI_RESOURCE_NVIDIA_COM_NVIDIA_L40S-1Q for both names: the second would get the first's devices.
    lookalike = (1145, "nvidia.l40s-1q")
    first, second = SRIOV_VGPU_NODE.sriov_vgpus
    inventory = discover(build(with_gpus(first, dataclasses.replace(second, types=(lookalike,))), tmp_path))
    assert inventory.resource_names == (L40S_1Q_NAME,)
    reason = {item.id: item.reason for item in inventory.ignored}[VF_B0]
    assert reason == (
        f"resource nvidia.com/nvidia.l40s-1q would be allocated through {L40S_1Q_ENV}, which resource "
        f"{L40S_1Q_NAME} already has (KubeVirt upper-cases a resource name and turns '.' and '/' into '_')"
    )


def _sriov_node(vfs_per_gpu: int) -> Node:
    """Eight L40S, each with ``vfs_per_gpu`` VFs enabled, half of them with a vGPU type."""
    functions = []
    gpus = []
    for index, bus in enumerate((0x17, 0x1F, 0x3A, 0x5D, 0x85, 0x8F, 0xAE, 0xD7)):
        port = Function(f"0000:{bus:02x}:00.0", 0x8086, 0x2030, 0x060400, "pcieport", 500 + index * 40, index // 4)
        pf = Function(
            f"0000:{bus + 1:02x}:00.0",
            0x10DE,
            0x26B9,
            0x030200,
            "nvidia",
            501 + index * 40,
            index // 4,
            parent=port.address,
        )
        vfs = sriov_vfs(pf, vfs_per_gpu, 502 + index * 40)
        functions += [port, pf, *vfs]
        typed = (L40S_1Q[0],) * (vfs_per_gpu // 2)
        gpus.append(SriovVgpuGpu(pf.address, tuple(vf.address for vf in vfs), 32, types=(L40S_1Q,), current=typed))
    return dataclasses.replace(
        SRIOV_VGPU_NODE, name=f"l40s-x8-{vfs_per_gpu}", functions=tuple(functions), sriov_vgpus=tuple(gpus)
    )


def test_scan_work_per_vf_stays_the_same_from_32_to_256_vfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear in the VFs (sriov_totalvfs 32 x 8 GPUs): the reads and link lookups per VF do not grow with their
    number (the timing itself is bench/'s business)."""
    calls: list[str] = []
    for name in ("read", "readlink_name", "listdir", "exists", "resolve"):
        original = getattr(HostRoot, name)

        def counting(self: HostRoot, path: str, _original: Any = original) -> Any:
            calls.append(path)
            return _original(self, path)

        monkeypatch.setattr(HostRoot, name, counting)
    per_vf = {}
    for vfs in (4, 32):
        root = build(_sriov_node(vfs), tmp_path / str(vfs))
        calls.clear()
        inventory = discover(root)
        assert len(inventory.resource(L40S_1Q_NAME).devices) == 8 * vfs // 2
        per_vf[vfs] = len(calls) / (8 * vfs)
    assert per_vf[32] <= per_vf[4] * 1.1, per_vf
