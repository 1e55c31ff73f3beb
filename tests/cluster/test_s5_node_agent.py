"""Scenario 5: the node agent's DaemonSets placed by the workload label, and the plugin's init container
(``components/wait-for-node-agent``, in the top-level ``deploy/``) waiting for the agent's readiness file,
observed in the pods' status: the agent Ready first, the init container done after, the plugin Ready last.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.support import (
    DEPLOY,
    PLUGIN_NAMESPACE,
    PLUGIN_SELECTOR,
    RTX,
    WORKLOAD_LABEL,
    Cluster,
    describe_pods,
    plugin_serving,
    point_at_fixture,
    ready_pod,
    wait_until,
)

pytestmark = pytest.mark.cluster

AGENT_STATE = Path("/run/kubevirt-gpu-passthrough/node-agent")
PASSTHROUGH = "app.kubernetes.io/component=node-agent-passthrough"
VGPU = "app.kubernetes.io/component=node-agent-vgpu"


def _when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _condition(pod: dict[str, Any], kind: str) -> str:
    (found,) = [c for c in pod["status"]["conditions"] if c["type"] == kind]
    return str(found["lastTransitionTime"])


def _desired(cluster: Cluster, name: str) -> int:
    ds = cluster.json("get", "daemonset", name, "-n", PLUGIN_NAMESPACE)
    return int(ds.get("status", {}).get("desiredNumberScheduled", 0))


@pytest.fixture(scope="module")
def whole_deploy(gpu_node: Cluster, node01_tree: Path) -> Cluster:
    cluster = gpu_node
    cluster.kubectl("delete", "daemonset", "--all", "-n", PLUGIN_NAMESPACE, "--wait=true")
    wait_until("the old plugin pods gone", lambda: not cluster.pods(PLUGIN_NAMESPACE, "app.kubernetes.io/name"))
    for leftover in ("ready", "state.json"):
        (AGENT_STATE / leftover).unlink(missing_ok=True)
    cluster.label_node(WORKLOAD_LABEL, "vm-passthrough")
    cluster.apply(point_at_fixture(cluster.kustomize(DEPLOY), node01_tree))
    return cluster


def test_the_agent_is_placed_by_label_and_the_plugin_waits_for_it(whole_deploy: Cluster) -> None:
    cluster = whole_deploy
    agent = wait_until(
        "the passthrough agent Ready",
        lambda: ready_pod(cluster, PLUGIN_NAMESPACE, PASSTHROUGH),
        explain=lambda: describe_pods(cluster, PLUGIN_NAMESPACE),
    )
    plugin = wait_until(
        "the plugin Ready",
        lambda: ready_pod(cluster, PLUGIN_NAMESPACE, PLUGIN_SELECTOR),
        explain=lambda: describe_pods(cluster, PLUGIN_NAMESPACE),
    )
    assert (AGENT_STATE / "ready").exists()
    assert _desired(cluster, "gpu-node-agent-vgpu") == 0
    assert cluster.pods(PLUGIN_NAMESPACE, VGPU) == []
    (init,) = plugin["status"]["initContainerStatuses"]
    assert init["name"] == "wait-for-node-agent"
    finished = init["state"]["terminated"]
    assert finished["exitCode"] == 0
    agent_ready = _when(_condition(agent, "Ready"))
    # The agent's file comes with its first bind (before the probe says Ready): the init container ends after
    # the agent started, and the plugin is Ready after both.
    assert _when(agent["status"]["startTime"]) <= _when(finished["finishedAt"])
    assert _when(finished["finishedAt"]) <= _when(_condition(plugin, "Ready"))
    assert agent_ready <= _when(_condition(plugin, "Ready"))
    plugin_serving(cluster)
    assert cluster.allocatable(RTX) == 4


def test_the_vgpu_agent_is_placed_only_on_vm_vgpu_nodes(whole_deploy: Cluster) -> None:
    cluster = whole_deploy
    cluster.label_node(WORKLOAD_LABEL, "vm-vgpu")
    try:
        wait_until("the vGPU agent placed", lambda: _desired(cluster, "gpu-node-agent-vgpu") == 1)
        wait_until("the passthrough agent removed", lambda: _desired(cluster, "gpu-node-agent-passthrough") == 0)
        pods = wait_until("a vGPU agent pod", lambda: cluster.pods(PLUGIN_NAMESPACE, VGPU) or None)
        assert pods[0]["spec"]["nodeName"] == "node01"
    finally:
        cluster.label_node(WORKLOAD_LABEL, "vm-passthrough")
