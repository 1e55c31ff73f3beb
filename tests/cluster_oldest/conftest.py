"""The DRA suite on Kubernetes 1.34, the oldest release ``deploy/dra`` and ``serve --dra`` claim to support.

It runs after tests/cluster (which brings its 1.36 cluster down at its end) on the same node paths: one cluster
at a time. A missing piece fails under ``CI=true`` and skips elsewhere, as in tests/cluster; a 1.36 cluster still
up (``KGP_CLUSTER_KEEP=1`` or brought up by hand) fails the suite naming it, since this one needs the node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.conftest import NODE01_FOR_VMS
from tests.cluster.support import Cluster, cluster_session, fixture_tree, remove_dev_vfio

RELEASE = "kube134"


@pytest.fixture(scope="package")
def cluster134() -> Iterator[Cluster]:
    yield from cluster_session(RELEASE)


@pytest.fixture(scope="package")
def node01_tree134(cluster134: Cluster) -> Iterator[Path]:
    root, made = fixture_tree(NODE01_FOR_VMS)
    yield root
    remove_dev_vfio(made)
