"""The plugin keeps the kubelet's view true while the node and the kubelet change under it (in-process).

The real :class:`~plugin.manager.PluginManager` runs in a thread against the kubelet stand-in over unix
sockets, on fixture trees that the tests change while it runs: ``/dev/vfio`` group nodes removed and
restored, drivers rebound, a card hot-added, mdevs created, the kubelet restarted or late, our socket
deleted. Every wait is for a condition, with a generous timeout; how fast is ``bench/``'s business.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from simkit.fixture_nodes import (
    CLASS_3D,
    MIXED_NODE,
    NODE01,
    NVIDIA,
    T4_1Q_A,
    T4_1Q_B,
    VGPU_NODE,
    root_port,
    tu106_card,
)
from simkit.kubelet_standin import KubeletStandIn
from simkit.sysfs_fixture import Function, Node
from tests.plugin_support import (
    WAIT,
    add_mdev,
    build_tree,
    hot_add,
    manager_for,
    rebind,
    remove_group_node,
    restore_group_node,
    running,
    short_dir,
    sockets,
    wait_until,
)

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
TU106_SOCKET = "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
A10 = "nvidia.com/GA102GL_A10"
NODE01_GPUS = ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0")


@pytest.fixture
def base() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory


def _all(health: str, ids: tuple[str, ...] = NODE01_GPUS) -> dict[str, str]:
    return dict.fromkeys(ids, health)


def test_group_node_removed_then_restored(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir, scan_interval=60)):
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        # The scan interval is a minute: only the inotify watch on /dev/vfio can make this happen in time.
        remove_group_node(root, 30)  # 0000:3b:00.0's group
        devices = kubelet.wait_for_devices(TU106, lambda devices: devices.get("0000:3b:00.0") == "Unhealthy")
        assert devices == {**_all("Healthy"), "0000:3b:00.0": "Unhealthy"}
        assert kubelet.allocatable(TU106) == 3
        assert kubelet.capacity(TU106) == 4
        restore_group_node(root, 30)
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        assert kubelet.registration_count(TU106) == 1
        assert kubelet.stream_open(TU106)


def test_gpu_rebound_to_nvidia_is_withdrawn_and_companion_on_host_driver_unhealthy(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)):
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        rebind(root, "0000:5e:00.0", "nvidia")
        kubelet.wait_for_devices(TU106, lambda devices: "0000:5e:00.0" not in devices)
        assert kubelet.devices(TU106) == _all("Healthy", ("0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"))
        rebind(root, "0000:86:00.1", "snd_hda_intel")  # the audio function makes the group not viable
        kubelet.wait_for_devices(TU106, lambda devices: devices.get("0000:86:00.0") == "Unhealthy")
        rebind(root, "0000:5e:00.0", "vfio-pci")
        rebind(root, "0000:86:00.1", "vfio-pci")
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        assert kubelet.registration_count(TU106) == 1


def test_hot_added_cards_new_resource_and_existing_resource(base: Path) -> None:
    root = build_tree(MIXED_NODE, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)) as manager:
        kubelet.wait_for_devices(A10, lambda devices: len(devices) == 2)
        assert TU106 not in manager.served()
        hot_add(root, *tu106_card(0xAE))  # a resource this node did not have: its own server and registration
        registration = kubelet.wait_for_registration(TU106)
        assert registration.endpoint == TU106_SOCKET
        # A scan may land mid-hot-plug (sysfs written, /dev/vfio/<group> not yet): Unhealthy first, then Healthy.
        kubelet.wait_for_devices(TU106, lambda devices: devices == {"0000:af:00.0": "Healthy"})
        assert (kubelet_dir / TU106_SOCKET).is_socket()
        hot_add(
            root,
            root_port(0x17),
            Function("0000:18:00.0", NVIDIA, 0x2236, CLASS_3D, "vfio-pci", 20, 0, parent="0000:17:00.0"),
        )
        devices = kubelet.wait_for_devices(A10, lambda devices: len(devices) == 3)
        assert devices == _all("Healthy", ("0000:18:00.0", "0000:3b:00.0", "0000:d8:00.0"))
        assert kubelet.registration_count(A10) == 1


def test_resource_with_no_devices_left_stops_its_server(base: Path) -> None:
    root = build_tree(MIXED_NODE, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)) as manager:
        kubelet.wait_for_devices("nvidia.com/2fff", lambda devices: devices == {"0000:5e:00.0": "Healthy"})
        assert (kubelet_dir / "kubevirt-2fff.sock").is_socket()
        rebind(root, "0000:5e:00.0", None)  # unbound: not offered, and it was the resource's only device
        kubelet.wait_for_stream_end("nvidia.com/2fff")
        wait_until(lambda: not (kubelet_dir / "kubevirt-2fff.sock").exists(), what="the socket to be removed")
        assert "nvidia.com/2fff" not in manager.served()
        assert kubelet.devices("nvidia.com/2fff") == {"0000:5e:00.0": "Unhealthy"}  # what the kubelet keeps
        assert kubelet.stream_open(A10)
        rebind(root, "0000:5e:00.0", "vfio-pci")  # back: served and registered again
        kubelet.wait_for_registration("nvidia.com/2fff", 2)
        kubelet.wait_for_devices("nvidia.com/2fff", lambda devices: devices == {"0000:5e:00.0": "Healthy"})


def test_new_mdevs_join_their_resource_or_get_a_new_one(base: Path) -> None:
    root = build_tree(VGPU_NODE, base)
    kubelet_dir = base / "kubelet"
    new_1q = "0d6bd2a5-33e2-4b4c-9c70-3c9a4f1f2b01"
    new_1b = "7e8a8f5c-1f3b-4d86-a1c2-5b0e7c6d4a02"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)):
        kubelet.wait_for_devices("nvidia.com/GRID_T4-1Q", lambda devices: len(devices) == 2)
        add_mdev(root, new_1q, "0000:3b:00.0", "nvidia-230", 143)
        devices = kubelet.wait_for_devices("nvidia.com/GRID_T4-1Q", lambda devices: len(devices) == 3)
        assert devices == _all("Healthy", (T4_1Q_A, T4_1Q_B, new_1q))
        add_mdev(root, new_1b, "0000:d8:00.0", "nvidia-222", 144)
        kubelet.wait_for_registration("nvidia.com/GRID_T4-1B")
        assert kubelet.wait_for_devices("nvidia.com/GRID_T4-1B", bool) == {new_1b: "Healthy"}
        response = kubelet.allocate("nvidia.com/GRID_T4-1B", [new_1b])
        assert dict(response.container_responses[0].envs) == {"MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1B": new_1b}
        assert [d.host_path for d in response.container_responses[0].devices] == ["/dev/vfio/vfio", "/dev/vfio/144"]


def test_kubelet_restart_serves_again_and_re_registers(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    (kubelet_dir).mkdir()
    (kubelet_dir / "kubelet_internal_checkpoint").write_text("{}")
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir, scan_interval=60)):
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        kubelet.restart()  # deletes every socket, ours included, then serves a new kubelet.sock
        kubelet.wait_for_registration(TU106, 2)
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        assert kubelet.stream_open(TU106)
        assert sockets(kubelet_dir) == ["kubelet.sock", TU106_SOCKET]
        assert kubelet.allocate(TU106, ["0000:86:00.0"]).container_responses[0].envs
        kubelet.restart()
        kubelet.wait_for_registration(TU106, 3)
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        assert kubelet.registration_count(TU106) == 3  # once per kubelet start, no duplicates
        assert kubelet.refusals == []


def test_own_socket_deleted_serves_again_and_re_registers(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir, scan_interval=60)):
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        (kubelet_dir / TU106_SOCKET).unlink()
        kubelet.wait_for_registration(TU106, 2)
        wait_until(lambda: kubelet.stream_open(TU106), what="a new ListAndWatch stream")
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        assert (kubelet_dir / TU106_SOCKET).is_socket()


def test_kubelet_started_late_and_stopped_for_a_while(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    kubelet = KubeletStandIn(kubelet_dir)
    with running(manager_for(root, kubelet_dir, scan_interval=60)) as manager:
        # No kubelet: the plugin serves and waits, it does not exit.
        assert (kubelet_dir / TU106_SOCKET).is_socket()
        assert manager.registered() == ()
        kubelet.start()
        try:
            kubelet.wait_for_registration(TU106)
            kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
            kubelet.stop()  # a dead kubelet leaves its socket: registrations to it fail, and are retried
            kubelet.start()
            kubelet.wait_for_registration(TU106, 2)
            kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        finally:
            kubelet.stop()


def test_stop_ends_streams_and_removes_only_our_sockets(base: Path) -> None:
    root = build_tree(VGPU_NODE, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet:
        with running(manager_for(root, kubelet_dir)):
            kubelet.wait_for_devices("nvidia.com/GRID_T4-2Q", bool)
            assert sockets(kubelet_dir) == ["kubelet.sock", "kubevirt-GRID_T4-1Q.sock", "kubevirt-GRID_T4-2Q.sock"]
        assert sockets(kubelet_dir) == ["kubelet.sock"]
        kubelet.wait_for_stream_end("nvidia.com/GRID_T4-1Q")
        kubelet.wait_for_devices("nvidia.com/GRID_T4-2Q", lambda devices: set(devices.values()) == {"Unhealthy"})
    assert WAIT > 0


def test_unreadable_sysfs_keeps_the_last_truth_and_vfio_dir_recreated(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    devices_dir = root / "sys" / "bus" / "pci" / "devices"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)) as manager:
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        scans = manager.scans
        devices_dir.rename(root / "sys" / "bus" / "pci" / "hidden")  # a scan now fails: nothing to read
        wait_until(lambda: manager.scans >= scans + 3, what="a few failed rescans")
        assert manager.served() == (TU106,)
        assert kubelet.devices(TU106) == _all("Healthy")
        assert kubelet.stream_open(TU106)
        (root / "sys" / "bus" / "pci" / "hidden").rename(devices_dir)
        # vfio unloaded and loaded again: every group node goes, then the directory comes back (new watch).
        vfio = root / "dev" / "vfio"
        saved = sorted(entry.name for entry in vfio.iterdir())
        for name in saved:
            (vfio / name).unlink()
        vfio.rmdir()
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Unhealthy"))
        vfio.mkdir()
        for name in saved:
            (vfio / name).write_text("")
        kubelet.wait_for_devices(TU106, lambda devices: devices == _all("Healthy"))
        remove_group_node(root, 50)  # the new watch works: 0000:5e:00.0
        kubelet.wait_for_devices(TU106, lambda devices: devices.get("0000:5e:00.0") == "Unhealthy")
        assert kubelet.registration_count(TU106) == 1


def test_node_without_gpus_waits_then_serves_a_hot_added_card(base: Path) -> None:
    root = build_tree(Node(name="empty", functions=(root_port(0x17),)), base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)) as manager:
        assert manager.served() == ()
        assert sockets(kubelet_dir) == ["kubelet.sock"]
        hot_add(root, *tu106_card(0x3A))
        kubelet.wait_for_registration("nvidia.com/1f08")  # this tree has no pci.ids: hex names
        assert kubelet.wait_for_devices("nvidia.com/1f08", bool) == {"0000:3b:00.0": "Healthy"}
