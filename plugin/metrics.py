"""The device plugin's Prometheus metrics and its small HTTP endpoint (``/metrics``, ``/healthz``, ``/readyz``).

Why a module of its own: the facts are born in three places (the manager's scans and registrations, each
servicer's ``Allocate``), and each of them should record a fact with one call and know nothing of Prometheus.
:class:`PluginMetrics` owns the metric objects, on a :class:`~prometheus_client.CollectorRegistry` of its own
(never the global one), so tests and several managers in one process do not collide. ``Allocate`` only
increments a counter; everything else is recorded from the manager's single thread.

:class:`MetricsServer` is ``gpu-device-plugin serve --metrics-address HOST:PORT``: a small threaded HTTP
server answering

- ``GET /metrics``: the registry in Prometheus' text format;
- ``GET /healthz``: ``200 ok`` while the manager's loop is alive (its heartbeat is younger than the bound and
  ``kubelet.sock`` has not been gone for a minute, see :meth:`plugin.manager.PluginManager.liveness`), else
  ``503`` with the reason — the liveness probe;
- ``GET /readyz``: ``200 ok`` once the first scan is served and every resource is registered with the
  current kubelet, else ``503`` with the reason — the readiness probe.

Requests are not logged (the plugin's stderr carries its event lines only).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from typing import Any

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from plugin.inventory import Resource

PREFIX = "gpu_device_plugin_"
HEALTHS = ("Healthy", "Unhealthy")
SCAN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds; node01 scans in a few ms, a 4096-function tree in ~0.1 s, a stuck sysfs read much longer."""

Probe = Callable[[], str | None]
"""A health check: None when fine, else the reason (the 503 body)."""


class PluginMetrics:
    """The plugin's metrics on their own registry; the ``record_*``/``observe_*`` methods are the only writers."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, host: str, port: int, app: MetricsServer) -> None:
        self.app = app
        self._dual_stack = host == ""
        if self._dual_stack:
            self.address_family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
            host = "::" if socket.has_ipv6 else "0.0.0.0"  # noqa: S104 -- asked for: every interface
        else:
            self.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if self._dual_stack else 1)
        # HTTPServer.server_bind would look up the host's FQDN (a DNS query at start); the TCP bind is enough.
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(200, app.metrics.exposition(), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/readyz"):
            problem = (app.liveness if path == "/healthz" else app.readiness)()
            if problem is None:
                self._answer(200, b"ok\n")
            else:
                self._answer(503, problem.encode() + b"\n")
        else:
            self._answer(404, b"not found: try /metrics, /healthz or /readyz\n")

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log on stderr: it would break the one-event-per-line log


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
    def port(self) -> int:
        return self.address[1]

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.5}, name="metrics-http", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop answering and close the listening socket (idempotent)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
