"""What the DRA scenarios share (tests/cluster/test_s6_dra.py on 1.36, tests/cluster_oldest on 1.34): ``deploy/dra``
applied against a fixture tree, pods that use claims, and the node-side files the plugin and the kubelet keep.

Nothing here stands in for a peer: the API server stores the slices and claims, the scheduler allocates, the
kubelet prepares through the plugin's socket and containerd applies the CDI specs. The helpers only read what
those wrote (the kubelet's ``dra_manager_state``, containerd's OCI spec of a container, the plugin's checkpoint).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from schemas.dra import DRIVER_NAME
from tests.cluster import kit
from tests.cluster.support import (
    DEPLOY,
    WORKLOAD_LABEL,
    Cluster,
    Doc,
    describe_pods,
    point_at_fixture,
    ready_pod,
    wait_until,
)

DRA_LABEL = "gpu-passthrough.kubevirt.io/dra"
DRA_SELECTOR = "app.kubernetes.io/name=gpu-dra-plugin"
NAMESPACE = "kubevirt-gpu-passthrough"
VMS = "gpu-vms"
PLUGIN_DIR = kit.KUBELET_ROOT / "plugins" / DRIVER_NAME
CHECKPOINT = PLUGIN_DIR / "checkpoint.json"
METADATA = PLUGIN_DIR / "metadata"
CDI_DIR = Path("/var/run/cdi")
KUBELET_STATE = kit.KUBELET_ROOT / "dra_manager_state"
IMAGE = "registry.example.com/kubevirt-gpu-passthrough:0.1.0"
CLAIM_METADATA_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
PASSTHROUGH = f"passthrough.{DRIVER_NAME}"

TU106_NUMA1 = {"pci-0000-86-00-0", "pci-0000-af-00-0"}
"""What the sample template's selectors mean on node01: TU106 on NUMA node 1 (the cards below 0x85 and 0xae)."""


def deploy_dra(cluster: Cluster, tree: Path, workload: str = "vm-passthrough") -> list[Doc]:
    """``deploy/dra`` as it is (its ``/sys`` pointed at ``tree``), the node labelled for it; the plugin Ready."""
    docs = point_at_fixture(cluster.kustomize(DEPLOY / "dra"), tree)
    cluster.apply(docs)
    cluster.label_node(WORKLOAD_LABEL, workload)
    cluster.label_node(DRA_LABEL, "true")
    wait_until(
        "the DRA plugin pod Ready on the fixture tree",
        lambda: _ready_on(cluster, tree),
        explain=lambda: describe_pods(cluster, NAMESPACE) + plugin_log(cluster),
    )
    return docs


def _ready_on(cluster: Cluster, tree: Path) -> Doc | None:
    pod = ready_pod(cluster, NAMESPACE, DRA_SELECTOR)
    if pod is None:
        return None
    paths = [v.get("hostPath", {}).get("path") for v in pod["spec"]["volumes"]]
    return pod if str(tree / "sys") in paths else None


def plugin_log(cluster: Cluster, tail: int = 40) -> str:
    done = cluster.kubectl("logs", "-n", NAMESPACE, "-l", DRA_SELECTOR, f"--tail={tail}", check=False)
    return "\nplugin log:\n" + done.stdout[-4000:]


def plugin_events(cluster: Cluster, event: str) -> list[dict[str, Any]]:
    """The plugin's JSON log lines of ``event`` (all of its current container's log)."""
    done = cluster.kubectl("logs", "-n", NAMESPACE, "-l", DRA_SELECTOR, "--tail=-1", check=False)
    found = []
    for line in done.stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


def published(cluster: Cluster) -> list[Doc]:
    """The node's ResourceSlices of our driver as the API server stores them."""
    items: list[Doc] = cluster.json("get", "resourceslices", "--field-selector", f"spec.nodeName={kit.NODE}")["items"]
    return [s for s in items if s["spec"]["driver"] == DRIVER_NAME]


def published_devices(cluster: Cluster) -> dict[str, Doc]:
    return {d["name"]: d for s in published(cluster) for d in s["spec"].get("devices", [])}


def expected_slices(tree: Path) -> list[Doc]:
    """What ``xmlgen discover --dra-slices`` says the plugin publishes for ``tree`` (the project's own view)."""
    done = subprocess.run(
        [
            str(kit.REPO / ".venv" / "bin" / "xmlgen"),
            "discover",
            "--dra-slices",
            kit.NODE,
            "--host-root",
            str(tree),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    items: list[Doc] = json.loads(done.stdout)["items"]
    return items


def pod(name: str, claims: dict[str, str], *, template: bool = False) -> Doc:
    """A pod of the project's image whose one container uses every claim (pod claim name → claim or template)."""
    key = "resourceClaimTemplateName" if template else "resourceClaimName"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": VMS},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": n, key: c} for n, c in claims.items()],
            "containers": [
                {
                    "name": "compute",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "infinity"],
                    "resources": {"claims": [{"name": n} for n in claims]},
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "runAsNonRoot": True,
                        "runAsUser": 65534,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                }
            ],
        },
    }


KUBEVIRT_DRA_GATES = ("Sidecar", "GPUsWithDRA", "HostDevicesWithDRA")
"""The KubeVirt CR's gates for the DRA example (deploy/dra/kubevirt-patch.yaml adds the last two)."""


def kubevirt_vm_pod(cluster: Cluster, name: str) -> Doc:
    """:func:`pod` with the claims KubeVirt 1.9's own template service gives ``deploy/dra/example/vm.yaml``'s pod
    (``launcher-pod`` with the DRA gates on): its ``resourceClaims`` and compute's ``resources.claims``."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as cr:
        yaml.safe_dump(
            {
                "apiVersion": "kubevirt.io/v1",
                "kind": "KubeVirt",
                "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
                "spec": {"configuration": {"developerConfiguration": {"featureGates": list(KUBEVIRT_DRA_GATES)}}},
            },
            cr,
        )
        cr.flush()
        done = subprocess.run(
            [
                str(cluster.peers.binary("kubevirt", "launcher-pod")),
                "--vm",
                str(DEPLOY / "dra" / "example" / "vm.yaml"),
                "--kubevirt",
                cr.name,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, f"launcher-pod: {done.stderr[-1500:]}"
    rendered: Doc = yaml.safe_load(done.stdout)
    (compute,) = [c for c in rendered["spec"]["containers"] if c["name"] == "compute"]
    doc = pod(name, {})
    doc["spec"]["resourceClaims"] = rendered["spec"]["resourceClaims"]
    doc["spec"]["containers"][0]["resources"] = {"claims": compute["resources"]["claims"]}
    return doc


def claim(name: str, requests: list[Doc]) -> Doc:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": VMS},
        "spec": {"devices": {"requests": requests}},
    }


def request(name: str, device_class: str = PASSTHROUGH, count: int = 1, cel: str | None = None) -> Doc:
    exactly: Doc = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    return {"name": name, "exactly": exactly}


def running(cluster: Cluster, name: str) -> Doc:
    def probe() -> Doc | None:
        got = cluster.kubectl("get", "pod", "-n", VMS, name, "-o", "json", check=False)
        if got.returncode != 0:
            return None
        doc: Doc = json.loads(got.stdout)
        statuses = doc.get("status", {}).get("containerStatuses", [])
        return doc if statuses and statuses[0].get("state", {}).get("running") else None

    return wait_until(
        f"pod {VMS}/{name} running",
        probe,
        explain=lambda: describe_pods(cluster, VMS) + plugin_log(cluster),
    )


def delete_pod(cluster: Cluster, name: str) -> None:
    cluster.kubectl("delete", "pod", "-n", VMS, name, "--ignore-not-found", "--wait=true", timeout=180)


def allocation(cluster: Cluster, claim_name: str) -> list[Doc]:
    got: Doc = cluster.json("get", "resourceclaim", "-n", VMS, claim_name)
    results: list[Doc] = got.get("status", {}).get("allocation", {}).get("devices", {}).get("results", [])
    return results


def claim_of(cluster: Cluster, pod_doc: Doc, pod_claim: str) -> str:
    """The ResourceClaim's name behind a pod's claim (templates get generated names)."""
    for status in pod_doc.get("status", {}).get("resourceClaimStatuses", []):
        if status["name"] == pod_claim:
            return str(status["resourceClaimName"])
    for entry in pod_doc["spec"]["resourceClaims"]:
        if entry["name"] == pod_claim and "resourceClaimName" in entry:
            return str(entry["resourceClaimName"])
    raise AssertionError(f"pod {pod_doc['metadata']['name']} has no claim {pod_claim}: {pod_doc.get('status')}")


def kubelet_claims() -> dict[str, Doc]:
    """The kubelet's DRA checkpoint (``dra_manager_state``): claim UID → its entry."""
    if not KUBELET_STATE.exists():
        return {}
    outer = json.loads(KUBELET_STATE.read_text())
    inner = json.loads(outer["Data"])
    return {entry["ClaimUID"]: entry for entry in inner.get("ClaimInfoStateList") or []}


def plugin_checkpoint() -> dict[str, Doc]:
    if not CHECKPOINT.exists():
        return {}
    claims: dict[str, Doc] = json.loads(CHECKPOINT.read_text()).get("claims", {})
    return claims


def cdi_specs() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(CDI_DIR.glob(f"{DRIVER_NAME}-claim_*.json"))}


def metadata_claims() -> set[str]:
    return {p.name for p in METADATA.iterdir()} if METADATA.is_dir() else set()


def files_match_checkpoint() -> list[str]:
    """What is wrong between the plugin's files and its checkpoint (nothing half-written: every file parses and
    belongs to a recorded claim, with the recorded bytes; every recorded file exists)."""
    problems: list[str] = []
    recorded = plugin_checkpoint()
    for name, data in cdi_specs().items():
        uid = name.removeprefix(f"{DRIVER_NAME}-claim_").removesuffix(".json")
        try:
            json.loads(data)
        except ValueError as exc:
            problems.append(f"{name} is not JSON: {exc}")
        if uid not in recorded:
            problems.append(f"{name}: claim {uid} is not in the checkpoint")
    for uid in metadata_claims() - set(recorded):
        problems.append(f"metadata/{uid}: not in the checkpoint")
    for uid, entry in recorded.items():
        for path, content in entry.get("files", {}).items():
            file = Path(path)
            if not file.exists():
                problems.append(f"{path} of claim {uid} is missing")
            elif file.read_text() != content:
                problems.append(f"{path} of claim {uid} differs from the checkpoint")
    return problems


def oci_spec(cluster: Cluster, pod_doc: Doc) -> Doc:
    """containerd's OCI spec of the pod's first container (what runc was given)."""
    container = pod_doc["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    done = subprocess.run(
        [
            str(cluster.peers.binary("containerd", "ctr")),
            "-a",
            str(kit.RUN / "containerd" / "containerd.sock"),
            "-n",
            "k8s.io",
            "containers",
            "info",
            container,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    spec: Doc = json.loads(done.stdout)["Spec"]
    return spec


def vm_json() -> str:
    """deploy/dra/example/vm.yaml as JSON (the hook reads a VMI's or a VM's gpus[])."""
    docs = list(yaml.safe_load_all((DEPLOY / "dra" / "example" / "vm.yaml").read_text()))
    (vm,) = [d for d in docs if d and d.get("kind") == "VirtualMachine"]
    return json.dumps(vm)


def spec_view(slices: list[dict[str, object]]) -> list[object]:
    """The parts of slices both sides decide (not the pool generation, which the publisher counts up)."""
    view = []
    for s in slices:
        spec = dict(s["spec"])  # type: ignore[call-overload]
        pool = dict(spec.pop("pool"))
        pool.pop("generation")
        view.append({**spec, "pool": pool})
    return sorted(view, key=repr)


def slices_are(cluster: Cluster, tree: Path) -> bool:
    return spec_view(published(cluster)) == spec_view(expected_slices(tree))
