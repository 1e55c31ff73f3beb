"""The node agent's Kubernetes API edge: its own Node, and nothing else (``gpu-node-agent operate``).

Through the official ``kubernetes`` client and the plumbing the DRA plugin shares (:mod:`runtime.kube_api`:
configuration from the pod's service account or a kubeconfig, a total deadline on every call, bounded reads,
:class:`~runtime.kube_api.KubeError` naming the call, the object and the answer). :class:`NodeApi` is the typed
facade of the three calls the agent makes, all on the one Node named at construction (the pod's
``spec.nodeName``, from the downward API):

- ``GET /api/v1/nodes/<node>`` (each write is decided on the Node as it is);
- ``LIST /api/v1/nodes?fieldSelector=metadata.name=<node>`` (one item; the list's ``resourceVersion`` is where a
  watch starts);
- ``WATCH /api/v1/nodes?fieldSelector=metadata.name=<node>`` from a ``resourceVersion``, with bookmarks and a
  server-side ``timeoutSeconds``; each event one line of at most :data:`MAX_EVENT_BYTES`;
- ``PATCH /api/v1/nodes/<node>`` as ``application/merge-patch+json`` (RFC 7386) of ``metadata.labels`` and
  ``metadata.annotations`` only (a None value deletes the key), optionally with the ``resourceVersion`` the
  change was decided on as a precondition (409 when the node has moved on since).

:class:`NodeWatcher` keeps the latest Node object as client-go's informers do, for one object: LIST, then WATCH
from the list's ``resourceVersion``; each event replaces the object, a ``BOOKMARK`` moves the
version on; a watch the server ends (its timeout) or a 410 ``Expired`` (the version compacted away) starts
over with a LIST; any other failure (a dropped connection, a 5xx) waits with a doubling backoff up to
:data:`MAX_BACKOFF` and resumes the watch from the last ``resourceVersion`` seen (a 410 then sends it to a
LIST). :meth:`NodeWatcher.stop` ends it at once, also mid-read (the watch's
sockets are cut, :class:`~runtime.kube_api.Abort`).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import kubernetes.client

from runtime.kube_api import DEFAULT_DEADLINE, DEFAULT_TIMEOUT, JSON, Abort, KubeClient, KubeError
from runtime.logs import component_logger

MAX_EVENT_BYTES = 4 * 1024 * 1024
"""Longest watch event line read (a Node object is at most etcd's 1.5 MiB; its JSON event a little more)."""
WATCH_SECONDS = 300
"""``timeoutSeconds`` of each watch: the server ends it then and the watcher starts over with a GET, so a missed
event (there should be none) is made good within this."""
WATCH_READ_TIMEOUT = WATCH_SECONDS + 30.0
"""Seconds one read of the watch stream may wait for a byte: past the server's end of the watch, so a stream
that went silent (a half-open connection) is noticed."""
MIN_BACKOFF = 0.5
MAX_BACKOFF = 30.0
"""Seconds between attempts after a failure: doubling from :data:`MIN_BACKOFF` up to this cap."""
FIELD_MANAGER = "gpu-node-agent"
MERGE_PATCH = "application/merge-patch+json"

log = component_logger("node_agent")


class WatchExpired(KubeError):
    """The watch's ``resourceVersion`` is too old (410): start over from a GET."""


def node_metadata(node: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = node.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def string_map(node: Mapping[str, Any], key: str) -> dict[str, str]:
    """``metadata.<key>`` (labels, annotations) as a dict of strings (anything else in it left out)."""
    found = node_metadata(node).get(key)
    if not isinstance(found, Mapping):
        return {}
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}


def resource_version(node: Mapping[str, Any]) -> str:
    version = node_metadata(node).get("resourceVersion")
    return version if isinstance(version, str) else ""


class NodeApi(KubeClient):
    """GET, WATCH and PATCH (labels and annotations) of the one Node ``node_name``; nothing else."""

    def __init__(
        self,
        configuration: Any,
        timeout: tuple[float, float] = DEFAULT_TIMEOUT,
        deadline: float = DEFAULT_DEADLINE,
        node_name: str = "",
    ) -> None:
        super().__init__(configuration, timeout, deadline)
        self._core = kubernetes.client.CoreV1Api(self._client)
        self.node_name = node_name

    @classmethod
    def for_node(
        cls,
        node_name: str,
        host: str | None = None,
        kubeconfig: Path | None = None,
        timeout: tuple[float, float] = DEFAULT_TIMEOUT,
        deadline: float = DEFAULT_DEADLINE,
    ) -> NodeApi:
        """The API of ``node_name``: on ``host`` without credentials (tests, ``kubectl proxy``), else from the
        environment (the pod's service account, or ``kubeconfig``)."""
        if not node_name:
            raise KubeError("no node name: set NODE_NAME from the pod's spec.nodeName (downward API)")
        api = cls.for_host(host, timeout, deadline) if host else cls.from_environment(kubeconfig, timeout, deadline)
        api.node_name = node_name
        return api

    def get(self) -> JSON:
        node = self._call(f"read Node {self.node_name}", self._core.read_node, self.node_name)
        if node_metadata(node).get("name") != self.node_name:
            raise KubeError(f"read Node {self.node_name}: the answer is not that Node")
        return node

    def list(self) -> tuple[JSON, str]:
        """The Node and the list's ``resourceVersion`` (LIST with ``fieldSelector=metadata.name``): the version a
        watch resumes from. Not the object's own version, which may be older than the server's watch window
        (a Node that has not changed for a while), so a watch from it could only ever get 410."""
        what = f"list Node {self.node_name}"
        answer = self._call(what, self._core.list_node, field_selector=f"metadata.name={self.node_name}")
        items = answer.get("items")
        version = node_metadata(answer).get("resourceVersion")
        if not isinstance(items, list) or not isinstance(version, str) or not version:
            raise KubeError(f"{what}: the answer has no items and resourceVersion")
        found = [item for item in items if isinstance(item, dict) and node_metadata(item).get("name") == self.node_name]
        if len(found) != 1:
            raise KubeError(
                f"{what}: the API server has no Node {self.node_name} (is NODE_NAME the pod's spec.nodeName?)"
            )
        return found[0], version

    def watch(
        self,
        since: str,
        on_event: Callable[[str, JSON], None],
        abort: Abort | None = None,
        seconds: int = WATCH_SECONDS,
    ) -> None:
        """Watch the Node from ``since`` until the server ends the watch; ``on_event(type, object)`` for each
        ``ADDED``/``MODIFIED``/``DELETED``/``BOOKMARK``. :class:`WatchExpired` on a 410, :class:`KubeError` on
        anything else that is not a clean end."""
        what = f"watch Node {self.node_name} from resourceVersion {since}"
        for event in self._stream(
            what,
            self._core.list_node,
            seconds=seconds + WATCH_READ_TIMEOUT,
            read_timeout=WATCH_READ_TIMEOUT,
            max_line=MAX_EVENT_BYTES,
            abort=abort,
            watch=True,
            field_selector=f"metadata.name={self.node_name}",
            resource_version=since,
            allow_watch_bookmarks=True,
            timeout_seconds=seconds,
        ):
            kind, obj = event.get("type"), event.get("object")
            if not isinstance(kind, str) or not isinstance(obj, dict):
                raise KubeError(f"{what}: an event without a type and an object: {json.dumps(event)[:200]}")
            if kind == "ERROR":
                code, message = obj.get("code"), str(obj.get("message", ""))[:300]
                if code == 410:
                    raise WatchExpired(f"{what}: 410 from {self.host}: {message}")
                raise KubeError(f"{what}: the server ended the watch with an error ({code}): {message}")
            if kind != "BOOKMARK" and node_metadata(obj).get("name") != self.node_name:
                raise KubeError(f"{what}: an event of another object ({node_metadata(obj).get('name')!r})")
            on_event(kind, obj)

    def patch_metadata(
        self,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        expect_version: str | None = None,
    ) -> JSON:
        """One merge patch of the Node's labels and annotations (None deletes the key); with ``expect_version``,
        applied only if the Node is still at that ``resourceVersion`` (else a :class:`KubeError` saying 409)."""
        metadata: JSON = {}
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        if expect_version:
            metadata["resourceVersion"] = expect_version
        return self._call(
            f"patch the labels and annotations of Node {self.node_name}",
            self._client.call_api,
            "/api/v1/nodes/{name}",
            "PATCH",
            path_params={"name": self.node_name},
            query_params=[("fieldManager", FIELD_MANAGER)],
            header_params={"Accept": "application/json", "Content-Type": MERGE_PATCH},
            body={"metadata": metadata},
            post_params=[],
            files={},
            response_type="object",
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
        )


class NodeWatcher:
    """The latest Node object, kept by a GET and then a WATCH on a thread of its own (see the module doc).

    :meth:`wait` returns when a newer object has arrived (or on timeout / stop); :attr:`latest` is the object.
    ``on_change`` is called (on the watcher's thread) after each new object: the operate loop's wake-up."""

    def __init__(self, api: NodeApi, on_change: Callable[[], None] = lambda: None) -> None:
        self._api = api
        self._on_change = on_change
        self._lock = threading.Lock()
        self._latest: JSON | None = None
        self._generation = 0
        self._abort = Abort()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self.errors = 0
        """Failures so far (each logged, each followed by a backoff)."""
        self.relists = 0
        """LISTs so far (the first, then one after each watch the server ends and each 410)."""

    @property
    def latest(self) -> JSON | None:
        with self._lock:
            return copy.deepcopy(self._latest)

    @property
    def generation(self) -> int:
        """How many objects have arrived (a newer one makes it larger)."""
        with self._lock:
            return self._generation

    def start(self) -> NodeWatcher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._abort.fire()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _offer(self, node: JSON) -> None:
        with self._lock:
            if self._latest is not None and resource_version(self._latest) == resource_version(node):
                return
            self._latest = node
            self._generation += 1
        self._on_change()

    def _run(self) -> None:
        backoff = MIN_BACKOFF
        since: str | None = None  # None: read the Node (start, a watch the server ended, a 410)

        def on_event(kind: str, obj: JSON) -> None:
            nonlocal since
            version = resource_version(obj)
            if version:
                since = version
            if kind in ("ADDED", "MODIFIED"):
                self._offer(obj)

        while not self._stopped.is_set():
            try:
                if since is None:
                    node, since = self._api.list()
                    self.relists += 1
                    self._offer(node)
                self._api.watch(since, on_event, self._abort)
                since = None  # the server ended the watch (its timeout) cleanly: read the Node again
                backoff = MIN_BACKOFF
            except WatchExpired as exc:
                log.info("node watch expired, reading the Node again: %s", exc)
                since = None
            except KubeError as exc:  # a dropped connection, a 5xx: resume from the last version after a pause
                if self._stopped.is_set():
                    return
                self.errors += 1
                log.warning("node watch failed, again in %.3g s: %s", backoff, exc)
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
