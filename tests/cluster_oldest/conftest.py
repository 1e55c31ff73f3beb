"""The DRA suite on Kubernetes 1.34, the oldest release ``deploy/dra`` and ``serve --dra`` claim to support.

It runs after tests/cluster (which brings its 1.36 cluster down at its end) on the same node paths: one cluster
at a time. A missing piece fails under ``CI=true`` and skips elsewhere, as in tests/cluster; a 1.36 cluster still
up (``KGP_CLUSTER_KEEP=1`` or brought up by hand) fails the suite naming it, since this one needs the node.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import images, kit
from tests.cluster.conftest import NODE01_FOR_VMS
from tests.cluster.support import Cluster, fixture_tree, remove_dev_vfio
from tests.libvirt_support import missing

RELEASE = "kube134"


@pytest.fixture(scope="package")
def cluster134() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        missing("the real cluster runs as root (kubelet, containerd, runc)", "cluster piece missing")
    try:
        peers = kit.build_peers(("kube", "etcd", "containerd", "buildkit", "kubevirt", RELEASE))
    except kit.ClusterError as exc:
        missing(f"the peers cannot be built: {exc}", "cluster piece missing")
        raise  # unreachable
    was_up = kit.pid_of("kube-apiserver") is not None
    if was_up and kit.running_release() != RELEASE:
        pytest.fail(
            f"a Kubernetes {kit.RELEASES[kit.running_release()]} cluster is up; the 1.34 suite needs the node "
            "(scripts/cluster.sh down, or run tests/cluster without KGP_CLUSTER_KEEP=1)"
        )
    try:
        kit.up(peers, release=RELEASE)
        images.build_project_image(peers)
    except BaseException:
        if not was_up:
            kit.down()
        raise
    yield Cluster(peers)
    if not was_up and os.environ.get("KGP_CLUSTER_KEEP") != "1":
        problems = kit.down()
        assert not problems, f"scripts/cluster.sh down left: {problems}"


@pytest.fixture(scope="package")
def node01_tree134(cluster134: Cluster) -> Iterator[Path]:
    root, made = fixture_tree(NODE01_FOR_VMS)
    yield root
    remove_dev_vfio(made)
