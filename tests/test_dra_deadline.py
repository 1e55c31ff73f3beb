"""A trickling API server holds no DRA worker past a deadline (issue 22, finding 3).

urllib3's ``(connect, read)`` timeouts bound each socket operation, not the call: a server sending one byte
every few seconds kept a claim read going for ever, every worker busy, and an unrelated unprepare waiting
past the kubelet's 45 s. Here a real HTTP server on loopback dribbles its answer (a byte every 50 ms, well
inside the read timeout) until the test lets it go, so a call can only end early through its own deadline:

- every KubeApi call ends with a KubeError naming its deadline while the server is still dribbling, whether
  it dribbles the status line or the body;
- the claim reads of one NodePrepareResources share the call's time (``until``): two claims, one budget;
- an unprepare is answered while every prepare the server can hold is still reading its claim.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from plugin.dra import service
from plugin.dra.claims import AllocatedDevice, ClaimError, ClaimRef, StaticClaims
from plugin.dra.kube import KubeApi, KubeClaims, KubeError
from plugin.dra.prepare import PrepareCore
from plugin.dra.service import DraServer
from schemas.dra import DRIVER_NAME
from schemas.generated.kubelet.dra.v1 import api_pb2 as v1
from schemas.generated.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from simkit.fixture_nodes import NODE01
from tests.discovery_support import build_node, discover
from tests.plugin_support import WAIT, short_dir

DRIBBLE = 0.05
"""Seconds between two bytes of the server's answer: far inside every read timeout used here."""


class Trickler:
    """An HTTP server on loopback that answers every request one byte at a time until :meth:`release`."""

    def __init__(self, part: str = "body") -> None:
        self.part = part
        self.released = threading.Event()
        self._lock = threading.Lock()
        self.in_flight = 0
        self.answered = 0
        self.changed = threading.Condition(self._lock)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._answer, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _answer(self, conn: socket.socket) -> None:
        with self.changed:
            self.in_flight += 1
            self.changed.notify_all()
        try:
            if self.part == "tls":  # a TLS handshake that never gets its ServerHello: read, never answer
                conn.settimeout(DRIBBLE)
                while not self.released.is_set():
                    try:
                        if not conn.recv(4096):
                            return  # the client gave up
                    except TimeoutError:
                        continue
            conn.settimeout(WAIT)
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
            if self.part == "body":
                conn.sendall(head + b"{")
            sent = 0
            while not self.released.wait(DRIBBLE):
                byte = head[sent : sent + 1] if self.part == "headers" and sent < len(head) else b" "
                conn.sendall(byte)
                sent += 1
        except OSError:
            pass  # the client gave up on us: what a deadline does
        finally:
            conn.close()
            with self.changed:
                self.in_flight -= 1
                self.answered += 1
                self.changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    def release(self) -> None:
        self.released.set()
        self._sock.close()
        for thread in self._threads:
            thread.join(WAIT)


@contextmanager
def trickling(part: str = "body") -> Iterator[Trickler]:
    server = Trickler(part)
    try:
        yield server
    finally:
        server.release()


def ended(target: Any) -> tuple[bool, list[BaseException]]:
    """Run ``target`` in a thread; (whether it ended within WAIT, what it raised)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT)
    return not thread.is_alive(), errors


@pytest.mark.parametrize("part", ["headers", "body", "tls"])
def test_a_call_to_a_trickling_server_ends_at_its_deadline(part: str) -> None:
    with trickling(part) as server:
        # Per-operation timeouts longer than the wait: only the call's deadline can end it in time.
        url = server.url.replace("http://", "https://") if part == "tls" else server.url
        api = KubeApi.for_host(url, timeout=(WAIT * 4, WAIT * 4), deadline=0.5)
        done, errors = ended(lambda: api.read_claim("vms", "gpu-claim"))
        assert done, "the call is still reading the trickle"
        (error,) = errors
        assert isinstance(error, KubeError)
        assert "read ResourceClaim vms/gpu-claim: no complete answer from" in str(error) and "deadline" in str(error)
        assert not server.released.is_set()  # the server never stopped dribbling: the deadline ended the call
        assert server.wait_for(lambda: server.in_flight == 0)  # and the connection was closed, not left open
        api.close()


def test_the_claim_reads_of_one_call_share_its_time() -> None:
    """Each claim read gets what is left of the call's ``until``; a claim whose turn comes after it fails
    unread. Two claims each "taking for ever" cost one budget, not two."""
    with trickling() as server:
        api = KubeApi.for_host(server.url, timeout=(1.0, 1.0), deadline=WAIT * 10)
        claims = KubeClaims(api)
        until = time.monotonic() + 0.5
        done, errors = ended(lambda: claims.allocated(ClaimRef("vms", "a", "uid-a"), until))
        assert done and isinstance(errors[0], ClaimError) and "deadline" in str(errors[0])
        with pytest.raises(ClaimError, match="no time left"):
            claims.allocated(ClaimRef("vms", "b", "uid-b"), until)
        api.close()


UID_READY = "1a2b3c4d-0000-4000-8000-00000000abcd"


class Split:
    """Claims named ``ready`` come from a mapping, every other one from the API server."""

    def __init__(self, ready: StaticClaims, api: KubeClaims) -> None:
        self.ready, self.api = ready, api

    def allocated(self, claim: ClaimRef, until: float | None = None) -> list[AllocatedDevice]:
        source = self.ready if claim.name == "ready" else self.api
        return source.allocated(claim, until)


def test_an_unprepare_is_answered_while_every_prepare_reads_from_a_trickling_server(tmp_path: Path) -> None:
    root = build_node(NODE01, tmp_path)
    ready = ClaimRef("vms", "ready", UID_READY)
    static = StaticClaims.from_results({ready: [AllocatedDevice("gpu", DRIVER_NAME, "node01", "pci-0000-86-00-0")]})
    with short_dir() as base, trickling() as server:
        api = KubeApi.for_host(server.url, timeout=(WAIT, WAIT), deadline=WAIT * 20)  # the deadline alone won't do
        core = PrepareCore(Split(static, KubeClaims(api)), root, base / "plugin", tmp_path / "cdi", pool="node01")
        core.update_inventory(discover(root))
        core.start()
        dra = DraServer(core, base / "plugin", base / "reg")
        dra.start()
        channel = grpc.insecure_channel(f"unix:{dra.plugin_socket}")
        stub = v1_grpc.DRAPluginStub(channel)
        threads: list[threading.Thread] = []
        try:
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace="vms", name="ready", uid=UID_READY)]),
                timeout=WAIT,
            )
            assert answer.claims[UID_READY].error == ""
            calls = max(service.WORKERS, 4) + 2  # more prepares than workers, today's and yesterday's (4)
            finished: list[str] = []

            def slow_prepare(index: int) -> None:
                claim = v1.Claim(namespace="vms", name=f"slow-{index}", uid=f"uid-slow-{index}")
                try:
                    stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=[claim]), timeout=WAIT * 20)
                    finished.append("answered")
                except grpc.RpcError as exc:
                    finished.append(exc.code().name)

            threads += [threading.Thread(target=slow_prepare, args=(i,), daemon=True) for i in range(calls)]
            for thread in threads:
                thread.start()
            # Wait until the prepares have taken what they can: reading (held by the trickle) or turned away.
            assert server.wait_for(lambda: server.in_flight >= min(service.PREPARE_CALLS, 4))
            unprepared = stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[v1.Claim(namespace="vms", name="ready", uid=UID_READY)]),
                timeout=WAIT,
            )
            assert unprepared.claims[UID_READY].error == ""
            assert server.in_flight >= 1 and not server.released.is_set()  # prepares were still reading
            assert UID_READY not in core.prepared()
            assert set(finished) <= {"RESOURCE_EXHAUSTED"}  # none answered yet; any turned away said why
        finally:
            server.release()
            for thread in threads:
                thread.join(WAIT)
            channel.close()
            dra.stop(0)
            api.close()
