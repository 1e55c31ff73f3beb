"""The per-resource gRPC server on its own unix socket, with a plain gRPC client and with the kubelet stand-in.

Covers the protocol: options, ``ListAndWatch`` (whole list, NUMA topology, a message per visible change, open
until the server stops), ``PreStartContainer``, ``Register`` as the kubelet checks it, and the socket file's
life (stale replaced, a foreign file refused, ours removed on stop, a newer one left alone).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from plugin.inventory import Resource
from plugin.server import (
    API_VERSION,
    ResourceServer,
    SocketInUse,
    device_message,
    kubelet_view,
    list_response,
    plugin_options,
)
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from simkit.fixture_nodes import MIXED_NODE, NODE01
from simkit.kubelet_standin import KubeletStandIn
from tests.discovery_support import discover
from tests.plugin_support import WAIT, build_tree, short_dir

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"


@pytest.fixture
def base() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory


def _resource(base: Path, name: str = TU106, node: object = NODE01) -> tuple[Path, Resource]:
    root = build_tree(node, base)  # type: ignore[arg-type]
    return root, discover(root).resource(name)


@pytest.fixture
def served(base: Path) -> Iterator[tuple[ResourceServer, Resource]]:
    root, resource = _resource(base)
    server = ResourceServer(resource, base / "kubelet", root)
    (base / "kubelet").mkdir()
    server.start()
    try:
        yield server, resource
    finally:
        server.stop(grace=0)


def _stub(server: ResourceServer) -> tuple[grpc.Channel, object]:
    channel = grpc.insecure_channel(f"unix:{server.socket_path}")
    return channel, pb_grpc.DevicePluginStub(channel)


def _unhealthy(resource: Resource, device_id: str) -> Resource:
    devices = tuple(
        dataclasses.replace(device, healthy=False, reason="test") if device.id == device_id else device
        for device in resource.devices
    )
    return dataclasses.replace(resource, devices=devices)


class _Reader:
    """Reads a ListAndWatch stream in a thread into a queue (so a test can wait for the next message)."""

    def __init__(self, stub: object) -> None:
        self.call = stub.ListAndWatch(pb.Empty())  # type: ignore[attr-defined]
        self.messages: queue.Queue[pb.ListAndWatchResponse | None] = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.put(message)
        except grpc.RpcError as exc:
            self.error = exc
        self.messages.put(None)

    def next(self) -> pb.ListAndWatchResponse | None:
        return self.messages.get(timeout=WAIT)


def test_options_offer_preferred_allocation_and_no_pre_start(served: tuple[ResourceServer, Resource]) -> None:
    server, _ = served
    channel, stub = _stub(server)
    with channel:
        options = stub.GetDevicePluginOptions(pb.Empty(), timeout=WAIT)  # type: ignore[attr-defined]
        assert options.get_preferred_allocation_available is True
        assert options.pre_start_required is False
        assert options == plugin_options()
        assert stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["x"]), timeout=WAIT) == (  # type: ignore[attr-defined]
            pb.PreStartContainerResponse()
        )


def test_socket_is_the_resources_socket_name(served: tuple[ResourceServer, Resource]) -> None:
    server, resource = served
    assert server.socket_path.name == "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock" == resource.socket
    assert server.socket_path.is_socket()
    assert server.socket_intact()


def test_list_and_watch_sends_the_whole_list_with_numa_then_each_change(
    served: tuple[ResourceServer, Resource],
) -> None:
    server, resource = served
    channel, stub = _stub(server)
    with channel:
        reader = _Reader(stub)
        first = reader.next()
        assert first is not None
        assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in first.devices] == [
            ("0000:3b:00.0", "Healthy", [0]),
            ("0000:5e:00.0", "Healthy", [0]),
            ("0000:86:00.0", "Healthy", [1]),
            ("0000:af:00.0", "Healthy", [1]),
        ]
        # An update the kubelet cannot see (same IDs, health, NUMA) sends nothing; the next real change is
        # the very next message, and it carries the whole list again.
        assert server.update(dataclasses.replace(resource, selectors=("10DE:FFFF",))) is False
        assert server.update(_unhealthy(resource, "0000:86:00.0")) is True
        second = reader.next()
        assert second is not None
        assert {d.ID: d.health for d in second.devices} == {
            "0000:3b:00.0": "Healthy",
            "0000:5e:00.0": "Healthy",
            "0000:86:00.0": "Unhealthy",
            "0000:af:00.0": "Healthy",
        }
        withdrawn = dataclasses.replace(resource, devices=resource.devices[:2])
        assert server.update(withdrawn) is True
        third = reader.next()
        assert third is not None
        assert [d.ID for d in third.devices] == ["0000:3b:00.0", "0000:5e:00.0"]
        assert reader.messages.empty()
        server.stop(grace=0)
        assert reader.next() is None  # the stream ended when the plugin stopped, not before
        reader.thread.join(WAIT)


def test_two_streams_each_get_every_change(served: tuple[ResourceServer, Resource]) -> None:
    server, resource = served
    channel, stub = _stub(server)
    with channel:
        readers = [_Reader(stub), _Reader(stub)]
        for reader in readers:
            assert reader.next() is not None
        server.update(_unhealthy(resource, "0000:3b:00.0"))
        for reader in readers:
            message = reader.next()
            assert message is not None
            assert message.devices[0].health == "Unhealthy"
        reader = readers[0]
        reader.call.cancel()  # the kubelet goes away: its handler returns, the other stream is unaffected
        assert reader.next() is None
        server.update(resource)
        message = readers[1].next()
        assert message is not None
        assert all(device.health == "Healthy" for device in message.devices)


def test_unknown_numa_node_sends_no_topology(base: Path) -> None:
    _, resource = _resource(base, "nvidia.com/2fff", MIXED_NODE)
    (message,) = list_response(resource).devices
    assert message.ID == "0000:5e:00.0"
    assert not message.HasField("topology")
    assert device_message(resource.devices[0]) == message
    assert kubelet_view(resource) == (("0000:5e:00.0", True, None),)


def test_register_with_the_stand_in_which_dials_back(served: tuple[ResourceServer, Resource], base: Path) -> None:
    server, resource = served
    answers: queue.Queue[BaseException | None] = queue.Queue()
    with KubeletStandIn(base / "kubelet") as kubelet:
        server.restart()  # the starting kubelet removed every socket in its directory, ours too

        def done(error: BaseException | None, channel: grpc.Channel) -> None:
            channel.close()
            answers.put(error)

        server.register(kubelet.socket_path, done)
        assert answers.get(timeout=WAIT) is None
        registration = kubelet.wait_for_registration(TU106)
        assert registration.endpoint == "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
        assert registration.options == plugin_options()
        assert kubelet.options(TU106) == plugin_options()
        assert kubelet.wait_for_devices(TU106, lambda devices: len(devices) == 4) == {
            device.id: "Healthy" for device in resource.devices
        }
        server.update(_unhealthy(resource, "0000:af:00.0"))
        kubelet.wait_for_devices(TU106, lambda devices: devices.get("0000:af:00.0") == "Unhealthy")
        assert kubelet.allocatable(TU106) == 3
        assert kubelet.capacity(TU106) == 4
        assert API_VERSION == "v1beta1"


def test_register_fails_cleanly_without_a_kubelet(served: tuple[ResourceServer, Resource], base: Path) -> None:
    server, _ = served
    answers: queue.Queue[BaseException | None] = queue.Queue()

    def done(error: BaseException | None, channel: grpc.Channel) -> None:
        channel.close()
        answers.put(error)

    server.register(base / "kubelet" / "kubelet.sock", done)
    error = answers.get(timeout=WAIT)
    assert isinstance(error, grpc.RpcError)
    assert error.code() is grpc.StatusCode.UNAVAILABLE


def test_stale_socket_replaced_foreign_file_refused(base: Path) -> None:
    root, resource = _resource(base)
    kubelet_dir = base / "kubelet"
    kubelet_dir.mkdir()
    first = ResourceServer(resource, kubelet_dir, root)
    first.start()
    first._server.stop(0).wait()  # type: ignore[union-attr]  # a crashed run leaves its socket behind
    second = ResourceServer(resource, kubelet_dir, root)
    second.start()
    assert second.socket_intact()
    second.stop(grace=0)
    assert not second.socket_path.exists()
    second.socket_path.write_text("not a socket")
    with pytest.raises(SocketInUse, match="not a socket"):
        ResourceServer(resource, kubelet_dir, root).start()


def test_stop_leaves_a_newer_socket_alone(served: tuple[ResourceServer, Resource], base: Path) -> None:
    server, resource = served
    server.socket_path.unlink()  # deleted by a restarting kubelet; someone else serves the name now
    newer = ResourceServer(resource, base / "kubelet", base / "root")
    newer.start()
    try:
        assert not server.socket_intact()
        server.stop(grace=0)
        assert newer.socket_path.is_socket()
        assert newer.socket_intact()
    finally:
        newer.stop(grace=0)


def test_restart_serves_a_new_socket_and_generation(served: tuple[ResourceServer, Resource]) -> None:
    server, _ = served
    generation = server.generation
    server.socket_path.unlink()
    assert not server.socket_intact()
    server.restart()
    assert server.generation == generation + 1
    assert server.socket_intact()
    channel, stub = _stub(server)
    with channel:
        assert stub.GetDevicePluginOptions(pb.Empty(), timeout=WAIT) == plugin_options()  # type: ignore[attr-defined]


def test_too_long_socket_path_is_refused(base: Path) -> None:
    root, resource = _resource(base)
    deep = base / ("d" * 90)
    deep.mkdir()
    with pytest.raises(SocketInUse, match="longer than 107 bytes"):
        ResourceServer(resource, deep, root).start()
