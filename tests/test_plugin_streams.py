"""Issue 22's stream and registration findings (2, 10, 11, 12), each reproduced as reported, then what must hold.

The real plugin (an in-process :class:`~plugin.manager.PluginManager`) runs against the kubelet stand-in, which
behaves as the kubelet's device manager does (docs/protocols.md, "Kubelet device plugin API"): a replaced
client's stream stays open, the end of *any* stream disconnects the current client and marks every device
unhealthy, and a starting kubelet removes every socket in its directory before it listens on a new
``kubelet.sock``. Foreign clients are raw gRPC clients on the plugin's socket. Restart interleavings are made
deterministic with the stand-in's hooks (and, for the one reported race, by running the kubelet's start inside
the plugin's own identity check); no sleep stands in for a sync, and waits are generous deadlines.

- 2: foreign ``ListAndWatch`` streams never end the kubelet's; beyond a cap they are refused
  (``RESOURCE_EXHAUSTED``), and ``Allocate``/``GetPreferredAllocation`` still answer;
- 10: a kubelet restart gives exactly one ``Register``, whatever the order of the kubelet's cleanup and the
  plugin's reactions, also when the old ``kubelet.sock`` was left behind;
- 11: duplicate kubelet clients and foreign streams together leave the resource allocatable;
- 12: after the kubelet drops the plugin (its streams closed) the plugin registers again by itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import plugin.manager
import runtime.sockets
from plugin.manager import PluginManager
from plugin.registration import socket_identity
from plugin.server import MAX_OTHER_STREAMS
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from simkit.fixture_nodes import NODE01
from simkit.kubelet_standin import KubeletStandIn
from tests.plugin_support import (
    WAIT,
    build_tree,
    manager_for,
    remove_group_node,
    restore_group_node,
    running,
    short_dir,
    wait_until,
)

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
TU106_SOCKET = "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
GPUS = ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0")
GPU, GPU_GROUP = "0000:3b:00.0", 30
"""The first GPU of node01 and its IOMMU group (removing ``/dev/vfio/30`` makes just that GPU unhealthy)."""
UNARY_DEADLINE = 30.0
"""Unary calls held behind streams would wait forever; a served one answers in milliseconds. The bound is far
above that, so a busy machine does not reach it (as in tests/test_plugin_attacks.py)."""


@pytest.fixture
def base() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory


class Foreign:
    """A raw ``ListAndWatch`` client on the plugin's socket, reading in a thread (as a tool or an attacker would)."""

    def __init__(self, path: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix:{path}")
        self.call = pb_grpc.DevicePluginStub(self.channel).ListAndWatch(pb.Empty())
        self.first = threading.Event()
        self.done = threading.Event()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for _ in self.call:
                self.first.set()
        except grpc.RpcError as error:
            self.code, self.details = error.code(), error.details() or ""
        self.done.set()

    def admitted(self) -> bool:
        """Whether the plugin sent this stream its device list (an admitted stream gets it at once)."""
        return self.first.wait(WAIT)

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


@pytest.fixture
def foreign() -> Iterator[Callable[[Path], Foreign]]:
    opened: list[Foreign] = []

    def open_stream(path: Path) -> Foreign:
        opened.append(Foreign(path))
        return opened[-1]

    try:
        yield open_stream
    finally:
        for stream in opened:
            stream.close()


def _healthy_but(devices: dict[str, str], unhealthy: str) -> bool:
    return devices == {gpu: "Unhealthy" if gpu == unhealthy else "Healthy" for gpu in GPUS}


def _all_healthy(devices: dict[str, str]) -> bool:
    return devices == dict.fromkeys(GPUS, "Healthy")


def _the_kubelets_stream_carries_news(root: Path, kubelet: KubeletStandIn) -> None:
    """A health change reaches the kubelet exactly (one GPU unhealthy, the rest healthy), then back: proof
    that the kubelet's own stream is open and was never ended (an ended one leaves every device unhealthy)."""
    remove_group_node(root, GPU_GROUP)
    kubelet.wait_for_devices(TU106, lambda devices: _healthy_but(devices, GPU))
    restore_group_node(root, GPU_GROUP)
    kubelet.wait_for_devices(TU106, _all_healthy)


def _unary_calls_answer(kubelet: KubeletStandIn, socket: Path) -> None:
    assert kubelet.preferred_allocation(TU106, list(GPUS), [], 1, timeout=UNARY_DEADLINE)
    assert kubelet.allocate(TU106, [GPU], timeout=UNARY_DEADLINE).container_responses[0].envs
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[GPU])])
        assert pb_grpc.DevicePluginStub(channel).Allocate(request, timeout=UNARY_DEADLINE).container_responses


def _loop_turns(manager: PluginManager, turns: int = 3) -> None:
    """Let the plugin's loop scan (and so reconcile) ``turns`` more times: anything it would still do is done."""
    target = manager.scans + turns
    wait_until(lambda: manager.scans >= target, what=f"{turns} more turns of the plugin's loop")


# -- 2: foreign streams ---------------------------------------------------------------------------------------


def test_foreign_streams_never_end_the_kubelets_and_beyond_the_cap_are_refused(
    base: Path, foreign: Callable[[Path], Foreign]
) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    socket = kubelet_dir / TU106_SOCKET
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)):
        kubelet.wait_for_devices(TU106, _all_healthy)
        streams = [foreign(socket) for _ in range(MAX_OTHER_STREAMS)]
        assert all(stream.admitted() for stream in streams)
        # The reported attack: two foreign streams ended the kubelet's, which then showed 0 healthy for good.
        _the_kubelets_stream_carries_news(root, kubelet)
        assert kubelet.disconnects(TU106) == 0
        assert kubelet.registration_count(TU106) == 1
        # One more is refused at once; the ones admitted stay open.
        refused = foreign(socket)
        assert refused.done.wait(WAIT)
        assert refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ListAndWatch" in refused.details and str(MAX_OTHER_STREAMS) in refused.details
        assert not any(stream.done.is_set() for stream in streams)
        _unary_calls_answer(kubelet, socket)
        # A slot given back is free again.
        streams[0].close()
        assert streams[0].done.wait(WAIT)
        wait_until(lambda: foreign(socket).admitted(), what="a foreign stream admitted after one closed")
        _the_kubelets_stream_carries_news(root, kubelet)
        assert (kubelet.disconnects(TU106), kubelet.registration_count(TU106)) == (0, 1)


# -- 11: duplicate kubelet clients ----------------------------------------------------------------------------


def test_a_duplicate_kubelet_client_and_a_foreign_stream_leave_the_resource_allocatable(
    base: Path, foreign: Callable[[Path], Foreign]
) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)):
        kubelet.wait_for_devices(TU106, _all_healthy)
        # A second Register of the plugin's endpoint (the reported duplicates): the kubelet makes a second
        # client, keeps the first one's stream open, and now has two streams on the plugin.
        with grpc.insecure_channel(f"unix:{kubelet_dir / 'kubelet.sock'}") as channel:
            pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(version="v1beta1", endpoint=TU106_SOCKET, resource_name=TU106), timeout=WAIT
            )
        kubelet.wait_for_open_streams(TU106, 2)
        assert foreign(kubelet_dir / TU106_SOCKET).admitted()  # the third stream, which ended the oldest
        _the_kubelets_stream_carries_news(root, kubelet)
        assert kubelet.disconnects(TU106) == 0
        assert kubelet.open_streams(TU106) == 2
        assert kubelet.allocatable(TU106) == 4


# -- 12: the kubelet drops the plugin -------------------------------------------------------------------------


def test_after_the_kubelet_drops_the_plugin_it_registers_again_by_itself(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir, scan_interval=60)):
        kubelet.wait_for_devices(TU106, _all_healthy)
        for drop in (2, 3):  # and again: each drop is answered by a new Register
            assert kubelet.disconnect(TU106)  # what the kubelet does when any of the resource's streams ends
            # Registered again, no rescan needed (a generous deadline: behaviour, not timing).
            kubelet.wait_for_registration(TU106, count=drop, timeout=WAIT)
            kubelet.wait_for_devices(TU106, _all_healthy)
        # Exactly one Register per disconnect, none besides. The dropped client's stream can end after the plugin
        # has registered again: the kubelet then disconnects the new client as well (runClient re-reads the
        # resource's current client by name, kubelet pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go),
        # and the plugin registers once more. A busy machine makes that happen, so the count of rounds is not
        # fixed; the invariant is.
        wait_until(
            lambda: kubelet.stream_open(TU106) and kubelet.registration_count(TU106) == 1 + kubelet.disconnects(TU106),
            what="one Register per disconnect and the kubelet's stream open",
        )
        assert kubelet.disconnects(TU106) >= 2
        _the_kubelets_stream_carries_news(root, kubelet)


def test_a_plugin_registered_with_a_kubelet_that_dies_registers_with_the_next_one(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    kubelet = KubeletStandIn(kubelet_dir)
    kubelet.start()
    try:
        with running(manager_for(root, kubelet_dir)) as manager:
            kubelet.wait_for_devices(TU106, _all_healthy)
            kubelet.stop()  # killed: the streams end, kubelet.sock stays, nobody answers on it
            _loop_turns(manager)  # the plugin tries the dead socket and backs off
            assert manager.registered() == ()
            kubelet.start()
            kubelet.wait_for_registration(TU106, count=2)
            kubelet.wait_for_devices(TU106, _all_healthy)
            _loop_turns(manager)
            assert kubelet.request_count(TU106) == 2
            assert manager.registered() == (TU106,)
            assert manager.readiness() is None
    finally:
        kubelet.stop()


# -- 10: exactly one Register per kubelet restart --------------------------------------------------------------


def _plugin_serves_again(kubelet_dir: Path) -> Callable[[str], None]:
    """An ``after_remove`` hook: once the plugin's socket is removed, wait until the plugin serves it again."""

    def after_remove(name: str) -> None:
        if name == TU106_SOCKET:
            wait_until((kubelet_dir / TU106_SOCKET).is_socket, what="the plugin to serve again")

    return after_remove


@pytest.mark.parametrize(
    "interleaving",
    [
        "kubelet.sock first",
        "plugin socket first",
        "plugin serves again while the old kubelet.sock is left",
        "plugin serves again before the new kubelet listens",
    ],
)
def test_a_kubelet_restart_gives_exactly_one_register(base: Path, interleaving: str) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)) as manager:
        kubelet.wait_for_devices(TU106, _all_healthy)
        serves_again = _plugin_serves_again(kubelet_dir)
        if interleaving == "kubelet.sock first":
            kubelet.restart(order=["kubelet.sock", TU106_SOCKET])
        elif interleaving == "plugin socket first":
            kubelet.restart(order=[TU106_SOCKET, "kubelet.sock"])
        elif interleaving == "plugin serves again while the old kubelet.sock is left":
            kubelet.restart(order=[TU106_SOCKET, "kubelet.sock"], after_remove=serves_again)
        else:
            kubelet.restart(
                order=["kubelet.sock", TU106_SOCKET],
                after_remove=serves_again,
                before_listen=lambda: _loop_turns(manager),
            )
        kubelet.wait_for_registration(TU106, count=2)
        kubelet.wait_for_devices(TU106, _all_healthy)
        _loop_turns(manager)
        assert kubelet.request_count(TU106) == 2
        assert kubelet.registration_count(TU106) == 2
        assert kubelet.stream_open(TU106)
        assert manager.readiness() is None


def test_a_kubelet_sock_swapped_between_the_plugins_look_and_its_dial_gives_one_register(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reported race: the old ``kubelet.sock`` is left; the plugin notices its socket gone and reads the
    kubelet socket's identity (the old one), and the kubelet's cleanup swaps in the new socket before the plugin
    dials. Running the kubelet's start inside the plugin's identity check makes that order certain."""
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    kubelet = KubeletStandIn(kubelet_dir)
    armed = threading.Event()

    def identity_then_swap(path: Path) -> tuple[int, int] | None:
        seen = socket_identity(path)
        if (
            armed.is_set()
            and threading.current_thread().name == "plugin-manager"
            and path.name == "kubelet.sock"
            and not (kubelet_dir / TU106_SOCKET).exists()
        ):
            armed.clear()
            kubelet.start()  # the cleanup removes the old kubelet.sock, then the new kubelet listens
        return seen

    monkeypatch.setattr("plugin.manager.socket_identity", identity_then_swap)  # the loop's look, nobody else's
    kubelet.start()
    try:
        with running(manager_for(root, kubelet_dir)) as manager:
            kubelet.wait_for_devices(TU106, _all_healthy)
            kubelet.stop()  # the old kubelet.sock stays
            armed.set()
            (kubelet_dir / TU106_SOCKET).unlink()  # the cleanup's first step: the plugin's socket
            kubelet.wait_for_registration(TU106, count=2)
            assert not armed.is_set()
            kubelet.wait_for_devices(TU106, _all_healthy)
            _loop_turns(manager)
            assert kubelet.request_count(TU106) == 2
            assert kubelet.registration_count(TU106) == 2
            assert kubelet.disconnects(TU106) == 0
            assert manager.readiness() is None
    finally:
        kubelet.stop()


# -- attacks on the above -------------------------------------------------------------------------------------


def test_a_kubelet_whose_streams_keep_ending_is_not_answered_by_a_register_storm(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buggy kubelet drops the plugin each time its stream opens: the first loss is answered at once, a
    second one soon after its Register backs off (here for an hour) instead of registering again in a loop."""
    monkeypatch.setattr("plugin.registration.RETRY_FIRST", 3600.0)
    monkeypatch.setattr("plugin.registration.STREAM_STABLE", 3600.0)  # every stream ends "soon"
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir)) as manager:
        kubelet.wait_for_devices(TU106, _all_healthy)
        assert kubelet.disconnect(TU106)
        kubelet.wait_for_registration(TU106, count=2)  # the first loss: registered again at once
        kubelet.wait_for_devices(TU106, _all_healthy)
        assert kubelet.disconnect(TU106)  # and again, soon after that Register
        wait_until(lambda: "keeps ending" in (manager.readiness() or ""), what="the plugin to back off and say why")
        _loop_turns(manager)
        assert kubelet.registration_count(TU106) == 2
        assert kubelet.request_count(TU106) == 2


def _shape(path: Path, shape: str, elsewhere: Path) -> None:
    if shape == "fifo":
        os.mkfifo(path)  # opening it for reading would block the loop for good
    elif shape == "regular file":
        path.write_text("not a socket\n")
    elif shape == "dangling link":
        path.symlink_to(elsewhere / "nothing-here.sock")
    else:
        path.mkdir()


def _unshape(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink()


@pytest.mark.parametrize("shape", ["fifo", "regular file", "dangling link", "directory"])
def test_a_kubelet_sock_that_is_no_socket_is_waited_out_and_the_real_one_gets_one_register(
    base: Path, shape: str
) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    kubelet_dir.mkdir()
    kubelet_sock = kubelet_dir / "kubelet.sock"
    _shape(kubelet_sock, shape, base)
    kubelet = KubeletStandIn(kubelet_dir)
    try:
        with running(manager_for(root, kubelet_dir)) as manager:
            _loop_turns(manager)  # the loop keeps turning: nothing at that path is opened or dialed
            assert manager.liveness() is None
            assert "missing or not a socket" in (manager.readiness() or "")
            _unshape(kubelet_sock)
            kubelet.start()
            kubelet.wait_for_devices(TU106, _all_healthy)
            _loop_turns(manager)
            assert kubelet.request_count(TU106) == 1
            assert manager.readiness() is None
    finally:
        kubelet.stop()


def test_a_kubelet_sock_probed_between_its_bind_and_its_listen_is_probed_again(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kubelet's socket file exists from ``bind`` on but answers only from ``listen`` on; a probe in between
    finds it silent, and no file event follows. The plugin must look again by itself, long before its scan
    (60 s here; the wait is :data:`WAIT`): it waited for a change of the file that never came."""
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    kubelet = KubeletStandIn(kubelet_dir)
    kubelet.start()
    probes: list[bool] = []
    real_probe = runtime.sockets.socket_is_live

    def probe(path: Path, timeout: float) -> bool:  # the first two probes fall into the bind-listen window
        probes.append(real_probe(path, timeout) and len(probes) >= 2)
        return probes[-1]

    monkeypatch.setattr(plugin.manager, "socket_is_live", probe)
    try:
        with running(manager_for(root, kubelet_dir, scan_interval=60)):
            kubelet.wait_for_devices(TU106, _all_healthy, timeout=WAIT)
            assert probes[:3] == [False, False, True]
            assert kubelet.request_count(TU106) == 1
    finally:
        kubelet.stop()


def test_a_register_sent_while_the_kubelets_old_stream_is_open_is_claimed_by_the_next_stream(
    base: Path, foreign: Callable[[Path], Foreign]
) -> None:
    """The kubelet replaces its client on every ``Register`` and leaves the old client's stream open: the stream
    that follows the new grant is the kubelet's, even while the old granted stream still holds its slot (a
    ``Register`` whose answer failed after the kubelet had opened its stream, then retried). Left waiting, the
    grant would never be claimed and the plugin would register again and again."""
    from plugin.server import KubeletLink, ResourceServer
    from tests.discovery_support import discover

    root = build_tree(NODE01, base)
    (base / "kubelet").mkdir()
    server = ResourceServer(discover(root).resource(TU106), base / "kubelet", root)
    server.start()
    try:
        first = server.link.grant()
        old = foreign(server.socket_path)
        assert old.admitted()
        assert server.link.status(first) == KubeletLink.OPEN
        second = server.link.grant()  # the retried Register: the kubelet's new client opens the next stream
        new = foreign(server.socket_path)
        assert new.admitted()
        assert server.link.status(second) == KubeletLink.OPEN
        new.close()
        wait_until(lambda: server.link.status(second) == KubeletLink.ENDED, what="the new grant's stream ended")
        assert not old.done.is_set()  # the old stream was never ended by the plugin
    finally:
        server.stop(grace=0)
