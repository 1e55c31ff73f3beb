"""The kubelet stand-in behaves as docs/protocols.md, "Kubelet device plugin API" says, against a small fake plugin
over real unix sockets."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from simkit.kubelet_standin import KubeletStandIn, StandInError

RESOURCE = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
ENDPOINT = "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
GPU_A = "0000:3b:00.0"
GPU_B = "0000:86:00.0"


class FakePlugin:
    """A ``v1beta1.DevicePlugin`` whose device list and stream end the test controls."""

    def __init__(self, options: pb.DevicePluginOptions | None = None) -> None:
        self.answer_options = options or pb.DevicePluginOptions(get_preferred_allocation_available=True)
        self.option_calls = 0
        self.allocate_requests: list[list[str]] = []
        self.streams_open = 0
        self.authorities: list[str] = []
        self._changed = threading.Condition()
        self._devices: list[pb.Device] = []
        self._version = 0
        self._finished = False

    def set_devices(self, devices: dict[str, str]) -> None:
        with self._changed:
            self._devices = [pb.Device(ID=device_id, health=health) for device_id, health in devices.items()]
            self._version += 1
            self._changed.notify_all()

    def finish(self) -> None:
        """Make every open ListAndWatch handler return (a clean end of stream)."""
        with self._changed:
            self._finished = True
            self._changed.notify_all()

    def wait_streams(self, count: int, timeout: float = 5) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.streams_open == count, timeout), self.streams_open

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        with self._changed:
            self.option_calls += 1
        return self.answer_options

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        with self._changed:
            self.streams_open += 1
            self._changed.notify_all()
        context.add_callback(self._wake)
        try:
            sent = [-1]
            while True:
                with self._changed:
                    self._changed.wait_for(
                        lambda: self._version != sent[0] or self._finished or not context.is_active()
                    )
                    if self._finished or not context.is_active():
                        return
                    sent[0], devices = self._version, list(self._devices)
                yield pb.ListAndWatchResponse(devices=devices)
        finally:
            with self._changed:
                self.streams_open -= 1
                self._changed.notify_all()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        responses = []
        for container in request.container_requests:
            ids = list(container.devices_ids)
            self.allocate_requests.append(ids)
            responses.append(pb.ContainerAllocateResponse(envs={"IDS": ",".join(ids)}))
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(
                    deviceIDs=sorted(container.available_deviceIDs)[: container.allocation_size]
                )
                for container in request.container_requests
            ]
        )


@contextmanager
def serving(plugin: FakePlugin, path: Path) -> Iterator[grpc.Server]:
    executor = futures.ThreadPoolExecutor(max_workers=4)
    server = grpc.server(executor)
    pb_grpc.add_DevicePluginServicer_to_server(plugin, server)
    assert server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        yield server
    finally:
        plugin.finish()
        server.stop(grace=None).wait()
        executor.shutdown(wait=True)


def register(
    kubelet_dir: Path,
    resource: str = RESOURCE,
    endpoint: str = ENDPOINT,
    version: str = "v1beta1",
    options: pb.DevicePluginOptions | None = None,
) -> None:
    with grpc.insecure_channel(f"unix:{kubelet_dir / 'kubelet.sock'}") as channel:
        pb_grpc.RegistrationStub(channel).Register(
            pb.RegisterRequest(
                version=version,
                endpoint=endpoint,
                resource_name=resource,
                options=options or pb.DevicePluginOptions(get_preferred_allocation_available=True),
            ),
            timeout=15,
        )


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kp", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(kubelet_dir: Path) -> Iterator[KubeletStandIn]:
    with KubeletStandIn(kubelet_dir, dial_timeout=1.0) as standin:
        yield standin


def all_healthy(devices: dict[str, str]) -> bool:
    return bool(devices) and all(health == "Healthy" for health in devices.values())


def all_unhealthy(devices: dict[str, str]) -> bool:
    return bool(devices) and all(health == "Unhealthy" for health in devices.values())


def test_serves_kubelet_sock_and_register_dials_back_for_options(kubelet: KubeletStandIn, kubelet_dir: Path) -> None:
    assert (kubelet_dir / "kubelet.sock").is_socket()
    plugin = FakePlugin(pb.DevicePluginOptions(get_preferred_allocation_available=True))
    with serving(plugin, kubelet_dir / ENDPOINT):
        # The request's options differ from the dial-back's answer: the kubelet keeps the answer.
        register(kubelet_dir, options=pb.DevicePluginOptions(pre_start_required=True))
        assert plugin.option_calls == 1  # inside Register, before it returned
        registration = kubelet.wait_for_registration(RESOURCE)
        assert (registration.resource_name, registration.endpoint) == (RESOURCE, ENDPOINT)
        assert registration.options.pre_start_required
        options = kubelet.options(RESOURCE)
        assert options.get_preferred_allocation_available
        assert not options.pre_start_required


def test_register_fails_when_the_plugin_does_not_serve_its_endpoint(kubelet: KubeletStandIn, kubelet_dir: Path) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        register(kubelet_dir)
    assert caught.value.code() is grpc.StatusCode.UNKNOWN
    assert "GetDevicePluginOptions" in (caught.value.details() or "")
    assert kubelet.registrations == []
    assert kubelet.devices(RESOURCE) == {}
    with pytest.raises(StandInError):
        kubelet.options(RESOURCE)


def test_register_fails_when_get_device_plugin_options_fails(kubelet: KubeletStandIn, kubelet_dir: Path) -> None:
    class Broken(FakePlugin):
        def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
            context.abort(grpc.StatusCode.INTERNAL, "broken")

    with serving(Broken(), kubelet_dir / ENDPOINT), pytest.raises(grpc.RpcError) as caught:
        register(kubelet_dir)
    assert "broken" in (caught.value.details() or "")
    assert kubelet.registrations == []


@pytest.mark.parametrize(
    ("version", "resource", "reason"),
    [
        ("v1alpha", RESOURCE, "Unsupported version"),
        ("v1beta2", RESOURCE, "Unsupported version"),
        ("", RESOURCE, "Unsupported version"),
        ("v1beta1", "TU106", "invalid resource name"),
        ("v1beta1", "kubernetes.io/gpu", "invalid resource name"),
        ("v1beta1", "example.kubernetes.io/gpu", "invalid resource name"),
        ("v1beta1", "nvidia.com/", "invalid resource name"),
    ],
)
def test_register_refuses_other_versions_and_non_extended_names(
    kubelet: KubeletStandIn, kubelet_dir: Path, version: str, resource: str, reason: str
) -> None:
    plugin = FakePlugin()
    with serving(plugin, kubelet_dir / ENDPOINT), pytest.raises(grpc.RpcError) as caught:
        register(kubelet_dir, resource=resource, version=version)
    assert reason in (caught.value.details() or "")
    assert plugin.option_calls == 0
    assert kubelet.registrations == []
    assert len(kubelet.refusals) == 1


def test_every_message_replaces_the_list_and_only_exact_healthy_counts(
    kubelet: KubeletStandIn, kubelet_dir: Path
) -> None:
    plugin = FakePlugin()
    plugin.set_devices({GPU_A: "Healthy", GPU_B: "Healthy"})
    with serving(plugin, kubelet_dir / ENDPOINT):
        register(kubelet_dir)
        assert kubelet.wait_for_devices(RESOURCE, lambda d: len(d) == 2) == {GPU_A: "Healthy", GPU_B: "Healthy"}
        assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (2, 2)

        plugin.set_devices({GPU_B: "healthy"})
        assert kubelet.wait_for_devices(RESOURCE, lambda d: GPU_A not in d) == {GPU_B: "healthy"}
        assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (1, 0)

        plugin.set_devices({GPU_A: "Unhealthy", GPU_B: "Healthy"})
        kubelet.wait_for_devices(RESOURCE, lambda d: len(d) == 2)
        assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (2, 1)
        assert kubelet.healthy(RESOURCE) == [GPU_B]
        assert [device.ID for device in kubelet.device_messages(RESOURCE)] == [GPU_A, GPU_B]
        assert kubelet.updates(RESOURCE) == 3
        stamp = kubelet.updated_at(RESOURCE)
        assert stamp is not None and stamp >= kubelet.wait_for_registration(RESOURCE).time
    assert kubelet.updated_at("example.com/none") is None


def test_a_stream_the_handler_ends_makes_every_device_unhealthy(kubelet: KubeletStandIn, kubelet_dir: Path) -> None:
    plugin = FakePlugin()
    plugin.set_devices({GPU_A: "Healthy", GPU_B: "Healthy"})
    with serving(plugin, kubelet_dir / ENDPOINT):
        register(kubelet_dir)
        kubelet.wait_for_devices(RESOURCE, all_healthy)
        assert kubelet.stream_open(RESOURCE)
        plugin.finish()
        assert kubelet.wait_for_devices(RESOURCE, all_unhealthy) == {GPU_A: "Unhealthy", GPU_B: "Unhealthy"}
        assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (2, 0)
        kubelet.wait_for_stream_end(RESOURCE)
        assert not kubelet.stream_open(RESOURCE)


def test_a_plugin_that_dies_makes_every_device_unhealthy(kubelet: KubeletStandIn, kubelet_dir: Path) -> None:
    plugin = FakePlugin()
    plugin.set_devices({GPU_A: "Healthy"})
    with serving(plugin, kubelet_dir / ENDPOINT) as server:
        register(kubelet_dir)
        kubelet.wait_for_devices(RESOURCE, all_healthy)
        server.stop(grace=None).wait()
        assert kubelet.wait_for_devices(RESOURCE, all_unhealthy) == {GPU_A: "Unhealthy"}


def test_a_new_register_keeps_the_replaced_clients_stream_open_and_reads_it(
    kubelet: KubeletStandIn, kubelet_dir: Path
) -> None:
    old, new = FakePlugin(), FakePlugin()
    old.set_devices({GPU_A: "Healthy"})
    new.set_devices({GPU_B: "Healthy"})
    with serving(old, kubelet_dir / "old.sock"), serving(new, kubelet_dir / "new.sock"):
        register(kubelet_dir, endpoint="old.sock")
        kubelet.wait_for_devices(RESOURCE, lambda d: d == {GPU_A: "Healthy"})
        register(kubelet_dir, endpoint="new.sock")
        assert kubelet.wait_for_registration(RESOURCE, count=2).endpoint == "new.sock"
        assert kubelet.wait_for_devices(RESOURCE, lambda d: d == {GPU_B: "Healthy"}) == {GPU_B: "Healthy"}
        new.wait_streams(1)
        # The kubelet does not close the client it replaced: its stream stays open and its messages still
        # update the resource (the kubelet keys them by resource name only).
        old.set_devices({GPU_A: "Unhealthy"})
        assert kubelet.wait_for_devices(RESOURCE, lambda d: d == {GPU_A: "Unhealthy"}) == {GPU_A: "Unhealthy"}
        assert old.streams_open == 1
        assert kubelet.open_streams(RESOURCE) == 2
        assert kubelet.stream_open(RESOURCE)
        # Calls go to the endpoint of the last registration.
        kubelet.allocate(RESOURCE, [GPU_B])
        assert (old.allocate_requests, new.allocate_requests) == ([], [[GPU_B]])
        assert kubelet.disconnects(RESOURCE) == 0


def test_the_end_of_any_stream_disconnects_the_current_client_and_marks_every_device_unhealthy(
    kubelet: KubeletStandIn, kubelet_dir: Path
) -> None:
    old, new = FakePlugin(), FakePlugin()
    old.set_devices({GPU_A: "Healthy"})
    new.set_devices({GPU_A: "Healthy", GPU_B: "Healthy"})
    with serving(old, kubelet_dir / "old.sock"), serving(new, kubelet_dir / "new.sock"):
        register(kubelet_dir, endpoint="old.sock")
        old.wait_streams(1)
        register(kubelet_dir, endpoint="new.sock")
        kubelet.wait_for_devices(RESOURCE, lambda d: d == {GPU_A: "Healthy", GPU_B: "Healthy"})
        new.wait_streams(1)
        old.finish()  # the replaced client's stream ends: the kubelet disconnects the current client, the new one
        assert kubelet.wait_for_devices(RESOURCE, all_unhealthy) == {GPU_A: "Unhealthy", GPU_B: "Unhealthy"}
        new.wait_streams(0)  # its connection was closed
        assert kubelet.disconnects(RESOURCE) == 1
        assert not kubelet.stream_open(RESOURCE)
        kubelet.wait_for_open_streams(RESOURCE, 0)
        with pytest.raises(StandInError, match="disconnected"):
            kubelet.allocate(RESOURCE, [GPU_B])
        # Registering again connects a new client.
        register(kubelet_dir, endpoint="new.sock")
        kubelet.wait_for_devices(RESOURCE, all_healthy)
        assert kubelet.stream_open(RESOURCE)


def test_disconnect_closes_the_current_clients_connection_as_a_streams_end_does(
    kubelet: KubeletStandIn, kubelet_dir: Path
) -> None:
    plugin = FakePlugin()
    plugin.set_devices({GPU_A: "Healthy"})
    with serving(plugin, kubelet_dir / ENDPOINT):
        assert not kubelet.disconnect(RESOURCE)  # nothing registered
        register(kubelet_dir)
        kubelet.wait_for_devices(RESOURCE, all_healthy)
        assert kubelet.disconnect(RESOURCE)
        plugin.wait_streams(0)
        assert kubelet.devices(RESOURCE) == {GPU_A: "Unhealthy"}
        assert kubelet.disconnects(RESOURCE) == 1
        assert not kubelet.disconnect(RESOURCE)  # already gone
        assert kubelet.disconnects(RESOURCE) == 1


def test_every_register_call_is_counted_refused_or_not(kubelet: KubeletStandIn, kubelet_dir: Path) -> None:
    with pytest.raises(grpc.RpcError):
        register(kubelet_dir)  # nobody serves the endpoint
    with pytest.raises(grpc.RpcError):
        register(kubelet_dir, version="v1alpha")
    plugin = FakePlugin()
    with serving(plugin, kubelet_dir / ENDPOINT):
        register(kubelet_dir)
    assert kubelet.request_count(RESOURCE) == 3
    assert kubelet.registration_count(RESOURCE) == 1
    assert kubelet.requests == [(RESOURCE, ENDPOINT)] * 3


def test_allocate_and_preferred_allocation_reach_the_registered_plugin(
    kubelet: KubeletStandIn, kubelet_dir: Path
) -> None:
    plugin = FakePlugin()
    plugin.set_devices({GPU_A: "Healthy", GPU_B: "Healthy"})
    with serving(plugin, kubelet_dir / ENDPOINT):
        register(kubelet_dir)
        response = kubelet.allocate(RESOURCE, [GPU_B, GPU_A])
        assert plugin.allocate_requests == [[GPU_B, GPU_A]]
        assert dict(response.container_responses[0].envs) == {"IDS": f"{GPU_B},{GPU_A}"}
        assert kubelet.preferred_allocation(RESOURCE, [GPU_B, GPU_A], [], 1) == [GPU_A]


def test_preferred_allocation_is_not_asked_of_a_plugin_that_does_not_offer_it(
    kubelet: KubeletStandIn, kubelet_dir: Path
) -> None:
    plugin = FakePlugin(pb.DevicePluginOptions(get_preferred_allocation_available=False))
    with serving(plugin, kubelet_dir / ENDPOINT):
        register(kubelet_dir)
        with pytest.raises(StandInError, match="does not offer"):
            kubelet.preferred_allocation(RESOURCE, [GPU_A], [], 1)


def test_calls_without_a_registered_endpoint_fail_clearly(kubelet: KubeletStandIn) -> None:
    with pytest.raises(StandInError, match="no registered endpoint"):
        kubelet.allocate(RESOURCE, [GPU_A])
    with pytest.raises(TimeoutError, match="0 registration"):
        kubelet.wait_for_registration(RESOURCE, timeout=0.05)


def test_restart_deletes_every_socket_keeps_other_files_and_serves_anew(
    kubelet: KubeletStandIn, kubelet_dir: Path
) -> None:
    (kubelet_dir / "kubelet_internal_checkpoint").write_text("{}")
    (kubelet_dir / "notes.txt").write_text("keep")
    (kubelet_dir / "subdir").mkdir()
    stray = socket.socket(socket.AF_UNIX)
    stray.bind(str(kubelet_dir / "stray.sock"))
    stray.close()
    plugin = FakePlugin()
    plugin.set_devices({GPU_A: "Healthy"})
    with serving(plugin, kubelet_dir / ENDPOINT):
        register(kubelet_dir)
        kubelet.wait_for_devices(RESOURCE, all_healthy)
        kubelet.restart()
        assert sorted(os.listdir(kubelet_dir)) == ["kubelet.sock", "kubelet_internal_checkpoint", "notes.txt", "subdir"]
        assert (kubelet_dir / "kubelet.sock").is_socket()
        assert (kubelet_dir / "kubelet_internal_checkpoint").read_text() == "{}"
        # The restarted kubelet forgot the endpoint: devices it knew are unhealthy until the plugin registers again.
        assert kubelet.devices(RESOURCE) == {GPU_A: "Unhealthy"}
        plugin.wait_streams(0)
        with pytest.raises(StandInError):
            kubelet.allocate(RESOURCE, [GPU_A])
    # The plugin serves its socket again and re-registers.
    with serving(plugin := FakePlugin(), kubelet_dir / ENDPOINT):
        plugin.set_devices({GPU_A: "Healthy"})
        register(kubelet_dir)
        assert kubelet.wait_for_registration(RESOURCE, count=2).endpoint == ENDPOINT
        assert kubelet.wait_for_devices(RESOURCE, all_healthy) == {GPU_A: "Healthy"}
    assert kubelet.starts == 2


def test_stop_leaves_the_very_same_kubelet_sock_as_a_killed_kubelet_does(kubelet_dir: Path) -> None:
    standin = KubeletStandIn(kubelet_dir, dial_timeout=1.0)
    standin.start()
    before = (kubelet_dir / "kubelet.sock").lstat()
    standin.stop()
    after = (kubelet_dir / "kubelet.sock").lstat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert os.listdir(kubelet_dir) == ["kubelet.sock"]
    with pytest.raises(grpc.RpcError) as caught:
        register(kubelet_dir)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE  # nobody listens on it


def _bind(path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.close()  # the file stays, as a dead process leaves it


def test_start_removes_the_sockets_a_dead_kubelet_and_its_plugins_left_before_it_listens(kubelet_dir: Path) -> None:
    _bind(kubelet_dir / "kubelet.sock")  # the old kubelet's, nobody listens on it
    _bind(kubelet_dir / ENDPOINT)  # a plugin's, served before this kubelet started
    (kubelet_dir / "dir.sock").mkdir()  # a directory: kept, and not looked into
    _bind(kubelet_dir / "dir.sock" / "inner.sock")
    (kubelet_dir / "linked.sock").symlink_to(kubelet_dir / "dir.sock" / "inner.sock")  # stat follows it: removed
    (kubelet_dir / "dangling.sock").symlink_to(kubelet_dir / "missing")  # stat fails: kept
    (kubelet_dir / "kubelet_internal_checkpoint").write_text("{}")
    (kubelet_dir / "DEPRECATION").write_text("")
    standin = KubeletStandIn(kubelet_dir, dial_timeout=1.0)
    with standin:
        assert sorted(os.listdir(kubelet_dir)) == [
            "DEPRECATION",
            "dangling.sock",
            "dir.sock",
            "kubelet.sock",
            "kubelet_internal_checkpoint",
        ]
        assert (kubelet_dir / "dir.sock" / "inner.sock").is_socket()  # the link went, not its target
        assert (kubelet_dir / "kubelet.sock").is_socket()
        with pytest.raises(grpc.RpcError) as caught:
            register(kubelet_dir)  # the plugin's socket is gone: it must serve again before it registers
        assert "GetDevicePluginOptions" in (caught.value.details() or "")  # a new kubelet answered


def test_start_hooks_choose_the_cleanups_order_and_run_between_its_steps(kubelet_dir: Path) -> None:
    _bind(kubelet_dir / "kubelet.sock")
    _bind(kubelet_dir / "a.sock")
    _bind(kubelet_dir / "b.sock")
    seen: list[tuple[str, list[str]]] = []

    def after_remove(name: str) -> None:
        seen.append((name, sorted(os.listdir(kubelet_dir))))

    def before_listen() -> None:
        seen.append(("listen", sorted(os.listdir(kubelet_dir))))

    standin = KubeletStandIn(kubelet_dir, dial_timeout=1.0)
    standin.start(order=["b.sock", "kubelet.sock"], after_remove=after_remove, before_listen=before_listen)
    try:
        assert seen == [
            ("b.sock", ["a.sock", "kubelet.sock"]),
            ("kubelet.sock", ["a.sock"]),
            ("a.sock", []),
            ("listen", []),
        ]
        assert (kubelet_dir / "kubelet.sock").is_socket()
        seen.clear()
        _bind(kubelet_dir / "c.sock")
        standin.restart(after_remove=after_remove)
        assert [name for name, _ in seen] == ["c.sock", "kubelet.sock"]
    finally:
        standin.stop()


def _fds() -> dict[str, str]:
    links = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            links[name] = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the listing's own descriptor, already closed
            continue
    return links


def _extra_fds(before: dict[str, str]) -> dict[str, str]:
    """Descriptors open now that were not before, once gRPC's process-wide poller has wound down.

    When the last channel and server are gone, gRPC closes its shared epoll/eventfd pair on its own thread a
    few milliseconds later; that is gRPC's, not a leak, so wait (bounded) for it rather than race it.
    """
    deadline = time.monotonic() + 5
    while True:
        extra = {fd: link for fd, link in _fds().items() if before.get(fd) != link}
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.01)


def test_stop_joins_its_threads_and_closes_its_channels(kubelet_dir: Path) -> None:
    def cycle() -> None:
        plugin = FakePlugin()
        plugin.set_devices({GPU_A: "Healthy"})
        standin = KubeletStandIn(kubelet_dir)
        standin.start()  # first: a starting kubelet removes the sockets it finds
        with serving(plugin, kubelet_dir / ENDPOINT):
            try:
                register(kubelet_dir)
                standin.wait_for_devices(RESOURCE, all_healthy)
                standin.allocate(RESOURCE, [GPU_A])
                assert len(standin.threads()) == 1
            finally:
                standin.stop()
            assert standin.threads() == []
            assert not standin.serving
            plugin.wait_streams(0)

    cycle()  # gRPC's process-wide pieces (pollers, timers) start on first use
    threads_before, fds_before = set(threading.enumerate()), _fds()
    for _ in range(3):
        cycle()
    assert [thread.name for thread in set(threading.enumerate()) - threads_before] == []
    assert _extra_fds(fds_before) == {}


def test_stop_during_a_dial_back_cancels_it_and_leaks_nothing(kubelet_dir: Path) -> None:
    release = threading.Event()
    entered = threading.Event()

    class Slow(FakePlugin):
        def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
            entered.set()
            release.wait(30)
            return self.answer_options

    errors: list[grpc.RpcError] = []

    def call_register() -> None:
        try:
            register(kubelet_dir)
        except grpc.RpcError as error:
            errors.append(error)

    standin = KubeletStandIn(kubelet_dir)
    standin.start()  # first: a starting kubelet removes the sockets it finds
    with serving(Slow(), kubelet_dir / ENDPOINT):
        caller = threading.Thread(target=call_register)
        caller.start()
        try:
            assert entered.wait(5)
            standin.stop()  # returns without waiting for the plugin's answer (the dial is cancelled)
            caller.join(5)
            assert not caller.is_alive()
            assert len(errors) == 1
            assert standin.registrations == []
            assert standin.threads() == []
        finally:
            release.set()
            caller.join()


def test_register_while_stopped_is_impossible_and_start_twice_is_an_error(kubelet_dir: Path) -> None:
    standin = KubeletStandIn(kubelet_dir, dial_timeout=0.5)
    standin.start()
    try:
        with pytest.raises(StandInError, match="already serving"):
            standin.start()
    finally:
        standin.stop()
    with pytest.raises(grpc.RpcError):
        register(kubelet_dir)


def test_socket_paths_over_the_unix_limit_are_refused() -> None:
    with pytest.raises(ValueError, match="107 bytes"):
        KubeletStandIn(Path("/tmp") / ("d" * 120))
