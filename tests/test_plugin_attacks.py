"""Issue 11's attacks on the device plugin, each reproduced as it was reported, then what must hold instead.

- 1: idle ``ListAndWatch`` streams must not take the workers ``Allocate`` and ``GetPreferredAllocation`` need
  (beyond a cap they are refused, none is ended: issue 22's finding 2, tests/test_plugin_streams.py), and a
  kubelet that reconnects while foreign streams linger must still be served;
- 3: the kubelet's directory removed under the plugin: caught, logged, health red, served again once it is back;
- 9: a ``ListAndWatch`` message that cannot be built is logged and turns health red (no silent 0 devices);
- 11: a second server on a live socket refuses instead of unlinking it; a stale one is still replaced;
- 2: idle or slow connections to the metrics port must not pile up threads or starve the probes;
- 13: ``GetPreferredAllocation`` never hands back an ID it does not serve; ``/readyz`` needs a kubelet socket
  that is a socket and answers.

Everything runs on this machine over unix sockets, with bounded waits.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from plugin import metrics
from plugin.inventory import Resource
from plugin.server import MAX_OTHER_STREAMS, ResourceServer, ServeError, SocketInUse
from runtime.sockets import socket_is_live
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from simkit.fixture_nodes import NODE01
from simkit.kubelet_standin import KubeletStandIn
from tests.discovery_support import discover
from tests.plugin_support import WAIT, build_tree, manager_for, running, serve_process, short_dir, wait_until

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
TU106_SOCKET = "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
GPU = "0000:3b:00.0"
UNARY_DEADLINE = 30.0
"""The attack made unary calls wait forever (the kubelet gives up after its 10 s deadline); a served call
answers in milliseconds. The bound is far above that, so a busy machine does not reach it."""


@pytest.fixture
def base() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory


@pytest.fixture
def served(base: Path) -> Iterator[tuple[ResourceServer, Resource]]:
    root = build_tree(NODE01, base)
    resource = discover(root).resource(TU106)
    (base / "kubelet").mkdir()
    server = ResourceServer(resource, base / "kubelet", root)
    server.start()
    try:
        yield server, resource
    finally:
        server.stop(grace=0)


def _idle_streams(path: Path, count: int) -> list[tuple[grpc.Channel, grpc.Call]]:
    """``count`` ListAndWatch calls on their own channels, never read (the attack)."""
    calls = []
    for _ in range(count):
        channel = grpc.insecure_channel(f"unix:{path}")
        stub = pb_grpc.DevicePluginStub(channel)
        calls.append((channel, stub.ListAndWatch(pb.Empty())))
    return calls


def _close(calls: list[tuple[grpc.Channel, grpc.Call]]) -> None:
    for channel, call in calls:
        call.cancel()
        channel.close()


def _events(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    """The plugin's event lines captured so far (the test must have set the ``plugin`` logger to INFO)."""
    return [json.loads(record.getMessage()) for record in caplog.records if record.getMessage().startswith("{")]


def _refused(call: grpc.Call) -> bool:
    """Read ``call``'s first message; True if it was refused with ``RESOURCE_EXHAUSTED`` instead (an admitted
    stream gets the device list at once and stays open)."""
    try:
        for _ in call:  # type: ignore[attr-defined]
            return False
    except grpc.RpcError as error:
        return error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    return False


def _unary_calls_answer(path: Path) -> None:
    with grpc.insecure_channel(f"unix:{path}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        started = time.monotonic()
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[GPU])])
        allocated = stub.Allocate(request, timeout=UNARY_DEADLINE)
        assert allocated.container_responses[0].envs
        preferred = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=[GPU, "0000:5e:00.0"], allocation_size=1)
            ]
        )
        answer = stub.GetPreferredAllocation(preferred, timeout=UNARY_DEADLINE)
        assert len(answer.container_responses[0].deviceIDs) == 1
        assert time.monotonic() - started < UNARY_DEADLINE


# -- 1: idle streams ------------------------------------------------------------------------------------------


def test_seven_idle_list_and_watch_streams_leave_workers_for_allocate(served: tuple[ResourceServer, Resource]) -> None:
    server, _ = served
    calls = _idle_streams(server.socket_path, 7)
    try:
        # Those beyond the cap are refused at once (they end before any message); none is ended to make room,
        # so the ones admitted stay open. (The calls reach the server in any order.)
        refused = [_refused(call) for _, call in calls]
        assert refused.count(True) == 7 - MAX_OTHER_STREAMS
        _unary_calls_answer(server.socket_path)
        assert server._servicer is not None and server._servicer.open_streams == MAX_OTHER_STREAMS
        admitted = [call for (_, call), no in zip(calls, refused, strict=True) if not no]
        assert all(call.is_active() for call in admitted)
    finally:
        _close(calls)


def test_many_streams_opened_and_dropped_in_a_loop_keep_the_server_answering(
    served: tuple[ResourceServer, Resource],
) -> None:
    server, _ = served
    for _ in range(5):  # bounded
        calls = _idle_streams(server.socket_path, 10)
        _close(calls[:5])
        _unary_calls_answer(server.socket_path)
        _close(calls[5:])
    wait_until(lambda: server._servicer is not None and server._servicer.open_streams == 0, what="streams gone")


def test_a_reconnecting_kubelet_is_served_while_old_streams_linger(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)):
        kubelet.wait_for_registration(TU106)
        kubelet.wait_for_devices(TU106, lambda devices: len(devices) == 4)
        lingering = _idle_streams(kubelet_dir / TU106_SOCKET, 7)  # the cap's worth stay open, the rest refused
        try:
            # Each call answered (its first message, or its refusal) before the kubelet restarts: a call still
            # connecting then (a loaded machine) would reach the *new* server on the same path, take one of its
            # slots, or even the grant its Register makes, and the counts below would say so.
            assert [_refused(call) for _, call in lingering].count(True) == 7 - MAX_OTHER_STREAMS
            kubelet.restart()  # the kubelet comes back: deletes the sockets, the plugin serves and registers anew
            kubelet.wait_for_registration(TU106, count=2)
            kubelet.wait_for_devices(TU106, lambda devices: devices == dict.fromkeys(devices, "Healthy") != {})
            assert kubelet.preferred_allocation(TU106, [GPU, "0000:5e:00.0"], [], 1, timeout=UNARY_DEADLINE)
            assert kubelet.allocate(TU106, [GPU], timeout=UNARY_DEADLINE).container_responses[0].envs
            # and streams opened against the new server: refused beyond the cap, the kubelet's left alone
            more = _idle_streams(kubelet_dir / TU106_SOCKET, 7)
            try:
                assert [_refused(call) for _, call in more].count(True) == 7 - MAX_OTHER_STREAMS
                assert kubelet.allocate(TU106, [GPU], timeout=UNARY_DEADLINE).container_responses[0].envs
                assert kubelet.stream_open(TU106)
                assert kubelet.disconnects(TU106) == 0
                assert kubelet.registration_count(TU106) == 2
            finally:
                _close(more)
        finally:
            _close(lingering)


# -- 3: the kubelet directory removed ------------------------------------------------------------------------


def _remove_at_once(directory: Path) -> None:
    """``directory`` gone in one step (renamed away, then deleted), as an operator's ``rm -rf`` looks once it
    is done. Deleting in place races the plugin, which serves its socket again as soon as it sees it gone:
    ``rmdir`` then finds the new socket (seen on a loaded machine)."""
    gone = directory.with_name(directory.name + ".removed")
    directory.rename(gone)
    shutil.rmtree(gone)


def test_kubelet_dir_removed_is_logged_red_and_served_again_when_back(
    base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="plugin")
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    manager = manager_for(root, kubelet_dir)
    manager.kubelet_missing_bound = 0.5
    kubelet = KubeletStandIn(kubelet_dir)
    kubelet.start()
    try:
        with running(manager):
            kubelet.wait_for_registration(TU106)
            wait_until(lambda: manager.readiness() is None, what="ready")
            kubelet.stop()
            _remove_at_once(kubelet_dir)
            wait_until(lambda: (manager.readiness() or "").startswith("cannot serve"), what="readiness red")
            assert "does not exist" in (manager.readiness() or "")
            wait_until(lambda: manager.liveness() is not None, what="liveness red")  # after the bound (0.5 s)
            kubelet.start()  # recreates the directory and kubelet.sock
            kubelet.wait_for_registration(TU106, count=2, timeout=WAIT)
            wait_until(lambda: manager.readiness() is None, what="ready again")
            assert manager.liveness() is None
    finally:
        kubelet.stop()
    events = _events(caplog)
    failed = [event for event in events if event.get("event") == "serve_failed"]
    assert failed and "does not exist" in str(failed[0]["error"])
    assert any(event.get("event") == "serve_recovered" for event in events)


def test_serve_process_survives_its_kubelet_dir_removed_and_serves_again(base: Path) -> None:
    """As reported: ``serve`` exited 1 with a RuntimeError traceback when the directory went away."""
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    log = base / "plugin.log"
    kubelet = KubeletStandIn(kubelet_dir)
    kubelet.start()
    try:
        with serve_process(root, kubelet_dir, log=log) as process:
            kubelet.wait_for_registration(TU106, timeout=15)
            kubelet.stop()
            _remove_at_once(kubelet_dir)
            wait_until(lambda: "serve_failed" in log.read_text(), timeout=15, what="serve_failed")
            time.sleep(1.0)  # several loop turns and scans without the directory
            assert process.poll() is None, log.read_text()[-2000:]
            kubelet.start()
            kubelet.wait_for_registration(TU106, count=2, timeout=15)
            assert kubelet.allocate(TU106, [GPU], timeout=UNARY_DEADLINE).container_responses[0].envs
            process.send_signal(signal.SIGTERM)
            assert process.wait(WAIT) == 0
    finally:
        kubelet.stop()
    text = log.read_text()
    assert "Traceback" not in text and "RuntimeError" not in text


def test_start_in_a_missing_directory_is_a_serve_error_not_a_runtime_error(base: Path) -> None:
    root = build_tree(NODE01, base)
    server = ResourceServer(discover(root).resource(TU106), base / "gone", root)
    with pytest.raises(ServeError, match="does not exist"):
        server.start()
    (base / "ro").mkdir()
    (base / "ro").chmod(0o500)
    server = ResourceServer(discover(root).resource(TU106), base / "ro", root)
    if os.geteuid() == 0:  # root writes there anyway
        server.start()
        server.stop(grace=0)
    else:
        with pytest.raises(ServeError, match="cannot listen"):
            server.start()


# -- 9: a ListAndWatch message that cannot be built ------------------------------------------------------------


def _with_numa(resource: Resource, numa: int) -> Resource:
    devices = tuple(dataclasses.replace(device, numa_node=numa) for device in resource.devices)
    return dataclasses.replace(resource, devices=devices)


def test_an_unbuildable_list_and_watch_message_is_logged_and_turns_health_red(
    base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="plugin")
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    manager = manager_for(root, kubelet_dir, scan_interval=60)
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager):
        kubelet.wait_for_registration(TU106)
        kubelet.wait_for_devices(TU106, lambda devices: len(devices) == 4)
        wait_until(lambda: manager.liveness() is None and manager.readiness() is None, what="healthy")
        server = manager._served[TU106].server
        good = server.state.resource
        assert server.update(_with_numa(good, 2**63))  # past int64: protobuf refuses it
        wait_until(lambda: manager.liveness() is not None, what="liveness red")
        assert "cannot build the ListAndWatch message" in (manager.liveness() or "")
        assert "cannot build the ListAndWatch message" in (manager.readiness() or "")
        assert server.update(good)
        wait_until(lambda: manager.liveness() is None, what="liveness green again")
    events = _events(caplog)
    assert any(event.get("event") == "list_and_watch_failed" for event in events)
    assert any(event.get("event") == "list_and_watch_recovered" for event in events)


# -- 11: a live socket is not taken over ----------------------------------------------------------------------


def test_a_second_server_refuses_a_live_socket_and_the_first_stays_reachable(
    served: tuple[ResourceServer, Resource],
) -> None:
    first, resource = served
    second = ResourceServer(resource, first.kubelet_dir, first.host_root)
    with pytest.raises(SocketInUse, match="another server is listening on"):
        second.start()
    assert first.socket_intact()
    with grpc.insecure_channel(f"unix:{first.socket_path}") as channel:
        options = pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=WAIT)
        assert options.get_preferred_allocation_available


def test_a_stale_socket_nobody_answers_on_is_replaced(base: Path) -> None:
    root = build_tree(NODE01, base)
    resource = discover(root).resource(TU106)
    (base / "kubelet").mkdir()
    path = base / "kubelet" / resource.socket
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # bound, never listening: what a killed process leaves
    assert path.is_socket() and not socket_is_live(path)
    server = ResourceServer(resource, base / "kubelet", root)
    server.start()
    try:
        assert server.socket_intact() and socket_is_live(path)
    finally:
        server.stop(grace=0)


def test_a_second_serve_process_does_not_unlink_the_first(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, serve_process(root, kubelet_dir, log=base / "first.log"):
        kubelet.wait_for_registration(TU106, timeout=15)
        inode = (kubelet_dir / TU106_SOCKET).stat().st_ino
        with serve_process(root, kubelet_dir, log=base / "second.log") as second:
            wait_until(lambda: "serve_failed" in (base / "second.log").read_text(), timeout=15, what="refusal")
            assert second.poll() is None  # it keeps retrying, without taking the socket over
        log = (base / "second.log").read_text()
        assert "another server is listening on" in log and "another gpu-device-plugin on this node?" in log
        assert "Traceback" not in log
        assert (kubelet_dir / TU106_SOCKET).stat().st_ino == inode
        assert kubelet.allocate(TU106, [GPU], timeout=UNARY_DEADLINE).container_responses[0].envs
        assert kubelet.registration_count(TU106) == 1


# -- 13: preferred allocation and readiness -------------------------------------------------------------------


def test_preferred_allocation_refuses_an_unknown_must_include_id_and_never_returns_one(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)):
        kubelet.wait_for_registration(TU106)
        with pytest.raises(grpc.RpcError) as refused:
            kubelet.preferred_allocation(TU106, [GPU], ["zz"], 2)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "'zz'" in (refused.value.details() or "")
        assert kubelet.preferred_allocation(TU106, ["zz", GPU], [], 1) == [GPU]


@pytest.mark.parametrize("kind", ["file", "directory", "symlink", "stale socket"])
def test_readiness_needs_a_kubelet_socket_that_answers(base: Path, kind: str) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    manager = manager_for(root, kubelet_dir)
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager):
        kubelet.wait_for_registration(TU106)
        wait_until(lambda: manager.readiness() is None, what="ready")
        kubelet.stop()
        path = kubelet_dir / "kubelet.sock"
        path.unlink(missing_ok=True)  # gRPC removes it when the stand-in stops
        if kind == "file":
            path.write_text("")
        elif kind == "directory":
            path.mkdir()
        elif kind == "symlink":
            other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            other.bind(str(base / "real.sock"))
            other.listen()
            path.symlink_to(base / "real.sock")
        else:
            stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stale.bind(str(path))
            stale.close()
        problem = manager.readiness()
        assert problem is not None and "kubelet" in problem
        if kind == "symlink":
            other.close()


# -- 2: the metrics port --------------------------------------------------------------------------------------

IDLE_CONNECTIONS = 500


def _get(port: int, path: str, timeout: float = 2.0) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def _connect_idle(port: int, count: int) -> list[socket.socket]:
    idle = []
    for _ in range(count):  # bounded; connect() completes in the kernel's backlog even when nobody accepts
        idle.append(socket.create_connection(("127.0.0.1", port), timeout=2))
    return idle


@pytest.fixture
def http_endpoint() -> Iterator[metrics.MetricsServer]:
    server = metrics.MetricsServer("127.0.0.1", 0, metrics.PluginMetrics(), lambda: None, lambda: None)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_500_idle_connections_keep_threads_bounded_and_healthz_answering(
    http_endpoint: metrics.MetricsServer,
) -> None:
    before = set(threading.enumerate())
    idle = _connect_idle(http_endpoint.port, IDLE_CONNECTIONS)
    try:
        # Answered before any idle connection times out (the attack made it wait for them), on a busy machine too.
        started = time.monotonic()
        assert _get(http_endpoint.port, "/healthz", timeout=metrics.IDLE_TIMEOUT / 2) == (200, "ok\n")
        assert time.monotonic() - started < metrics.IDLE_TIMEOUT / 2
        # One thread serves them all: no per-connection thread (was: 500 more). Threads other pieces of the
        # test process start or end meanwhile are not the server's, so only its kind is looked for.
        started_threads = set(threading.enumerate()) - before
        assert not [thread.name for thread in started_threads if "process_request" in thread.name]
        assert len(started_threads) < IDLE_CONNECTIONS // 10
        assert http_endpoint.connections <= metrics.MAX_CONNECTIONS
        assert _get(http_endpoint.port, "/metrics")[0] == 200
    finally:
        for sock in idle:
            sock.close()


def test_a_slow_or_oversized_request_is_cut_off(
    http_endpoint: metrics.MetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics, "IDLE_TIMEOUT", 0.5)
    with socket.create_connection(("127.0.0.1", http_endpoint.port), timeout=WAIT) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished (slowloris)
        assert slow.recv(100) == b""  # closed by the server after the idle timeout
    with socket.create_connection(("127.0.0.1", http_endpoint.port), timeout=WAIT) as big:
        big.sendall(b"GET /healthz HTTP/1.1\r\nX: " + b"a" * (metrics.MAX_REQUEST_BYTES + 10))
        assert big.recv(100).startswith(b"HTTP/1.1 431 ")
    with socket.create_connection(("127.0.0.1", http_endpoint.port), timeout=WAIT) as post:
        post.sendall(b"POST /healthz HTTP/1.1\r\nContent-Length: 2\r\n\r\nab")
        assert post.recv(100).startswith(b"HTTP/1.1 405 ")
    connection = http.client.HTTPConnection("127.0.0.1", http_endpoint.port, timeout=WAIT)
    try:  # keep-alive still works for a well-behaved scraper
        for _ in range(3):
            connection.request("GET", "/readyz")
            response = connection.getresponse()
            assert (response.status, response.read()) == (200, b"ok\n")
    finally:
        connection.close()


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_serve_with_500_idle_metrics_connections_stays_healthy_and_stops_on_sigterm(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    log = base / "plugin.log"
    with (
        KubeletStandIn(kubelet_dir) as kubelet,
        serve_process(root, kubelet_dir, "--metrics-address", "127.0.0.1:0", log=log) as process,
    ):
        kubelet.wait_for_registration(TU106, timeout=15)

        def announced() -> list[int]:  # the line is written by the log thread, maybe a moment after registering
            return [
                int(event["port"])
                for event in (json.loads(line) for line in log.read_text().splitlines() if line.startswith("{"))
                if event.get("event") == "metrics_serving"
            ]

        wait_until(lambda: bool(announced()), timeout=15, what="the metrics_serving event")
        port = announced()[0]
        threads = _threads(process.pid)
        idle = _connect_idle(port, IDLE_CONNECTIONS)
        try:
            assert _get(port, "/healthz") == (200, "ok\n")
            assert _threads(process.pid) <= threads + 2
            assert kubelet.allocate(TU106, [GPU], timeout=UNARY_DEADLINE).container_responses[0].envs
            process.send_signal(signal.SIGTERM)
            assert process.wait(WAIT) == 0
        finally:
            for sock in idle:
                sock.close()
