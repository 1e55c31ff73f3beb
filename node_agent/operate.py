"""``gpu-node-agent operate``: the GPU Operator's node-label protocol, on this node's own Node object.

What the node serves comes from two labels of its Node, as NVIDIA's sandbox components read them
(docs/node-agent.md, "The GPU Operator's node-label protocol"): ``nvidia.com/gpu.workload.config`` (the
workload; ``--default-workload`` when absent) and ``nvidia.com/vgpu.config`` (the vGPU config's name;
``--default-vgpu-config`` when absent). On start and on each change of either (the Node is watched,
:class:`~node_agent.kube.NodeWatcher`) the agent:

1. reads which devices pods hold (the kubelet's PodResources ``List``: the device IDs of every resource under
   ``--plugin-resource-prefix``, PCI addresses or mdev UUIDs) and asks the node-local core for the transition
   (:meth:`Preparer.plan`; reads only). A refusal (a GPU a pod or a VM holds) is reported —
   ``nvidia.com/gpu.workload.config.state=refused``, ``nvidia.com/vgpu.config.state=failed`` on a vm-vgpu
   node, the message naming the GPUs and the pods in :data:`MESSAGE_ANNOTATION` — and nothing on the node is
   touched; it is tried again every ``--retry-period`` and on every change of the Node, so it goes through once
   the allocation ends.
2. with nothing to change: the state is ``success`` (the feature labels published), no pause.
3. with a change: state ``pending`` and the sandbox device plugin paused, in ONE patch that also records the
   deploy label's previous value (:data:`PAUSED_FROM_ANNOTATION`), so whatever happens next a later start
   knows what to put back; then it waits until ``status.allocatable`` shows none (or zero) of the resources the
   transition withdraws (the plugin has gone and the kubelet no longer offers its devices), or
   ``--pause-timeout`` (logged; applied anyway: the kubelet itself refuses to start a pod on a device whose
   plugin is gone, and the pods that hold devices were refused in step 1); applies; publishes the feature labels
   (stale ones of the core's prefixes removed); restores the deploy label (deleted if it was absent) and sets the
   state ``success`` or ``failed`` with the message, again in one patch.

Every write is a JSON merge patch of labels and annotations of our own key set only (:func:`ours`); the pause
and the restore carry the ``resourceVersion`` they were decided on (a 409 re-reads and decides again).
SIGTERM/SIGINT end the loop: between steps at once; during a wait for the plugin, the pause is lifted first (the
node was not touched); an apply runs to its end and is reported (it is never cut half-way).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

from node_agent.kube import NodeApi, NodeWatcher, string_map
from node_agent.protocol import (
    ANNOTATIONS,
    CONFLICT_RETRIES,
    DEFAULT_PAUSE_TIMEOUT,
    DEFAULT_RESOURCE_PREFIX,
    DEFAULT_RETRY_PERIOD,
    MAX_MESSAGE_CHARS,
    MAX_PAUSE_RECORD_CHARS,
    MESSAGE_ANNOTATION,
    PAUSED,
    PAUSED_FROM_ANNOTATION,
    PLUGIN_DEPLOY_LABEL,
    STATE_LABELS,
    VGPU_CONFIG_LABEL,
    VGPU_STATE_LABEL,
    WORKLOAD_LABEL,
    WORKLOAD_STATE_LABEL,
    WORKLOADS,
)
from runtime.kube_api import JSON, KubeError
from runtime.logs import component_logger
from runtime.pod_resources import PodResourcesClient, rpc_text

log = component_logger("node_agent")


# -- what the agent needs of the node-local core (node_agent.workload); the lead's adapter implements it --------


@dataclass(frozen=True)
class Wanted:
    """What the Node's labels (or the defaults) ask for."""

    workload: str
    vgpu_config: str | None


class Plan(Protocol):
    """A transition as the core planned it (``workload.Transition``)."""

    @property
    def refusals(self) -> Sequence[str]: ...

    @property
    def changes(self) -> bool: ...

    @property
    def workloads(self) -> dict[str, str]: ...


class Outcome(Protocol):
    """What applying it did (``workload.Outcome``): state ``success``, ``failed`` or ``refused``."""

    @property
    def state(self) -> str: ...

    @property
    def message(self) -> str: ...

    @property
    def workloads(self) -> dict[str, str]: ...


class Preparer(Protocol):
    """The node-local core as the operate loop uses it: one adapter over ``node_agent.workload`` (it reads the
    ``--workload-config`` and ``--vgpu-config`` files into a ``Desired`` and holds the host root and kernel)."""

    @property
    def label_prefixes(self) -> tuple[str, ...]:
        """The prefixes of every feature label :meth:`labels` can return (any of ours on the Node that it no longer
        returns is removed)."""
        ...

    def plan(self, wanted: Wanted, allocated: frozenset[str]) -> Plan:
        """``plan_transition`` (reads only); ``allocated``: device IDs (PCI addresses, mdev UUIDs) pods hold."""
        ...

    def apply(self, plan: Plan) -> Outcome:
        """``apply_transition``."""
        ...

    def labels(self, workloads: Mapping[str, str]) -> dict[str, str]:
        """``node_labels``: the feature labels for the node's GPUs as they now serve."""
        ...

    def withdrawn_resources(self, plan: Plan) -> frozenset[str] | None:
        """The extended resources the plugin stops offering with this transition (None: every one under the
        plugin's prefix): what ``status.allocatable`` must show at zero before the core writes."""
        ...

    def settled(self, state: str, message: str, workloads: Mapping[str, str], workload: str) -> None:
        """A pass ended in ``state`` with the GPUs serving ``workloads``: the node-local reports (the agent's
        readiness file, the sandbox validator's files) follow it."""
        ...


@dataclass(frozen=True)
class PreparerConfig:
    """What the adapter is built from: the ``operate`` command's node-local options."""

    host_root: Path
    state_dir: Path
    vgpu_config: Path | None
    workload_config: Path | None
    nvidia_smi: str
    kernel: object | None = None
    """The kernel a caller gave (tests: ``simkit.kernel_sim.SimKernel``); None: the real one."""
    validations_dir: Path | None = None
    """Where the GPU Operator's sandbox validator readiness files go (None: none written)."""


def workload_preparer(config: PreparerConfig) -> Preparer:
    """The node-local core (:mod:`node_agent.preparer`), imported when a command runs."""
    from node_agent.preparer import WorkloadPreparer  # noqa: PLC0415 (it imports this module's types)

    return WorkloadPreparer(config)


PREPARER_FACTORY: Callable[[PreparerConfig], Preparer] = workload_preparer
"""Builds the :class:`Preparer` ``operate`` runs with: the one place the node-local core is wired in."""


# -- who holds devices --------------------------------------------------------------------------------------


class Allocations(Protocol):
    def held(self) -> dict[str, list[str]]:
        """Device ID → the pods holding it (``namespace/name (resource)``); :class:`AllocationsUnknown` when the
        kubelet cannot be asked."""
        ...


class AllocationsUnknown(Exception):
    """The kubelet's PodResources could not be read: which devices pods hold is unknown (so nothing changes)."""


class PodResourcesAllocations:
    """:class:`Allocations` from the kubelet's PodResources ``List`` (resources under ``prefix`` only)."""

    def __init__(self, socket_path: Path, prefix: str = DEFAULT_RESOURCE_PREFIX, timeout: float = 10.0) -> None:
        self._client = PodResourcesClient(socket_path, timeout)
        self.prefix = prefix

    def held(self) -> dict[str, list[str]]:
        try:
            pods = self._client.list()
        except grpc.RpcError as error:
            raise AllocationsUnknown(
                f"the kubelet PodResources socket {self._client.socket_path} did not answer List ({rpc_text(error)})"
            ) from None
        held: dict[str, list[str]] = {}
        for pod in pods:
            for container in pod.containers:
                for devices in container.devices:
                    if not devices.resource_name.startswith(self.prefix):
                        continue
                    for device in devices.device_ids:
                        holder = f"{pod.namespace}/{pod.name} ({devices.resource_name})"
                        held.setdefault(device, [])
                        if holder not in held[device]:
                            held[device].append(holder)
        return held

    def close(self) -> None:
        self._client.close()


# -- the protocol --------------------------------------------------------------------------------------------


def ours(key: str, prefixes: Iterable[str]) -> bool:
    """Whether this agent may write the label or annotation ``key``."""
    return key in STATE_LABELS or key in ANNOTATIONS or any(key.startswith(prefix) for prefix in prefixes)


def _cut(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def paused_from(annotations: Mapping[str, str]) -> tuple[bool, str | None]:
    """(whether a pause of ours is recorded, the deploy label's value before it: None when absent)."""
    record = annotations.get(PAUSED_FROM_ANNOTATION)
    if record is None:
        return False, None
    try:
        value = json.loads(record[:MAX_PAUSE_RECORD_CHARS]).get("previous")
    except (ValueError, AttributeError):
        value = None
        log.warning(
            "annotation %s is not ours to read (%r): the deploy label is removed", PAUSED_FROM_ANNOTATION, record
        )
    return True, value if isinstance(value, str) else None


@dataclass
class OperateOptions:
    default_workload: str = "container"
    default_vgpu_config: str | None = None
    pause_timeout: float = DEFAULT_PAUSE_TIMEOUT
    retry_period: float = DEFAULT_RETRY_PERIOD
    resource_prefix: str = DEFAULT_RESOURCE_PREFIX


@dataclass
class Reconciled:
    """What one pass ended in: the state label written, and whether to try again without a label change."""

    state: str
    retry: bool = False
    messages: list[str] = field(default_factory=list)


class Stopping(Exception):
    """A stop request came while waiting for the plugin to go (the pause is lifted, nothing applied)."""


class Operator:
    """The operate loop of one node (see the module doc)."""

    def __init__(
        self,
        api: NodeApi,
        preparer: Preparer,
        allocations: Allocations,
        options: OperateOptions | None = None,
    ) -> None:
        self.api = api
        self.preparer = preparer
        self.allocations = allocations
        self.options = options or OperateOptions()
        self.stop_requested = threading.Event()
        self._wake = threading.Event()
        self.watcher = NodeWatcher(api, on_change=self._wake.set)
        self.passes = 0
        """Reconcile passes so far (tests wait on it)."""
        self.last: Reconciled | None = None

    def stop(self) -> None:
        """End :meth:`run` (any thread, a signal handler included: it only sets events)."""
        self.stop_requested.set()
        self._wake.set()

    def wanted(self, node: JSON) -> Wanted:
        labels = string_map(node, "labels")
        workload = labels.get(WORKLOAD_LABEL) or self.options.default_workload
        return Wanted(workload, labels.get(VGPU_CONFIG_LABEL) or self.options.default_vgpu_config)

    def run(self) -> None:
        """Until :meth:`stop`: a pass on start, on each change of the wanted labels, and every retry period while
        the last pass asked to be retried (a refusal, an API failure)."""
        self.watcher.start()
        try:
            done: Wanted | None = None
            retry_at: float | None = None
            while not self.stop_requested.is_set():
                self._wake.clear()
                node = self.watcher.latest
                wanted = self.wanted(node) if node is not None else None
                due = retry_at is not None and time.monotonic() >= retry_at
                if wanted is not None and (wanted != done or due):
                    try:
                        self.last = self.reconcile(wanted)
                    except Stopping:
                        break
                    except KubeError as exc:
                        log.warning("a pass failed on the API, again in %g s: %s", self.options.retry_period, exc)
                        self.last = Reconciled("unknown", retry=True, messages=[str(exc)])
                    self.passes += 1
                    done = wanted
                    retry_at = time.monotonic() + self.options.retry_period if self.last.retry else None
                    continue  # look again at once: the labels may have changed during the pass
                wait = 3600.0 if retry_at is None else max(0.0, retry_at - time.monotonic())
                self._wake.wait(wait)
        finally:
            self.watcher.stop()

    # -- one pass ------------------------------------------------------------------------------------------

    def reconcile(self, wanted: Wanted) -> Reconciled:
        vgpu = wanted.workload == "vm-vgpu"
        if wanted.workload not in WORKLOADS:
            message = f"{WORKLOAD_LABEL}={wanted.workload!r} is not one of {', '.join(WORKLOADS)}; nothing changed"
            self._finish("failed", message, vgpu=False, feature=None)
            return Reconciled("failed", messages=[message])
        try:
            held = self.allocations.held()
        except AllocationsUnknown as exc:
            message = f"{exc}; which GPUs pods hold is unknown, so nothing changed"
            self._finish("refused", message, vgpu, feature=None)
            return Reconciled("refused", retry=True, messages=[message])
        try:
            plan = self.preparer.plan(wanted, frozenset(held))
        except Exception as exc:  # a bug or an unreadable node: reported, nothing changed, tried again
            log.exception("planning %s failed", wanted.workload)
            message = f"{wanted.workload}: planning failed, nothing changed: {exc}"
            self._finish("failed", _cut(message), vgpu, feature=None)
            return Reconciled("failed", retry=True, messages=[message])
        if plan.refusals:
            holders = "; ".join(f"{device} held by {', '.join(pods)}" for device, pods in sorted(held.items()))
            message = "; ".join(plan.refusals) + (f" (devices pods hold: {holders})" if holders else "")
            message = f"{wanted.workload} refused, nothing changed: {message}"
            log.warning("%s", message)
            self._finish("refused", message, vgpu, feature=None)
            return Reconciled("refused", retry=True, messages=[message])
        if not plan.changes:
            message = f"{wanted.workload}: the node already serves it"
            self._settled("success", message, plan.workloads, wanted.workload)
            self._finish("success", message, vgpu, plan.workloads)
            return Reconciled("success")
        self._pause(vgpu, wanted)
        try:
            self._wait_for_withdrawal(self.preparer.withdrawn_resources(plan))
        except Stopping:
            self._finish("pending", "stopped before applying; the next start applies it", vgpu, feature=None)
            raise
        try:
            outcome = self.preparer.apply(plan)
        except Exception as exc:  # the core's failure is reported and the pause lifted, whatever it was
            log.exception("applying %s failed", wanted.workload)
            message = f"{wanted.workload}: the apply failed: {exc}"
            self._settled("failed", message, plan.workloads, wanted.workload)
            self._finish("failed", message, vgpu, None)
            return Reconciled("failed", messages=[message])
        state = outcome.state if outcome.state in ("success", "failed", "refused") else "failed"
        self._settled(state, outcome.message, outcome.workloads, wanted.workload)
        self._finish(state, _cut(outcome.message), vgpu, outcome.workloads)
        return Reconciled(state, retry=state == "refused", messages=[outcome.message])

    def _patch(self, decide: Callable[[JSON], tuple[dict[str, str | None], dict[str, str | None]]]) -> JSON:
        """One patch decided on the Node as it is now, with its ``resourceVersion`` as precondition; on a
        conflict read it again and decide again."""
        for _ in range(CONFLICT_RETRIES):
            node = self.api.get()
            labels, annotations = decide(node)
            prefixes = self.preparer.label_prefixes
            stray = [key for key in [*labels, *annotations] if not ours(key, prefixes)]
            if stray:
                raise KubeError(f"refusing to write keys that are not this agent's: {', '.join(sorted(stray))}")
            current_labels, current_annotations = string_map(node, "labels"), string_map(node, "annotations")
            labels = {k: v for k, v in labels.items() if current_labels.get(k) != v}
            annotations = {k: v for k, v in annotations.items() if current_annotations.get(k) != v}
            if not labels and not annotations:
                return node
            version = node["metadata"].get("resourceVersion")
            try:
                return self.api.patch_metadata(labels, annotations, expect_version=version)
            except KubeError as exc:
                if "HTTP 409 " not in str(exc):
                    raise
        raise KubeError(f"the Node changed under {CONFLICT_RETRIES} patches in a row; tried again later")

    def _settled(self, state: str, message: str, workloads: Mapping[str, str], workload: str) -> None:
        """The node-local reports first, then the Node: whoever reads the state label finds the files agree."""
        try:
            self.preparer.settled(state, message, workloads, workload)
        except Exception:  # the Node already says what happened; the local files are logged, not fatal
            log.exception("the node-local readiness files could not follow the %s pass", state)

    def _pause(self, vgpu: bool, wanted: Wanted) -> None:
        def decide(node: JSON) -> tuple[dict[str, str | None], dict[str, str | None]]:
            labels = string_map(node, "labels")
            annotations: dict[str, str | None] = {
                MESSAGE_ANNOTATION: f"applying {wanted.workload}"
                + (f" with vGPU config {wanted.vgpu_config}" if vgpu and wanted.vgpu_config else "")
            }
            recorded, _ = paused_from(string_map(node, "annotations"))
            if not recorded:  # a pause recorded by an earlier run keeps the value from before it
                annotations[PAUSED_FROM_ANNOTATION] = json.dumps({"previous": labels.get(PLUGIN_DEPLOY_LABEL)})
            states: dict[str, str | None] = {WORKLOAD_STATE_LABEL: "pending", PLUGIN_DEPLOY_LABEL: PAUSED}
            if vgpu:
                states[VGPU_STATE_LABEL] = "pending"
            return states, annotations

        self._patch(decide)
        log.info("paused the sandbox device plugin (%s=%s) to apply %s", PLUGIN_DEPLOY_LABEL, PAUSED, wanted.workload)

    def _finish(self, state: str, message: str, vgpu: bool, feature: Mapping[str, str] | None) -> None:
        """The state and message; the pause lifted (the recorded value back, or the label deleted); with
        ``feature``, the node's feature labels for those workloads (stale ones of ours deleted)."""
        published = self._feature_labels(feature) if feature is not None else None

        def decide(node: JSON) -> tuple[dict[str, str | None], dict[str, str | None]]:
            labels = string_map(node, "labels")
            annotations = string_map(node, "annotations")
            out: dict[str, str | None] = {WORKLOAD_STATE_LABEL: state}
            if vgpu:
                out[VGPU_STATE_LABEL] = {"refused": "failed", "pending": "pending"}.get(state, state)
            elif VGPU_STATE_LABEL in labels:
                out[VGPU_STATE_LABEL] = None  # not a vGPU node (any more): no vGPU state to report
            notes: dict[str, str | None] = {MESSAGE_ANNOTATION: _cut(message)}
            recorded, previous = paused_from(annotations)
            if recorded:
                if labels.get(PLUGIN_DEPLOY_LABEL) == PAUSED:  # someone else's value since: theirs stays
                    out[PLUGIN_DEPLOY_LABEL] = previous
                notes[PAUSED_FROM_ANNOTATION] = None
            if published is not None:
                for key in labels:
                    if key not in published and any(key.startswith(p) for p in self.preparer.label_prefixes):
                        out[key] = None
                out.update(published)
            return out, notes

        self._patch(decide)
        log.info("%s=%s: %s", WORKLOAD_STATE_LABEL, state, message)

    def _feature_labels(self, workloads: Mapping[str, str]) -> dict[str, str | None] | None:
        """The core's feature labels of ``workloads`` within its prefixes; None when it cannot say (logged: the
        labels on the Node then stay as they are, the state is still reported and the pause lifted)."""
        prefixes = self.preparer.label_prefixes
        try:
            labels = self.preparer.labels(workloads)
        except Exception:
            log.exception("the node's feature labels could not be made; those on the Node stay as they are")
            return None
        kept: dict[str, str | None] = {}
        for key, value in labels.items():
            if any(key.startswith(prefix) for prefix in prefixes) and key not in STATE_LABELS:
                kept[key] = value
            else:
                log.warning("feature label %s is outside the prefixes %s: not written", key, ", ".join(prefixes))
        return kept

    def _wait_for_withdrawal(self, resources: frozenset[str] | None) -> None:
        """Until ``status.allocatable`` offers none of ``resources`` (None: of the prefix), the pause timeout, or a
        stop request (:class:`Stopping`)."""
        deadline = time.monotonic() + self.options.pause_timeout
        while True:
            offered = self._offered(resources)
            if not offered:
                return
            if self.stop_requested.is_set():
                raise Stopping()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning(
                    "the sandbox device plugin still offers %s after %g s paused; applying anyway (pods holding "
                    "devices were refused before the pause; the kubelet starts no pod on a device whose plugin "
                    "is gone)",
                    ", ".join(sorted(offered)),
                    self.options.pause_timeout,
                )
                return
            self._wake.clear()
            self._wake.wait(min(remaining, 1.0))

    def _offered(self, resources: frozenset[str] | None) -> list[str]:
        node = self.watcher.latest or {}
        status = node.get("status")
        allocatable = status.get("allocatable") if isinstance(status, dict) else None
        if not isinstance(allocatable, dict):
            return []
        offered = []
        for name, quantity in allocatable.items():
            if not isinstance(name, str) or not name.startswith(self.options.resource_prefix):
                continue
            if resources is not None and name not in resources:
                continue
            if str(quantity).strip() not in ("0", ""):
                offered.append(name)
        return offered
