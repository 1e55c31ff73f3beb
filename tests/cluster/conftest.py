"""Session fixtures of the real-cluster suite: the cluster (up once), the project's image built into it, the
fixture host tree node01 and the stand-in ``/dev/vfio`` nodes.

A missing piece (not root, the peers cannot be built: no Go, no module proxy) fails under ``CI=true`` and skips
elsewhere, naming it. A cluster that was built but does not come up, or leaves something behind at ``down``,
always fails. A cluster that was already up when the session started (``scripts/cluster.sh up`` by hand) is
used and left up; otherwise the session brings it down at the end and checks that nothing is left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from simkit.fixture_nodes import NODE01
from tests.cluster.support import (
    WORKLOAD_LABEL,
    Cluster,
    cluster_session,
    deploy_plugin,
    fixture_tree,
    plugin_serving,
    remove_dev_vfio,
)


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    yield from cluster_session()


NODE01_FOR_VMS = dataclasses.replace(
    NODE01, functions=tuple(f for f in NODE01.functions if f.driver != "nvidia" and f.address != "0000:d7:00.0")
)
"""node01 without its T4 (left on ``nvidia`` for containers): a node whose every NVIDIA GPU serves VMs, as the
node agent's ``bind --all`` on a ``vm-passthrough`` node expects. A fixture tree has no kernel behind it, so the
agent could not move the T4 to vfio-pci here; the plugin's view (four TU106) is the same either way."""


@pytest.fixture(scope="package")
def node01_tree(cluster: Cluster) -> Iterator[Path]:
    """node01's sysfs (four TU106 cards on vfio-pci) as a host path the DaemonSets mount, and its groups' nodes."""
    root, made = fixture_tree(NODE01_FOR_VMS)
    yield root
    remove_dev_vfio(made)


@pytest.fixture(scope="package")
def gpu_node(cluster: Cluster, node01_tree: Path) -> Cluster:
    """The plugin deployed against node01's tree, the node labelled ``vm-passthrough``, four GPUs allocatable."""
    deploy_plugin(cluster, node01_tree)
    cluster.label_node(WORKLOAD_LABEL, "vm-passthrough")
    plugin_serving(cluster)
    return cluster
