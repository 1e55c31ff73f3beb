"""``gpu-node-agent operate``: the GPU Operator's node-label protocol against a real HTTP API server and kubelet.

The agent's API edge (:mod:`node_agent.kube`, the official client) talks to :mod:`simkit.fake_apiserver`; the
kubelet's PodResources is :mod:`simkit.podresources_standin` on a real unix socket. The node-local core is a
small fake here (:class:`FakeCore`, the :class:`~node_agent.operate.Preparer` protocol): it records every write
it would make to the node's devices, so a refusal is shown to touch nothing. A stand-in for the sandbox device
plugin (:class:`PluginStandIn`) does what the DaemonSet and the kubelet do together: while the deploy label
says paused, the Node's ``status.allocatable`` offers none of its devices.

Everything is asserted from what the API server received (its request log, in order) and stored; waits are
conditions with generous timeouts, never a sleep standing for an assertion.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from node_agent import operate
from node_agent.cli import cli
from node_agent.kube import NodeApi, string_map
from node_agent.operate import (
    OperateOptions,
    Operator,
    PodResourcesAllocations,
    PreparerConfig,
    Wanted,
)
from node_agent.preparer import WorkloadPreparer
from node_agent.protocol import (
    MESSAGE_ANNOTATION,
    PAUSED,
    PAUSED_FROM_ANNOTATION,
    PLUGIN_DEPLOY_LABEL,
    VGPU_CONFIG_LABEL,
    VGPU_STATE_LABEL,
    WORKLOAD_LABEL,
    WORKLOAD_STATE_LABEL,
)
from runtime.kube_api import KubeError
from simkit.agent_nodes import build_node, mdev_node
from simkit.fake_apiserver import FakeApiServer, Request
from simkit.podresources_standin import Container, FakeKubelet, Pod, fake_kubelet
from tests.hook_support import short_dir

NODE = "gpu-node-1"
WAIT = 30.0
GPUS = ("0000:86:00.0", "0000:af:00.0")
RESOURCE = "nvidia.com/GA102GL_A10"
FEATURE_PREFIX = "gpu-passthrough.kubevirt.io/gpu."
OUR_ANNOTATIONS = (PAUSED_FROM_ANNOTATION, MESSAGE_ANNOTATION)
OUR_LABELS = (WORKLOAD_STATE_LABEL, VGPU_STATE_LABEL, PLUGIN_DEPLOY_LABEL)


@dataclass(frozen=True)
class FakePlan:
    refusals: list[str]
    changes: bool
    workloads: dict[str, str]


@dataclass(frozen=True)
class FakeOutcome:
    state: str
    message: str
    workloads: dict[str, str]


@dataclass
class FakeCore:
    """The node-local core: each GPU serves a workload; a change of a GPU a pod holds is refused."""

    server: FakeApiServer
    serving: dict[str, str] = field(default_factory=lambda: dict.fromkeys(GPUS, "container"))
    writes: list[dict[str, str]] = field(default_factory=list)
    """Each apply's new workloads: the node's devices written."""
    offered_at_apply: list[str] = field(default_factory=list)
    """``status.allocatable`` of the resource when each apply began."""
    extra_labels: dict[str, str] = field(default_factory=dict)
    label_prefixes: tuple[str, ...] = (FEATURE_PREFIX,)
    settlements: list[tuple[str, str]] = field(default_factory=list)
    """Each pass's end as the core was told it: (state, the node's workload)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(self, wanted: Wanted, allocated: frozenset[str]) -> FakePlan:
        with self.lock:
            target = dict.fromkeys(self.serving, wanted.workload)
            moving = [gpu for gpu in self.serving if self.serving[gpu] != target[gpu]]
        refusals = [f"GPU {gpu} is in use" for gpu in moving if gpu in allocated]
        return FakePlan(refusals, bool(moving), target)

    def apply(self, plan: Any) -> FakeOutcome:
        node = self.server.node(NODE)
        self.offered_at_apply.append(node.get("status", {}).get("allocatable", {}).get(RESOURCE, "absent"))
        with self.lock:
            self.serving = dict(plan.workloads)
            self.writes.append(dict(plan.workloads))
        return FakeOutcome("success", f"now {sorted(set(plan.workloads.values()))}", dict(plan.workloads))

    def labels(self, workloads: Mapping[str, str]) -> dict[str, str]:
        vms = [gpu for gpu, workload in workloads.items() if workload != "container"]
        found = {FEATURE_PREFIX + "count": str(len(vms))} if vms else {}
        if any(workload == "vm-vgpu" for workload in workloads.values()):
            found[FEATURE_PREFIX + "vgpu.types"] = "A10-4Q"
        return {**found, **self.extra_labels}

    def withdrawn_resources(self, plan: Any) -> frozenset[str] | None:
        return frozenset({RESOURCE})

    def settled(self, state: str, message: str, workloads: Mapping[str, str], workload: str) -> None:
        with self.lock:
            self.settlements.append((state, workload))


class PluginStandIn:
    """The sandbox device plugin's DaemonSet and the kubelet, as the Node shows them: paused → allocatable 0."""

    def __init__(self, server: FakeApiServer, offered: str = "2") -> None:
        self.server = server
        self.offered = offered
        self.enabled = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            node = self.server.node(NODE)
            paused = string_map(node, "labels").get(PLUGIN_DEPLOY_LABEL) == PAUSED
            want = "0" if paused and self.enabled else self.offered
            if node.get("status", {}).get("allocatable", {}).get(RESOURCE) != want:
                self.server.set_allocatable(NODE, {RESOURCE: want, "cpu": "8"})
            self._stop.wait(0.02)  # an actor's pace, not an assertion

    def __enter__(self) -> PluginStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class Rig:
    server: FakeApiServer
    kubelet: FakeKubelet
    socket: Path
    core: FakeCore


@contextmanager
def rig(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> Iterator[Rig]:
    with FakeApiServer() as server, short_dir() as directory:
        server.add_node(
            NODE,
            labels={"kubernetes.io/hostname": NODE, PLUGIN_DEPLOY_LABEL: "true", **(labels or {})},
            annotations=annotations,
            allocatable={RESOURCE: "2", "cpu": "8"},
        )
        kubelet = FakeKubelet([])
        socket_path = directory / "kubelet.sock"
        with fake_kubelet(kubelet, socket_path):
            yield Rig(server, kubelet, socket_path, FakeCore(server))


@contextmanager
def running(r: Rig, **options: Any) -> Iterator[Operator]:
    api = NodeApi.for_node(NODE, host=r.server.url)
    allocations = PodResourcesAllocations(r.socket)
    settings = OperateOptions(**{"pause_timeout": WAIT, "retry_period": 0.2, **options})
    operator = Operator(api, r.core, allocations, settings)
    thread = threading.Thread(target=operator.run, daemon=True)
    thread.start()
    try:
        yield operator
    finally:
        operator.stop()
        thread.join(WAIT)
        assert not thread.is_alive(), "the operate loop did not end on stop()"
        allocations.close()
        api.close()


def labels(r: Rig) -> dict[str, str]:
    return string_map(r.server.node(NODE), "labels")


def notes_of(r: Rig) -> dict[str, str]:
    return string_map(r.server.node(NODE), "annotations")


def patches(r: Rig, since: int = 0) -> list[Request]:
    return [request for request in r.server.requests()[since:] if request.method == "PATCH"]


def wait_state(r: Rig, state: str, passes: int | None = None, operator: Operator | None = None) -> None:
    def reached() -> bool:
        done = labels(r).get(WORKLOAD_STATE_LABEL) == state
        return done and (passes is None or operator is None or operator.passes >= passes)

    r.server.wait_for(reached, WAIT, f"{WORKLOAD_STATE_LABEL}={state}")


def touched(request: Request) -> tuple[dict[str, Any], dict[str, Any]]:
    metadata = (request.body or {}).get("metadata", {})
    return metadata.get("labels", {}), metadata.get("annotations", {})


def assert_only_ours(r: Rig) -> None:
    """Every PATCH the agent sent is a merge patch of our labels and annotations, nothing else."""
    for request in patches(r):
        assert request.path == f"/api/v1/nodes/{NODE}"
        assert request.content_type == "application/merge-patch+json"
        body = request.body or {}
        assert set(body) == {"metadata"}
        assert set(body["metadata"]) <= {"labels", "annotations", "resourceVersion"}
        label_keys, annotation_keys = touched(request)
        for key in label_keys:
            assert key in OUR_LABELS or key.startswith(FEATURE_PREFIX), key
        for key in annotation_keys:
            assert key in OUR_ANNOTATIONS, key


def step_patches(r: Rig, since: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [touched(request) for request in patches(r, since)]


def test_a_node_without_labels_gets_the_defaults_applied_and_reports_success() -> None:
    with rig() as r, PluginStandIn(r.server), running(r, default_workload="vm-passthrough") as operator:
        wait_state(r, "success", 1, operator)
        assert r.core.writes == [dict.fromkeys(GPUS, "vm-passthrough")]
        assert r.core.offered_at_apply == ["0"]  # applied once the node offered none of the plugin's devices
        pause, finish = step_patches(r, 0)
        assert pause[0] == {WORKLOAD_STATE_LABEL: "pending", PLUGIN_DEPLOY_LABEL: PAUSED}
        assert json.loads(pause[1][PAUSED_FROM_ANNOTATION]) == {"previous": "true"}
        assert finish[0] == {
            WORKLOAD_STATE_LABEL: "success",
            PLUGIN_DEPLOY_LABEL: "true",
            FEATURE_PREFIX + "count": "2",
        }
        assert finish[1][PAUSED_FROM_ANNOTATION] is None
        now = labels(r)
        assert now[PLUGIN_DEPLOY_LABEL] == "true" and VGPU_STATE_LABEL not in now
        assert PAUSED_FROM_ANNOTATION not in notes_of(r)
        assert now["kubernetes.io/hostname"] == NODE
        assert_only_ours(r)


def test_nothing_to_change_is_success_without_a_pause() -> None:
    with rig() as r, running(r) as operator:  # default container: the fake core's GPUs serve it already
        wait_state(r, "success", 1, operator)
        assert r.core.writes == []
        assert all(PLUGIN_DEPLOY_LABEL not in touched(request)[0] for request in patches(r))
        assert "already serves" in notes_of(r)[MESSAGE_ANNOTATION]
        assert_only_ours(r)


def passed(operator: Operator, count: int) -> bool:
    return operator.passes >= count


def test_relabelling_moves_the_node_through_every_workload_pausing_the_plugin_each_time() -> None:
    with rig() as r, PluginStandIn(r.server), running(r, default_vgpu_config="A10-4Q") as operator:
        wait_state(r, "success", 1, operator)
        for step, workload in enumerate(["vm-passthrough", "vm-vgpu", "container", "vm-passthrough"], start=2):
            since = len(r.server.requests())
            r.server.set_labels(NODE, {WORKLOAD_LABEL: workload})
            r.server.wait_for(functools.partial(passed, operator, step), WAIT, f"pass {step}")
            wait_state(r, "success")
            assert r.core.serving == dict.fromkeys(GPUS, workload)
            steps = step_patches(r, since)
            assert len(steps) == 2, steps
            (pause_labels, pause_notes), (done_labels, done_notes) = steps
            vgpu = workload == "vm-vgpu"
            assert pause_labels[WORKLOAD_STATE_LABEL] == "pending" and pause_labels[PLUGIN_DEPLOY_LABEL] == PAUSED
            assert (pause_labels.get(VGPU_STATE_LABEL) == "pending") is vgpu
            assert json.loads(pause_notes[PAUSED_FROM_ANNOTATION]) == {"previous": "true"}
            assert done_labels[WORKLOAD_STATE_LABEL] == "success" and done_labels[PLUGIN_DEPLOY_LABEL] == "true"
            assert (done_labels.get(VGPU_STATE_LABEL) == "success") is vgpu
            assert done_notes[PAUSED_FROM_ANNOTATION] is None
            now = labels(r)
            assert now[PLUGIN_DEPLOY_LABEL] == "true"
            assert (now.get(VGPU_STATE_LABEL) == "success") is vgpu
            assert (FEATURE_PREFIX + "vgpu.types" in now) is vgpu  # a stale feature label of ours goes
            assert (FEATURE_PREFIX + "count" in now) is (workload != "container")
        assert r.core.offered_at_apply == ["0"] * 4
        assert_only_ours(r)


def test_a_change_while_a_pod_holds_a_gpu_is_refused_until_the_allocation_ends() -> None:
    pod = Pod("vms", "virt-launcher-vm1-abcde", [Container("compute", [(RESOURCE, [GPUS[0]])])])
    with rig({WORKLOAD_LABEL: "container"}) as r, PluginStandIn(r.server), running(r) as operator:
        wait_state(r, "success", 1, operator)
        r.kubelet.set_pods([pod, Pod("other", "web-1", [Container("c", [("example.com/nic", ["nic0"])])])])
        since = len(r.server.requests())
        r.server.set_labels(NODE, {WORKLOAD_LABEL: "vm-vgpu", VGPU_CONFIG_LABEL: "A10-4Q"})
        wait_state(r, "refused")
        assert labels(r)[VGPU_STATE_LABEL] == "failed"  # as vgpu-device-manager reports a config it cannot apply
        message = notes_of(r)[MESSAGE_ANNOTATION]
        assert GPUS[0] in message and "vms/virt-launcher-vm1-abcde" in message and "nic0" not in message
        assert r.core.writes == []  # nothing on the node touched
        assert all(PLUGIN_DEPLOY_LABEL not in labels_ for labels_, _ in step_patches(r, since))  # never paused
        retries = operator.passes
        r.server.wait_for(lambda: operator.passes >= retries + 2, WAIT, "retries while refused")
        assert r.core.writes == []
        r.kubelet.set_pods([])  # the VM ended
        wait_state(r, "success")
        assert r.core.writes == [dict.fromkeys(GPUS, "vm-vgpu")]
        assert labels(r)[VGPU_STATE_LABEL] == "success" and labels(r)[PLUGIN_DEPLOY_LABEL] == "true"
        assert_only_ours(r)


def test_an_unreadable_pod_resources_socket_refuses_every_change() -> None:
    with rig({WORKLOAD_LABEL: "vm-passthrough"}) as r:
        api = NodeApi.for_node(NODE, host=r.server.url)
        allocations = PodResourcesAllocations(r.socket.parent / "missing.sock", timeout=2.0)
        operator = Operator(api, r.core, allocations, OperateOptions(retry_period=60))
        thread = threading.Thread(target=operator.run, daemon=True)
        thread.start()
        try:
            wait_state(r, "refused")
            assert "did not answer List" in notes_of(r)[MESSAGE_ANNOTATION]
            assert r.core.writes == []
        finally:
            operator.stop()
            thread.join(WAIT)
            allocations.close()


def test_a_restart_while_paused_restores_the_deploy_label() -> None:
    left = {PLUGIN_DEPLOY_LABEL: PAUSED, WORKLOAD_STATE_LABEL: "pending"}
    record = {PAUSED_FROM_ANNOTATION: json.dumps({"previous": "true"})}
    with rig(left, record) as r, running(r) as operator:  # the core already serves container: nothing to apply
        wait_state(r, "success", 1, operator)
        assert labels(r)[PLUGIN_DEPLOY_LABEL] == "true"
        assert PAUSED_FROM_ANNOTATION not in notes_of(r)
        assert r.core.writes == []


def test_a_restart_mid_change_keeps_the_value_from_before_the_first_pause() -> None:
    left = {PLUGIN_DEPLOY_LABEL: PAUSED, WORKLOAD_LABEL: "vm-passthrough"}
    record = {PAUSED_FROM_ANNOTATION: json.dumps({"previous": None})}  # the label was absent before
    with rig(left, record) as r, running(r, pause_timeout=0.5) as operator:
        wait_state(r, "success", 1, operator)
        assert r.core.writes == [dict.fromkeys(GPUS, "vm-passthrough")]
        assert PLUGIN_DEPLOY_LABEL not in labels(r)  # deleted, as it was absent
        assert PAUSED_FROM_ANNOTATION not in notes_of(r)


def test_a_deploy_label_someone_else_changed_during_the_pause_is_theirs() -> None:
    with rig({WORKLOAD_LABEL: "vm-passthrough"}) as r:
        core = r.core
        original = core.apply

        def apply(plan: Any) -> FakeOutcome:
            r.server.set_labels(NODE, {PLUGIN_DEPLOY_LABEL: "false"})  # the operator turned the plugin off
            return original(plan)

        core.apply = apply  # type: ignore[method-assign]
        with running(r, pause_timeout=0.2) as operator:
            wait_state(r, "success", 1, operator)
            assert labels(r)[PLUGIN_DEPLOY_LABEL] == "false"
            assert PAUSED_FROM_ANNOTATION not in notes_of(r)


def test_the_pause_timeout_applies_anyway() -> None:
    with rig() as r, running(r, default_workload="vm-passthrough", pause_timeout=0.3) as operator:
        wait_state(r, "success", 1, operator)  # no plugin stand-in: the node keeps offering the devices
        assert r.core.offered_at_apply == ["2"]
        assert labels(r)[PLUGIN_DEPLOY_LABEL] == "true"


def test_a_stop_while_waiting_for_the_plugin_lifts_the_pause_and_applies_nothing() -> None:
    with rig({WORKLOAD_LABEL: "vm-passthrough"}) as r:
        with running(r):  # no plugin stand-in: the wait lasts until the stop
            r.server.wait_for(lambda: labels(r).get(PLUGIN_DEPLOY_LABEL) == PAUSED, WAIT, "the pause")
        assert r.core.writes == []
        assert labels(r)[PLUGIN_DEPLOY_LABEL] == "true"
        assert labels(r)[WORKLOAD_STATE_LABEL] == "pending"
        assert PAUSED_FROM_ANNOTATION not in notes_of(r)


def test_the_watch_recovers_from_410_and_from_a_dropped_connection() -> None:
    with rig() as r, PluginStandIn(r.server), running(r) as operator:
        wait_state(r, "success", 1, operator)
        r.server.wait_for(lambda: r.server.open_watches() == 1, WAIT, "the watch")
        r.server.bookmark()
        r.server.drop_watches()  # resumes from its resourceVersion
        relists = operator.watcher.relists
        r.server.wait_for(lambda: operator.watcher.errors >= 1 and r.server.open_watches() == 1, WAIT, "a re-watch")
        assert operator.watcher.relists == relists  # resumed from its version, no LIST
        r.server.set_labels(NODE, {WORKLOAD_LABEL: "vm-passthrough"})
        wait_state(r, "success", 2, operator)
        assert r.core.serving == dict.fromkeys(GPUS, "vm-passthrough")
        r.server.compact()
        r.server.drop_watches()  # the version it resumes from is gone now: 410, then a LIST
        r.server.wait_for(lambda: operator.watcher.relists > relists, WAIT, "a re-list after 410")
        r.server.set_labels(NODE, {WORKLOAD_LABEL: "container"})
        wait_state(r, "success", 3, operator)
        assert r.core.serving == dict.fromkeys(GPUS, "container")
        watches = [q for q in r.server.requests() if q.query.get("watch")]
        assert all(q.query["fieldSelector"] == [f"metadata.name={NODE}"] for q in watches)
        assert all(q.query["allowWatchBookmarks"][0].lower() == "true" and q.query["timeoutSeconds"] for q in watches)
        resumed = [q.query["resourceVersion"][0] for q in watches]
        assert len(resumed) >= 4 and len(set(resumed)) == len(resumed)  # each from a newer version, never from ""
        reads = {(q.path, str(q.query)) for q in r.server.requests() if q.method == "GET" and not q.query.get("watch")}
        assert reads == {
            (f"/api/v1/nodes/{NODE}", "{}"),
            ("/api/v1/nodes", str({"fieldSelector": [f"metadata.name={NODE}"]})),
        }


def test_a_feature_label_outside_the_core_prefixes_is_never_written() -> None:
    with rig() as r:
        r.core.extra_labels = {"nvidia.com/gpu.product": "A10", "kubernetes.io/arch": "evil"}
        with PluginStandIn(r.server), running(r, default_workload="vm-passthrough") as operator:
            wait_state(r, "success", 1, operator)
        assert "nvidia.com/gpu.product" not in labels(r) and "kubernetes.io/arch" not in labels(r)
        assert_only_ours(r)


def test_a_label_value_the_api_server_refuses_is_reported_and_retried() -> None:
    with rig() as r:
        r.core.extra_labels = {FEATURE_PREFIX + "product": "not a label value!"}
        with PluginStandIn(r.server), running(r, default_workload="vm-passthrough") as operator:
            r.server.wait_for(lambda: operator.passes >= 1, WAIT, "a pass")
            assert operator.last is not None and operator.last.retry
            assert "422" in operator.last.messages[0]


def test_node_api_patch_deletes_with_null_and_names_the_node_on_errors() -> None:
    with FakeApiServer() as server:
        server.add_node(NODE, labels={"a": "1", "b": "2"})
        api = NodeApi.for_node(NODE, host=server.url)
        answer = api.patch_metadata({"a": None, "c": "3"})
        assert answer["metadata"]["labels"] == {"b": "2", "c": "3"}
        stale = "1"
        with pytest.raises(KubeError, match=f"Node {NODE}: HTTP 409"):
            api.patch_metadata({"c": "4"}, expect_version=stale)
        server.fail_next(1, 403, "Forbidden")
        with pytest.raises(KubeError, match=f"read Node {NODE}: HTTP 403"):
            api.get()
        with pytest.raises(KubeError, match="no node name"):
            NodeApi.for_node("", host=server.url)
        api.close()


def test_pod_resources_allocations_reads_the_prefix_only() -> None:
    pods = [
        Pod("vms", "vm-a", [Container("compute", [(RESOURCE, [GPUS[0]]), ("devices.kubevirt.io/kvm", ["kvm0"])])]),
        Pod("vms", "vm-b", [Container("compute", [("nvidia.com/A10-4Q", ["5b3c7c3e-0000-4000-8000-000000000001"])])]),
    ]
    with short_dir() as directory, fake_kubelet(FakeKubelet(pods), directory / "k.sock"):
        reader = PodResourcesAllocations(directory / "k.sock")
        try:
            held = reader.held()
        finally:
            reader.close()
    assert held == {
        GPUS[0]: [f"vms/vm-a ({RESOURCE})"],
        "5b3c7c3e-0000-4000-8000-000000000001": ["vms/vm-b (nvidia.com/A10-4Q)"],
    }


def test_sigterm_ends_the_operate_command(monkeypatch: pytest.MonkeyPatch) -> None:
    with rig() as r:
        monkeypatch.setattr(operate, "PREPARER_FACTORY", lambda config: r.core)

        def terminate_when_watching() -> None:
            r.server.wait_for(lambda: r.server.open_watches() == 1, WAIT, "the watch")
            wait_state(r, "success")
            os.kill(os.getpid(), signal.SIGTERM)

        killer = threading.Thread(target=terminate_when_watching, daemon=True)
        killer.start()
        previous = signal.getsignal(signal.SIGTERM)
        result = CliRunner().invoke(
            cli,
            ["operate", "--api-server", r.server.url, "--podresources-socket", str(r.socket)],
            env={"NODE_NAME": NODE},
            catch_exceptions=False,
        )
        killer.join(WAIT)
        assert result.exit_code == 0, result.output
        assert signal.getsignal(signal.SIGTERM) == previous
        r.server.wait_for(lambda: r.server.open_watches() == 0, WAIT, "the watch closed")


T4_CONFIG = """\
version: v1
vgpu-configs:
  t4:
    - devices: all
      vgpu-devices: {T4-1Q: 2}
"""


def test_the_wired_core_moves_a_fixture_node_and_reports_it(tmp_path: Path) -> None:
    """The loop with the real core (node_agent.preparer) over the mdev T4 tree and the simulated kernel: each
    relabel moves the GPUs, and the Node, the readiness file and the validator's files say so."""
    sim = build_node(mdev_node(), tmp_path / "root")
    (tmp_path / "vgpu.yaml").write_text(T4_CONFIG)
    (tmp_path / "workloads.yaml").write_text("version: v1\ngpus: []\n")
    state_dir, validations = tmp_path / "state", tmp_path / "validations"
    config = PreparerConfig(
        sim.root, state_dir, tmp_path / "vgpu.yaml", tmp_path / "workloads.yaml", "nvidia-smi", sim, validations
    )
    core = WorkloadPreparer(config)
    t4s = ("0000:3b:00.0", "0000:af:00.0")
    with rig(labels={WORKLOAD_LABEL: "vm-passthrough"}) as r:
        r.server.set_allocatable(NODE, {"cpu": "8"})
        api = NodeApi.for_node(NODE, host=r.server.url)
        allocations = PodResourcesAllocations(r.socket)
        operator = Operator(api, core, allocations, OperateOptions(pause_timeout=WAIT, retry_period=0.2))
        thread = threading.Thread(target=operator.run, daemon=True)
        thread.start()
        try:
            wait_state(r, "success")
            assert [driver_of(sim, a) for a in t4s] == ["vfio-pci", "vfio-pci"]
            assert labels(r)["nvidia.com/gpu.count"] == "2"
            assert (state_dir / "ready").exists()
            assert (validations / "vfio-pci-ready").exists()
            assert (validations / "workload-type").read_text().strip() == "vm-passthrough"

            mark = len(r.server.requests())
            r.server.set_labels(NODE, {WORKLOAD_LABEL: "vm-vgpu", VGPU_CONFIG_LABEL: "t4"})
            r.server.wait_for(lambda: labels(r).get(VGPU_STATE_LABEL) == "success", WAIT, f"{VGPU_STATE_LABEL}=success")
            assert [driver_of(sim, a) for a in t4s] == ["nvidia", "nvidia"]
            assert [len(list((sim.root / "sys/bus/pci/devices" / a).glob("*-*-*-*-*"))) for a in t4s] == [2, 2]
            assert {k: v for k, v in labels(r).items() if k.startswith("nvidia.com/vgpu.type.")} == {
                "nvidia.com/vgpu.type.T4-1Q": "4"
            }
            states = [s.get(WORKLOAD_STATE_LABEL) for s, _ in step_patches(r, mark) if WORKLOAD_STATE_LABEL in s]
            assert states == ["pending", "success"]
            assert not (validations / "vfio-pci-ready").exists()
            assert (validations / "vgpu-devices-ready").exists()

            r.server.set_labels(NODE, {WORKLOAD_LABEL: "vm-vgpu", VGPU_CONFIG_LABEL: "missing"})
            wait_state(r, "refused")
            assert "missing" in notes_of(r)[MESSAGE_ANNOTATION]
            assert [driver_of(sim, a) for a in t4s] == ["nvidia", "nvidia"]  # nothing touched
            assert (state_dir / "ready").exists()  # still serving what it served
        finally:
            operator.stop()
            thread.join(WAIT)
            allocations.close()
            api.close()
    assert not thread.is_alive()


def driver_of(sim: Any, address: str) -> str | None:
    link = sim.root / "sys" / "bus" / "pci" / "devices" / address / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def test_a_watch_event_over_the_bound_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("node_agent.kube.MAX_EVENT_BYTES", 2048)
    with FakeApiServer() as server:
        server.add_node(NODE)
        api = NodeApi.for_node(NODE, host=server.url)
        _, since = api.list()
        seen: list[str] = []
        server.set_annotations(NODE, {"example.com/big": "x" * 4096})
        with pytest.raises(KubeError, match=r"an event from .* is over 2048 bytes"):
            api.watch(since, lambda kind, obj: seen.append(kind), seconds=30)
        assert seen == []
        api.close()


def test_a_core_that_cannot_make_its_labels_still_reports_and_lifts_the_pause() -> None:
    with rig() as r:

        def broken(workloads: Mapping[str, str]) -> dict[str, str]:
            raise RuntimeError("no pci.ids")

        r.core.labels = broken  # type: ignore[method-assign]
        with PluginStandIn(r.server), running(r, default_workload="vm-passthrough") as operator:
            wait_state(r, "success", 1, operator)
        assert labels(r)[PLUGIN_DEPLOY_LABEL] == "true"
        assert PAUSED_FROM_ANNOTATION not in notes_of(r)


def test_a_stop_during_an_apply_lets_it_finish_and_report_before_the_loop_ends() -> None:
    with rig() as r:
        entered, release = threading.Event(), threading.Event()
        original = r.core.apply

        def slow_apply(plan: Any) -> FakeOutcome:
            entered.set()
            assert release.wait(WAIT)
            return original(plan)

        r.core.apply = slow_apply  # type: ignore[method-assign]
        with PluginStandIn(r.server), running(r, default_workload="vm-passthrough") as operator:
            assert entered.wait(WAIT)
            operator.stop()  # mid-apply: the loop ends only after the apply and its report
            release.set()
        assert r.core.writes == [dict.fromkeys(GPUS, "vm-passthrough")]
        assert labels(r)[WORKLOAD_STATE_LABEL] == "success" and labels(r)[PLUGIN_DEPLOY_LABEL] == "true"
        assert PAUSED_FROM_ANNOTATION not in notes_of(r)
