"""The kubelet's DRA health stream (KEP 4680): ``v1alpha1.DRAResourceHealth/NodeWatchResources`` on dra.sock.

Read over the real unix socket by a gRPC client, as the kubelet reads it (docs/dra.md, "Health stream"): the full
state at once, every device (pool, name) with HEALTHY/UNHEALTHY/UNKNOWN, ``last_updated_time``, the reason as
``message`` and ``health_check_timeout_seconds``; a device made unhealthy in the fixture tree is reported
UNHEALTHY without reopening the stream; a prepared device gone from the node is UNHEALTHY; a stream beyond the
cap takes the oldest one's place (tests/test_dra_health_attacks.py); a stream nobody reads never holds the loop;
stop ends every stream (a SIGTERM'd ``serve --dra`` exits while the kubelet stand-in's stream is open).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from plugin.dra.checkpoint import PreparedClaim, PreparedDevice
from plugin.dra.claims import AllocatedDevice, ClaimRef
from plugin.dra.health_stream import (
    GONE,
    KEEPALIVE,
    MAX_MESSAGE,
    MAX_STREAMS,
    NOT_SCANNED,
    SERVICE,
    DeviceState,
    HealthBoard,
    device_states,
    health_timeout,
)
from plugin.dra.service import SERVICES
from plugin.inventory import Device, Inventory, Resource
from schemas.dra import DRIVER_NAME
from schemas.generated.kubelet.dra_health.v1alpha1 import api_pb2 as pb
from schemas.generated.kubelet.dra_health.v1alpha1 import api_pb2_grpc as pb_grpc
from simkit.fixture_nodes import NODE01
from simkit.kubelet_dra_standin import DraStandInError, KubeletDraStandIn
from tests.dra_cluster_support import many_gpus
from tests.dra_support import DraPaths, dra_runner, running_dra, write_claim
from tests.plugin_support import WAIT, build_tree, plugin_env, serve_command, short_dir

PATIENCE = 30.0
"""Seconds a test waits for a message it is owed (a busy machine; behaviour is what is checked)."""
UID = "0f4c6a4e-2b7a-4c3e-9d2f-8a1b2c3d4e5f"


class Reader:
    """A NodeWatchResources stream read on a thread into a queue (so a test never blocks on it forever)."""

    def __init__(self, socket: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket}")
        self.call = pb_grpc.DRAResourceHealthStub(self.channel).NodeWatchResources(pb.NodeWatchResourcesRequest())
        self.messages: queue.Queue[pb.NodeWatchResourcesResponse] = queue.Queue()
        self.ended = threading.Event()
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.put(message)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()

    def next(self, timeout: float = PATIENCE) -> pb.NodeWatchResourcesResponse:
        return self.messages.get(timeout=timeout)

    def until(self, wanted: Any, timeout: float = PATIENCE) -> pb.NodeWatchResourcesResponse:
        """The first message for which ``wanted(message)`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.next(max(0.0, deadline - time.monotonic()))
            if wanted(message):
                return message

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()
        self._thread.join(PATIENCE)


@contextmanager
def reading(socket: Path) -> Iterator[Reader]:
    reader = Reader(socket)
    try:
        yield reader
    finally:
        reader.close()


def health_of(message: pb.NodeWatchResourcesResponse) -> dict[str, tuple[str, str]]:
    return {d.device.device_name: (pb.HealthStatus.Name(d.health), d.message) for d in message.devices}


# -- what is reported ------------------------------------------------------------------------------------------


def sick(inventory: Inventory, device_id: str, reason: str) -> Inventory:
    resources = []
    for resource in inventory.resources:
        devices = tuple(
            Device(**{**{f: getattr(d, f) for f in d.__slots__}, "healthy": False, "reason": reason})
            if d.id == device_id
            else d
            for d in resource.devices
        )
        resources.append(Resource(resource.name, resource.kind, devices, resource.selectors))
    return Inventory(tuple(resources))


def claim_of(*devices: tuple[str, str]) -> PreparedClaim:
    return PreparedClaim(
        "ns", "c", "uid-1", tuple(PreparedDevice(("gpu",), pool, name, (f"x={name}",)) for pool, name in devices)
    )


def test_states_name_every_device_with_its_health_and_a_gone_prepared_device_is_unhealthy() -> None:
    inventory = sick(many_gpus(2), "0000:01:01.0", "/dev/vfio/1 is missing")
    prepared = [claim_of(("node01", "pci-0000-01-00-0"), ("node01", "pci-0000-09-00-0"))]
    states = device_states(inventory, prepared, "node01")
    assert states == (
        DeviceState("node01", "pci-0000-01-00-0", pb.HEALTHY),
        DeviceState("node01", "pci-0000-01-01-0", pb.UNHEALTHY, "/dev/vfio/1 is missing"),
        DeviceState("node01", "pci-0000-09-00-0", pb.UNHEALTHY, GONE),
    )
    # no pool known (no --node-name): the prepared devices, in the pool their answers named
    assert [s.device for s in device_states(inventory, prepared, None)] == ["pci-0000-01-00-0", "pci-0000-09-00-0"]
    assert {s.health for s in device_states(None, prepared, "node01")} == {pb.UNKNOWN}
    assert device_states(None, prepared, None)[0].message == NOT_SCANNED
    long = device_states(sick(many_gpus(1), "0000:01:00.0", "x" * 5000), [], "n")[0].message
    assert len(long) == MAX_MESSAGE and long.endswith("...")


def test_the_timeout_told_the_kubelet_covers_three_reports() -> None:
    assert health_timeout(0.2) == 30 and health_timeout(5.0) == 30  # the kubelet's default, reports every 10 s
    assert health_timeout(60.0) == 180


def test_an_unchanged_state_is_published_again_only_after_the_keepalive() -> None:
    board = HealthBoard(keepalive=3600.0)
    states = [DeviceState("p", "d", pb.HEALTHY)]
    assert board.update(states) and not board.update(states)
    assert board.update([DeviceState("p", "d", pb.UNHEALTHY, "why")])
    again = HealthBoard(keepalive=0.0)
    assert again.update(states) and again.update(states)
    assert KEEPALIVE < 30 / 2  # two reports fit in the kubelet's default timeout


# -- the stream on the real socket ---------------------------------------------------------------------------


def test_the_stream_sends_the_state_at_once_then_each_change_and_stop_ends_it() -> None:
    with short_dir() as base:
        node01 = build_tree(NODE01, base)
        paths = DraPaths.under(base, node01)
        runner = dra_runner(paths, pool="node01")
        with running_dra(runner), reading(runner.server.plugin_socket) as reader:
            first = reader.next()
            assert health_of(first) == {
                "pci-0000-3b-00-0": ("HEALTHY", ""),
                "pci-0000-5e-00-0": ("HEALTHY", ""),
                "pci-0000-86-00-0": ("HEALTHY", ""),
                "pci-0000-af-00-0": ("HEALTHY", ""),
            }
            device = first.devices[0]
            assert device.device.pool_name == "node01"
            assert device.health_check_timeout_seconds == health_timeout(runner.scan_interval)
            assert abs(device.last_updated_time - time.time()) < 600
            assert runner.inventory is not None
            group = next(d.iommu_group for r in runner.inventory.resources for d in r.devices if d.id == "0000:86:00.0")
            os.unlink(node01 / "dev" / "vfio" / str(group))  # the GPU's VFIO group node goes
            changed = reader.until(lambda m: health_of(m)["pci-0000-86-00-0"][0] == "UNHEALTHY")
            assert health_of(changed)["pci-0000-86-00-0"] == ("UNHEALTHY", f"/dev/vfio/{group} is missing")
            assert health_of(changed)["pci-0000-3b-00-0"] == ("HEALTHY", "")
            runner.request_stop()
            assert reader.ended.wait(PATIENCE), "stop did not end the health stream"
            assert reader.error is None  # ended cleanly: the kubelet reads EOF and opens a new one later


def test_a_stream_beyond_the_cap_is_refused_while_every_stream_reads_and_a_closed_one_frees_its_place() -> None:
    with short_dir() as base:
        paths = DraPaths.under(base, build_tree(NODE01, base))
        runner = dra_runner(paths, pool="node01")
        with running_dra(runner):
            socket = runner.server.plugin_socket
            readers: list[Reader] = []
            try:
                for _ in range(MAX_STREAMS):
                    readers.append(Reader(socket))
                    readers[-1].next()
                with reading(socket) as refused:  # one beyond, while all four read: refused, nobody goes
                    assert refused.ended.wait(PATIENCE)
                    assert refused.error is not None
                    assert refused.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert not any(reader.ended.is_set() for reader in readers)
                readers.pop(1).close()  # a stream breaks: its place is freed (gRPC's callback)
                assert _wait(lambda: runner.server.health.streams == MAX_STREAMS - 1)
                readers.append(Reader(socket))  # takes the free place: nobody goes
                readers[-1].next()
                runner.server.health.update([DeviceState("node01", "probe", pb.UNKNOWN)])
                for reader in readers:  # every open stream still hears the news
                    reader.until(lambda m: "probe" in health_of(m))
                assert not any(reader.ended.is_set() for reader in readers)
                assert runner.server.health.streams == MAX_STREAMS
            finally:
                for reader in readers:
                    reader.close()


def test_a_stream_nobody_reads_never_holds_the_loop_and_then_gets_the_latest_state() -> None:
    with short_dir() as base:
        paths = DraPaths.under(base, build_tree(NODE01, base))
        runner = dra_runner(paths, pool="node01")
        with running_dra(runner):
            channel = grpc.insecure_channel(f"unix:{runner.server.plugin_socket}")
            try:
                call = pb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                    pb.NodeWatchResourcesRequest(), timeout=PATIENCE * 4
                )
                board = runner.server.health
                assert _wait(lambda: board.streams == 1)
                big = "m" * MAX_MESSAGE
                for index in range(300):  # ~30 MB of messages were they queued; nobody reads, update never waits
                    board.update([DeviceState("node01", f"dev-{index}-{n}", pb.UNHEALTHY, big) for n in range(100)])
                board.update([DeviceState("node01", "last", pb.HEALTHY)])
                for message in call:  # what was already on its way, then the latest
                    if health_of(message) == {"last": ("HEALTHY", "")}:
                        break
                call.cancel()
            finally:
                channel.close()


def _drained(messages: Iterator[Any]) -> bool:
    """Read ``messages`` to their end: True once the stream ended, cleanly or broken."""
    try:
        for _ in messages:
            pass
    except DraStandInError:
        pass
    return True


def _wait(condition: Any, timeout: float = PATIENCE) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- as the kubelet does it: the registered endpoint, then SIGTERM ---------------------------------------------


def test_the_kubelet_reads_health_on_the_registered_endpoint_and_sigterm_is_not_held_by_the_stream() -> None:
    assert SERVICE == "v1alpha1.DRAResourceHealth" and SERVICE not in SERVICES  # not a registered "version"
    claim = ClaimRef("vms", "gpu-claim", UID)
    with short_dir() as base:
        paths = DraPaths.under(base, build_tree(NODE01, base))
        write_claim(paths, claim, [AllocatedDevice("gpu", DRIVER_NAME, "node01", "pci-0000-86-00-0")])
        paths.cdi_dir.mkdir()
        env = plugin_env(
            GPU_PLUGIN_DRA="true",
            GPU_PLUGIN_DRA_PLUGIN_DIR=str(paths.plugin_dir),
            GPU_PLUGIN_PLUGINS_REGISTRY=str(paths.registry),
            GPU_PLUGIN_CDI_DIR=str(paths.cdi_dir),
            GPU_PLUGIN_CLAIMS_DIR=str(paths.claims_dir),
        )  # no node name: only the prepared devices are reported, in the pool their answers named
        command = serve_command(paths.root, base / "kubelet", "--scan-interval", "0.2")
        with (base / "plugin.log").open("wb") as stderr, KubeletDraStandIn(paths.registry) as kubelet:
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            try:
                kubelet.wait_for_registration(DRIVER_NAME, timeout=PATIENCE)
                (devices, error) = kubelet.prepare(DRIVER_NAME, [("vms", "gpu-claim", UID)])[UID]
                assert error == ""
                watch = kubelet.watch_health(DRIVER_NAME, timeout=PATIENCE * 4)
                messages = iter(watch)
                report = next(messages)
                while not report:  # the state before the prepare was seen by a scan lists nothing
                    report = next(messages)
                (device,) = report
                assert (device.pool, device.device, device.health) == ("node01", "pci-0000-86-00-0", "HEALTHY")
                assert (device.pool, device.device) == (devices[0].pool, devices[0].device)
                process.send_signal(signal.SIGTERM)
                assert process.wait(WAIT * 4) == 0  # the open stream does not hold the stop
                assert _drained(messages)  # the stream has ended with the process
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
