"""Registering each resource's server with the kubelet: calls in flight, their answers, retries with back-off.

One role of the plugin's lifecycle, apart from watching (:mod:`plugin.watching`) and reconciling
(:mod:`plugin.manager`). ``Register`` is asynchronous (the kubelet dials us back inside it), so answers come
back on gRPC's threads; they are queued here and taken by the manager's loop, which alone changes
:class:`Registration` state. A registration is tied to the kubelet socket's identity (inode and mtime): a
restarted kubelet is a new identity, and every resource registers again. A failed registration to the same
kubelet is retried after :data:`RETRY_FIRST` seconds, doubling up to the scan interval.
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
from plugin.server import ResourceServer, describe_rpc_error

RETRY_FIRST = 0.25
"""Seconds before retrying a failed registration to the same kubelet socket; doubles up to the scan interval."""

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
    """The kubelet socket we are registered with (None: not registered with the current server)."""
    pending: bool = False
    """A ``Register`` call is in flight."""
    failed: Identity | None = None
    """The kubelet socket the last failed registration went to; retries to it wait for ``retry_at``."""
    failures: int = 0
    retry_at: float = 0.0

    def due(self, kubelet: Identity, now: float) -> bool:
        """Whether to register with ``kubelet`` now: not in flight, not registered there, no back-off running."""
        if self.pending or self.registered == kubelet:
            return False
        return not (self.failed == kubelet and now < self.retry_at)

    def reset(self) -> None:
        """The server was (re)started: nothing is registered with it yet."""
        self.registered = self.failed = None
        self.failures = 0


@dataclass(frozen=True, slots=True)
class _Answer:
    registration: Registration
    generation: int
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
        generation = registration.server.generation

        def done(error: BaseException | None, channel: grpc.Channel) -> None:
            self._answers.put(_Answer(registration, generation, kubelet, error, channel))
            self._wake()

        registration.pending = True  # set before the call: its answer may come before register() returns
        registration.server.register(self.kubelet_socket, done)

    def take_answers(self, current: Mapping[str, Registration], max_backoff: float) -> None:
        """Apply every answer received; an answer for a server since stopped or restarted only closes its channel."""
        while True:
            try:
                answer = self._answers.get_nowait()
            except queue.Empty:
                return
            answer.channel.close()
            registration = answer.registration
            registration.pending = False
            server = registration.server
            if current.get(server.name) is not registration or answer.generation != server.generation:
                continue  # the manager's reconcile registers the new one
            self._metrics.record_registration(server.name, ok=answer.error is None)
            if answer.error is None:
                registration.registered, registration.failed, registration.failures = answer.kubelet, None, 0
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
