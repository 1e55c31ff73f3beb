"""The DRA prepare path on the real node: a claim to its container's start, next to an empty pod's start.

Run: ``python -m bench.dra_prepare --cluster [--rounds N]`` as root. It uses the cluster kit (tests/cluster/kit.py:
the real API server, scheduler, kubelet and containerd built from their modules), bringing it up if it is not
(and down again at the end), with ``deploy/dra`` from the project's image on node01's fixture tree. Each round,
interleaved so that machine load hits both alike:

- **claim**: a pod whose claim comes from the sample template ``tu106-pair`` (two GPUs): the controller makes
  the claim, the scheduler allocates it, the kubelet calls ``NodePrepareResources`` and containerd applies the
  CDI spec; timed from the create to the container running (as the kubelet reports it), then deleted and its
  claim unprepared before the next round;
- **floor**: the same pod with no claim, create to running.

Prints the medians and their ratio and exits 0: a measurement, not a test (no goal is set).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from tests.cluster import images, kit
from tests.cluster.conftest import NODE01_FOR_VMS
from tests.cluster.dra import cdi_specs, delete_pod, deploy_dra, metadata_claims, pod, running
from tests.cluster.support import DEPLOY, Cluster, fixture_tree, remove_dev_vfio, wait_until


def _start(cluster: Cluster, doc: dict[str, object]) -> float:
    name = str(doc["metadata"]["name"])  # type: ignore[index]
    started = time.monotonic()
    cluster.apply([doc])
    running(cluster, name)
    took = time.monotonic() - started
    delete_pod(cluster, name)
    return took


def run(rounds: int) -> int:
    if os.geteuid() != 0:
        print("bench.dra_prepare --cluster runs the cluster kit, which needs root")
        return 2
    was_up = kit.pid_of("kube-apiserver") is not None
    peers = kit.up(kit.build_peers())
    made: list[Path] = []
    try:
        images.build_project_image(peers)
        cluster = Cluster(peers)
        tree, made = fixture_tree(NODE01_FOR_VMS)
        deploy_dra(cluster, tree)
        cluster.kubectl("apply", "-k", str(DEPLOY / "dra" / "example"))
        claimed, empty = [], []
        for index in range(rounds):
            claimed.append(_start(cluster, pod(f"bench-claim-{index}", {"gpus": "tu106-pair"}, template=True)))
            wait_until("the claim unprepared", lambda: not cdi_specs() and not metadata_claims())
            empty.append(_start(cluster, pod(f"bench-empty-{index}", {})))
        load = os.getloadavg()[0]
    finally:
        remove_dev_vfio(made)
        if not was_up:
            kit.down()
    claim_s, floor_s = statistics.median(claimed), statistics.median(empty)
    print(f"the real 1.36 node (kubelet, scheduler, containerd 2), {rounds} rounds, load {load:.1f}")
    print(
        f"pod with a 2-GPU claim, create to running: {claim_s:.2f} s median "
        f"(floor: the same pod without a claim {floor_s:.2f} s, {claim_s / floor_s:.2f}x; "
        f"claims {min(claimed):.2f}-{max(claimed):.2f} s, empty {min(empty):.2f}-{max(empty):.2f} s)"
    )
    return 0
