"""``deploy/dra`` and ``serve --dra`` on Kubernetes 1.34.10, the oldest release they claim (docs/dra.md, "Versions").

The same path as tests/cluster/test_s6_dra.py, judged by 1.34's API server, scheduler and kubelet: the manifests
apply with strict validation, the plugin registers (the 1.34 kubelet speaks ``v1.DRAPlugin``), its slices are
stored as sent, the sample template is allocated as its CEL means, the container gets the CDI devices and the
metadata file, and deleting the pod unprepares it. What differs from 1.36 is asserted too: 1.34 has no device
health in pod status (``ResourceHealthStatus`` is alpha and off), so the kubelet opens no health stream.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from schemas.dra import DRIVER_NAME
from tests.cluster import kit
from tests.cluster.dra import (
    TU106_NUMA1,
    VMS,
    allocation,
    cdi_specs,
    claim_of,
    delete_pod,
    deploy_dra,
    kubelet_claims,
    kubevirt_vm_pod,
    metadata_claims,
    plugin_checkpoint,
    plugin_events,
    plugin_log,
    published,
    published_devices,
    running,
    slices_are,
)
from tests.cluster.support import DEPLOY, Cluster, wait_until

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def dra134(cluster134: Cluster, node01_tree134: Path) -> Cluster:
    version = cluster134.json("version")
    assert (version["serverVersion"]["major"], version["serverVersion"]["minor"]) == ("1", "34"), version
    deploy_dra(cluster134, node01_tree134)
    cluster134.kubectl("apply", "-k", str(DEPLOY / "dra" / "example"))
    return cluster134


def test_the_1_34_kubelet_registers_the_plugin_and_its_slices_are_stored_as_sent(
    dra134: Cluster, node01_tree134: Path
) -> None:
    cluster = dra134
    node = cluster.node()
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.34.10"
    wait_until(
        "node01's slices stored as sent",
        lambda: slices_are(cluster, node01_tree134),
        deadline=120,
        explain=lambda: f"stored: {published(cluster)}" + plugin_log(cluster),
    )
    assert plugin_events(cluster, "dra_registered"), plugin_log(cluster)
    assert len(published_devices(cluster)) == 4


def test_the_1_34_scheduler_and_kubelet_give_the_example_vms_claims_their_devices(dra134: Cluster) -> None:
    cluster = dra134
    # The example VM's claims as KubeVirt renders its pod, created as virt-controller creates it: server-side
    # apply refuses it (the API's apply schema keys a container's resources.claims by name alone, and KubeVirt
    # lists one entry per request of a claim).
    cluster.kubectl("create", "-f", "-", stdin=yaml.safe_dump(kubevirt_vm_pod(cluster, "sample")))
    try:
        doc = running(cluster, "sample")
        name = claim_of(cluster, doc, "gpus")
        assert {r["device"] for r in allocation(cluster, name)} == TU106_NUMA1
        uid = cluster.json("get", "resourceclaim", "-n", VMS, name)["metadata"]["uid"]
        assert sorted(cluster.exec(VMS, "sample", "compute", "ls", "/dev/vfio").split()) == ["74", "96", "vfio"]
        files = cluster.exec(
            VMS, "sample", "compute", "find", "/var/run/kubernetes.io/dra-device-attributes", "-type", "f"
        ).split()
        assert sorted(files) == [
            f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/{r}/{DRIVER_NAME}-metadata.json"
            for r in ("gpu0", "gpu1")
        ]
        devices = kubelet_claims()[uid]["DriverState"][DRIVER_NAME]["Devices"]
        assert sorted(d["DeviceName"] for d in devices) == sorted(TU106_NUMA1)
        assert set(plugin_checkpoint()) == {uid}
        # 1.34: no health stream (ResourceHealthStatus is off), so no pod status field for it either.
        statuses = doc["status"]["containerStatuses"][0]
        assert "allocatedResourcesStatus" not in statuses
    finally:
        delete_pod(cluster, "sample")
    wait_until("the claim's files removed", lambda: not cdi_specs() and not metadata_claims())
    assert uid not in kubelet_claims()
    assert kit.running_release() == "kube134"


def test_the_1_34_api_server_drops_the_taint_and_keeps_healthy_false(dra134: Cluster) -> None:
    """1.34's API server has device taints off (``DRADeviceTaints`` alpha): it stores the slice without the taint
    the plugin sends for an unhealthy GPU, and ``healthy: false`` still keeps the DeviceClasses from giving it."""
    cluster = dra134
    node = Path("/dev/vfio/74")
    node.unlink()
    try:

        def unhealthy() -> dict[str, object] | None:
            device = published_devices(cluster).get("pci-0000-86-00-0")
            return device if device and device["attributes"]["healthy"]["bool"] is False else None

        device = wait_until(
            "pci-0000-86-00-0 healthy: false in its slice", unhealthy, deadline=120, explain=lambda: plugin_log(cluster)
        )
        assert "taints" not in device, device
    finally:
        if not node.exists():
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    wait_until(
        "pci-0000-86-00-0 healthy again",
        lambda: published_devices(cluster)["pci-0000-86-00-0"]["attributes"]["healthy"]["bool"] is True,
        deadline=120,
        explain=lambda: plugin_log(cluster),
    )
