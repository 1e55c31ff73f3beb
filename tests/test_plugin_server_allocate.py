"""Allocate and GetPreferredAllocation through the real servers, called by the kubelet stand-in.

The plugin runs in-process (:class:`~plugin.manager.PluginManager`) on the fixture trees; the stand-in calls
the methods over the unix sockets as the kubelet does. Checks the env var (exactly the request's IDs, in
request order), the DeviceSpecs (real host paths, ``mrw``), the vGPU variable and the mdev's group, and the
refusals (unknown → INVALID_ARGUMENT, unhealthy → FAILED_PRECONDITION, each naming the device).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from plugin.allocation import DeviceUnavailable, InvalidRequest
from plugin.manager import PluginManager
from plugin.server import status_for_refusal
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from simkit.fixture_nodes import MIXED_NODE, NODE01, T4_1Q_A, T4_1Q_B, T4_2Q, VGPU_NODE
from simkit.kubelet_standin import KubeletStandIn
from simkit.sysfs_fixture import Node
from tests.plugin_support import WAIT, build_tree, manager_for, running, short_dir

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
TU106_ENV = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
TU106_COMPANIONS = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"


@pytest.fixture
def base() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory


@pytest.fixture
def plugin(base: Path, request: pytest.FixtureRequest) -> Iterator[tuple[KubeletStandIn, PluginManager, Path]]:
    node: Node = getattr(request, "param", NODE01)
    root = build_tree(node, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir, scan_interval=5)) as manager:
        yield kubelet, manager, root


def _specs(response: pb.AllocateResponse) -> list[tuple[str, str, str]]:
    return [(d.container_path, d.host_path, d.permissions) for d in response.container_responses[0].devices]


def test_allocate_env_holds_the_requested_ids_in_request_order(
    plugin: tuple[KubeletStandIn, PluginManager, Path],
) -> None:
    kubelet, _, _ = plugin
    kubelet.wait_for_registration(TU106)
    kubelet.wait_for_devices(TU106, lambda devices: len(devices) == 4)
    response = kubelet.allocate(TU106, ["0000:af:00.0", "0000:3b:00.0"])
    container = response.container_responses[0]
    assert dict(container.envs) == {
        TU106_ENV: "0000:af:00.0,0000:3b:00.0",
        TU106_COMPANIONS: "0000:af:00.0=0000:af:00.1+0000:af:00.2+0000:af:00.3,"
        "0000:3b:00.0=0000:3b:00.1+0000:3b:00.2+0000:3b:00.3",
    }
    # Real node paths (not under the host root), the container node first, each group once, mrw.
    assert _specs(response) == [
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
        ("/dev/vfio/96", "/dev/vfio/96", "mrw"),
        ("/dev/vfio/30", "/dev/vfio/30", "mrw"),
    ]
    one = kubelet.allocate(TU106, ["0000:86:00.0"])
    assert dict(one.container_responses[0].envs) == {
        TU106_ENV: "0000:86:00.0",
        TU106_COMPANIONS: "0000:86:00.0=0000:86:00.1+0000:86:00.2+0000:86:00.3",
    }


def test_allocate_refuses_unknown_and_names_it(plugin: tuple[KubeletStandIn, PluginManager, Path]) -> None:
    kubelet, _, _ = plugin
    kubelet.wait_for_registration(TU106)
    with pytest.raises(grpc.RpcError) as caught:
        kubelet.allocate(TU106, ["0000:3b:00.0", "0000:d8:00.0"])
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "0000:d8:00.0" in str(caught.value.details())
    with pytest.raises(grpc.RpcError) as caught:
        kubelet.allocate(TU106, ["x" * 10_000])
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # The server is still fine after bad input.
    assert kubelet.allocate(TU106, ["0000:3b:00.0"]).container_responses[0].envs[TU106_ENV] == "0000:3b:00.0"


@pytest.mark.parametrize("plugin", [MIXED_NODE], indirect=True)
def test_allocate_refuses_an_unhealthy_device(plugin: tuple[KubeletStandIn, PluginManager, Path]) -> None:
    kubelet, _, _ = plugin
    resource = "nvidia.com/GA102_GEFORCE_RTX_3090"
    kubelet.wait_for_registration(resource)
    assert kubelet.wait_for_devices(resource, lambda devices: len(devices) == 1) == {"0000:86:00.0": "Unhealthy"}
    with pytest.raises(grpc.RpcError) as caught:
        kubelet.allocate(resource, ["0000:86:00.0"])
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "0000:86:00.0" in str(caught.value.details())
    assert "snd_hda_intel" in str(caught.value.details())


@pytest.mark.parametrize("plugin", [VGPU_NODE], indirect=True)
def test_vgpu_allocate_sets_the_mdev_variable_and_the_mdevs_group(
    plugin: tuple[KubeletStandIn, PluginManager, Path],
) -> None:
    kubelet, manager, _ = plugin
    kubelet.wait_for_registration("nvidia.com/GRID_T4-1Q")
    kubelet.wait_for_registration("nvidia.com/GRID_T4-2Q")
    assert manager.served() == ("nvidia.com/GRID_T4-1Q", "nvidia.com/GRID_T4-2Q")
    assert kubelet.wait_for_devices("nvidia.com/GRID_T4-1Q", lambda devices: len(devices) == 2) == {
        T4_1Q_A: "Healthy",
        T4_1Q_B: "Healthy",
    }
    response = kubelet.allocate("nvidia.com/GRID_T4-1Q", [T4_1Q_B, T4_1Q_A])
    assert dict(response.container_responses[0].envs) == {
        "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q": f"{T4_1Q_B},{T4_1Q_A}"
    }
    assert _specs(response) == [
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
        ("/dev/vfio/141", "/dev/vfio/141", "mrw"),
        ("/dev/vfio/140", "/dev/vfio/140", "mrw"),
    ]
    other = kubelet.allocate("nvidia.com/GRID_T4-2Q", [T4_2Q])
    assert dict(other.container_responses[0].envs) == {"MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-2Q": T4_2Q}
    assert _specs(other)[1] == ("/dev/vfio/142", "/dev/vfio/142", "mrw")


def test_preferred_allocation_answers_exactly_the_size(plugin: tuple[KubeletStandIn, PluginManager, Path]) -> None:
    kubelet, _, _ = plugin
    kubelet.wait_for_registration(TU106)
    available = ["0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0"]
    chosen = kubelet.preferred_allocation(TU106, available, ["0000:86:00.0"], 2)
    assert len(chosen) == 2
    assert chosen[0] == "0000:86:00.0"
    assert set(chosen) <= set(available)
    assert kubelet.preferred_allocation(TU106, available, ["0000:86:00.0"], 2) == chosen  # deterministic


def test_bad_preferred_request_is_a_status_not_a_crash(plugin: tuple[KubeletStandIn, PluginManager, Path]) -> None:
    kubelet, _, _ = plugin
    kubelet.wait_for_registration(TU106)
    with pytest.raises(grpc.RpcError) as caught:
        kubelet.preferred_allocation(TU106, ["0000:3b:00.0"], [], 3)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert len(kubelet.preferred_allocation(TU106, ["0000:3b:00.0", "0000:5e:00.0"], [], 1)) == 1
    assert WAIT > 0


def test_the_grpc_adapter_maps_allocation_refusals_to_status_codes() -> None:
    assert status_for_refusal(InvalidRequest("r: unknown device ID 'x'", "x")) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_for_refusal(DeviceUnavailable("r: device x is unhealthy", "x")) is grpc.StatusCode.FAILED_PRECONDITION
