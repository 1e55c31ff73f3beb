"""The kubelet's DRA health stream (KEP 4680, ``ResourceHealthStatus``): ``v1alpha1.DRAResourceHealth``.

A kubelet with the gate on (beta, on by default from 1.36) opens one ``NodeWatchResources`` server stream per
registered DRA plugin, on the plugin's DRAPlugin endpoint (the same gRPC connection as NodePrepareResources; the
service is not listed in ``supported_versions``), and reads it until it breaks; a failed or ended stream
(``UNIMPLEMENTED`` included) is opened again 5 s later. Each message is the driver's complete state: the kubelet
stamps every device it lists with the time it received it and takes a device not reported for
``health_check_timeout_seconds`` (default 30 s) for UNKNOWN, so a plugin must report again well within that
time even when nothing changed. The kubelet puts the health of each prepared device into the pod's
``status.containerStatuses[].allocatedResourcesStatus`` (with ``message`` under ``ResourceHealthStatusMessage``).
Sources: Kubernetes ``pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`` (the stream's loop),
``pkg/kubelet/cm/dra/manager.go`` (``HandleWatchResourcesStream``), ``pkg/kubelet/cm/dra/healthinfo.go`` (the
timeout); docs/dra.md, "Health stream".

Here: :class:`HealthBoard` holds the latest state, which the serve loop sets after every scan
(:func:`device_states` of the inventory and the prepared claims) and publishes when it changed or
:data:`KEEPALIVE` seconds after the last publication. Each stream sends the latest state it has not sent:
nothing queues (latest state wins), so a slow reader never holds the loop, and the loop never waits on a
stream. At most :data:`MAX_STREAMS` streams at once (each holds a server thread); a newer one takes the place of
one that has not taken the newest state (a stalled reader, which is cancelled) and is refused while every stream
reads, so no client's stream takes a place from another's that is being served (docs/dra.md, "Health stream").
A message stays under the kubelet's 4 MiB receive limit
(:data:`KUBELET_MAX_RECEIVE`, prepared devices first) and its ``message`` fields are UTF-8 of at most 1024 bytes.
:meth:`HealthBoard.close` (stop) ends every stream at once, so SIGTERM never waits on a kubelet.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from plugin.dra.checkpoint import PreparedClaim
from plugin.inventory import Device, Inventory
from plugin.log import log_event
from schemas.dra import device_name
from schemas.generated.kubelet.dra_health.v1alpha1 import api_pb2 as pb

SERVICE = "v1alpha1.DRAResourceHealth"
"""The full gRPC service name the kubelet calls (``/v1alpha1.DRAResourceHealth/NodeWatchResources``)."""
MAX_STREAMS = 4
"""Streams served at once: the kubelet holds one; a second may overlap while an old one is being torn down."""
KEEPALIVE = 10.0
"""Seconds after which an unchanged state is sent again (the kubelet's default timeout is 30 s)."""
KUBELET_DEFAULT_TIMEOUT = 30
"""``DefaultHealthTimeout`` of the kubelet (``pkg/kubelet/cm/dra/healthinfo.go``), seconds."""
MAX_MESSAGE = 1024
"""``DeviceHealth.message`` in UTF-8 bytes: the kubelet cuts a longer one at that many *bytes*
(``truncateHealthMessage``, Go's ``len``, ``v1.ResourceHealthMessageMaxLength``), possibly inside a character;
we cut first, on a character boundary."""
MAX_DEVICES = 4096
"""Devices in one message at most (a node has a few dozen)."""
KUBELET_MAX_RECEIVE = 4 * 1024 * 1024 - 64 * 1024
"""Bytes one message may take: the kubelet dials the plugin with grpc-go's default receive limit of 4 MiB
(``dra_plugin_manager.go`` sets no ``MaxCallRecvMsgSize``) and a longer message breaks the stream at every try, so
no device's health is heard at all. 64 KiB are kept for the framing; :func:`device_states` stops adding devices
at this bound, prepared devices first."""
_ENTRY_OVERHEAD = 48
"""Bytes of one ``DeviceHealth`` beyond its three strings, at most (tags, lengths, the enum and two varints)."""
POLL = 5.0
"""Seconds a waiting stream looks again whether its peer is still there (gRPC's callback normally says so first)."""
GONE = "not found on the node at the last scan"
NOT_SCANNED = "the node has not been scanned yet"


def health_timeout(scan_interval: float) -> int:
    """``health_check_timeout_seconds`` for a loop scanning every ``scan_interval`` s: three reports' time, and
    never less than the kubelet's default."""
    return max(KUBELET_DEFAULT_TIMEOUT, math.ceil(3 * max(scan_interval, KEEPALIVE)))


def _utf8(text: str) -> str:
    """``text`` as protobuf can send it: a name decoded with surrogate escapes (``os.readlink`` of a link whose
    name is not UTF-8) would make serializing the whole message fail; its bytes are shown as ``\\xff`` instead."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def _message(text: str) -> str:
    """``text`` as valid UTF-8 of at most :data:`MAX_MESSAGE` bytes (cut on a character, ``...`` at the end)."""
    text = _utf8(text)
    raw = text.encode("utf-8")
    if len(raw) <= MAX_MESSAGE:
        return text
    return raw[: MAX_MESSAGE - 3].decode("utf-8", "ignore") + "..."


def _entry_bytes(pool: str, device: str, message: str) -> int:
    return len(pool.encode("utf-8")) + len(device.encode("utf-8")) + len(message.encode("utf-8")) + _ENTRY_OVERHEAD


@dataclass(frozen=True, slots=True)
class DeviceState:
    """One device's health as the stream reports it."""

    pool: str
    device: str
    health: int
    """``pb.HEALTHY``, ``pb.UNHEALTHY`` or ``pb.UNKNOWN``."""
    message: str = ""


def device_states(
    inventory: Inventory | None, prepared: Iterable[PreparedClaim], pool: str | None
) -> tuple[DeviceState, ...]:
    """Every device the kubelet may ask about: each prepared claim's devices (their pool as answered to the
    kubelet), and with ``pool`` (the node's, as the ResourceSlices publish it) every device of ``inventory``.
    Healthy, unhealthy with its reason, unhealthy when a prepared device is gone from the node, unknown before
    the first scan. Sorted by (pool, device), at most :data:`MAX_DEVICES` and :data:`KUBELET_MAX_RECEIVE` bytes in
    all, the prepared devices kept first."""
    by_name: dict[str, Device] = {}
    for resource in inventory.resources if inventory is not None else ():
        for device in resource.devices:
            by_name.setdefault(device_name(device.kind, device.id), device)
    prepared_keys = sorted({(_utf8(item.pool), _utf8(item.device)) for claim in prepared for item in claim.devices})
    others = sorted({(pool, name) for name in by_name} - set(prepared_keys)) if pool is not None else []
    states: list[DeviceState] = []
    budget = KUBELET_MAX_RECEIVE
    for pool_name, name in [*prepared_keys, *others]:  # the prepared ones first: the kubelet looks at no others
        found = by_name.get(name)
        if inventory is None:
            state = DeviceState(pool_name, name, pb.UNKNOWN, NOT_SCANNED)
        elif found is None:
            state = DeviceState(pool_name, name, pb.UNHEALTHY, GONE)
        elif found.healthy:
            state = DeviceState(pool_name, name, pb.HEALTHY)
        else:
            state = DeviceState(pool_name, name, pb.UNHEALTHY, _message(found.reason or "unhealthy"))
        budget -= _entry_bytes(state.pool, state.device, state.message)
        if budget < 0 or len(states) == MAX_DEVICES:
            break
        states.append(state)
    return tuple(sorted(states, key=lambda state: (state.pool, state.device)))


class _Stream:
    """One open stream: ended by its generator, by gRPC's callback (the peer went), or by a newer stream taking
    its place (:meth:`HealthBoard._open_stream`), whichever comes first."""

    def __init__(self, board: HealthBoard, context: grpc.ServicerContext) -> None:
        self.board = board
        self.context = context
        self.ended = False
        self.seen = 0
        """The version of the last state it took."""
        self.waiting = False
        """Whether it waits in the board for a newer state (else it is in gRPC's send, or not started)."""

    def end(self) -> None:
        self.board._end(self)


class StreamsFull(Exception):
    """Every stream place is held by a stream that reads: the newcomer is refused (``RESOURCE_EXHAUSTED``)."""

    def __init__(self, places: int) -> None:
        super().__init__(f"all {places} health streams are open and reading; try again later")
        self.places = places


class HealthBoard:
    """The latest health state and the open streams (thread-safe; see the module doc)."""

    def __init__(
        self,
        max_streams: int = MAX_STREAMS,
        keepalive: float = KEEPALIVE,
        timeout_seconds: int = KUBELET_DEFAULT_TIMEOUT,
    ) -> None:
        self.max_streams = max_streams
        self.keepalive = keepalive
        self.timeout_seconds = timeout_seconds
        self._changed = threading.Condition()
        self._states: tuple[DeviceState, ...] | None = None
        self._at = 0
        """Unix seconds of the scan that determined ``_states``."""
        self._version = 0
        self._published = 0.0
        self._streams: list[_Stream] = []
        self._closed = False

    @property
    def streams(self) -> int:
        with self._changed:
            return len(self._streams)

    def update(self, states: Sequence[DeviceState], at: float | None = None) -> bool:
        """Take the state of a scan at ``at`` (Unix seconds; default now); publish it to the streams when it
        differs from the last or that one is :attr:`keepalive` old. Never blocks on a stream."""
        now = time.monotonic()
        with self._changed:
            fresh = tuple(states) != self._states
            if not fresh and now < self._published + self.keepalive:
                return False
            self._states, self._at = tuple(states), int(time.time() if at is None else at)
            self._version += 1
            self._published = now
            self._changed.notify_all()
            return True

    def open(self) -> None:
        """Serve streams (again, after :meth:`close`)."""
        with self._changed:
            self._closed = False

    def close(self) -> None:
        """End every stream now and refuse new ones until :meth:`open`."""
        with self._changed:
            self._closed = True
            self._streams.clear()
            self._changed.notify_all()

    def _open_stream(self, context: grpc.ServicerContext) -> _Stream | None:
        """A place for a new stream; None once closed. With every place taken, the newcomer gets the place of a
        stream that has not taken the newest state (a reader that stopped reading: it is served nothing anyway),
        and is refused (:class:`StreamsFull`) while every stream reads: one client's streams never take a place
        from another's that is being served. ``dra.sock`` is root's alone, and the kubelet's own broken stream
        frees its place at once (gRPC's callback), so a kubelet opening again 5 s later finds one."""
        with self._changed:
            if self._closed:
                return None
            victim = None
            if len(self._streams) >= self.max_streams:
                stalled = [s for s in self._streams if not s.waiting and s.seen < self._version]
                if not stalled:
                    raise StreamsFull(self.max_streams)
                victim = stalled[0]
                victim.ended = True
                self._streams.remove(victim)
                self._changed.notify_all()
            stream = _Stream(self, context)
            stream.seen = self._version  # not "stalled" before its first turn: it takes the newest state at once
            self._streams.append(stream)
        if victim is not None:
            # Cancelled, not only marked: a stream whose peer never reads sits in gRPC's send, holding its server
            # thread, where no flag of ours reaches it. Outside the lock: gRPC may run the callbacks right here.
            log_event("dra_health_stream_replaced", streams=self.max_streams, reason="stalled")
            victim.context.cancel()
        return stream

    def _end(self, stream: _Stream) -> None:
        with self._changed:
            stream.ended = True
            if stream in self._streams:
                self._streams.remove(stream)
            self._changed.notify_all()

    def _next(self, stream: _Stream, seen: int, active: Any) -> tuple[int, pb.NodeWatchResourcesResponse] | None:
        """The first state newer than version ``seen``, waiting for it; None once the stream or board ended."""
        with self._changed:
            while True:
                if stream.ended or self._closed or not active():
                    return None
                if self._states is not None and self._version > seen:
                    stream.seen, stream.waiting = self._version, False
                    return self._version, self._response()
                stream.waiting = True
                self._changed.wait(POLL)

    def _response(self) -> pb.NodeWatchResourcesResponse:
        response = pb.NodeWatchResourcesResponse()
        for state in self._states or ():
            response.devices.add(
                device=pb.DeviceIdentifier(pool_name=state.pool, device_name=state.device),
                health=state.health,
                last_updated_time=self._at,
                health_check_timeout_seconds=self.timeout_seconds,
                message=state.message,
            )
        return response

    def watch(self, context: grpc.ServicerContext) -> Generator[pb.NodeWatchResourcesResponse, None, None]:
        """One ``NodeWatchResources`` stream: the full state at once (as soon as there is one), then every
        newer one, until the peer goes or :meth:`close`."""
        try:
            stream = self._open_stream(context)
        except StreamsFull as full:
            log_event("dra_health_stream_refused", streams=full.places)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))
        if stream is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the DRA plugin is stopping; try again")
        assert stream is not None
        if not context.add_callback(stream.end):  # the peer went (or the server stops): the stream is gone at once
            stream.end()  # already over
        try:
            seen = 0
            while True:
                got = self._next(stream, seen, context.is_active)
                if got is None:
                    return
                seen, response = got
                yield response
        finally:
            stream.end()


class HealthServicer:
    """``v1alpha1.DRAResourceHealth`` over a :class:`HealthBoard`."""

    def __init__(self, board: HealthBoard) -> None:
        self.board = board

    def NodeWatchResources(
        self, request: pb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.NodeWatchResourcesResponse]:
        return self.board.watch(context)
