"""Allocate and a GPU's companions: the re-check covers them (issue 7), the companion variable lists them (issue 15).

A GPU is healthy only if every other function of its IOMMU group is viable for VFIO (docs/node.md, "VFIO": a companion
on a host driver such as ``snd_hda_intel`` blocks the group). Between two scans a companion can be rebound
to a host driver (``modprobe snd_hda_intel`` grabbing the audio function, a card handed back to the host
function by function); Allocate must then refuse with FAILED_PRECONDITION naming the device, as it does when
the GPU itself is rebound, instead of trusting a scan that is up to ``scan_interval`` old.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from plugin.allocation import AllocationError, DeviceUnavailable, allocate, recheck_device
from plugin.config import PluginConfig
from plugin.health import UsabilityRule
from plugin.inventory import Resource
from plugin.sysfs import scan
from runtime.pciids import PciIds
from schemas.companions import parse_companions
from schemas.kinds import kind_of_variable
from schemas.pci import PciAddress
from simkit.fixture_nodes import MIXED_NODE, NODE01, VGPU_NODE
from simkit.kubelet_standin import KubeletStandIn
from simkit.sysfs_fixture import Function, Node, build
from tests.plugin_support import build_tree, rebind, serve_process, short_dir

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
GPU = "0000:86:00.0"
AUDIO = "0000:86:00.1"


def _resource(root: Path) -> Resource:
    inventory = scan(root, PluginConfig(host_root=str(root)), PciIds.load(root / "usr" / "share" / "misc" / "pci.ids"))
    return next(resource for resource in inventory.resources if resource.name == TU106)


@pytest.mark.parametrize("driver", ["snd_hda_intel", "nvidia"])
def test_companion_rebound_to_a_host_driver_after_the_scan_is_refused(tmp_path: Path, driver: str) -> None:
    root = build(NODE01, tmp_path / "root")
    resource = _resource(root)  # the scan: every function of the card on vfio-pci
    device = resource.device(GPU)
    assert device.healthy
    rebind(root, AUDIO, driver)
    problem = recheck_device(device, root)
    assert problem is not None
    assert AUDIO in problem and driver in problem
    with pytest.raises(AllocationError) as refused:
        allocate(resource, [GPU], root)
    assert isinstance(refused.value, DeviceUnavailable)
    assert refused.value.device_id == GPU
    assert GPU in refused.value.message and AUDIO in refused.value.message


def test_companion_unbound_or_back_on_vfio_is_still_allocatable(tmp_path: Path) -> None:
    """No driver, or a VFIO driver, keeps the group viable: no refusal before the next scan."""
    root = build(NODE01, tmp_path / "root")
    resource = _resource(root)
    rebind(root, AUDIO, None)
    assert recheck_device(resource.device(GPU), root) is None
    rebind(root, AUDIO, "vfio-pci")
    assert recheck_device(resource.device(GPU), root) is None
    assert allocate(resource, [GPU], root).envs


def test_plugin_process_refuses_a_gpu_whose_companion_was_rebound_before_its_next_scan() -> None:
    with short_dir() as base:
        root = build_tree(NODE01, base)
        kubelet_dir = base / "kubelet"
        with KubeletStandIn(kubelet_dir) as kubelet, serve_process(root, kubelet_dir, "--scan-interval", "600"):
            kubelet.wait_for_devices(TU106, lambda devices: devices.get(GPU) == "Healthy", timeout=15)
            rebind(root, AUDIO, "snd_hda_intel")  # no rescan for 10 minutes: only Allocate's re-check can see it
            with pytest.raises(grpc.RpcError) as refused:
                kubelet.allocate(TU106, [GPU])
            error = refused.value
            assert isinstance(error, grpc.Call)
            assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert GPU in (error.details() or "") and AUDIO in (error.details() or "")
            rebind(root, AUDIO, "vfio-pci")
            assert kubelet.allocate(TU106, [GPU]).container_responses[0].envs


@pytest.mark.parametrize("node", [NODE01, MIXED_NODE, VGPU_NODE], ids=lambda node: node.name)
def test_the_scan_and_the_recheck_apply_one_rule(tmp_path: Path, node: Node) -> None:
    """Every device the scan calls unhealthy, Allocate's re-check refuses with the very same reason."""
    root = build(node, tmp_path / "root")
    config = PluginConfig(host_root=str(root))
    inventory = scan(root, config, PciIds.load(root / "usr" / "share" / "misc" / "pci.ids"))
    rule = UsabilityRule.from_config(config)
    for resource in inventory.resources:
        for device in resource.devices:
            if device.iommu_group is not None:
                assert recheck_device(device, root, rule) == device.reason, device.id


# The companion variable (issue 15): each allocated GPU's other functions that share its guest slot.

COMPANIONS_ENV = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"


def test_allocate_lists_every_vfio_companion_of_the_gpus_slot(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "root")
    result = allocate(_resource(root), [GPU], root)
    value = result.envs[COMPANIONS_ENV]
    assert value == "0000:86:00.0=0000:86:00.1+0000:86:00.2+0000:86:00.3"
    gpu = PciAddress.parse(GPU)
    assert parse_companions(COMPANIONS_ENV, value) == {
        gpu: tuple(PciAddress.parse(f"0000:86:00.{function}") for function in (1, 2, 3))
    }
    assert kind_of_variable(COMPANIONS_ENV) is None  # neither KubeVirt's prefix nor the hook's allocation prefix


@pytest.mark.parametrize("driver", [None, "pci-stub"])
def test_a_companion_not_on_a_vfio_driver_is_left_out(tmp_path: Path, driver: str | None) -> None:
    """No driver and an allowed host driver keep the group viable, but such a function cannot be passed."""
    root = build(NODE01, tmp_path / "root")
    resource = _resource(root)
    rebind(root, "0000:86:00.2", driver)  # after the scan: Allocate reads the driver as it is now
    result = allocate(resource, [GPU], root)
    assert result.envs[COMPANIONS_ENV] == "0000:86:00.0=0000:86:00.1+0000:86:00.3"
    for function in ("0000:86:00.1", "0000:86:00.3"):
        rebind(root, function, None)
    result = allocate(resource, [GPU], root)
    assert COMPANIONS_ENV not in result.envs  # no GPU with a companion: no variable
    assert list(result.envs) == [resource.env]


def test_only_functions_of_the_gpus_bus_and_slot_are_companions(tmp_path: Path) -> None:
    """A bridge of the group (allowed on pcieport) and a vfio function in another slot stay out of the GPU's
    guest slot: they could not keep their function numbers there."""
    node = Node(
        name="slots",
        functions=(
            Function("0000:3a:00.0", 0x8086, 0x2030, 0x060400, "pcieport", 30, 0),
            Function("0000:3b:00.0", 0x10DE, 0x1F08, 0x030000, "vfio-pci", 30, 0, parent="0000:3a:00.0"),
            Function("0000:3b:00.1", 0x10DE, 0x10F9, 0x040300, "vfio-pci", 30, 0, parent="0000:3a:00.0"),
            Function("0000:3b:01.0", 0x10DE, 0x10F9, 0x040300, "vfio-pci", 30, 0, parent="0000:3a:00.0"),
        ),
        pci_ids=NODE01.pci_ids,
    )
    root = build(node, tmp_path / "root")
    resource = _resource_named(root, TU106)
    device = resource.device("0000:3b:00.0")
    assert device.healthy
    assert {str(companion.address) for companion in device.companions} >= {"0000:3a:00.0", "0000:3b:01.0"}
    result = allocate(resource, ["0000:3b:00.0"], root)
    assert result.envs[COMPANIONS_ENV] == "0000:3b:00.0=0000:3b:00.1"


def test_vgpu_resources_get_no_companion_variable(tmp_path: Path) -> None:
    root = build(VGPU_NODE, tmp_path / "root")
    inventory = scan(root, PluginConfig(host_root=str(root)), PciIds.load(root / "usr" / "share" / "misc" / "pci.ids"))
    for resource in inventory.resources:
        healthy = [device.id for device in resource.devices if device.healthy]
        envs = allocate(resource, healthy[:1], root).envs
        assert list(envs) == [resource.env]
        assert not any(name.startswith("PCI_COMPANIONS_") for name in envs)


def test_plugin_process_sends_the_companion_variable() -> None:
    with short_dir() as base:
        root = build_tree(NODE01, base)
        kubelet_dir = base / "kubelet"
        with KubeletStandIn(kubelet_dir) as kubelet, serve_process(root, kubelet_dir):
            kubelet.wait_for_devices(TU106, lambda devices: devices.get(GPU) == "Healthy", timeout=15)
            envs = dict(kubelet.allocate(TU106, [GPU]).container_responses[0].envs)
            assert envs[COMPANIONS_ENV] == "0000:86:00.0=0000:86:00.1+0000:86:00.2+0000:86:00.3"


def _resource_named(root: Path, name: str) -> Resource:
    inventory = scan(root, PluginConfig(host_root=str(root)), PciIds.load(root / "usr" / "share" / "misc" / "pci.ids"))
    return inventory.resource(name)
