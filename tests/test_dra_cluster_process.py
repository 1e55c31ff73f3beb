"""``gpu-device-plugin serve --dra`` in a cluster, as a process: claims from the API server and the node's
ResourceSlices published there, through the real kubernetes client against simkit.fake_apiserver (found by
KUBECONFIG, as a developer runs the plugin by hand; in a pod the service account is used instead)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import yaml

from plugin.dra.claims import AllocatedDevice, ClaimRef, claim_object
from plugin.dra.kube import KubeApi, SlicePublisher
from schemas.dra import CDI_KIND, DRIVER_NAME
from simkit.fake_apiserver import running
from simkit.fixture_nodes import NODE01
from simkit.kubelet_dra_standin import KubeletDraStandIn
from tests.dra_support import DraPaths, dra_runner, running_dra
from tests.plugin_support import WAIT, build_tree, plugin_env, serve_command, short_dir, wait_until

UID = "5d0e3a1c-7b6f-4e2a-9c1d-2f3e4a5b6c7d"
CLAIM = ClaimRef("gpu-vms", "vm-gpus", UID)


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "dev", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "dev"}}],
                "current-context": "fake",
            }
        )
    )
    return path


def test_serve_dra_publishes_slices_and_prepares_a_claim_from_the_api_server() -> None:
    with short_dir() as base, running() as api:
        api.add_node("node01")
        api.add_claim(claim_object(CLAIM, [AllocatedDevice("gpu0", DRIVER_NAME, "node01", "pci-0000-86-00-0")]))
        paths = DraPaths.under(base, build_tree(NODE01, base))
        paths.cdi_dir.mkdir()
        env = plugin_env(
            GPU_PLUGIN_DRA="true",
            GPU_PLUGIN_DRA_PLUGIN_DIR=str(paths.plugin_dir),
            GPU_PLUGIN_PLUGINS_REGISTRY=str(paths.registry),
            GPU_PLUGIN_CDI_DIR=str(paths.cdi_dir),
            GPU_PLUGIN_NODE_NAME="node01",
            KUBECONFIG=str(kubeconfig(base / "kubeconfig", api.url)),
        )
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = base / "plugin.log"
        command = serve_command(paths.root, base / "kubelet", "--scan-interval", "0.2")
        with log.open("wb") as stderr, KubeletDraStandIn(paths.registry) as kubelet:
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            try:
                kubelet.wait_for_registration(DRIVER_NAME, timeout=30)
                wait_until(lambda: len(api.slices()) == 1, what="the node's ResourceSlice")
                (published,) = api.slices()
                assert published["spec"]["nodeName"] == "node01" and published["spec"]["driver"] == DRIVER_NAME
                names = [device["name"] for device in published["spec"]["devices"]]
                assert names == ["pci-0000-3b-00-0", "pci-0000-5e-00-0", "pci-0000-86-00-0", "pci-0000-af-00-0"]
                assert published["spec"]["devices"][2]["attributes"]["productName"] == {
                    "string": "TU106 [GeForce RTX 2060 Rev. A]"
                }
                devices, error = kubelet.prepare(DRIVER_NAME, [(CLAIM.namespace, CLAIM.name, CLAIM.uid)])[UID]
                assert error == "" and devices[0].cdi_ids == (f"{CDI_KIND}={UID}-gpu0",)
                claim_reads = [r for r in api.requests() if r.path.endswith(f"/resourceclaims/{CLAIM.name}")]
                assert claim_reads and claim_reads[0].path.startswith("/apis/resource.k8s.io/v1/namespaces/gpu-vms/")
                writes = [r.method for r in api.requests() if r.method != "GET"]
                assert writes == ["POST"]  # rescans of an unchanged node write nothing
                process.send_signal(signal.SIGTERM)
                assert process.wait(WAIT * 2) == 0
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        assert len(api.slices()) == 1  # a restart must not make the pool vanish: slices stay on SIGTERM
        events = [json.loads(line)["event"] for line in log.read_text().splitlines() if line.strip()]
        assert "dra_slices_published" in events


def test_serve_dra_without_cluster_credentials_is_a_clear_error(tmp_path: Path) -> None:
    root = build_tree(NODE01, tmp_path)
    env = plugin_env(GPU_PLUGIN_NODE_NAME="node01", KUBECONFIG=str(tmp_path / "no-such-kubeconfig"))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    done = subprocess.run(
        [*serve_command(root, tmp_path / "kubelet"), "--dra"],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
        text=True,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        f"cannot configure the Kubernetes client from kubeconfig {str(tmp_path / 'no-such-kubeconfig')!r}"
        in done.stderr
    )


def test_slices_deleted_under_the_plugin_come_back_at_the_resync() -> None:
    """An unchanged inventory is offered to the publisher again after the runner's resync interval: slices
    deleted by hand (or collected after the Node was re-created) are published again without a restart."""
    with short_dir() as base, running() as api:
        api.add_node("node01")
        paths = DraPaths.under(base, build_tree(NODE01, base))
        client = KubeApi.for_host(api.url, timeout=(2.0, 5.0))
        runner = dra_runner(paths, sinks=[SlicePublisher(client, "node01")], pool="node01")
        runner.sink_resync = 0.5
        with running_dra(runner):
            wait_until(lambda: len(api.slices()) == 1, what="the node's ResourceSlice")
            (first,) = api.slices()
            api.handle("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{first['metadata']['name']}", b"")
            assert api.slices() == []
            wait_until(lambda: len(api.slices()) == 1, what="the slice published again")
        (again,) = api.slices()
        assert again["spec"]["devices"] == first["spec"]["devices"]
        assert again["metadata"]["name"] != first["metadata"]["name"]
        client.close()


def test_a_gpu_turning_unhealthy_is_tainted_once_and_the_taint_then_stays_put() -> None:
    """The fixture tree loses a GPU's VFIO group node while the plugin runs: its slice entry gets the
    NoSchedule taint (healthy: false kept) in one update, and later scans and resyncs write nothing more."""
    with short_dir() as base, running() as api:
        api.add_node("node01")
        node01 = build_tree(NODE01, base)
        paths = DraPaths.under(base, node01)
        client = KubeApi.for_host(api.url, timeout=(2.0, 5.0))
        runner = dra_runner(paths, sinks=[SlicePublisher(client, "node01")], pool="node01")
        runner.sink_resync = 0.3
        try:
            with running_dra(runner):
                wait_until(lambda: len(api.slices()) == 1, what="the node's ResourceSlice", timeout=30)
                assert runner.inventory is not None
                group = next(
                    d.iommu_group for r in runner.inventory.resources for d in r.devices if d.id == "0000:86:00.0"
                )
                (base / "gone").mkdir()
                (node01 / "dev" / "vfio" / str(group)).rename(base / "gone" / str(group))

                def sick() -> dict[str, Any] | None:
                    devices = {d["name"]: d for obj in api.slices() for d in obj["spec"]["devices"]}
                    device = devices.get("pci-0000-86-00-0")
                    return device if device is not None and "taints" in device else None

                wait_until(lambda: sick() is not None, what="the taint", timeout=30)
                device = sick()
                assert device is not None and device["attributes"]["healthy"] == {"bool": False}
                (taint,) = device["taints"]
                assert (taint["key"], taint["value"], taint["effect"]) == (
                    "gpu-passthrough.kubevirt.io/unhealthy",
                    "VFIOGroupNodeMissing",
                    "NoSchedule",
                )
                api.clear_requests()
                wait_until(
                    lambda: len([r for r in api.requests() if r.method == "GET"]) >= 3, what="resyncs", timeout=30
                )
                assert [r.method for r in api.requests() if r.method != "GET"] == []  # the taint does not churn
                assert sick() == device
                (base / "gone" / str(group)).rename(node01 / "dev" / "vfio" / str(group))
                wait_until(lambda: sick() is None, what="the taint removed", timeout=30)
        finally:
            client.close()
