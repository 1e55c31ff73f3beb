"""Registering each resource's server with the kubelet: calls in flight, their answers, retries with back-off.

One role of the plugin's lifecycle, apart from watching (:mod:`plugin.watching`) and reconciling
(:mod:`plugin.manager`). ``Register`` is asynchronous (the kubelet dials us back inside it), so answers come
back on gRPC's threads; they are queued here and taken by the manager's loop, which alone changes
:class:`Registration` state.

Whether the kubelet still has us is not read from ``kubelet.sock``'s identity (the kubelet's start removes and
recreates that file while we look at it, and a kubelet can drop a client while its socket stays the same): each
``Register`` grants the next ``ListAndWatch`` stream to the kubelet (:class:`plugin.server.KubeletLink`), and a
registration holds while that stream is open, or for :data:`STREAM_WAIT` seconds after a successful answer
while the stream is on its way. When the stream ends (the kubelet disconnected us, died, or our server was
restarted) the resource registers again at once. A failed registration is retried after :data:`RETRY_FIRST`
seconds, doubling up to the scan interval; the back-off is keyed on the kubelet socket's identity, so a new
``kubelet.sock`` is tried at once.
"""

from __future__ import annotations

import queue
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from plugin.log import log_event
from plugin.metrics import MetricsRecorder
from plugin.server import KubeletLink, ResourceServer, describe_rpc_error

RETRY_FIRST = 0.25
"""Seconds before retrying a failed registration to the same kubelet socket; doubles up to the scan interval."""
STREAM_WAIT = 10.0
"""Seconds a successful registration waits for the kubelet's ``ListAndWatch`` before it is sent again. The kubelet
opens it as soon as its dial-back is done, so it comes in milliseconds; this only covers a stream that never
comes (a kubelet that failed to open it has already dropped its client)."""
STREAM_STABLE = 10.0
"""Seconds after a successful answer from which the end of the kubelet's stream is answered by a ``Register`` at
once. A stream that ends sooner, or never comes, twice in a row (a kubelet that drops every client it gets) is
answered after :data:`RETRY_FIRST` seconds, doubling up to the scan interval, instead of in a loop."""

Identity = tuple[int, int]


def socket_identity(path: Path) -> Identity | None:
    """Inode and mtime of the unix socket at ``path``, or None when there is none: a new kubelet = a new identity."""
    try:
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISSOCK(info.st_mode):
        return None
    return info.st_ino, info.st_mtime_ns


@dataclass(eq=False)
class Registration:
    """One resource's server and where its registration stands."""

    server: ResourceServer
    registered: Identity | None = None
    """Set by a successful answer (to the kubelet socket's identity when the call was sent, for the logs);
    None: not registered. Cleared when the granted stream ends or never comes (:meth:`holds`)."""
    pending: bool = False
    """A ``Register`` call is in flight."""
    token: int | None = None
    """The stream grant of the last ``Register`` sent."""
    answered_at: float = 0.0
    """``time.monotonic()`` of the last successful answer."""
    failed: Identity | None = None
    """The kubelet socket the last failed registration went to; retries to it wait for ``retry_at``."""
    failures: int = 0
    retry_at: float = 0.0
    losses: int = 0
    """The kubelet's streams lost in a row, each sooner than :data:`STREAM_STABLE` after its answer (or never
    opened); the first is answered at once, the next ones after a back-off (:meth:`lost`)."""
    hold_until: float = 0.0
    """``time.monotonic()`` before which no ``Register`` is sent after a lost stream (:meth:`lost`) to the same
    kubelet: ``held_for``, the ``kubelet.sock`` the lost registration went to (a new kubelet is not held)."""
    held_for: Identity | None = None

    def link(self) -> str:
        """The state of the kubelet's stream for the last ``Register`` (see :class:`plugin.server.KubeletLink`)."""
        return self.server.link.status(self.token)

    def holds(self, now: float) -> bool:
        """Registered, and the kubelet's stream is open or (just after the answer) still on its way."""
        if self.registered is None:
            return False
        status = self.link()
        return status == KubeletLink.OPEN or (status == KubeletLink.WAITING and now < self.stream_deadline())

    def stream_deadline(self) -> float:
        """When a successful registration whose stream has not come is given up (and sent again)."""
        return self.answered_at + STREAM_WAIT

    def due(self, kubelet: Identity, now: float) -> bool:
        """Whether to register with ``kubelet`` now: not in flight, not registered, no back-off running."""
        if self.pending or self.registered is not None or (now < self.hold_until and kubelet == self.held_for):
            return False
        return not (self.failed == kubelet and now < self.retry_at)

    def lost(self, now: float, max_backoff: float) -> float:
        """The kubelet's stream for this registration ended or never came (:meth:`holds` turned False): forget
        the registration and return the seconds before the next ``Register``. 0 unless the stream before was
        lost soon to the same kubelet: then :data:`RETRY_FIRST`, doubling up to ``max_backoff`` (a kubelet that
        drops each client at once would otherwise get a ``Register`` storm). A new ``kubelet.sock`` (a kubelet
        restart) starts over: each restart still gets its one ``Register`` at once."""
        stable = self.link() == KubeletLink.ENDED and now - self.answered_at >= STREAM_STABLE
        if stable or self.registered != self.held_for:
            self.losses = 0
        self.held_for = self.registered
        self.losses += 1
        delay = 0.0
        if self.losses > 1:
            delay = min(RETRY_FIRST * 2 ** (self.losses - 2), max(max_backoff, RETRY_FIRST))
        self.registered = None
        self.hold_until = now + delay
        return delay

    def restarted(self) -> None:
        """The server was (re)started: the back-off starts over. A registration in flight stays so (the
        kubelet's dial-back may reach the new server); one that held lost its stream, which :meth:`holds` sees."""
        self.failed = None
        self.failures = 0


@dataclass(frozen=True, slots=True)
class _Answer:
    registration: Registration
    token: int
    kubelet: Identity
    error: BaseException | None
    channel: grpc.Channel


class Registrar:
    """Sends ``Register`` calls and applies their answers in the manager's thread (:meth:`take_answers`)."""

    def __init__(self, kubelet_socket: Path, wake: Callable[[], None], metrics: MetricsRecorder) -> None:
        self.kubelet_socket = kubelet_socket
        self._wake = wake
        self._metrics = metrics
        self._answers: queue.SimpleQueue[_Answer] = queue.SimpleQueue()

    def register(self, registration: Registration, kubelet: Identity) -> None:
        """Start registering ``registration``'s server with the kubelet whose socket is ``kubelet`` now."""
        token = registration.server.link.grant()

        def done(error: BaseException | None, channel: grpc.Channel) -> None:
            self._answers.put(_Answer(registration, token, kubelet, error, channel))
            self._wake()

        registration.pending = True  # set before the call: its answer may come before register() returns
        registration.registered = None
        registration.token = token
        registration.server.register(self.kubelet_socket, done, token)

    def take_answers(self, current: Mapping[str, Registration], max_backoff: float) -> None:
        """Apply every answer received; an answer for a server since withdrawn only closes its channel."""
        while True:
            try:
                answer = self._answers.get_nowait()
            except queue.Empty:
                return
            answer.channel.close()
            registration = answer.registration
            registration.pending = False
            server = registration.server
            if answer.error is not None:
                server.link.revoke(answer.token)
            if current.get(server.name) is not registration or answer.token != registration.token:
                continue
            self._metrics.record_registration(server.name, ok=answer.error is None)
            if answer.error is None:
                registration.registered, registration.failed, registration.failures = answer.kubelet, None, 0
                registration.answered_at = time.monotonic()
                log_event("registered", resource=server.name, endpoint=server.socket_path.name)
                continue
            registration.failures = registration.failures + 1 if registration.failed == answer.kubelet else 1
            registration.failed = answer.kubelet
            delay = min(RETRY_FIRST * 2 ** (registration.failures - 1), max(max_backoff, RETRY_FIRST))
            registration.retry_at = time.monotonic() + delay
            log_event(
                "registration_failed",
                resource=server.name,
                error=describe_rpc_error(answer.error),
                attempt=registration.failures,
                retry_in=round(delay, 3),
            )
