"""Scenario 6: DRA for real (issue 25). ``deploy/dra`` on the real 1.36 node, from the project's image.

- the plugin registers with the kubelet's plugin manager and publishes ResourceSlices the API server stores as
  sent (no field dropped), for node01's tree and for the vGPU and SR-IOV vGPU trees;
- the sample ResourceClaimTemplate is allocated by the scheduler with the project's DeviceClass and request CEL:
  exactly the devices the selectors mean;
- the kubelet prepares through the plugin; containerd applies the CDI specs: the container has the stand-in
  ``/dev/vfio`` nodes and the KEP-5304 metadata file where virt-launcher reads it, which the hook's reader
  (``xmlgen render --dra-metadata-root``, in that container) turns into the allocated PCI addresses;
- one CDI ID given for two devices of one request reaches runc once;
- deleting the pod unprepares and removes every file; a kubelet restart with a running pod prepares it at most
  once more, with identical devices and files; a plugin killed while pods are being prepared leaves nothing
  half-written; slices follow a device made unhealthy, removed and given back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import pytest
import yaml

from schemas.dra import DRIVER_NAME
from simkit.fixture_nodes import SRIOV_VGPU_NODE, VGPU_NODE
from simkit.sysfs_fixture import Node
from tests.cluster import kit
from tests.cluster.dra import (
    DRA_LABEL,
    TU106_NUMA1,
    VMS,
    allocation,
    cdi_specs,
    claim,
    claim_of,
    delete_pod,
    deploy_dra,
    files_match_checkpoint,
    kubelet_claims,
    kubevirt_vm_pod,
    metadata_claims,
    oci_spec,
    plugin_checkpoint,
    plugin_events,
    plugin_log,
    pod,
    published,
    published_devices,
    request,
    running,
    slices_are,
    vm_json,
)
from tests.cluster.support import (
    DEPLOY,
    Cluster,
    deploy_plugin,
    fixture_tree,
    remove_dev_vfio,
    wait_until,
)

pytestmark = pytest.mark.cluster
SLICE_DEADLINE = 120.0


@pytest.fixture(scope="module")
def dra_node(cluster: Cluster, node01_tree: Path) -> Iterator[Cluster]:
    """``deploy/dra`` on node01's tree (the device plugin leaves the node), then the device plugin back."""
    deploy_dra(cluster, node01_tree)
    cluster.kubectl("apply", "-k", str(DEPLOY / "dra" / "example"))
    yield cluster
    cluster.kubectl("delete", "namespace", VMS, "--ignore-not-found", "--wait=true", timeout=240)
    cluster.kubectl("delete", "daemonset", "-n", "kubevirt-gpu-passthrough", "gpu-dra-plugin", "--ignore-not-found")
    cluster.label_node(DRA_LABEL, None)
    deploy_plugin(cluster, node01_tree)


def test_slices_are_stored_as_the_plugin_sent_them(dra_node: Cluster, node01_tree: Path) -> None:
    cluster = dra_node
    wait_until(
        "node01's slices in the API server as `xmlgen discover --dra-slices` says",
        lambda: slices_are(cluster, node01_tree),
        deadline=SLICE_DEADLINE,
        explain=lambda: f"stored: {published(cluster)}" + plugin_log(cluster),
    )
    assert set(published_devices(cluster)) == {
        "pci-0000-3b-00-0",
        "pci-0000-5e-00-0",
        "pci-0000-86-00-0",
        "pci-0000-af-00-0",
    }
    assert plugin_events(cluster, "dra_registered"), plugin_log(cluster)
    # Each slice is the node's (it goes with the Node object).
    for s in published(cluster):
        (owner,) = s["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("Node", kit.NODE)


def test_the_example_vms_claims_get_what_their_selectors_mean_and_the_container_its_devices(dra_node: Cluster) -> None:
    cluster = dra_node
    # The example VM's claims as KubeVirt renders its pod, created as virt-controller creates it: server-side
    # apply refuses it (the API's apply schema keys a container's resources.claims by name alone, and KubeVirt
    # lists one entry per request of a claim).
    cluster.kubectl("create", "-f", "-", stdin=yaml.safe_dump(kubevirt_vm_pod(cluster, "sample")))
    try:
        doc = running(cluster, "sample")
        name = claim_of(cluster, doc, "gpus")
        results = allocation(cluster, name)
        # The scheduler's CEL (class and request selectors) and the matchAttribute constraint, not ours.
        assert {r["device"] for r in results} == TU106_NUMA1, results
        assert {r["request"] for r in results} == {"gpu0", "gpu1"}
        assert {(r["driver"], r["pool"]) for r in results} == {(DRIVER_NAME, kit.NODE)}
        uid = cluster.json("get", "resourceclaim", "-n", VMS, name)["metadata"]["uid"]

        # containerd applied the CDI spec: /dev/vfio/vfio and the two GPUs' groups (74, 96), nothing else.
        listing = cluster.exec(VMS, "sample", "compute", "ls", "/dev/vfio").split()
        assert sorted(listing) == ["74", "96", "vfio"]
        # The metadata files where virt-launcher reads them, turned into PCI addresses by the hook's reader.
        rendered = cluster.kubectl(
            "exec",
            "-i",
            "-n",
            VMS,
            "sample",
            "-c",
            "compute",
            "--",
            "xmlgen",
            "render",
            "--vmi",
            "-",
            "--pci-mmio64",
            "off",
            stdin=vm_json(),
        ).stdout
        # Each gpus[] entry gets its request's device (the allocation's, not a guess).
        hostdevs = ElementTree.fromstring(rendered).findall("hostdev")
        seen = {h.find("alias").get("name"): h.find("source/address").get("bus") for h in hostdevs}  # type: ignore[union-attr]
        wanted = {f"ua-{r['request']}": "0x" + r["device"].split("-")[2] for r in results}
        assert seen == wanted, rendered

        # What runc got: each node and each metadata mount once.
        spec = oci_spec(cluster, doc)
        paths = [d["path"] for d in spec["linux"]["devices"]]
        assert sorted(paths) == ["/dev/vfio/74", "/dev/vfio/96", "/dev/vfio/vfio"]
        mounts = [m["destination"] for m in spec["mounts"] if "dra-device-attributes" in m["destination"]]
        assert len(mounts) == len(set(mounts)) == 2, mounts
        assert all(m["options"][:1] == ["ro"] for m in spec["mounts"] if m["destination"] in mounts)

        # The kubelet's record: the two devices, one CDI ID each.
        entry = kubelet_claims()[uid]
        devices = entry["DriverState"][DRIVER_NAME]["Devices"]
        assert sorted(d["DeviceName"] for d in devices) == sorted(TU106_NUMA1)
        assert all(len(d["CDIDeviceIDs"]) == 1 for d in devices)
        assert set(plugin_checkpoint()) == {uid}
    finally:
        delete_pod(cluster, "sample")

    # Unprepared: the template's claim is gone with the pod, and every file of it.
    wait_until("the claim's files removed", lambda: uid not in metadata_claims() and not cdi_specs())
    assert uid not in plugin_checkpoint()
    assert uid not in kubelet_claims()
    assert files_match_checkpoint() == []


def test_one_cdi_id_for_two_devices_reaches_runc_once(dra_node: Cluster) -> None:
    cluster = dra_node
    cluster.apply([claim("pair", [request("gpus", count=2)]), pod("pair", {"gpus": "pair"})])
    try:
        doc = running(cluster, "pair")
        results = allocation(cluster, "pair")
        assert len({r["device"] for r in results}) == 2
        uid = cluster.json("get", "resourceclaim", "-n", VMS, "pair")["metadata"]["uid"]
        devices = kubelet_claims()[uid]["DriverState"][DRIVER_NAME]["Devices"]
        ids = {i for d in devices for i in d["CDIDeviceIDs"]}
        assert len(devices) == 2 and len(ids) == 1, devices  # the same CDI device for both
        spec = oci_spec(cluster, doc)
        paths = [d["path"] for d in spec["linux"]["devices"]]
        assert len(paths) == len(set(paths)) == 3, paths  # vfio and the two groups, each once
        mounts = [m["destination"] for m in spec["mounts"] if "dra-device-attributes" in m["destination"]]
        assert mounts == [
            f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/pair/gpus/{DRIVER_NAME}-metadata.json"
        ]
    finally:
        delete_pod(cluster, "pair")
        cluster.kubectl("delete", "resourceclaim", "-n", VMS, "pair", "--ignore-not-found")
    wait_until("the pair's files removed", lambda: not cdi_specs() and not metadata_claims())


def test_a_kubelet_restart_keeps_a_running_pods_devices(dra_node: Cluster) -> None:
    cluster = dra_node
    cluster.apply([pod("steady", {"gpus": "tu106-pair"}, template=True)])
    try:
        before_pod = running(cluster, "steady")
        uid = cluster.json("get", "resourceclaim", "-n", VMS, claim_of(cluster, before_pod, "gpus"))["metadata"]["uid"]
        specs, kubelet_state, checkpoint = cdi_specs(), kubelet_claims()[uid], plugin_checkpoint()[uid]
        prepares = len([e for e in plugin_events(cluster, "dra_prepared") if uid in e["claim"]])
        kit.restart("kubelet", cluster.peers)
        kit.wait_for(f"node {kit.NODE} Ready", lambda: kit._node_ready(cluster.peers), component="kubelet")
        # The kubelet deletes the node's slices when it starts; the plugin, registered again, publishes them again.
        wait_until(
            "the slices back after the kubelet restart",
            lambda: bool(published_devices(cluster)),
            deadline=SLICE_DEADLINE,
            explain=lambda: plugin_log(cluster),
        )
        after_pod = running(cluster, "steady")
        assert after_pod["status"]["containerStatuses"][0]["restartCount"] == 0
        assert (
            after_pod["status"]["containerStatuses"][0]["containerID"]
            == (before_pod["status"]["containerStatuses"][0]["containerID"])
        )
        again = len([e for e in plugin_events(cluster, "dra_prepared") if uid in e["claim"]])
        assert again - prepares <= 1, "prepared more than once more after the kubelet restart"
        assert kubelet_claims()[uid] == kubelet_state  # no device appended again
        assert plugin_checkpoint()[uid] == checkpoint
        assert cdi_specs() == specs
    finally:
        delete_pod(cluster, "steady")
    wait_until("steady's files removed", lambda: not cdi_specs() and not metadata_claims())


def _plugin_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"serve" in argv and b"--dra" in argv and any(a.endswith(b"gpu-device-plugin") for a in argv):
                    pids.append(int(entry.name))
    return pids


def test_a_plugin_killed_while_preparing_leaves_nothing_half_written(dra_node: Cluster, node01_tree: Path) -> None:
    """SIGKILL the plugin as pods are created, three times; each time, once it is back, its files are exactly its
    checkpoint's and every pod runs with the devices the scheduler gave it."""
    cluster = dra_node
    names = [f"kill{n}" for n in range(3)]
    try:
        for index, name in enumerate(names):
            cluster.apply([claim(name, [request("gpu")]), pod(name, {"gpu": name})])
            time.sleep(
                0.3 * index
            )  # a different moment of the prepare each round; what is asserted does not depend on it
            for pid in _plugin_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            doc = running(cluster, name)
            assert files_match_checkpoint() == [], plugin_log(cluster)
            results = allocation(cluster, name)
            assert len(results) == 1
            group_of = {
                "pci-0000-3b-00-0": "30",
                "pci-0000-5e-00-0": "50",
                "pci-0000-86-00-0": "74",
                "pci-0000-af-00-0": "96",
            }
            listing = cluster.exec(VMS, name, "compute", "ls", "/dev/vfio").split()
            assert sorted(listing) == sorted(["vfio", group_of[results[0]["device"]]])
            assert doc["metadata"]["name"] == name
    finally:
        for name in names:
            delete_pod(cluster, name)
            cluster.kubectl("delete", "resourceclaim", "-n", VMS, name, "--ignore-not-found")
    wait_until("the killed round's files removed", lambda: not cdi_specs() and not metadata_claims())
    assert files_match_checkpoint() == []
    assert plugin_checkpoint() == {}


def _device_healthy(cluster: Cluster, name: str) -> bool | None:
    device = published_devices(cluster).get(name)
    if device is None:
        return None
    return bool(device["attributes"]["healthy"]["bool"])


def test_slices_follow_a_device_made_unhealthy_removed_and_given_back(dra_node: Cluster, node01_tree: Path) -> None:
    cluster = dra_node
    wait_until("all four healthy", lambda: all(_device_healthy(cluster, d) for d in TU106_NUMA1))
    # Unhealthy: the group node of 0000:86:00.0 gone from /dev/vfio (the plugin's health rule).
    node = Path("/dev/vfio/74")
    node.unlink()
    try:
        wait_until(
            "pci-0000-86-00-0 unhealthy in its slice",
            lambda: _device_healthy(cluster, "pci-0000-86-00-0") is False,
            deadline=SLICE_DEADLINE,
            explain=lambda: plugin_log(cluster),
        )
        # The scheduler does not give it: a claim for a healthy TU106 on NUMA 1 gets 0000:af:00.0 only.
        cluster.apply(
            [
                claim("numa1", [request("gpu", cel='device.attributes["gpu-passthrough.kubevirt.io"].numaNode == 1')]),
                pod("numa1", {"gpu": "numa1"}),
            ]
        )
        running(cluster, "numa1")
        assert [r["device"] for r in allocation(cluster, "numa1")] == ["pci-0000-af-00-0"]
    finally:
        if not node.exists():
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        delete_pod(cluster, "numa1")
        cluster.kubectl("delete", "resourceclaim", "-n", VMS, "numa1", "--ignore-not-found")
    wait_until(
        "pci-0000-86-00-0 healthy again",
        lambda: _device_healthy(cluster, "pci-0000-86-00-0") is True,
        deadline=SLICE_DEADLINE,
        explain=lambda: plugin_log(cluster),
    )
    # Removed: the GPU's function gone from sysfs (a hot unplug), then back.
    link = node01_tree / "sys" / "bus" / "pci" / "devices" / "0000:af:00.0"
    target = os.readlink(link)
    link.unlink()
    try:
        wait_until(
            "pci-0000-af-00-0 gone from the slices",
            lambda: "pci-0000-af-00-0" not in published_devices(cluster),
            deadline=SLICE_DEADLINE,
            explain=lambda: plugin_log(cluster),
        )
    finally:
        if not link.is_symlink():
            link.symlink_to(target)
    wait_until(
        "pci-0000-af-00-0 back in the slices",
        lambda: _device_healthy(cluster, "pci-0000-af-00-0") is True,
        deadline=SLICE_DEADLINE,
        explain=lambda: plugin_log(cluster),
    )


@pytest.mark.parametrize(
    ("node", "workload", "device_class", "count"),
    [(VGPU_NODE, "vm-vgpu", "mdev-vgpu", 3), (SRIOV_VGPU_NODE, "vm-vgpu", "sriov-vgpu", 3)],
    ids=["vgpu", "sriov-vgpu"],
)
def test_vgpu_trees_publish_and_prepare(
    dra_node: Cluster, node01_tree: Path, node: Node, workload: str, device_class: str, count: int
) -> None:
    cluster = dra_node
    tree, made = fixture_tree(node)
    try:
        deploy_dra(cluster, tree, workload)
        wait_until(
            f"{node.name}'s slices stored as sent",
            lambda: slices_are(cluster, tree),
            deadline=SLICE_DEADLINE,
            explain=lambda: f"stored: {published(cluster)}" + plugin_log(cluster),
        )
        devices = published_devices(cluster)
        kinds = {d["attributes"]["kind"]["string"] for d in devices.values()}
        assert kinds == {device_class} and len(devices) == count, devices
        name = f"{device_class}-one"
        cluster.apply([claim(name, [request("vgpu", f"{device_class}.{DRIVER_NAME}")]), pod(name, {"vgpu": name})])
        try:
            running(cluster, name)
            (result,) = allocation(cluster, name)
            assert result["device"] in devices
            group = str(devices[result["device"]]["attributes"]["iommuGroup"]["int"])
            assert sorted(cluster.exec(VMS, name, "compute", "ls", "/dev/vfio").split()) == sorted(["vfio", group])
        finally:
            delete_pod(cluster, name)
            cluster.kubectl("delete", "resourceclaim", "-n", VMS, name, "--ignore-not-found")
        wait_until("the vGPU claim's files removed", lambda: not cdi_specs() and not metadata_claims())
    finally:
        deploy_dra(cluster, node01_tree)
        remove_dev_vfio(made)
        shutil.rmtree(tree, ignore_errors=True)


def _taints(cluster: Cluster, name: str) -> list[dict[str, object]] | None:
    device = published_devices(cluster).get(name)
    return None if device is None else list(device.get("taints", []))


def _health_of(cluster: Cluster, pod_name: str) -> dict[str, str]:
    """The compute container's ``allocatedResourcesStatus``: ``claim:<pod claim>/<request>`` → the health of its
    one resource (KEP 4680, what the kubelet made of the plugin's health stream)."""
    doc = cluster.json("get", "pod", "-n", VMS, pod_name)
    (compute,) = [c for c in doc["status"].get("containerStatuses", []) if c["name"] == "compute"]
    health = {}
    for entry in compute.get("allocatedResourcesStatus") or []:
        states = {r.get("health") for r in entry.get("resources", [])}
        health[entry["name"]] = ",".join(sorted(s for s in states if s))
    return health


def test_an_unhealthy_gpu_is_tainted_and_its_vms_pod_is_told(dra_node: Cluster) -> None:
    """1.36's device taints and the kubelet's resource health: the GPU of a running VM's pod loses its VFIO group
    node; its slice entry gets the NoSchedule taint, the pod's status says Unhealthy for that request only, the
    pod keeps running; the node back, the taint goes and the status says Healthy."""
    cluster = dra_node
    cluster.kubectl("create", "-f", "-", stdin=yaml.safe_dump(kubevirt_vm_pod(cluster, "watched")))
    node = Path("/dev/vfio/74")  # 0000:86:00.0's group
    try:
        doc = running(cluster, "watched")
        by_request = {r["request"]: r["device"] for r in allocation(cluster, claim_of(cluster, doc, "gpus"))}
        assert set(by_request.values()) == TU106_NUMA1
        sick = next(request for request, device in by_request.items() if device == "pci-0000-86-00-0")
        well = next(request for request in by_request if request != sick)
        wait_until(
            "both requests Healthy in the pod's status",
            lambda: (
                _health_of(cluster, "watched") == {f"claim:gpus/{sick}": "Healthy", f"claim:gpus/{well}": "Healthy"}
            ),
            deadline=SLICE_DEADLINE,
            explain=lambda: f"status: {_health_of(cluster, 'watched')}" + plugin_log(cluster),
        )
        assert _taints(cluster, "pci-0000-86-00-0") == []
        node.unlink()
        taints = wait_until(
            "pci-0000-86-00-0 tainted in its slice",
            lambda: _taints(cluster, "pci-0000-86-00-0") or None,
            deadline=SLICE_DEADLINE,
            explain=lambda: plugin_log(cluster),
        )
        (taint,) = taints
        assert (taint["key"], taint["value"], taint["effect"]) == (
            f"{DRIVER_NAME}/unhealthy",
            "VFIOGroupNodeMissing",
            "NoSchedule",
        )
        assert taint["timeAdded"]
        wait_until(
            "the sick request Unhealthy in the pod's status, the other Healthy",
            lambda: (
                _health_of(cluster, "watched") == {f"claim:gpus/{sick}": "Unhealthy", f"claim:gpus/{well}": "Healthy"}
            ),
            deadline=SLICE_DEADLINE,
            explain=lambda: f"status: {_health_of(cluster, 'watched')}" + plugin_log(cluster),
        )
        # NoSchedule: an allocated claim keeps its device and the pod keeps running.
        still = running(cluster, "watched")
        assert still["status"]["containerStatuses"][0]["restartCount"] == 0
        assert _taints(cluster, "pci-0000-af-00-0") == []
    finally:
        if not node.exists():
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    try:
        wait_until(
            "the taint gone once the node is back",
            lambda: _taints(cluster, "pci-0000-86-00-0") == [],
            deadline=SLICE_DEADLINE,
            explain=lambda: plugin_log(cluster),
        )
        wait_until(
            "both requests Healthy again",
            lambda: set(_health_of(cluster, "watched").values()) == {"Healthy"},
            deadline=SLICE_DEADLINE,
            explain=lambda: f"status: {_health_of(cluster, 'watched')}" + plugin_log(cluster),
        )
    finally:
        delete_pod(cluster, "watched")
    wait_until("watched's files removed", lambda: not cdi_specs() and not metadata_claims())
