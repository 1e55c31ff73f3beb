"""The Kubernetes API client plumbing the DRA plugin and the node agent share: one implementation of each part.

Both talk to the API server with the official ``kubernetes`` client (its REST layer over urllib3); this module
holds what is generic about that, and each component's own module (:mod:`plugin.dra.kube`,
:mod:`node_agent.kube`) holds its typed facade of the few calls it makes. Only those two import this module, so
nothing else (the device-plugin path, the hook sidecar) loads the client.

- :class:`KubeClient` configures the client from the pod's service account when running in a cluster
  (``KUBERNETES_SERVICE_HOST`` set, no kubeconfig given), else from a kubeconfig; or, for tests and
  ``kubectl proxy``, talks to a plain ``http://`` host (:meth:`KubeClient.for_host`). It never retries on its
  own (each caller decides what a failure means).
- Every call has a timeout (connect, each read) **and a total deadline**: urllib3's timeouts bound each socket
  operation, so a server trickling a byte every few seconds would hold a call forever. A watchdog
  (:class:`_Deadline`) shuts down the sockets the call is using when its deadline passes, so the call fails at
  once with a :class:`KubeError` saying so. The same watchdog ends a long call (a watch) on request from
  another thread (:class:`Abort`), which is how a stop request never waits on a socket.
- Answers are read with a size bound (:data:`MAX_RESPONSE_BYTES`; a watch's events one line each, each under
  its own bound), parsed once, and must be JSON objects; errors are :class:`KubeError` naming the operation,
  the object and the API server's answer (the ``message`` of its ``Status``, cut).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Self

import kubernetes.client
import kubernetes.config
import urllib3
import urllib3.connection
import urllib3.connectionpool

from schemas.errors import InputError

DEFAULT_TIMEOUT = (5.0, 15.0)
"""Seconds to connect and to wait for each read of the answer, for every call."""
DEFAULT_DEADLINE = 20.0
"""Seconds a whole call may take, however the server dribbles its answer."""
MAX_RESPONSE_BYTES = 32 * 1024 * 1024
"""Largest answer read (etcd's object limit is 1.5 MiB; a list of a node's objects stays far below this)."""
STREAM_CHUNK_BYTES = 64 * 1024
"""Most bytes taken from a streamed answer at once."""

JSON = dict[str, Any]


class KubeError(InputError):
    """A Kubernetes API call failed; the message names the call, the object and the server's answer."""


def _reason(body: bytes | str | None) -> str:
    """The ``message`` of a Kubernetes Status body, else the start of the body."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    try:
        status = json.loads(text)
    except ValueError:
        status = None
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        return str(status["message"])[:300]
    return text[:300].strip() or "(no body)"


class _Deadline:
    """One call's deadline: when it passes, every connection the call used has its socket shut down, so a
    read blocked on a trickling server returns at once (on the calling thread, which then reports the deadline).

    The connections register themselves (:class:`_WatchedConnection`) through a thread-local: the client is
    synchronous, so the connection a call uses is used on the thread that made the call."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self._lock = threading.Lock()
        self._connections: list[urllib3.connection.HTTPConnection] = []
        self._sockets: list[socket.socket] = []
        self._done = False
        self._timer = threading.Timer(max(0.0, seconds), self._expire)
        self._timer.daemon = True

    def watch(self, connection: urllib3.connection.HTTPConnection) -> None:
        with self._lock:
            if connection not in self._connections:
                self._connections.append(connection)
            expired = self.expired
        if expired:
            raise TimeoutError(f"the call's deadline of {self.seconds:g} s has passed")

    def watch_socket(self, sock: socket.socket) -> None:
        """A new connection's socket, before TLS wraps it (and detaches this object from its descriptor): a
        duplicate descriptor of it is kept until :meth:`finish`, so a handshake dribbled byte by byte is cut too
        (``shutdown`` acts on the connection, whichever descriptor names it)."""
        duplicate = sock.dup()
        with self._lock:
            if self._done:
                duplicate.close()
                return
            self._sockets.append(duplicate)
            expired = self.expired
        if expired:
            with suppress(OSError):
                duplicate.shutdown(socket.SHUT_RDWR)

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            socks = [getattr(connection, "sock", None) for connection in self._connections] + self._sockets
            for sock in socks:
                if sock is not None:  # the plain socket's shutdown, also under TLS: the reader sees EOF, gives up
                    with suppress(OSError):
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def cut(self) -> None:
        """End the call now, from any thread (a stop request): as if its deadline had passed."""
        self._expire()

    def start(self) -> None:
        self._timer.start()

    def finish(self) -> None:
        with self._lock:
            self._done = True
            duplicates, self._sockets = self._sockets, []
        self._timer.cancel()
        for duplicate in duplicates:
            duplicate.close()


_calls = threading.local()


def _current_deadline() -> _Deadline | None:
    deadline: _Deadline | None = getattr(_calls, "deadline", None)
    return deadline


class _WatchedConnection(urllib3.connection.HTTPConnection):
    """An HTTP connection that puts itself under the calling thread's :class:`_Deadline` when it is used."""

    def _new_conn(self) -> socket.socket:
        sock: socket.socket = super()._new_conn()
        deadline = _current_deadline()
        if deadline is not None:
            deadline.watch_socket(sock)
        return sock

    def connect(self) -> None:
        deadline = _current_deadline()
        if deadline is not None:
            deadline.watch(self)
        super().connect()

    def request(self, *args: Any, **kwargs: Any) -> None:
        deadline = _current_deadline()
        if deadline is not None:
            deadline.watch(self)
        super().request(*args, **kwargs)


class _WatchedHTTPSConnection(_WatchedConnection, urllib3.connection.HTTPSConnection):
    """The same for TLS: the methods above come first in the order, then TLS's own (their ``super()``)."""


class _WatchedPool(urllib3.connectionpool.HTTPConnectionPool):
    ConnectionCls = _WatchedConnection


class _WatchedHTTPSPool(urllib3.connectionpool.HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


@contextmanager
def _deadline(seconds: float) -> Iterator[_Deadline]:
    deadline = _Deadline(seconds)
    _calls.deadline = deadline
    deadline.start()
    try:
        yield deadline
    finally:
        deadline.finish()
        _calls.deadline = None


class Abort:
    """A stop request for the long call (a watch) another thread is making: :meth:`fire` cuts its sockets at once
    (and every later call through it fails before sending). Thread-safe; one per long-running loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadline: _Deadline | None = None
        self.fired = False

    def attach(self, deadline: _Deadline | None) -> None:
        with self._lock:
            self._deadline = deadline
            fired = self.fired
        if fired and deadline is not None:
            deadline.cut()

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            deadline = self._deadline
        if deadline is not None:
            deadline.cut()


class KubeClient:
    """The client with JSON dicts in and out, every call bounded (see the module doc); subclasses add the calls."""

    def __init__(
        self, configuration: Any, timeout: tuple[float, float] = DEFAULT_TIMEOUT, deadline: float = DEFAULT_DEADLINE
    ) -> None:
        if deadline <= 0:
            raise ValueError("deadline must be positive")
        configuration.retries = False  # no silent retries: each caller retries whole, and logs it
        self._client = kubernetes.client.ApiClient(configuration)
        # Every connection the client opens answers to the calling thread's deadline (see _Deadline).
        self._client.rest_client.pool_manager.pool_classes_by_scheme = {
            "http": _WatchedPool,
            "https": _WatchedHTTPSPool,
        }
        self._timeout = timeout
        self.deadline = deadline
        """Seconds a whole call may take (connect, send, the whole answer read)."""
        self.host = str(configuration.host)

    @classmethod
    def for_host(
        cls, host: str, timeout: tuple[float, float] = DEFAULT_TIMEOUT, deadline: float = DEFAULT_DEADLINE
    ) -> Self:
        """An unauthenticated client of ``host`` (``http://127.0.0.1:PORT``): tests and ``kubectl proxy``."""
        configuration = kubernetes.client.Configuration()
        configuration.host = host
        return cls(configuration, timeout, deadline)

    @classmethod
    def from_environment(
        cls,
        kubeconfig: Path | None = None,
        timeout: tuple[float, float] = DEFAULT_TIMEOUT,
        deadline: float = DEFAULT_DEADLINE,
    ) -> Self:
        """The pod's service account when running in a cluster (``KUBERNETES_SERVICE_HOST`` set) and no
        ``kubeconfig`` is given, else ``kubeconfig`` (default: ``$KUBECONFIG``, then ``~/.kube/config``)."""
        return cls(configuration_from_environment(kubeconfig), timeout, deadline)

    def close(self) -> None:
        self._client.close()

    def _call(
        self, what: str, method: Callable[..., Any], *args: Any, until: float | None = None, **kwargs: Any
    ) -> JSON:
        """Call ``method`` for the raw answer and return its JSON object; :class:`KubeError` naming ``what``.

        The call has :attr:`deadline` seconds in all, fewer when ``until`` (a ``time.monotonic()`` time: the
        caller's own deadline) comes sooner."""
        seconds = self.deadline if until is None else min(self.deadline, until - time.monotonic())
        if seconds <= 0:
            raise KubeError(f"{what}: not sent to {self.host}: no time left before the caller's deadline")
        with _deadline(seconds) as deadline:
            try:
                return self._call_within(what, method, *args, **kwargs)
            except Exception:
                if deadline.expired:
                    raise KubeError(
                        f"{what}: no complete answer from {self.host} within {seconds:.3g} s (the call's deadline; "
                        "a server that answers this slowly is stuck or overloaded)"
                    ) from None
                raise

    def _call_within(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> JSON:
        response = self._send(what, method, *args, _request_timeout=self._timeout, **kwargs)
        try:
            data = response.read(MAX_RESPONSE_BYTES + 1)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(f"{what}: reading the answer from {self.host}: {exc}") from None
        finally:
            response.release_conn()
        if len(data) > MAX_RESPONSE_BYTES:
            raise KubeError(f"{what}: the answer from {self.host} is over {MAX_RESPONSE_BYTES} bytes")
        return self._object(what, data)

    def _send(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, _preload_content=False, **kwargs)
        except kubernetes.client.ApiException as exc:
            raise KubeError(f"{what}: HTTP {exc.status} from {self.host}: {_reason(exc.body)}") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(f"{what}: no answer from {self.host}: {exc}") from None

    def _object(self, what: str, data: bytes) -> JSON:
        try:
            obj = json.loads(data) if data else {}
        except (ValueError, RecursionError) as exc:
            raise KubeError(f"{what}: the answer from {self.host} is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise KubeError(f"{what}: the answer from {self.host} is not a JSON object")
        return obj

    def _stream(
        self,
        what: str,
        method: Callable[..., Any],
        *args: Any,
        seconds: float,
        read_timeout: float,
        max_line: int,
        abort: Abort | None = None,
        **kwargs: Any,
    ) -> Iterator[JSON]:
        """The JSON objects of a streamed answer (a watch: one object per line), each line at most ``max_line``
        bytes, the whole stream within ``seconds``, each read within ``read_timeout``; ``abort`` ends it from
        another thread. Ends when the server ends the answer; :class:`KubeError` for everything else."""
        if abort is not None and abort.fired:
            raise KubeError(f"{what}: not sent to {self.host}: stopping")
        with _deadline(seconds) as deadline:
            if abort is not None:
                abort.attach(deadline)
            try:
                yield from self._lines(what, method, args, kwargs, read_timeout, max_line)
            except Exception:
                if abort is not None and abort.fired:
                    raise KubeError(f"{what}: ended: stopping") from None
                if deadline.expired:
                    raise KubeError(
                        f"{what}: still open after {seconds:.3g} s, its deadline (the server did not end it)"
                    ) from None
                raise
            finally:
                if abort is not None:
                    abort.attach(None)

    def _lines(
        self,
        what: str,
        method: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        read_timeout: float,
        max_line: int,
    ) -> Iterator[JSON]:
        response = self._send(what, method, *args, _request_timeout=(self._timeout[0], read_timeout), **kwargs)
        try:
            pending = b""
            for chunk in response.stream(STREAM_CHUNK_BYTES, decode_content=True):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if len(pending) > max_line:
                    raise KubeError(f"{what}: an event from {self.host} is over {max_line} bytes")
                for line in lines:
                    if len(line) > max_line:
                        raise KubeError(f"{what}: an event from {self.host} is over {max_line} bytes")
                    if line.strip():
                        yield self._object(what, line)
            if pending.strip():
                yield self._object(what, pending)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(f"{what}: reading the stream from {self.host}: {exc}") from None
        finally:
            response.close()  # never back into the pool: a stream cut half-way leaves nothing reusable
            response.release_conn()


def configuration_from_environment(kubeconfig: Path | None = None) -> Any:
    """The client configuration :meth:`KubeClient.from_environment` uses (:class:`KubeError` naming the source)."""
    configuration = kubernetes.client.Configuration()
    in_cluster = kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    try:
        if in_cluster:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        else:
            kubernetes.config.load_kube_config(
                config_file=None if kubeconfig is None else str(kubeconfig), client_configuration=configuration
            )
    except (kubernetes.config.ConfigException, OSError, ValueError) as exc:
        shown = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        where = "the in-cluster service account" if in_cluster else f"kubeconfig {str(shown)!r}"
        raise KubeError(f"cannot configure the Kubernetes client from {where}: {exc}") from None
    return configuration


__all__ = [
    "DEFAULT_DEADLINE",
    "DEFAULT_TIMEOUT",
    "JSON",
    "MAX_RESPONSE_BYTES",
    "Abort",
    "KubeClient",
    "KubeError",
    "configuration_from_environment",
]
