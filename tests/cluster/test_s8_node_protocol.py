"""Scenario 8: the GPU Operator's node-label protocol on the real cluster (``components/node-label-protocol``).

One node agent (``gpu-node-agent operate``, run with the simulated kernel over a fresh copy of the vGPU node's
fixture tree: two Tesla T4 on ``nvidia`` with three vGPUs) follows node01's labels while the real API server,
scheduler, DaemonSet controller and kubelet do the rest. The node is relabelled ``vm-passthrough`` →
``vm-vgpu`` → ``container`` → ``vm-vgpu`` → ``vm-passthrough``; for each step, from the API server (a watch of
the Node, every label change in order) and the kubelet (the Node's allocatable, which only the kubelet sets
from what the device plugin serves):

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

from simkit.fixture_nodes import VGPU_NODE
from tests.cluster import kit
from tests.cluster.support import (
    DEPLOY,
    PLUGIN_NAMESPACE,
    PLUGIN_SELECTOR,
    WORKLOAD_LABEL,
    Cluster,
    Doc,
    describe_pods,
    fixture_tree,
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
VGPU_T4 = "nvidia.com/GRID_T4-1B"
T4_GROUPS = ("30", "118")
"""The T4s' IOMMU groups in the fixture (``0000:3b:00.0``, ``0000:d8:00.0``): their /dev/vfio stand-ins."""
TEST_CONFIG = "T4-1B-x2"
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
    kubernetes.config.load_kube_config(config_file=str(kit.STATE / "admin.kubeconfig"))
    api = kubernetes.client.CoreV1Api()
    last: dict[str, Any] | None = None
    while not history.stop.is_set():
        watch = kubernetes.watch.Watch()
        try:
            for event in watch.stream(api.list_node, field_selector=f"metadata.name={kit.NODE}", timeout_seconds=5):
                view = _view(event["object"])
                if view != last:
                    with history.lock:
                        history.changes.append(view)
                    last = view
                if history.stop.is_set():
                    break
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
    """A fresh copy of the vGPU node's tree (the agent moves its GPUs) and stand-in nodes for the T4s' groups."""
    node = dataclasses.replace(VGPU_NODE, name="s8-vgpu")
    shutil.rmtree(kit.STATE / "fixtures" / node.name, ignore_errors=True)
    root, made = fixture_tree(node)
    made += make_dev_vfio(T4_GROUPS)
    yield root
    remove_dev_vfio(made)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def protocol(cluster: Cluster, t4_tree: Path, history: NodeHistory) -> Cluster:
    cluster.kubectl("delete", "daemonset", "--all", "-n", PLUGIN_NAMESPACE, "--wait=true")
    wait_until("the old pods gone", lambda: not cluster.pods(PLUGIN_NAMESPACE, "app.kubernetes.io/name"))
    for key in (*OURS, VGPU_CONFIG_LABEL):
        cluster.label_node(key, None)
    cluster.label_node(WORKLOAD_LABEL, "vm-passthrough")
    cluster.apply(protocol_docs(cluster, t4_tree))
    return cluster


def protocol_docs(cluster: Cluster, tree: Path) -> list[Doc]:
    """deploy/ with the component, pointed at the tree: the agent runs with the simulated kernel (which makes the
    group nodes under the tree's /dev/vfio, as the real kernel would under /dev/vfio), and the ConfigMap gains a
    vGPU config that fits the fixture's T4s (two GRID T4-1B each)."""
    overlay = kit.STATE / "s8-overlay"
    shutil.rmtree(overlay, ignore_errors=True)
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text(
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
            configs["vgpu-configs"][TEST_CONFIG] = [{"devices": "all", "vgpu-devices": {"T4-1B": 2}}]
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
    return docs


def _agent(cluster: Cluster) -> Doc:
    return wait_until(
        "the node agent Ready",
        lambda: ready_pod(cluster, PLUGIN_NAMESPACE, AGENT_SELECTOR),
        explain=lambda: describe_pods(cluster, PLUGIN_NAMESPACE),
    )


def _settled(cluster: Cluster, resource: str | None) -> dict[str, Any]:
    """The Node once the agent reports success and (for a VM workload) the kubelet offers ``resource``."""

    def done() -> dict[str, Any] | None:
        node = cluster.node()
        labels = node["metadata"].get("labels", {})
        allocatable = {k: int(v) for k, v in node["status"].get("allocatable", {}).items() if k.startswith("nvidia.com/")}
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
