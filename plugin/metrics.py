"""The device plugin's Prometheus metrics and its small HTTP endpoint (``/metrics``, ``/healthz``, ``/readyz``).

Why a module of its own: the facts are born in three places (the manager's scans and registrations, each
servicer's ``Allocate``), and each of them should record a fact with one call and know nothing of Prometheus.
:class:`PluginMetrics` owns the metric objects, on a :class:`~prometheus_client.CollectorRegistry` of its own
(never the global one), so tests and several managers in one process do not collide. ``Allocate`` only
increments a counter; everything else is recorded from the manager's single thread.

:class:`MetricsServer` is ``gpu-device-plugin serve --metrics-address HOST:PORT``: a small HTTP server in
one thread (a selector; bounded connections, request size and idle time, see :class:`_Server`) answering

- ``GET /metrics``: the registry in Prometheus' text format;
- ``GET /healthz``: ``200 ok`` while the manager's loop is alive (its heartbeat is younger than the bound and
  ``kubelet.sock`` has not been gone for a minute, see :meth:`plugin.manager.PluginManager.liveness`), else
  ``503`` with the reason — the liveness probe;
- ``GET /readyz``: ``200 ok`` once the first scan is served and every resource is registered with the
  current kubelet, else ``503`` with the reason — the readiness probe.

Requests are not logged (the plugin's stderr carries its event lines only).

``prometheus_client`` is imported only when metrics are kept (:class:`PluginMetrics`, ``--metrics-address``):
without it the manager records into :data:`NO_METRICS` and the process never loads it (a smaller resident
set; ``bench/plugin_device.py``).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

from plugin.inventory import Resource
from plugin.log import log_event

PREFIX = "gpu_device_plugin_"
HEALTHS = ("Healthy", "Unhealthy")
SCAN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds; node01 scans in a few ms, a 4096-function tree in ~0.1 s, a stuck sysfs read much longer."""

Probe = Callable[[], str | None]
"""A health check: None when fine, else the reason (the 503 body)."""


class MetricsRecorder(Protocol):
    """What the manager and the servicers record; :class:`PluginMetrics` keeps it, :data:`NO_METRICS` drops it."""

    def record_scan(self, seconds: float, *, ok: bool) -> None: ...

    def observe_devices(self, resources: Iterable[Resource]) -> None: ...

    def record_allocation(self, resource: str, code: grpc.StatusCode) -> None: ...

    def record_registration(self, resource: str, *, ok: bool) -> None: ...


class NoMetrics:
    """A :class:`MetricsRecorder` that keeps nothing: ``serve`` without ``--metrics-address``."""

    def record_scan(self, seconds: float, *, ok: bool) -> None:
        pass

    def observe_devices(self, resources: Iterable[Resource]) -> None:
        pass

    def record_allocation(self, resource: str, code: grpc.StatusCode) -> None:
        pass

    def record_registration(self, resource: str, *, ok: bool) -> None:
        pass


NO_METRICS = NoMetrics()


class PluginMetrics:
    """The plugin's metrics on their own registry; the ``record_*``/``observe_*`` methods are the only writers."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # Here, not at the top: a plugin that serves no metrics never loads prometheus_client.
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram  # noqa: PLC0415

        self.content_type = CONTENT_TYPE_LATEST
        """The ``Content-Type`` of :meth:`exposition`'s text."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.devices = Gauge(
            PREFIX + "devices",
            "Devices served to the kubelet, by resource and health (Healthy, Unhealthy), as of the last scan.",
            ["resource", "health"],
            registry=self.registry,
        )
        self.allocations = Counter(
            PREFIX + "allocations",
            "Allocate calls answered, by resource and result (ok, or the gRPC status code in lower case: "
            "invalid_argument, failed_precondition, unknown).",
            ["resource", "result"],
            registry=self.registry,
        )
        self.registrations = Counter(
            PREFIX + "registrations",
            "Successful Register calls to the kubelet, by resource (one per plugin start and kubelet restart).",
            ["resource"],
            registry=self.registry,
        )
        self.registration_failures = Counter(
            PREFIX + "registration_failures",
            "Register calls to the kubelet that failed (they are retried), by resource.",
            ["resource"],
            registry=self.registry,
        )
        self.scans = Counter(
            PREFIX + "scans",
            "Discovery scans of sysfs and /dev/vfio, by result (ok, failed: the last good view is kept).",
            ["result"],
            registry=self.registry,
        )
        self.scan_duration = Histogram(
            PREFIX + "scan_duration_seconds",
            "How long a discovery scan took, successful or not.",
            buckets=SCAN_BUCKETS,
            registry=self.registry,
        )
        self.last_successful_scan = Gauge(
            PREFIX + "last_successful_scan_timestamp_seconds",
            "When the last successful discovery scan ended (Unix time).",
            registry=self.registry,
        )
        for result in ("ok", "failed"):
            self.scans.labels(result)  # both series from the start: rate() and alerts need no absent()
        self._resources: set[str] = set()

    @staticmethod
    def disable_created_series() -> None:
        """No ``*_created`` series (process-wide in prometheus_client; ``serve`` does it once, before serving)."""
        from prometheus_client import disable_created_metrics  # noqa: PLC0415 -- loaded with PluginMetrics

        disable_created_metrics()  # type: ignore[no-untyped-call]

    def record_scan(self, seconds: float, *, ok: bool) -> None:
        self.scans.labels("ok" if ok else "failed").inc()
        self.scan_duration.observe(seconds)
        if ok:
            self.last_successful_scan.set(time.time())

    def observe_devices(self, resources: Iterable[Resource]) -> None:
        """Set the device gauge to what is served now; resources no longer served lose their series."""
        current: set[str] = set()
        for resource in resources:
            current.add(resource.name)
            healthy = sum(1 for device in resource.devices if device.healthy)
            self.devices.labels(resource.name, "Healthy").set(healthy)
            self.devices.labels(resource.name, "Unhealthy").set(len(resource.devices) - healthy)
        for name in self._resources - current:
            for health in HEALTHS:
                with contextlib.suppress(KeyError):
                    self.devices.remove(name, health)
        self._resources = current

    def record_allocation(self, resource: str, code: grpc.StatusCode) -> None:
        """One Allocate call's outcome (the hot path: a counter increment)."""
        self.allocations.labels(resource, code.name.lower()).inc()

    def record_registration(self, resource: str, *, ok: bool) -> None:
        (self.registrations if ok else self.registration_failures).labels(resource).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (what ``GET /metrics`` answers)."""
        from prometheus_client import generate_latest  # noqa: PLC0415 -- loaded with PluginMetrics already

        return generate_latest(self.registry)


# -- the HTTP endpoint -------------------------------------------------------------------------------------


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port). ``[v6]:PORT`` and a bare IPv6 host with its port after the last colon
    are accepted; an empty host (``:9498``) means every interface. Raises ``ValueError`` with the reason."""
    host, colon, port_text = text.rpartition(":")
    if not colon or not port_text.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9498, :9498 or [::1]:9498)")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port {port} in {text!r} is out of range 0..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


MAX_CONNECTIONS = 64
"""Open HTTP connections at most; a new one beyond this closes the one idle for longest (probes and a scraper
need a handful)."""
IDLE_TIMEOUT = 10.0
"""Seconds a connection may take to send a complete request, or stay idle between keep-alive requests, or to
read our answer; then it is closed (a probe's whole exchange takes milliseconds)."""
MAX_REQUEST_BYTES = 8192
"""A request line and headers larger than this are refused with 431 and the connection closed."""
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    deadline: float
    received: bytearray = field(default_factory=bytearray)
    pending: bytes = b""
    close_after: bool = False


def _listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (empty host: every interface, IPv6 dual-stack when possible)."""
    dual_stack = host == ""
    if dual_stack:
        family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
        host = "::" if socket.has_ipv6 else "0.0.0.0"  # noqa: S104 -- asked for: every interface
    else:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual_stack else 1)
        listener.bind((host, port))
        listener.listen(128)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


class _Server:
    """A small HTTP/1.1 server in one thread around a selector: bounded connections, buffers and waits.

    Why not :class:`http.server.ThreadingHTTPServer`: it starts a thread per connection and waits on each
    without a timeout, so idle connections pile up threads and memory until the probes fail and the process
    no longer stops (issue 11, finding 2). Here one thread serves every connection; each has at most
    :data:`MAX_REQUEST_BYTES` of request and one answer buffered, :data:`IDLE_TIMEOUT` to make progress, and
    at most :data:`MAX_CONNECTIONS` are open (the longest-idle one makes room for a new one). Answers are
    computed in microseconds to milliseconds (a registry exposition, two health checks), so serving them
    inline keeps every client answered in turn.
    """

    def __init__(self, host: str, port: int, app: MetricsServer) -> None:
        self.app = app
        self.listener = _listening_socket(host, port)
        self.server_address = self.listener.getsockname()
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._connections: dict[socket.socket, _Connection] = {}
        self._stopping = threading.Event()
        self._accept_error = ""

    @property
    def connections(self) -> int:
        """Connections open now (for tests and the soak)."""
        return len(self._connections)

    def serve_forever(self) -> None:
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                self._turn()
        finally:
            for connection in list(self._connections.values()):
                self._close(connection)
            self._selector.close()

    def shutdown(self) -> None:
        """Ask :meth:`serve_forever` to return (from another thread); it closes every connection."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")

    def server_close(self) -> None:
        self.listener.close()
        self._wake_read.close()
        self._wake_write.close()

    def _turn(self) -> None:
        now = time.monotonic()
        timeout = min((connection.deadline for connection in self._connections.values()), default=now + 1.0) - now
        for key, mask in self._selector.select(max(0.0, min(timeout, 1.0))):
            target = key.fileobj
            if target is self.listener:
                self._accept()
            elif target is self._wake_read:
                with contextlib.suppress(OSError):
                    self._wake_read.recv(4096)
            else:
                connection = self._connections.get(target)  # type: ignore[call-overload]
                if connection is None:
                    continue
                try:
                    if mask & selectors.EVENT_READ:
                        self._receive(connection)
                    elif mask & selectors.EVENT_WRITE:
                        self._send(connection)
                except OSError:
                    self._close(connection)
                except Exception as exc:  # never let one connection end the endpoint
                    log_event("metrics_failed", error=f"{type(exc).__name__}: {exc}")
                    self._close(connection)
        now = time.monotonic()
        for connection in [c for c in self._connections.values() if c.deadline <= now]:
            self._close(connection)

    def _accept(self) -> None:
        for _ in range(MAX_CONNECTIONS):  # bounded per turn: timeouts and answers get their turn too
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: let the backlog wait a little, say why once
                if str(exc) != self._accept_error:
                    log_event("metrics_failed", error=f"accept: {exc}")
                self._accept_error = str(exc)
                time.sleep(0.05)  # the listener stays readable: do not spin
                return
            if len(self._connections) >= MAX_CONNECTIONS:
                idle = [c for c in self._connections.values() if not c.pending]
                oldest = min(idle or self._connections.values(), key=lambda c: c.deadline)
                self._close(oldest)
            sock.setblocking(False)
            connection = _Connection(sock, time.monotonic() + IDLE_TIMEOUT)
            self._connections[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ)

    def _close(self, connection: _Connection) -> None:
        if self._connections.pop(connection.sock, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(connection.sock)
        connection.sock.close()

    def _receive(self, connection: _Connection) -> None:
        data = connection.sock.recv(4096)
        if not data:
            self._close(connection)
            return
        connection.received += data
        end = connection.received.find(b"\r\n\r\n")
        if end < 0:
            if len(connection.received) > MAX_REQUEST_BYTES:
                self._answer(connection, 431, b"request too large\n", close=True)
            return
        head = bytes(connection.received[:end])
        rest = connection.received[end + 4 :]
        connection.received = bytearray()
        self._handle(connection, head, bool(rest))

    def _handle(self, connection: _Connection, head: bytes, more: bool) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._answer(connection, 400, b"bad request\n", close=True)
            return
        method, target, version = parts
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                headers[name.strip().lower()] = value.strip().lower()
        body = headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers
        close = (
            more  # pipelined requests are not served: answer the first, then close
            or body
            or headers.get("connection") == "close"
            or (version == "HTTP/1.0" and headers.get("connection") != "keep-alive")
        )
        if method not in ("GET", "HEAD"):
            self._answer(connection, 405, b"only GET\n", close=True)
            return
        status, content, content_type = self.app.respond(target.split("?", 1)[0])
        self._answer(connection, status, content, content_type, close=close, head_only=method == "HEAD")

    def _answer(
        self,
        connection: _Connection,
        status: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        *,
        close: bool,
        head_only: bool = False,
    ) -> None:
        header = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            + ("Connection: close\r\n" if close else "")
            + "\r\n"
        )
        connection.pending = header.encode("latin-1") + (b"" if head_only else body)
        connection.close_after = close
        connection.deadline = time.monotonic() + IDLE_TIMEOUT
        self._selector.modify(connection.sock, selectors.EVENT_WRITE)
        self._send(connection)

    def _send(self, connection: _Connection) -> None:
        try:
            sent = connection.sock.send(connection.pending)
        except BlockingIOError:
            return
        connection.pending = connection.pending[sent:]
        if connection.pending:
            return
        if connection.close_after:
            self._close(connection)
            return
        connection.deadline = time.monotonic() + IDLE_TIMEOUT
        self._selector.modify(connection.sock, selectors.EVENT_READ)


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` (port 0: any free one, see :attr:`port`)."""

    def __init__(
        self, host: str, port: int, metrics: PluginMetrics, liveness: Probe, readiness: Probe | None = None
    ) -> None:
        self.metrics = metrics
        self.liveness = liveness
        self.readiness = readiness or liveness
        self._server = _Server(host, port, self)  # binds now: a taken port is an error at start, not later
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def connections(self) -> int:
        """HTTP connections open now (bounded by :data:`MAX_CONNECTIONS`)."""
        return self._server.connections

    def respond(self, path: str) -> tuple[int, bytes, str]:
        """Status, body and content type for ``GET path``; a failing check is a 500 naming the error."""
        text = "text/plain; charset=utf-8"
        try:
            if path == "/metrics":
                return 200, self.metrics.exposition(), self.metrics.content_type
            if path in ("/healthz", "/readyz"):
                problem = (self.liveness if path == "/healthz" else self.readiness)()
                return (200, b"ok\n", text) if problem is None else (503, problem.encode() + b"\n", text)
        except Exception as exc:
            log_event("metrics_failed", path=path, error=f"{type(exc).__name__}: {exc}")
            return 500, f"{path} failed: {type(exc).__name__}\n".encode(), text
        return 404, b"not found: try /metrics, /healthz or /readyz\n", text

    @property
    def port(self) -> int:
        return self.address[1]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop answering and close the listening socket (idempotent)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
