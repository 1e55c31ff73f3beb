"""Scenario 2: the device plugin DaemonSet placed by the real DaemonSet controller only on a node labelled
``vm-passthrough``/``vm-vgpu``, running from the project's image in containerd against node01's fixture tree,
registered with the real kubelet, its four GPUs in the Node's ``status.allocatable``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import images
from tests.cluster.support import (
    PLUGIN_NAMESPACE,
    PLUGIN_SELECTOR,
    RTX,
    WORKLOAD_LABEL,
    Cluster,
    deploy_plugin,
    plugin_serving,
    wait_until,
)

pytestmark = pytest.mark.cluster


def _daemonset(cluster: Cluster) -> dict[str, Any]:
    status: dict[str, Any] = cluster.json("get", "daemonset", "gpu-device-plugin", "-n", PLUGIN_NAMESPACE)
    return status


def test_the_image_was_built_from_the_dockerfile_by_buildkit(cluster: Cluster) -> None:
    config = images.image_config(cluster.peers, images.PROJECT_IMAGE)
    assert config["config"]["User"] == "10001:10001"
    assert (
        "PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in (config["config"]["Env"])
    )
    assert config["config"]["Labels"]["org.opencontainers.image.title"] == "kubevirt-gpu-passthrough"


def test_not_placed_on_a_node_for_containers(cluster: Cluster, node01_tree: Path) -> None:
    cluster.label_node(WORKLOAD_LABEL, "container")
    deploy_plugin(cluster, node01_tree)
    wait_until(
        "the DaemonSet controller to see the DaemonSet",
        lambda: _daemonset(cluster).get("status", {}).get("observedGeneration") is not None,
    )
    # The controller would create the pod at once on a matching node; give it a few status rounds.
    time.sleep(6)
    status = _daemonset(cluster)["status"]
    assert status["desiredNumberScheduled"] == 0
    assert cluster.pods(PLUGIN_NAMESPACE, PLUGIN_SELECTOR) == []
    assert cluster.allocatable(RTX) == 0


@pytest.mark.parametrize("workload", ["vm-vgpu", "vm-passthrough"])
def test_placed_on_a_vm_node_and_registered_with_the_kubelet(
    cluster: Cluster, node01_tree: Path, workload: str
) -> None:
    deploy_plugin(cluster, node01_tree)
    cluster.label_node(WORKLOAD_LABEL, workload)
    pod = plugin_serving(cluster)
    spec = pod["spec"]
    assert spec["nodeName"] == "node01"
    (container,) = spec["containers"]
    assert container["image"] == images.PROJECT_IMAGE
    statuses = pod["status"]["containerStatuses"]
    assert statuses[0]["ready"] is True
    assert statuses[0]["imageID"].startswith("sha256:") or "@sha256:" in statuses[0]["imageID"]
    node = cluster.node()
    assert node["status"]["capacity"][RTX] == "4"
    assert node["status"]["allocatable"][RTX] == "4"
