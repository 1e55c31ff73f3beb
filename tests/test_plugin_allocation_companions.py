"""Allocate's host re-check covers a GPU's companions, not only the GPU (found by the flapping soak, issue 7).

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
from simkit.fixture_nodes import MIXED_NODE, NODE01, VGPU_NODE
from simkit.kubelet_standin import KubeletStandIn
from simkit.sysfs_fixture import Node, build
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
