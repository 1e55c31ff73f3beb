"""Scenario 8: the GPU Operator's node-label protocol on the real cluster (``components/node-label-protocol``).

One node agent (``gpu-node-agent operate``, run with the simulated kernel over a fresh fixture tree: two Tesla
T4 on ``nvidia`` with two time-sliced vGPU types each, ``simkit.agent_nodes.mdev_node``) follows node01's
labels while the real API server, scheduler, DaemonSet controller and kubelet do the rest. The node is
relabelled ``vm-passthrough`` → ``vm-vgpu`` → ``container`` → ``vm-vgpu`` → ``vm-passthrough``; for each step,
from the API server (a watch of the Node, every label change in order) and the kubelet (the Node's
allocatable, which only the kubelet sets from what the device plugin serves):

- the state goes ``pending`` then ``success``, and the plugin is paused in between
  (``nvidia.com/gpu.deploy.sandbox-device-plugin=paused-for-vgpu-change``, then the label as it was);
- the devices the plugin serves after the step are those of the new workload only;
- a change while a pod holds a GPU is refused (the state says so, the tree is not touched, the plugin is not
  paused) and is applied once the pod is gone;
- the agent's token cannot change another Node or a label it does not own (the ValidatingAdmissionPolicy).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import kubernetes.watch
import pytest
import yaml

from simkit.agent_nodes import build_mig_node, build_node, mdev_node
from tests.cluster import kit
from tests.cluster.support import (
    DEPLOY,
    PLUGIN_NAMESPACE,
    PLUGIN_SELECTOR,
    WORKLOAD_LABEL,
    Cluster,
    Doc,
    describe_pods,
    make_dev_vfio,
    point_at_fixture,
    ready_pod,
    remove_dev_vfio,
    wait_until,
)

pytestmark = pytest.mark.cluster

VGPU_CONFIG_LABEL = "nvidia.com/vgpu.config"
VGPU_STATE_LABEL = "nvidia.com/vgpu.config.state"
WORKLOAD_STATE_LABEL = "nvidia.com/gpu.workload.config.state"
PAUSE_LABEL = "nvidia.com/gpu.deploy.sandbox-device-plugin"
PAUSED = "paused-for-vgpu-change"
AGENT_SELECTOR = "app.kubernetes.io/name=gpu-node-agent,app.kubernetes.io/component=node-agent"
PASSTHROUGH_T4 = "nvidia.com/TU104GL_TESLA_T4"
VGPU_T4 = "nvidia.com/GRID_T4-1Q"
T4S = ("0000:3b:00.0", "0000:af:00.0")
T4_GROUPS = ("30", "31")
"""The T4s' IOMMU groups in the fixture: host /dev/vfio stand-ins, for a pod the kubelet gives one."""
TEST_CONFIG = "T4-1Q-x2"
MIG_CONFIG = "mig-a100-h100"
VALIDATIONS = Path("/run/nvidia/validations")
OURS = (VGPU_STATE_LABEL, WORKLOAD_STATE_LABEL, PAUSE_LABEL)


@dataclasses.dataclass
class NodeHistory:
    """Every change of the labels in :data:`OURS` and of node01's ``nvidia.com/`` allocatable, in the order the
    API server's watch delivered them."""

    changes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def snapshot(self) -> int:
        with self.lock:
            return len(self.changes)

    def since(self, mark: int) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.changes[mark:])


def _view(node: Any) -> dict[str, Any]:
    labels = node.metadata.labels or {}
    allocatable = node.status.allocatable or {} if node.status else {}
    return {
        **{key: labels.get(key) for key in (*OURS, WORKLOAD_LABEL, VGPU_CONFIG_LABEL)},
        "allocatable": {k: int(v) for k, v in allocatable.items() if k.startswith("nvidia.com/") and int(v) > 0},
    }


def _watch(history: NodeHistory) -> None:
    """Every change of the Node, in order. Each watch ends after 5 s (so the thread notices ``stop``) and the
    next resumes from the last resourceVersion seen: the API server replays what came in between, so a state
    that lasted less than the gap between two watches is not lost (on a loaded machine that gap is long). A 410
    (that version compacted away) starts over from the current state, the one gap the API allows."""
    kubernetes.config.load_kube_config(config_file=str(kit.STATE / "admin.kubeconfig"))
    api = kubernetes.client.CoreV1Api()
    last: dict[str, Any] | None = None
    version: str | None = None
    while not history.stop.is_set():
        watch = kubernetes.watch.Watch()
        resume = {"resource_version": version} if version else {}
        try:
            for event in watch.stream(
                api.list_node, field_selector=f"metadata.name={kit.NODE}", timeout_seconds=5, **resume
            ):
                node = event["object"]
                version = node.metadata.resource_version or version
                view = _view(node)
                if view != last:
                    with history.lock:
                        history.changes.append(view)
                    last = view
                if history.stop.is_set():
                    break
        except kubernetes.client.ApiException as error:
            if error.status == 410:
                version = None
        except Exception:  # a dropped watch: start another (the history keeps what it saw)
            continue
        finally:
            watch.stop()


@pytest.fixture(scope="module")
def history(cluster: Cluster) -> Iterator[NodeHistory]:
    seen = NodeHistory()
    thread = threading.Thread(target=_watch, args=(seen,), daemon=True)
    thread.start()
    yield seen
    seen.stop.set()
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def t4_tree(cluster: Cluster) -> Iterator[Path]:
    """A fresh tree (the agent moves its GPUs) and host stand-in nodes for the T4s' groups."""
    root = kit.STATE / "fixtures" / "s8-t4"
    shutil.rmtree(root, ignore_errors=True)
    build_node(mdev_node(), root)
    made = make_dev_vfio(T4_GROUPS)
    yield root
    remove_dev_vfio(made)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def protocol(cluster: Cluster, t4_tree: Path, history: NodeHistory) -> Iterator[Cluster]:
    # The earlier scenarios' VMs hold node01's GPUs, whose addresses the T4 tree reuses: the kubelet's
    # PodResources would (rightly) make the agent refuse every move. They go first, with their namespace.
    cluster.kubectl("delete", "namespace", "gpu-vms", "--ignore-not-found", "--wait=true", timeout=240)
    cluster.kubectl("delete", "daemonset", "--all", "-n", PLUGIN_NAMESPACE, "--wait=true")
    wait_until("the old pods gone", lambda: not cluster.pods(PLUGIN_NAMESPACE, "app.kubernetes.io/name"))
    for key in _ours_on(cluster):
        cluster.label_node(key, None)
    cluster.label_node(WORKLOAD_LABEL, "vm-passthrough")
    shutil.rmtree(VALIDATIONS, ignore_errors=True)
    docs = protocol_docs(cluster, t4_tree)
    cluster.apply(docs)
    yield cluster
    cluster.kubectl("delete", "pod", "holder", "-n", "default", "--ignore-not-found", "--wait=true")
    cluster.kubectl("delete", "node", "node02", "--ignore-not-found")
    cluster.kubectl("delete", "daemonset", "--all", "-n", PLUGIN_NAMESPACE, "--wait=true")
    for doc in docs:
        if doc["kind"] in (
            "ClusterRole",
            "ClusterRoleBinding",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ):
            cluster.kubectl("delete", doc["kind"], doc["metadata"]["name"], "--ignore-not-found")
    for key in _ours_on(cluster):
        cluster.label_node(key, None)
    shutil.rmtree(VALIDATIONS, ignore_errors=True)


def _ours_on(cluster: Cluster) -> list[str]:
    """The protocol's labels on node01 now (the states, the pause, the vGPU config, the feature labels)."""
    feature = ("nvidia.com/gpu.product", "nvidia.com/gpu.count", "nvidia.com/vgpu.type.")
    return [
        key
        for key in cluster.node()["metadata"].get("labels", {})
        if key in (*OURS, VGPU_CONFIG_LABEL) or key.startswith(feature)
    ]


def protocol_docs(cluster: Cluster, tree: Path, sim_node: str = "") -> list[Doc]:
    """deploy/ with the component, pointed at the tree: the agent runs with the simulated kernel (which makes the
    group nodes under the tree's /dev/vfio, as the real kernel would under /dev/vfio; ``sim_node``: its
    SIMKIT_NODE), and the ConfigMap gains the configs that fit the fixtures (two GRID T4-1Q per T4; MIG-backed
    vGPUs on the A100 and the H100)."""
    overlay = kit.STATE / "s8-overlay"
    shutil.rmtree(overlay, ignore_errors=True)
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text(  # deploy/ and the component, as a user's overlay lists them
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(DEPLOY, overlay)],
                "components": [os.path.relpath(DEPLOY / "components" / "node-label-protocol", overlay)],
            }
        )
    )
    docs = point_at_fixture(cluster.kustomize(overlay), tree)
    for doc in docs:
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith("gpu-node-agent-vgpu"):
            configs = yaml.safe_load(doc["data"]["config.yaml"])
            configs["vgpu-configs"][TEST_CONFIG] = [{"devices": "all", "vgpu-devices": {"T4-1Q": 2}}]
            configs["vgpu-configs"][MIG_CONFIG] = [
                {"devices": [0], "vgpu-devices": {"A100-1-5C": 2, "A100-2-10C": 1}},
                {"devices": [1], "vgpu-devices": {"H100-1-10C": 2}},
            ]
            doc["data"]["config.yaml"] = yaml.safe_dump(configs)
        if doc["kind"] == "DaemonSet":
            for volume in doc["spec"]["template"]["spec"]["volumes"]:
                host = volume.get("hostPath")
                if host and host["path"] == "/dev/vfio":
                    host["path"] = str(tree / "dev" / "vfio")
            for container in doc["spec"]["template"]["spec"]["containers"]:
                for mount in container.get("volumeMounts", []):
                    if mount["name"] == "host-dev-vfio" and doc["metadata"]["name"] == "gpu-node-agent":
                        mount["readOnly"] = False
        if doc["kind"] == "DaemonSet" and doc["metadata"]["name"] == "gpu-node-agent":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            container["command"] = ["python", "-m", "simkit.sim_agent"]
            container["args"] = ["operate"]
            container["env"].append({"name": "SIMKIT_NODE", "value": sim_node})
    return docs


def _agent(cluster: Cluster) -> Doc:
    return wait_until(
        "the node agent Ready",
        lambda: ready_pod(cluster, PLUGIN_NAMESPACE, AGENT_SELECTOR),
        explain=lambda: describe_pods(cluster, PLUGIN_NAMESPACE),
    )


def _settled(cluster: Cluster, resource: str | None, moved: tuple[NodeHistory, int] | None = None) -> dict[str, Any]:
    """The Node once the agent reports success and (for a VM workload) the kubelet offers ``resource``;
    ``moved``: only after the watch saw the agent start a change since that mark (the state before a relabel
    may already say success)."""

    def done() -> dict[str, Any] | None:
        if moved is not None and not any(c[WORKLOAD_STATE_LABEL] == "pending" for c in moved[0].since(moved[1])):
            return None
        node = cluster.node()
        labels = node["metadata"].get("labels", {})
        allocatable = {
            k: int(v) for k, v in node["status"].get("allocatable", {}).items() if k.startswith("nvidia.com/")
        }
        offered = {k: v for k, v in allocatable.items() if v > 0}
        if labels.get(WORKLOAD_STATE_LABEL) != "success" or labels.get(PAUSE_LABEL) == PAUSED:
            return None
        if resource is None:
            return node if not offered else None
        return node if set(offered) == {resource} else None

    return wait_until(
        f"the node settled with {resource or 'no GPU'} offered",
        done,
        explain=lambda: json.dumps(_view_of(cluster)) + describe_pods(cluster, PLUGIN_NAMESPACE),
    )


def _view_of(cluster: Cluster) -> dict[str, Any]:
    node = cluster.node()
    return {
        "labels": {k: v for k, v in node["metadata"].get("labels", {}).items() if k.startswith("nvidia.com/")},
        "annotations": node["metadata"].get("annotations", {}),
        "allocatable": node["status"].get("allocatable", {}),
    }


def _driver(tree: Path, address: str) -> str | None:
    link = tree / "sys" / "bus" / "pci" / "devices" / address / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def _mdevs(tree: Path, address: str) -> int:
    return len([p for p in (tree / "sys" / "bus" / "pci" / "devices" / address).iterdir() if p.name.count("-") == 4])


def _relabel(cluster: Cluster, workload: str, vgpu_config: str | None = None) -> None:
    args = [
        f"{WORKLOAD_LABEL}={workload}",
        f"{VGPU_CONFIG_LABEL}={vgpu_config}" if vgpu_config else f"{VGPU_CONFIG_LABEL}-",
    ]
    cluster.kubectl("label", "node", kit.NODE, *args, "--overwrite")


def _first(changes: list[dict[str, Any]], what: str, test: Any, after: int = 0) -> int:
    for index in range(after, len(changes)):
        if test(changes[index]):
            return index
    raise AssertionError(f"the Node never showed {what} (from the watch, in order): {json.dumps(changes, indent=1)}")


def test_the_first_start_prepares_the_labelled_workload(protocol: Cluster, t4_tree: Path) -> None:
    cluster = protocol
    _agent(cluster)
    node = _settled(cluster, PASSTHROUGH_T4)
    assert int(node["status"]["allocatable"][PASSTHROUGH_T4]) == 2
    assert [_driver(t4_tree, a) for a in T4S] == ["vfio-pci", "vfio-pci"]
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.count"] == "2"
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"
    assert PAUSE_LABEL not in labels  # absent before the first pause, absent after it
    assert (VALIDATIONS / "vfio-pci-ready").exists()
    assert (VALIDATIONS / "workload-type").read_text() == "vm-passthrough\n"


STEPS = [
    ("vm-vgpu", TEST_CONFIG, VGPU_T4, "nvidia", 2),
    ("container", None, None, "nvidia", 0),
    ("vm-vgpu", TEST_CONFIG, VGPU_T4, "nvidia", 2),
    ("vm-passthrough", None, PASSTHROUGH_T4, "vfio-pci", 0),
]
"""From vm-passthrough (the first start): to vm-vgpu, to container and back; each (workload, vGPU config, the
resource offered after, the T4s' driver, vGPUs per T4)."""


def test_relabelling_moves_the_node_through_every_workload_and_back(
    protocol: Cluster, t4_tree: Path, history: NodeHistory
) -> None:
    _settled(protocol, PASSTHROUGH_T4)
    for step in STEPS:
        _step(protocol, t4_tree, history, *step)


def _step(
    cluster: Cluster,
    t4_tree: Path,
    history: NodeHistory,
    workload: str,
    config: str | None,
    resource: str | None,
    drivers: str,
    vgpus: int,
) -> None:
    """One relabel, asserted from the API server's watch in order and from the tree."""
    before = _serving(cluster)
    mark = history.snapshot()
    _relabel(cluster, workload, config)
    node = _settled(cluster, resource, (history, mark))
    assert [_driver(t4_tree, a) for a in T4S] == [drivers, drivers]
    assert [_mdevs(t4_tree, a) for a in T4S] == [vgpus, vgpus]
    changes = history.since(mark)
    # In order, from the API server: pending with the plugin paused (one patch), the old devices no longer
    # offered by the kubelet, then success with the pause lifted and (for a VM workload) the new devices.
    paused = _first(
        changes, "pending + paused", lambda c: c[WORKLOAD_STATE_LABEL] == "pending" and c[PAUSE_LABEL] == PAUSED
    )
    if before is not None:
        _first(changes, f"{before} withdrawn", lambda c: before not in c["allocatable"], paused)
    done = _first(changes, "success", lambda c: c[WORKLOAD_STATE_LABEL] == "success", paused)
    assert changes[done][PAUSE_LABEL] is None
    assert all(c[PAUSE_LABEL] == PAUSED for c in changes[paused:done])
    if resource is not None:
        assert all(resource not in c["allocatable"] for c in changes[paused:done])
        _first(changes, f"{resource} offered", lambda c: resource in c["allocatable"], done)
    assert changes[-1][VGPU_STATE_LABEL] == ("success" if workload == "vm-vgpu" else None)
    if workload == "container":
        # The DaemonSet no longer selects the node: its pod goes (terminating takes a while on a loaded node).
        wait_until("the device plugin's pods gone", lambda: not cluster.pods(PLUGIN_NAMESPACE, PLUGIN_SELECTOR))
        assert "nvidia.com/gpu.count" not in node["metadata"]["labels"]
    assert (VALIDATIONS / "workload-type").read_text() == f"{workload}\n"


def _serving(cluster: Cluster) -> str | None:
    offered = [
        k
        for k, v in cluster.node()["status"].get("allocatable", {}).items()
        if k.startswith("nvidia.com/") and int(v) > 0
    ]
    return offered[0] if len(offered) == 1 else None


def test_a_change_while_a_pod_holds_a_gpu_is_refused_then_applied_once_it_is_gone(
    protocol: Cluster, t4_tree: Path, history: NodeHistory
) -> None:
    cluster = protocol
    _settled(cluster, PASSTHROUGH_T4)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "holder", "namespace": "default"},
        "spec": {
            "nodeName": kit.NODE,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "holder",
                    "image": "registry.example.com/kubevirt-gpu-passthrough:0.1.0",
                    "command": ["sleep", "3600"],
                    "resources": {"limits": {PASSTHROUGH_T4: "1"}},
                }
            ],
        },
    }
    cluster.apply([pod])
    wait_until(
        "the pod holding a T4 running",
        lambda: cluster.json("get", "pod", "holder", "-n", "default")["status"].get("phase") == "Running",
        explain=lambda: describe_pods(cluster, "default"),
    )
    mark = history.snapshot()
    _relabel(cluster, "vm-vgpu", TEST_CONFIG)
    wait_until(
        "the change refused",
        lambda: cluster.node()["metadata"]["labels"].get(WORKLOAD_STATE_LABEL) == "refused",
        explain=lambda: json.dumps(_view_of(cluster)),
    )
    node = cluster.node()
    message = node["metadata"]["annotations"]["gpu-passthrough.kubevirt.io/workload.config.message"]
    assert "default/holder" in message, message
    assert node["metadata"]["labels"][VGPU_STATE_LABEL] == "failed"  # as vgpu-device-manager reports it
    assert [_driver(t4_tree, a) for a in T4S] == ["vfio-pci", "vfio-pci"]  # nothing touched
    assert all(c[PAUSE_LABEL] is None for c in history.since(mark))  # the plugin was never paused
    assert int(node["status"]["allocatable"][PASSTHROUGH_T4]) == 2

    mark = history.snapshot()
    cluster.kubectl("delete", "pod", "holder", "-n", "default", "--wait=true")
    _settled(cluster, VGPU_T4, (history, mark))
    assert [_mdevs(t4_tree, a) for a in T4S] == [2, 2]
    assert cluster.node()["metadata"]["labels"][VGPU_STATE_LABEL] == "success"
    mark = history.snapshot()
    _relabel(cluster, "vm-passthrough")
    _settled(cluster, PASSTHROUGH_T4, (history, mark))


PATCH_AS_THE_AGENT = """
import json, os, ssl, sys, urllib.error, urllib.request
account = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{account}/token").read()
context = ssl.create_default_context(cafile=f"{account}/ca.crt")
url = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}/api/v1/nodes/{sys.argv[1]}"
body = json.dumps({"metadata": {"labels": {sys.argv[2]: sys.argv[3]}}}).encode()
headers = {"Authorization": "Bearer " + token, "Content-Type": "application/merge-patch+json"}
try:
    answer = urllib.request.urlopen(urllib.request.Request(url, body, headers, method="PATCH"), context=context)
    print(answer.status)
except urllib.error.HTTPError as exc:
    print(exc.code, json.load(exc)["message"])
"""


def test_the_agents_token_changes_only_its_own_nodes_own_labels(protocol: Cluster) -> None:
    """The real API server enforces the ValidatingAdmissionPolicy on the agent's own bound token."""
    cluster = protocol
    agent = _agent(cluster)["metadata"]["name"]
    cluster.apply([{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node02"}}])

    def patch(node: str, key: str, value: str) -> str:
        return cluster.exec(
            PLUGIN_NAMESPACE, agent, "gpu-node-agent", "python", "-c", PATCH_AS_THE_AGENT, node, key, value
        )

    state = cluster.node()["metadata"]["labels"][WORKLOAD_STATE_LABEL]
    assert patch(kit.NODE, WORKLOAD_STATE_LABEL, state).strip() == "200"
    other = patch("node02", WORKLOAD_STATE_LABEL, "success")
    assert other.startswith("403 ") and "only its own Node" in other, other
    foreign = patch(kit.NODE, "example.com/mine", "x")
    assert foreign.startswith("403 ") and "only its own labels" in foreign, foreign
    user = patch(kit.NODE, WORKLOAD_LABEL, "container")
    assert user.startswith("403 "), user
    assert cluster.node()["metadata"]["labels"][WORKLOAD_LABEL] != "container"


@pytest.fixture(scope="module")
def mig_tree(protocol: Cluster) -> Iterator[Path]:
    """The A100/H100/L40S tree (``simkit.agent_nodes.build_mig_node``), the agent and plugin moved onto it."""
    root = kit.STATE / "fixtures" / "s8-mig"
    shutil.rmtree(root, ignore_errors=True)
    build_mig_node(root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_mig_backed_config_on_an_a100_and_an_h100(protocol: Cluster, mig_tree: Path, history: NodeHistory) -> None:
    """vm-vgpu with a MIG-backed config: MIG mode and GPU instances first (the simulated nvidia-smi), then the
    vGPUs on the VFs; the kubelet offers them once the plugin is back."""
    cluster = protocol
    cluster.kubectl("delete", "daemonset", "--all", "-n", PLUGIN_NAMESPACE, "--wait=true")
    wait_until("the T4 pods gone", lambda: not cluster.pods(PLUGIN_NAMESPACE, "app.kubernetes.io/name"))
    mark = history.snapshot()
    _relabel(cluster, "vm-vgpu", MIG_CONFIG)
    cluster.apply(protocol_docs(cluster, mig_tree, "mig"))

    def offered() -> dict[str, int] | None:
        node = cluster.node()
        labels = node["metadata"].get("labels", {})
        if labels.get(VGPU_STATE_LABEL) != "success" or labels.get(PAUSE_LABEL) == PAUSED:
            return None
        found = {
            k: int(v)
            for k, v in node["status"].get("allocatable", {}).items()
            if k.startswith("nvidia.com/") and int(v)
        }
        return found if len(found) == 3 else None

    found = wait_until(
        "the MIG-backed vGPUs offered",
        offered,
        explain=lambda: json.dumps(_view_of(cluster)) + describe_pods(cluster, PLUGIN_NAMESPACE),
    )
    assert sorted((k.rsplit("_", 1)[-1], v) for k, v in found.items()) == [
        ("A100-1-5C", 2),
        ("A100-2-10C", 1),
        ("H100-1-10C", 2),
    ], found
    assert any(c[VGPU_STATE_LABEL] == "pending" for c in history.since(mark))
    labels = cluster.node()["metadata"]["labels"]
    assert labels["nvidia.com/vgpu.type.A100-1-5C"] == "2"
    assert labels["nvidia.com/vgpu.type.H100-1-10C"] == "2"
