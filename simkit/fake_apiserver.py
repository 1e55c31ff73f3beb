"""A small Kubernetes API server on loopback, for testing the DRA plugin's cluster side and the node agent's
``operate`` through the real client.

:mod:`plugin.dra.kube` and :mod:`node_agent.kube` talk to the API server with the official ``kubernetes``
client; a mock of the client would test our idea of the client, not the client. This is a real HTTP server
(``ThreadingHTTPServer`` on 127.0.0.1, a bounded number of requests and body sizes) that speaks just enough of
the Kubernetes REST API for what the plugin does, with the server-side rules the plugin relies on:

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
- Nodes (cluster-scoped; what the node agent does, :mod:`node_agent.kube`): GET by name; LIST and WATCH with
  ``fieldSelector`` on ``metadata.name`` (the field label Kubernetes supports for nodes beside
  ``spec.unschedulable``; any other is a 400). A watch answers with a chunked stream of one JSON event per line,
  as the API server does: from ``resourceVersion`` on (a version older than the retained history,
  :meth:`FakeApiServer.compact`, gets one ``ERROR`` event carrying a 410 ``Expired`` Status, then the end); from
  none (or ``0``), an ``ADDED`` event of each matching node first. It ends cleanly after ``timeoutSeconds``;
  :meth:`FakeApiServer.bookmark` sends a ``BOOKMARK`` (the current ``resourceVersion``) to every watch that
  asked for them (``allowWatchBookmarks``); :meth:`FakeApiServer.drop_watches` cuts every open watch mid-stream
  (no chunked terminator: a dropped connection). PATCH takes ``application/merge-patch+json`` only (RFC 7386;
  any other type is a 415) on ``metadata.labels`` and ``metadata.annotations``: a patch of any other field is
  a 422 here (the node agent writes nothing else; the real server would take it), label keys and values and
  annotation keys are checked as the API server's validation checks them (:func:`label_name_problem`,
  :func:`label_value_problem`; annotations at most 256 KiB in all), a ``metadata.resourceVersion`` in the patch
  is a precondition (409 when the node has moved on), and a change bumps the ``resourceVersion`` and is a
  ``MODIFIED`` event. Tests play the other actors through :meth:`FakeApiServer.set_labels` (a user relabels
  the node) and :meth:`FakeApiServer.set_allocatable` (the kubelet reports ``status.allocatable``).

Errors are Kubernetes ``Status`` objects with the code and a message. Faults can be injected: the next
requests fail with a given code (:meth:`FakeApiServer.fail_next`). Every request is recorded (method, path,
query, body, content type) so tests can assert what the client sent. Nothing here is persistent; the server
is a context manager.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
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
NODE_LIST = "/api/v1/nodes"
MAX_WATCH_SECONDS = 1800
"""The longest watch served (the API server's ``--min-request-timeout`` is 1800 s by default)."""
MAX_ANNOTATIONS_BYTES = 256 * 1024
"""``TotalAnnotationSizeLimitB``: keys and values of all annotations of an object together."""
MERGE_PATCH = "application/merge-patch+json"
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
    content_type: str = ""


@dataclass
class _State:
    slices: dict[str, JSON] = field(default_factory=dict)
    claims: dict[tuple[str, str], JSON] = field(default_factory=dict)
    nodes: dict[str, JSON] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)
    version: int = 0
    node_events: list[tuple[int, str, JSON]] = field(default_factory=list)
    """(resourceVersion, type, object) of every node change still in the history a watch can resume from."""
    compacted: int = 0
    """Node events of a resourceVersion at or below this are gone: a watch from there gets 410."""
    bookmarks: int = 0
    drops: int = 0
    open_watches: int = 0


@dataclass
class _Watch:
    """An admitted watch: the node it selects (None: all), the resourceVersion it starts after, whether it takes
    bookmarks, its end (``time.monotonic()``), the events it starts with, and whether it counts as open."""

    wanted: str | None
    cursor: int
    bookmarks: bool
    end: float
    first: list[JSON]
    counted: bool = True


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


def _node_selector(text: str) -> str | None:
    """The node name of a ``metadata.name=<name>`` field selector (None: no selector); any other field is a 400."""
    name: str | None = None
    for term in filter(None, text.split(",")):
        key, sep, value = term.partition("=")
        key = key.rstrip("=")
        if not sep or key != "metadata.name":
            raise _ApiError(400, "BadRequest", f'field label not supported for nodes: "{key or term}"')
        name = value.lstrip("=")
    return name


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, a null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def metadata_problems(metadata: JSON) -> list[str]:
    """What the API server's ObjectMeta validation says of ``metadata``'s labels and annotations."""
    problems: list[str] = []
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    if not isinstance(labels, dict) or not isinstance(annotations, dict):
        return ["metadata.labels and metadata.annotations must be objects of strings"]
    for key, value in labels.items():
        problem = label_name_problem(key)
        if problem:
            problems.append(f"metadata.labels: Invalid value: {key!r}: {problem}")
        problem = label_value_problem(value)
        if problem:
            problems.append(f"metadata.labels: Invalid value: {str(value)[:80]!r}: {problem}")
    size = 0
    for key, value in annotations.items():
        problem = label_name_problem(key)
        if problem:
            problems.append(f"metadata.annotations: Invalid value: {key!r}: {problem}")
        if not isinstance(value, str):
            problems.append(f"metadata.annotations: Invalid value: {key!r}: the value must be a string")
            continue
        size += len(key) + len(value)
    if size > MAX_ANNOTATIONS_BYTES:
        problems.append(f"metadata.annotations: Too long: must have at most {MAX_ANNOTATIONS_BYTES} bytes")
    return problems


class FakeApiServer:
    """The server; ``url`` is ``http://127.0.0.1:PORT``. Use as a context manager (or start/stop)."""

    def __init__(self, device_taints: bool = True) -> None:
        """``device_taints`` False: an API server of 1.34/1.35 with ``DRADeviceTaints`` off (its default), which
        drops ``spec.devices[].taints`` from what it stores."""
        self.device_taints = device_taints
        self._state = _State()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stopping = False
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
        with self._lock:
            self._stopping = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test set-up and inspection ------------------------------------------------------------------------

    def add_node(
        self,
        name: str,
        uid: str | None = None,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        allocatable: dict[str, str] | None = None,
    ) -> JSON:
        metadata: JSON = {"name": name, "uid": uid or str(uuid.uuid4())}
        if labels is not None:
            metadata["labels"] = dict(labels)
        if annotations is not None:
            metadata["annotations"] = dict(annotations)
        node: JSON = {"apiVersion": "v1", "kind": "Node", "metadata": metadata}
        if allocatable is not None:
            node["status"] = {"allocatable": dict(allocatable), "capacity": dict(allocatable)}
        with self._lock:
            metadata.update(resourceVersion=self._next_version(), creationTimestamp="2026-01-01T00:00:00Z")
            self._state.nodes[name] = node
            self._node_event("ADDED", node)
        return copy.deepcopy(node)

    def node(self, name: str) -> JSON:
        with self._lock:
            return copy.deepcopy(self._state.nodes[name])

    def set_labels(self, name: str, labels: dict[str, str | None]) -> JSON:
        """Another actor (a user, the GPU Operator) labels the node: None removes a label."""
        return self._change_node(name, {"metadata": {"labels": labels}})

    def set_annotations(self, name: str, annotations: dict[str, str | None]) -> JSON:
        return self._change_node(name, {"metadata": {"annotations": annotations}})

    def set_allocatable(self, name: str, allocatable: dict[str, str]) -> JSON:
        """The kubelet reports ``status.allocatable`` (and the same ``capacity``): replaces both whole."""
        with self._lock:
            node = copy.deepcopy(self._state.nodes[name])
            node["status"] = {"allocatable": dict(allocatable), "capacity": dict(allocatable)}
            return copy.deepcopy(self._store_node(node))

    def _change_node(self, name: str, patch: JSON) -> JSON:
        with self._lock:
            node = merge_patch(self._state.nodes[name], patch)
            problems = metadata_problems(node["metadata"])
            if problems:
                raise ValueError("; ".join(problems))
            return copy.deepcopy(self._store_node(node))

    def _store_node(self, node: JSON) -> JSON:
        node["metadata"]["resourceVersion"] = self._next_version()
        self._state.nodes[node["metadata"]["name"]] = node
        self._node_event("MODIFIED", node)
        return node

    def _node_event(self, kind: str, node: JSON) -> None:
        self._state.node_events.append((int(node["metadata"]["resourceVersion"]), kind, copy.deepcopy(node)))
        self._changed.notify_all()

    def compact(self) -> None:
        """Other writes in the cluster, then a compaction (etcd's) at the newest version: the node history is gone,
        and a watch from any version older than that gets 410 (a LIST's version is not older)."""
        with self._lock:
            self._state.version += 1
            self._state.compacted = self._state.version
            self._state.node_events.clear()

    def bookmark(self) -> None:
        """Every open watch that allowed bookmarks gets one (the current resourceVersion)."""
        with self._lock:
            self._state.bookmarks += 1
            self._changed.notify_all()

    def drop_watches(self) -> None:
        """Cut every open watch mid-stream, as a dropped connection or an API server restart does."""
        with self._lock:
            self._state.drops += 1
            self._changed.notify_all()

    def open_watches(self) -> int:
        with self._lock:
            return self._state.open_watches

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Until ``predicate()`` (called without the lock held) is true; AssertionError naming ``what`` after
        ``timeout`` seconds. For tests: checked on every change the server sees, and every 50 ms."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"the fake API server did not see {what} within {timeout} s")
            with self._lock:
                self._changed.wait(min(remaining, 0.05))

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

    def _patch_node(self, node: JSON, body: JSON | None, content_type: str) -> JSON:
        name = node["metadata"]["name"]
        if content_type.split(";", maxsplit=1)[0].strip() != MERGE_PATCH:
            raise _ApiError(
                415, "UnsupportedMediaType", f"the body of the request was in an unknown format ({content_type!r})"
            )
        if body is None:
            raise _ApiError(400, "BadRequest", "no body")
        other = sorted(key for key in body if key != "metadata")
        meta = body.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            raise _ApiError(400, "BadRequest", "metadata is not an object")
        other += sorted(
            f"metadata.{key}" for key in (meta or {}) if key not in ("labels", "annotations", "resourceVersion")
        )
        if other:
            raise _ApiError(422, "Invalid", f"this fake patches only metadata.labels and annotations, not {other}")
        wanted = (meta or {}).get("resourceVersion")
        if wanted is not None and wanted != node["metadata"]["resourceVersion"]:
            raise _ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on nodes "{name}": the object has been modified; please apply your '
                "changes to the latest version and try again",
            )
        patched = merge_patch(node, {"metadata": {k: v for k, v in (meta or {}).items() if k != "resourceVersion"}})
        problems = metadata_problems(patched["metadata"])
        if problems:
            raise _ApiError(422, "Invalid", f'Node "{name}" is invalid: ' + "; ".join(problems))
        if patched == node:
            return node
        return self._store_node(patched)

    def _route(
        self, method: str, path: str, query: dict[str, list[str]], body: JSON | None, content_type: str = ""
    ) -> tuple[int, JSON]:
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
        if path.startswith(NODES) and method in ("GET", "PATCH"):
            name = path[len(NODES) :]
            node = self._state.nodes.get(name)
            if node is None:
                raise _ApiError(404, "NotFound", f'nodes "{name}" not found')
            if method == "PATCH":
                return 200, self._patch_node(node, body, content_type)
            return 200, node
        if path == NODE_LIST and method == "GET":
            wanted = _node_selector(query.get("fieldSelector", [""])[0])
            return 200, {
                "apiVersion": "v1",
                "kind": "NodeList",
                "metadata": {"resourceVersion": str(self._state.version)},
                "items": [node for key, node in sorted(self._state.nodes.items()) if wanted in (None, key)],
            }
        raise _ApiError(404, "NotFound", f"the server could not find the requested resource ({method} {path})")

    def _is_watch(self, method: str, target: str) -> bool:
        split = urlsplit(target)
        return (
            method == "GET"
            and split.path == NODE_LIST
            and parse_qs(split.query).get("watch", [""])[0] in ("true", "1", "True")
        )

    def handle(self, method: str, target: str, raw: bytes, content_type: str = "") -> tuple[int, JSON]:
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
                self._admit(Request(method, split.path, query, copy.deepcopy(body), content_type))
                code, obj = self._route(method, split.path, query, body, content_type)
                self._changed.notify_all()  # a request is a change for wait_for
                return code, copy.deepcopy(obj)
        except _ApiError as exc:
            return exc.code, _status(exc.code, exc.reason, exc.message)

    def _admit(self, request: Request) -> None:
        """Record the request, then the request limit and the injected failures (with the lock held)."""
        self._state.requests.append(request)
        if len(self._state.requests) > MAX_REQUESTS:
            raise _ApiError(503, "ServiceUnavailable", f"the fake API server served {MAX_REQUESTS} requests")
        if self._state.failures:
            code, reason = self._state.failures.pop(0)
            raise _ApiError(code, reason, f"injected failure {code}")

    def _watch_start(self, target: str) -> tuple[int, JSON] | _Watch:
        """Admit a watch: an error answer (code, Status), or the watch to stream."""
        split = urlsplit(target)
        query = parse_qs(split.query)
        try:
            with self._lock:
                self._admit(Request("GET", split.path, query, None))
                wanted = _node_selector(query.get("fieldSelector", [""])[0])
                since = query.get("resourceVersion", [""])[0]
                try:
                    seconds = min(float(query.get("timeoutSeconds", [str(MAX_WATCH_SECONDS)])[0]), MAX_WATCH_SECONDS)
                except ValueError:
                    raise _ApiError(400, "BadRequest", "timeoutSeconds is not a number") from None
                bookmarks = query.get("allowWatchBookmarks", [""])[0] in ("true", "1", "True")
                first: list[JSON] = []
                if since in ("", "0"):
                    cursor = self._state.version
                    first = [
                        {"type": "ADDED", "object": copy.deepcopy(node)}
                        for key, node in sorted(self._state.nodes.items())
                        if wanted in (None, key)
                    ]
                else:
                    try:
                        cursor = int(since)
                    except ValueError:
                        raise _ApiError(400, "BadRequest", f"invalid resourceVersion {since!r}") from None
                    if cursor < self._state.compacted:  # the watch cache no longer reaches back there
                        gone = _status(410, "Expired", f"too old resource version: {cursor} ({self._state.compacted})")
                        return _Watch(wanted, cursor, False, 0.0, [{"type": "ERROR", "object": gone}], counted=False)
                self._state.open_watches += 1
                self._changed.notify_all()
                return _Watch(wanted, cursor, bookmarks, time.monotonic() + seconds, first)
        except _ApiError as exc:
            return exc.code, _status(exc.code, exc.reason, exc.message)

    def _watch_events(self, watch: _Watch, client_gone: Callable[[], bool] = lambda: False) -> Iterator[JSON | None]:
        """The events after the watch's cursor as they happen; None when it is to be cut (a drop, a stop); ends at
        its end."""
        wanted, cursor, bookmarks, end = watch.wanted, watch.cursor, watch.bookmarks, watch.end
        with self._lock:
            seen_bookmarks, seen_drops = self._state.bookmarks, self._state.drops
        try:
            while True:
                with self._lock:
                    while True:
                        if self._stopping or self._state.drops != seen_drops or client_gone():
                            ready: list[JSON | None] = [None]
                            break
                        ready = [
                            {"type": kind, "object": copy.deepcopy(obj)}
                            for version, kind, obj in self._state.node_events
                            if version > cursor and wanted in (None, obj["metadata"]["name"])
                        ]
                        cursor = self._state.version
                        if bookmarks and self._state.bookmarks != seen_bookmarks:
                            mark = {"kind": "Node", "apiVersion": "v1", "metadata": {"resourceVersion": str(cursor)}}
                            ready.append({"type": "BOOKMARK", "object": mark})
                        seen_bookmarks = self._state.bookmarks
                        remaining = end - time.monotonic()
                        if ready or remaining <= 0:
                            break
                        self._changed.wait(min(remaining, 0.1))
                yield from ready
                if None in ready or not ready:
                    return
        finally:
            with self._lock:
                self._state.open_watches -= 1
                self._changed.notify_all()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _client_gone(self) -> bool:
                """Whether the client closed its end (the API server sees its request context end)."""
                try:
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    return True

            def _stream(self) -> None:
                started = server._watch_start(self.path)
                if isinstance(started, tuple):
                    code, obj = started
                    data = json.dumps(obj).encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for first in started.first:
                        self._chunk(json.dumps(first).encode() + b"\n")
                    if not started.counted:  # an ERROR event (410) and the end
                        self._chunk(b"")
                        return
                    for event in server._watch_events(started, self._client_gone):
                        if event is None:  # cut: no terminator, the connection just ends
                            self.close_connection = True
                            with suppress(OSError):
                                self.connection.shutdown(socket.SHUT_RDWR)
                            return
                        self._chunk(json.dumps(event).encode() + b"\n")
                    self._chunk(b"")
                except OSError:  # the client went away
                    self.close_connection = True

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES or length < 0:
                    code, obj = 413, _status(413, "RequestEntityTooLarge", f"body over {MAX_BODY_BYTES} bytes")
                    self.close_connection = True
                elif server._is_watch(self.command, self.path):
                    self._stream()
                    return
                else:
                    code, obj = server.handle(
                        self.command,
                        self.path,
                        self.rfile.read(length) if length else b"",
                        self.headers.get("Content-Type") or "",
                    )
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: tests read :meth:`FakeApiServer.requests` instead."""

        return Handler


@contextmanager
def running(device_taints: bool = True) -> Iterator[FakeApiServer]:
    """A started server, stopped on exit."""
    with FakeApiServer(device_taints) as server:
        yield server
