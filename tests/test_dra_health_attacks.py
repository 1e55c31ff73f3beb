"""Attacks on the kubelet's DRA health stream (``v1alpha1.DRAResourceHealth/NodeWatchResources``, docs/dra.md,
"Health stream"): local clients holding every place, a state of the maximum size, reasons that do not fit.

- Any process that can open ``dra.sock`` can open streams; the kubelet holds one and opens it again 5 s after
  it ends. Local streams that hold every place must not shut the kubelet's out: the newest stream is served, and
  the one it replaces is cancelled (so a replaced stream that never reads does not keep its server thread).
- The kubelet reads with grpc-go's default receive limit (4 MiB: ``dra_plugin_manager.go`` dials with no
  ``MaxCallRecvMsgSize``); a message over it breaks the stream at every try, so no device's health is heard.
  The largest state we send must fit, and the prepared devices (the only ones the kubelet looks at) come first.
- The kubelet cuts a ``message`` at 1024 *bytes* (``truncateHealthMessage`` in ``manager.go``: Go's ``len``);
  protobuf refuses a string that is not UTF-8 (a reason naming a driver whose name is not: ``os.readlink``
  decodes it with surrogate escapes), which would end every stream at every state.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent import futures
from typing import Any, cast

import grpc
import pytest

from plugin.dra.checkpoint import PreparedClaim, PreparedDevice
from plugin.dra.health_stream import (
    KUBELET_MAX_RECEIVE,
    MAX_DEVICES,
    MAX_MESSAGE,
    DeviceState,
    HealthBoard,
    HealthServicer,
    device_states,
)
from plugin.inventory import Device, Inventory, Resource
from schemas.generated.kubelet.dra_health.v1alpha1 import api_pb2 as pb
from schemas.generated.kubelet.dra_health.v1alpha1 import api_pb2_grpc as pb_grpc
from schemas.kinds import ResourceKind
from simkit.fixture_nodes import NODE01
from tests.dra_support import DraPaths, dra_runner, running_dra
from tests.plugin_support import build_tree, short_dir
from tests.test_dra_health_stream import PATIENCE, _wait, health_of, reading

GRPC_DEFAULT_RECEIVE = 4 * 1024 * 1024
"""grpc-go's ``defaultClientMaxReceiveMessageSize`` (and grpc Python's default): what the kubelet accepts."""


# -- local streams holding every place -----------------------------------------------------------------------


class FakeContext:
    """What the board uses of a gRPC servicer context."""

    def __init__(self) -> None:
        self.cancelled = False
        self.callbacks: list[Any] = []

    def add_callback(self, callback: Any) -> bool:
        self.callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        return not self.cancelled

    def cancel(self) -> None:
        self.cancelled = True
        for callback in self.callbacks:
            callback()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"aborted {code}: {details}")
        self.code = code


def test_a_replaced_stream_is_cancelled_even_while_its_reader_never_takes_a_message() -> None:
    """A stream whose peer never reads sits in gRPC's send, not in the board: only cancelling its call frees the
    server thread it holds. A stalled stream that gives its place up is cancelled; one that has taken the newest
    state keeps its place, and a newcomer is refused instead."""
    board = HealthBoard(max_streams=2)
    board.update([DeviceState("p", "d", pb.HEALTHY)])
    contexts = [FakeContext() for _ in range(5)]
    streams = [board.watch(cast(grpc.ServicerContext, context)) for context in contexts]
    for stream in streams[:2]:
        next(stream)  # the first state went out; the reader never asks for more (the generator stays here)
    board.update([DeviceState("p", "d2", pb.HEALTHY)])  # both are now behind: stalled
    assert board.streams == 2
    for index in range(2, 4):
        assert next(streams[index]).devices[0].device.device_name == "d2"
        assert contexts[index - 2].cancelled  # the oldest stalled one, sitting after its yield, is cancelled
        assert board.streams == 2
    with pytest.raises(Aborted) as refused:  # the two in place took the newest state: the fifth is refused
        next(streams[4])
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not any(context.cancelled for context in contexts[2:])
    for stream in streams:
        stream.close()
    assert board.streams == 0


def test_a_stream_that_stopped_taking_states_is_replaced_before_an_older_one_that_reads() -> None:
    board = HealthBoard(max_streams=2)
    board.update([DeviceState("p", "d", pb.HEALTHY)])
    reading_context, stalled_context, newcomer_context = FakeContext(), FakeContext(), FakeContext()
    heard: queue.Queue[pb.NodeWatchResourcesResponse] = queue.Queue()
    reader = board.watch(cast(grpc.ServicerContext, reading_context))

    def read() -> None:
        for message in reader:
            heard.put(message)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    heard.get(timeout=PATIENCE)  # the oldest stream reads on
    stalled = board.watch(cast(grpc.ServicerContext, stalled_context))
    next(stalled)  # took the first state, then its reader stops reading
    board.update([DeviceState("p", "d", pb.UNHEALTHY, "why")])
    heard.get(timeout=PATIENCE)  # the reader took the news; the stalled one did not
    assert _wait(
        lambda: all(s.waiting for s in board._streams if s.context is cast(grpc.ServicerContext, reading_context))
    )
    newcomer = board.watch(cast(grpc.ServicerContext, newcomer_context))
    assert next(newcomer).devices[0].health == pb.UNHEALTHY
    assert stalled_context.cancelled and not reading_context.cancelled
    reading_context.cancel()
    thread.join(PATIENCE)
    newcomer.close()
    stalled.close()


# -- the largest state ---------------------------------------------------------------------------------------


def _inventory(count: int, reason: str | None) -> Inventory:
    devices = tuple(
        Device(
            id=f"0000:{index // 256:02x}:{(index // 8) % 32:02x}.{index % 8}",
            kind=ResourceKind.PCI,
            vendor_device="10DE:1F08",
            iommu_group=index,
            numa_node=None,
            healthy=reason is None,
            reason=reason,
        )
        for index in range(count)
    )
    return Inventory((Resource("nvidia.com/GPU", ResourceKind.PCI, devices, ("10DE:1F08",)),))


def test_the_largest_state_fits_in_what_the_kubelet_receives_and_keeps_the_prepared_devices() -> None:
    pool = "n" * 63 + "." + "o" * 63 + "." + "d" * 63 + "." + "e" * 61  # a node name of 253 characters
    inventory = _inventory(MAX_DEVICES + 100, "é" * 5000)  # every device unhealthy with a reason too long
    last = sorted(d.id for r in inventory.resources for d in r.devices)[-1]
    prepared_name = "pci-" + last.replace(":", "-").replace(".", "-")
    gone = "pci-ffff-ff-1f-7"
    devices = (PreparedDevice(("r",), pool, prepared_name, ("x=1",)), PreparedDevice(("r",), pool, gone, ("x=2",)))
    prepared = [PreparedClaim("ns", "c", "u", devices)]
    states = device_states(inventory, prepared, pool)
    names = {state.device for state in states}
    assert {prepared_name, gone} <= names  # the ones the kubelet asks about are never the ones cut
    board = HealthBoard()
    board.update(states)
    with short_dir() as base:
        server = grpc.server(futures.ThreadPoolExecutor(2))
        pb_grpc.add_DRAResourceHealthServicer_to_server(HealthServicer(board), server)
        server.add_insecure_port(f"unix:{base}/h.sock")
        server.start()
        try:
            channel = grpc.insecure_channel(f"unix:{base}/h.sock")  # the default receive limit, as the kubelet's
            call = pb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                pb.NodeWatchResourcesRequest(), timeout=PATIENCE
            )
            message = next(iter(call))  # a message over the limit is RESOURCE_EXHAUSTED here
            assert prepared_name in health_of(message) and gone in health_of(message)
            assert message.ByteSize() <= KUBELET_MAX_RECEIVE <= GRPC_DEFAULT_RECEIVE
            call.cancel()
            channel.close()
        finally:
            server.stop(0).wait()


# -- reasons that do not fit -----------------------------------------------------------------------------------


def _kubelet_truncates(message: str) -> bool:
    """Whether the kubelet's ``truncateHealthMessage`` would cut ``message`` (its length in UTF-8 bytes)."""
    return len(message.encode("utf-8")) > MAX_MESSAGE


def test_a_long_reason_in_any_script_is_cut_to_what_the_kubelet_keeps_whole() -> None:
    for reason in ("x" * 5000, "é" * 1000, "€" * 600, "😀" * 300, "a" * 1020 + "€€"):
        (state,) = device_states(_inventory(1, reason), [], "n")
        assert not _kubelet_truncates(state.message), (reason[:3], len(state.message.encode()))
        assert state.message.endswith("...") and reason.startswith(state.message[:-3])
    short = "IOMMU group 5 is not viable: 0000:86:00.1 (10DE:10F9 audio) is bound to snd_hda_intel"
    assert device_states(_inventory(1, short), [], "n")[0].message == short


def test_a_reason_that_is_not_utf8_does_not_break_the_stream() -> None:
    # os.readlink of a driver link whose name is not UTF-8 (b"snd\xff") gives "snd\udcff"
    reason = "IOMMU group 5 is not viable: 0000:86:00.1 (10DE:10F9 audio) is bound to snd\udcff"
    (state,) = device_states(_inventory(1, reason), [], "n")
    state.message.encode("utf-8")  # what protobuf does with it
    assert state.message.startswith("IOMMU group 5 is not viable") and "snd" in state.message
    board = HealthBoard()
    board.update([state])
    context = FakeContext()
    stream = board.watch(cast(grpc.ServicerContext, context))
    message = next(stream)
    assert message.devices[0].health == pb.UNHEALTHY
    stream.close()


# -- the loop and a slow API server ----------------------------------------------------------------------------


def test_a_publisher_stuck_on_the_api_server_never_holds_the_scans_or_the_health_stream() -> None:
    """The ResourceSlice publisher may wait on the API server (20 s a call, several calls a sync); meanwhile the
    node is still scanned, a device's change still reaches the kubelet's health stream (which would otherwise go
    silent and turn every device Unknown after its 30 s), and the loop keeps turning (``/healthz``)."""
    release = threading.Event()
    entered = threading.Event()

    class SlowSink:
        calls = 0

        def publish(self, inventory: Inventory) -> None:
            self.calls += 1
            if self.calls >= 2:  # the first publishes; the next one hangs on the API server
                entered.set()
                release.wait(PATIENCE * 4)

    with short_dir() as base:
        node01 = build_tree(NODE01, base)
        paths = DraPaths.under(base, node01)
        runner = dra_runner(paths, sinks=[SlowSink()], pool="node01")
        runner.sink_resync = 0.0  # every scan offers the inventory again: the second offer hangs
        try:
            with running_dra(runner), reading(runner.server.plugin_socket) as kubelet:
                kubelet.next()
                assert entered.wait(PATIENCE)
                scans = runner.scans
                assert _wait(lambda: runner.scans >= scans + 3), "the scans stopped while the publisher waits"
                assert runner.liveness() is None
                assert runner.inventory is not None
                group = next(
                    d.iommu_group for r in runner.inventory.resources for d in r.devices if d.id == "0000:86:00.0"
                )
                os.unlink(node01 / "dev" / "vfio" / str(group))
                kubelet.until(lambda m: health_of(m)["pci-0000-86-00-0"][0] == "UNHEALTHY")
        finally:
            release.set()
