"""A small Kubernetes API server on loopback, for testing the DRA plugin's cluster side through the real client.

:mod:`plugin.dra.kube` talks to the API server with the official ``kubernetes`` client; a mock of the client
would test our idea of the client, not the client. This is a real HTTP server (``ThreadingHTTPServer`` on
127.0.0.1, a bounded number of requests and body sizes) that speaks just enough of the Kubernetes REST API
for what the plugin does, with the server-side rules the plugin relies on:

- ``resource.k8s.io/v1`` ResourceSlices (cluster-scoped): LIST with ``fieldSelector`` on ``metadata.name``,
  ``spec.nodeName`` and ``spec.driver``, the only field labels Kubernetes supports for them (any other,
  ``spec.pool.name`` included, is a 400, as there); GET; POST with ``generateName`` (five random characters
  appended, the base cut to 58 as the API server does); PUT with an optimistic-concurrency check (a stale
  ``resourceVersion`` is a 409 Conflict; ``dryRun=All``: checked and answered, nothing stored); DELETE.
  ``metadata.uid``, ``resourceVersion`` and ``creationTimestamp`` are the server's; an immutable field changed
  by a PUT (``spec.driver``, ``spec.nodeName``, ``spec.pool.name``) is a 422, as Kubernetes' validation answers.
  Device taints (``spec.devices[].taints``, 1.36 with ``DRADeviceTaints`` on) are checked as Kubernetes'
  validation checks them (:func:`taint_problems`: key a label name, value a label value, effect ``None``/
  ``NoSchedule``/``NoExecute``, at most 16 per device, at most 64 devices in a slice with any taint) and a taint
  without ``timeAdded`` gets the current time, cut to the second, as the API server's defaulting does.
- ResourceClaims (namespaced): GET.
- Nodes: GET.

Errors are Kubernetes ``Status`` objects with the code and a message. Faults can be injected: the next
requests fail with a given code (:meth:`FakeApiServer.fail_next`). Every request is recorded (method, path,
query) so tests can assert what the client sent. Nothing here is persistent; the server is a context manager.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body accepted (Kubernetes' own limit is 3 MiB for most objects)."""
MAX_REQUESTS = 10_000
"""Requests served before the server answers 503 to everything: a runaway loop in a test stops on its own."""
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS_PREFIX = "/apis/resource.k8s.io/v1/namespaces/"
NODES = "/api/v1/nodes/"
IMMUTABLE = (("driver",), ("nodeName",), ("pool", "name"))
MAX_DEVICES = 128
"""``ResourceSliceMaxDevices`` (k8s.io/api resource/v1)."""
MAX_DEVICES_WITH_TAINTS = 64
"""``ResourceSliceMaxDevicesWithAdvancedFeatures``: when any device of the slice has a taint."""
MAX_TAINTS = 16
"""``DeviceTaintsMaxLength``."""
TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def label_name_problem(key: object) -> str | None:
    """Why ``key`` is not a label name (apimachinery ``IsQualifiedName``): an optional DNS-subdomain prefix of
    at most 253 characters and ``/``, then a name of 1..63 characters, alphanumeric at both ends, ``-_.`` inside."""
    if not isinstance(key, str) or not key:
        return "must be a non-empty string"
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return f"prefix {prefix!r} must be a DNS subdomain of at most 253 characters"
    if not 1 <= len(name) <= 63 or not _LABEL_NAME.fullmatch(name):
        return f"name part {name!r} must be 1..63 characters, alphanumeric at both ends, '-', '_', '.' inside"
    return None


def label_value_problem(value: object) -> str | None:
    """Why ``value`` is not a label value (``IsValidLabelValue``): empty, or at most 63 characters like a name."""
    if not isinstance(value, str):
        return "must be a string"
    if value and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
        return f"{value[:80]!r} must be at most 63 characters, alphanumeric at both ends, '-', '_', '.' inside"
    return None


def taint_problems(spec: JSON) -> list[str]:
    """What Kubernetes' ResourceSlice validation says of ``spec``'s device taints and device count."""
    devices = spec.get("devices") or []
    if not isinstance(devices, list):
        return ["spec.devices: must be a list"]
    problems: list[str] = []
    tainted = False
    for index, device in enumerate(devices):
        taints = device.get("taints") if isinstance(device, dict) else None
        if taints is None:
            continue
        where = f"spec.devices[{index}].taints"
        if not isinstance(taints, list):
            problems.append(f"{where}: must be a list")
            continue
        tainted = tainted or bool(taints)
        if len(taints) > MAX_TAINTS:
            problems.append(f"{where}: Too many: {len(taints)}: must have at most {MAX_TAINTS} items")
        for number, taint in enumerate(taints):
            if not isinstance(taint, dict):
                problems.append(f"{where}[{number}]: must be an object")
                continue
            key_problem = label_name_problem(taint.get("key"))
            if key_problem:
                problems.append(f"{where}[{number}].key: Invalid value: {key_problem}")
            value_problem = label_value_problem(taint.get("value", ""))
            if value_problem:
                problems.append(f"{where}[{number}].value: Invalid value: {value_problem}")
            if taint.get("effect") not in TAINT_EFFECTS:
                problems.append(f"{where}[{number}].effect: Unsupported value: {taint.get('effect')!r}")
    limit = MAX_DEVICES_WITH_TAINTS if tainted else MAX_DEVICES
    if len(devices) > limit:
        problems.append(f"spec.devices: Too many: {len(devices)}: must have at most {limit} items")
    return problems


JSON = dict[str, Any]


@dataclass(frozen=True)
class Request:
    """One request as the server saw it."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: JSON | None


@dataclass
class _State:
    slices: dict[str, JSON] = field(default_factory=dict)
    claims: dict[tuple[str, str], JSON] = field(default_factory=dict)
    nodes: dict[str, JSON] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)
    version: int = 0


class _ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _status(code: int, reason: str, message: str) -> JSON:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _get(obj: JSON, path: tuple[str, ...]) -> Any:
    value: Any = obj
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _field_selector(text: str) -> list[tuple[tuple[str, ...], str]]:
    """``spec.nodeName=x,spec.driver=y`` as (path, value) pairs; only the field labels Kubernetes converts for
    ResourceSlices (``metadata.name``, ``spec.nodeName``, ``spec.driver``: pkg/apis/resource/v1 conversion)."""
    terms = []
    for term in filter(None, text.split(",")):
        key, sep, value = term.partition("=")
        key = key.rstrip("=")
        if not sep or key not in ("spec.nodeName", "spec.driver", "metadata.name"):
            raise _ApiError(
                400,
                "BadRequest",
                f"field label not supported for resource.k8s.io/v1, Kind=ResourceSlice: {key or term}",
            )
        terms.append((tuple(key.split(".")), value.lstrip("=")))
    return terms


class FakeApiServer:
    """The server; ``url`` is ``http://127.0.0.1:PORT``. Use as a context manager (or start/stop)."""

    def __init__(self, device_taints: bool = True) -> None:
        """``device_taints`` False: an API server of 1.34/1.35 with ``DRADeviceTaints`` off (its default), which
        drops ``spec.devices[].taints`` from what it stores."""
        self.device_taints = device_taints
        self._state = _State()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-apiserver", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test set-up and inspection ------------------------------------------------------------------------

    def add_node(self, name: str, uid: str | None = None) -> JSON:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": uid or str(uuid.uuid4())}}
        with self._lock:
            self._state.nodes[name] = node
        return copy.deepcopy(node)

    def add_claim(self, obj: JSON) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        with self._lock:
            self._state.claims[key] = copy.deepcopy(obj)

    def add_slice(self, obj: JSON) -> JSON:
        """Store a slice as if someone had created it (another driver, a previous run)."""
        with self._lock:
            return copy.deepcopy(self._create_slice(copy.deepcopy(obj)))

    def slices(self) -> list[JSON]:
        """Every stored slice, sorted by name."""
        with self._lock:
            return [copy.deepcopy(self._state.slices[name]) for name in sorted(self._state.slices)]

    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._state.requests)

    def clear_requests(self) -> None:
        with self._lock:
            self._state.requests.clear()

    def fail_next(self, count: int, code: int = 500, reason: str = "InternalError") -> None:
        """The next ``count`` requests are answered with ``code`` (after being recorded)."""
        with self._lock:
            self._state.failures.extend([(code, reason)] * count)

    # -- the API ---------------------------------------------------------------------------------------------

    def _next_version(self) -> str:
        self._state.version += 1
        return str(self._state.version)

    def _admit_spec(self, obj: JSON) -> None:
        """Kubernetes' validation of the device taints (422 naming each problem), then its defaulting; with the
        gate off, the field dropped first (``dropDisabledDRADeviceTaintsFields``)."""
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            raise _ApiError(422, "Invalid", "spec: Required value")
        if not self.device_taints:
            for device in spec.get("devices") or []:
                if isinstance(device, dict):
                    device.pop("taints", None)
        problems = taint_problems(spec)
        if problems:
            raise _ApiError(422, "Invalid", "ResourceSlice is invalid: " + "; ".join(problems))
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for device in spec.get("devices") or []:
            for taint in device.get("taints") or []:
                taint.setdefault("timeAdded", now)

    def _create_slice(self, obj: JSON) -> JSON:
        self._admit_spec(obj)
        metadata = obj.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise _ApiError(400, "BadRequest", "metadata is not an object")
        name = metadata.get("name")
        if not name:
            base = metadata.get("generateName")
            if not isinstance(base, str) or not base:
                raise _ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            name = base[:58] + secrets.token_hex(3)[:5]
        if name in self._state.slices:
            raise _ApiError(409, "AlreadyExists", f'resourceslices.resource.k8s.io "{name}" already exists')
        metadata.pop("generateName", None)
        metadata.update(
            name=name,
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_version(),
            generation=1,
            creationTimestamp="2026-01-01T00:00:00Z",
        )
        self._state.slices[name] = obj
        return obj

    def _replace_slice(self, name: str, obj: JSON, dry_run: bool = False) -> JSON:
        """PUT; ``dry_run`` (``?dryRun=All``): validated, defaulted and answered as stored, but nothing stored."""
        old = self._state.slices.get(name)
        if old is None:
            raise _ApiError(404, "NotFound", f'resourceslices.resource.k8s.io "{name}" not found')
        metadata = obj.get("metadata")
        if not isinstance(metadata, dict) or metadata.get("name") != name:
            raise _ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        if metadata.get("resourceVersion") != old["metadata"]["resourceVersion"]:
            raise _ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on resourceslices.resource.k8s.io "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
            )
        for path in IMMUTABLE:
            if _get(obj.get("spec", {}), path) != _get(old.get("spec", {}), path):
                raise _ApiError(422, "Invalid", f"spec.{'.'.join(path)}: Invalid value: field is immutable")
        self._admit_spec(obj)
        changed = obj.get("spec") != old.get("spec")
        metadata.update(
            uid=old["metadata"]["uid"],
            resourceVersion=old["metadata"]["resourceVersion"] if dry_run else self._next_version(),
            generation=old["metadata"]["generation"] + (1 if changed else 0),
            creationTimestamp=old["metadata"]["creationTimestamp"],
        )
        if not dry_run:
            self._state.slices[name] = obj
        return obj

    def _route(self, method: str, path: str, query: dict[str, list[str]], body: JSON | None) -> tuple[int, JSON]:
        if path == SLICES and method == "GET":
            terms = _field_selector(query.get("fieldSelector", [""])[0])
            items = [
                obj
                for name, obj in sorted(self._state.slices.items())
                if all(_get(obj, key) == value for key, value in terms)
            ]
            return 200, {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSliceList",
                "metadata": {"resourceVersion": str(self._state.version)},
                "items": items,
            }
        if path == SLICES and method == "POST":
            if body is None:
                raise _ApiError(400, "BadRequest", "no body")
            return 201, self._create_slice(body)
        if path.startswith(SLICES + "/"):
            name = path[len(SLICES) + 1 :]
            if method == "GET":
                if name not in self._state.slices:
                    raise _ApiError(404, "NotFound", f'resourceslices.resource.k8s.io "{name}" not found')
                return 200, self._state.slices[name]
            if method == "PUT":
                if body is None:
                    raise _ApiError(400, "BadRequest", "no body")
                dry_run = query.get("dryRun", [""])[0]
                if dry_run not in ("", "All"):
                    raise _ApiError(400, "BadRequest", f"unsupported dryRun {dry_run!r} (only All)")
                return 200, self._replace_slice(name, body, dry_run=dry_run == "All")
            if method == "DELETE":
                if self._state.slices.pop(name, None) is None:
                    raise _ApiError(404, "NotFound", f'resourceslices.resource.k8s.io "{name}" not found')
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        if path.startswith(CLAIMS_PREFIX) and method == "GET":
            namespace, _, rest = path[len(CLAIMS_PREFIX) :].partition("/resourceclaims/")
            claim = self._state.claims.get((namespace, rest))
            if claim is None:
                raise _ApiError(404, "NotFound", f'resourceclaims.resource.k8s.io "{rest}" not found')
            return 200, claim
        if path.startswith(NODES) and method == "GET":
            node = self._state.nodes.get(path[len(NODES) :])
            if node is None:
                raise _ApiError(404, "NotFound", f'nodes "{path[len(NODES) :]}" not found')
            return 200, node
        raise _ApiError(404, "NotFound", f"the server could not find the requested resource ({method} {path})")

    def handle(self, method: str, target: str, raw: bytes) -> tuple[int, JSON]:
        split = urlsplit(target)
        query = parse_qs(split.query)
        body: JSON | None = None
        try:
            if raw:
                try:
                    parsed = json.loads(raw)
                except ValueError as exc:
                    raise _ApiError(400, "BadRequest", f"the body is not JSON: {exc}") from None
                if not isinstance(parsed, dict):
                    raise _ApiError(400, "BadRequest", "the body is not a JSON object")
                body = parsed
            with self._lock:
                self._state.requests.append(Request(method, split.path, query, copy.deepcopy(body)))
                if len(self._state.requests) > MAX_REQUESTS:
                    raise _ApiError(503, "ServiceUnavailable", f"the fake API server served {MAX_REQUESTS} requests")
                if self._state.failures:
                    code, reason = self._state.failures.pop(0)
                    raise _ApiError(code, reason, f"injected failure {code}")
                code, obj = self._route(method, split.path, query, body)
                return code, copy.deepcopy(obj)
        except _ApiError as exc:
            return exc.code, _status(exc.code, exc.reason, exc.message)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES or length < 0:
                    code, obj = 413, _status(413, "RequestEntityTooLarge", f"body over {MAX_BODY_BYTES} bytes")
                    self.close_connection = True
                else:
                    code, obj = server.handle(self.command, self.path, self.rfile.read(length) if length else b"")
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: tests read :meth:`FakeApiServer.requests` instead."""

        return Handler


@contextmanager
def running(device_taints: bool = True) -> Iterator[FakeApiServer]:
    """A started server, stopped on exit."""
    with FakeApiServer(device_taints) as server:
        yield server
