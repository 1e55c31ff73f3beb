"""Scenario 3: KubeVirt's virt-launcher pods, placed by the real scheduler onto node01.

Each pod is what KubeVirt 1.9's own template service renders for a VM of ``deploy/hook-sidecar`` (``launcher-pod``,
tests/cluster/peers/kubevirt): its labels, hostname, GPU requests and hook sidecar container (image, command,
args, ``CONTAINER_NAME``, the socket directory mounted with ``subPath: hook-sidecar-0``) as KubeVirt made them;
only what needs KubeVirt's node is left out (virt-launcher itself, its image volumes and init containers, the
KVM/TUN device plugins, the unpause readiness gate), and ``compute`` is a plain container that keeps the
kubelet's allocation.

Each ``compute`` container asks for two GPUs: the real kubelet asks the plugin for its preferred pair, calls
Allocate, and the container's environment gets ``PCI_RESOURCE_…`` and ``PCI_COMPANIONS_…`` with the device nodes
in ``/dev/vfio``. Two pods, the two ways ``deploy/hook-sidecar`` offers:

- the recommended one (``vm-two-gpus.yaml``): a default non-root VMI's pod, as KubeVirt's template service makes
  it (uid 107, the sidecar without any capability), its sidecar ``launcher-hook serve`` with no volume. Called
  ``OnDefineDomain`` with the domain virt-launcher sends (the example domain with the hostdevs virt-launcher
  renders from compute's env, ``tests/launcher_render_support``), it reads the allocation from that domain, and
  refuses a domain that lacks a GPU the VMI asks for;
- the PodResources option (``vm-two-gpus-root.yaml``): a root VMI's pod (the pod's uid 0), the sidecar with the
  PodResources claim. It reads the allocation from the **real kubelet's PodResources API** for its own pod, and
  refuses another pod's VMI. (A non-root sidecar cannot: the kubelet's socket is root's, docs/real-cluster.md.)

The sidecars' sysfs is this machine's, which has no GPUs: the companions they would read from it are not there,
so the domains carry the two GPUs alone.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from lxml import etree

from runtime.hook_api import HOOK_API_VERSIONS
from tests.cluster import images
from tests.cluster.support import (
    DEPLOY,
    RTX,
    RTX_ENV,
    Cluster,
    Doc,
    describe_pods,
    env_of,
    wait_until,
)
from tests.launcher_render_support import virt_launcher_domain

pytestmark = pytest.mark.cluster

NAMESPACE = "gpu-vms"
CONTROLLER = "system:serviceaccount:kubevirt:kubevirt-controller"
SAME_NUMA = ({"0000:3b:00.0", "0000:5e:00.0"}, {"0000:86:00.0", "0000:af:00.0"})
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seed-node01"
ROOT_OPTION = ("pod-resources-volume.yaml", "pod-resources-policy.yaml", "vm-two-gpus-root.yaml")


@dataclass(frozen=True)
class Launcher:
    vmi: str
    pod: Doc

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])


def kubevirt_pod(cluster: Cluster, vm_file: Path) -> Doc:
    """The virt-launcher pod KubeVirt 1.9's own template service renders for ``vm_file`` (``launcher-pod``)."""
    done = subprocess.run(
        [str(cluster.peers.binary("kubevirt", "launcher-pod")), "--vm", str(vm_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"launcher-pod --vm {vm_file}: {done.stderr[-1500:]}"
    pod: Doc = yaml.safe_load(done.stdout)
    return pod


def launcher_pod(rendered: Doc, *, root: bool) -> Doc:
    """KubeVirt's pod for this machine: its hook sidecar container, labels, hostname and GPU requests as KubeVirt
    rendered them; what needs KubeVirt's node (virt-launcher's image, its init containers and image volumes, the
    KVM/TUN device plugins, the unpause readiness gate, node labels) left out, and ``compute`` a plain container
    of the project's image that keeps the kubelet's allocation.

    ``root``: a root VMI's pod (KubeVirt's ``Root`` gate): the pod runs as uid 0, and so does the sidecar.
    Otherwise KubeVirt's default non-root VMI: pod and sidecar as uid 107, the sidecar without capabilities
    (pkg/virt-controller/services/template.go, newSidecarContainerRenderer; rendercontainer.go)."""
    spec = rendered["spec"]
    (compute,) = [c for c in spec["containers"] if c["name"] == "compute"]
    (sidecar,) = [copy.deepcopy(c) for c in spec["containers"] if c["name"] == "hook-sidecar-0"]
    gpus = {k: v for k, v in compute["resources"]["limits"].items() if k.startswith("nvidia.com/")}
    sidecar["securityContext"] = (
        {"runAsUser": 0, "runAsNonRoot": False}
        if root
        else {
            "runAsUser": 107,
            "runAsGroup": 107,
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
    )
    mounted = {m["name"] for c in (compute, sidecar) for m in c.get("volumeMounts", [])}
    hook_mounts = [m for m in compute["volumeMounts"] if m["name"] == "hook-sidecar-sockets"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            # KubeVirt's generateName, with a fixed suffix the test can name.
            "name": rendered["metadata"]["generateName"] + ("k8sq2" if root else "x7d4p"),
            "namespace": NAMESPACE,
            "labels": rendered["metadata"]["labels"],
        },
        "spec": {
            "securityContext": {"runAsUser": 0}
            if root
            else {"runAsUser": 107, "runAsGroup": 107, "fsGroup": 107, "runAsNonRoot": True},
            "hostname": spec["hostname"],
            "automountServiceAccountToken": spec["automountServiceAccountToken"],
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "compute",
                    "image": images.PROJECT_IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sleep", "infinity"],
                    "resources": {"limits": gpus, "requests": gpus},
                    "volumeMounts": hook_mounts,
                },
                sidecar,
            ],
            "volumes": [
                v
                for v in spec["volumes"]
                if v["name"] in mounted and v["name"] in ("hook-sidecar-sockets", "kubelet-pod-resources")
            ],
        },
    }


def _ready(cluster: Cluster, name: str) -> Doc | None:
    pod: Doc = cluster.json("get", "pod", name, "-n", NAMESPACE)
    conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return pod if conditions.get("Ready") == "True" else None


def _start(cluster: Cluster, rendered: Doc, *, root: bool) -> Launcher:
    pod = launcher_pod(rendered, root=root)
    name = pod["metadata"]["name"]
    cluster.kubectl("delete", "pod", name, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    cluster.kubectl("create", f"--as={CONTROLLER}", "-f", "-", stdin=yaml.safe_dump(pod))
    running = wait_until(
        f"the launcher pod {name} Ready",
        lambda: _ready(cluster, name),
        explain=lambda: describe_pods(cluster, NAMESPACE),
    )
    return Launcher(rendered["metadata"]["labels"]["vm.kubevirt.io/name"], running)


def _root_option() -> list[Doc]:
    return [
        doc for name in ROOT_OPTION for doc in yaml.safe_load_all((DEPLOY / "hook-sidecar" / name).read_text()) if doc
    ]


@pytest.fixture(scope="module")
def launchers(gpu_node: Cluster) -> dict[str, Launcher]:
    """Both pods, two GPUs each (the node's four): ``nonroot`` (recommended) and ``root`` (PodResources)."""
    cluster = gpu_node
    docs = cluster.kustomize(DEPLOY / "hook-sidecar")
    cluster.apply(docs)
    root_docs = _root_option()
    cluster.apply([d for d in root_docs if d["kind"] != "VirtualMachine"])
    cluster.let_virt_controller_create_pods(NAMESPACE)
    vm = kubevirt_pod(cluster, DEPLOY / "hook-sidecar" / "vm-two-gpus.yaml")
    root_vm = kubevirt_pod(cluster, DEPLOY / "hook-sidecar" / "vm-two-gpus-root.yaml")
    return {"nonroot": _start(cluster, vm, root=False), "root": _start(cluster, root_vm, root=True)}


def test_the_real_scheduler_placed_them_and_the_kubelet_admitted_them(
    gpu_node: Cluster, launchers: dict[str, Launcher]
) -> None:
    for launcher in launchers.values():
        assert launcher.pod["spec"]["nodeName"] == "node01"
        assert launcher.pod["spec"]["schedulerName"] == "default-scheduler"
    assert gpu_node.allocatable(RTX) == 4


def _compute_env(cluster: Cluster, launcher: Launcher) -> dict[str, str]:
    return env_of(cluster.exec(NAMESPACE, launcher.name, "compute", "env"))


def test_compute_has_the_preferred_pair_its_companions_and_the_device_nodes(
    gpu_node: Cluster, launchers: dict[str, Launcher]
) -> None:
    pairs = []
    for launcher in launchers.values():
        env = _compute_env(gpu_node, launcher)
        pair = set(env[RTX_ENV].split(","))
        assert pair in SAME_NUMA, f"{launcher.name}: {RTX_ENV}={env[RTX_ENV]}: not two GPUs of one NUMA node"
        pairs.append(pair)
        companions = env["PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"]
        for gpu in sorted(pair):
            slot = gpu[:-1]
            assert f"{gpu}={slot}1+{slot}2+{slot}3" in companions.split(","), companions
        listing = gpu_node.exec(NAMESPACE, launcher.name, "compute", "ls", "-l", "/dev/vfio")
        nodes = {line.split()[-1]: line[0] for line in listing.splitlines() if line[:1] in "cb-"}
        assert nodes.get("vfio") == "c", listing
        assert sum(1 for name, kind in nodes.items() if name.isdigit() and kind == "c") == 2, listing
    assert pairs[0] | pairs[1] == SAME_NUMA[0] | SAME_NUMA[1]


def _hook_socket(launcher: Launcher, cluster: Cluster | None = None) -> Path:
    """The sidecar's socket in the pod's emptyDir, through a short link (sun_path holds 107 bytes)."""
    uid = launcher.pod["metadata"]["uid"]
    # KubeVirt mounts each sidecar's part of the emptyDir (subPath hook-sidecar-<n>) at /var/run/kubevirt-hooks.
    directory = Path(f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/hook-sidecar-sockets/hook-sidecar-0")
    link = Path(f"/run/kgp-cluster/hook-{uid[:8]}")
    if not link.is_symlink():
        os.symlink(directory, link)
    socket_path = link / "gpu-hostdev.sock"

    def why() -> str:
        listing = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else "no such directory"
        logs = (
            ""
            if cluster is None
            else cluster.kubectl(
                "logs", "-n", NAMESPACE, launcher.name, "-c", "hook-sidecar-0", "--tail=20", check=False
            ).stdout
        )
        return f"{directory}: {listing}; the sidecar's log ends:\n{logs}"

    wait_until(f"the hook's socket {socket_path}", socket_path.exists, deadline=60, explain=why)
    return socket_path


def _vmi(name: str) -> bytes:
    vmi: dict[str, Any] = json.loads((EXAMPLE / "vmi.json").read_bytes())
    vmi["metadata"].update(name=name, namespace=NAMESPACE)
    vmi["metadata"]["labels"] = {"kubevirt.io/vm": name}
    return json.dumps(vmi).encode()


def _define(socket_path: Path, vmi: bytes, compute_env: dict[str, str] | None) -> bytes:
    """OnDefineDomain with the example domain as virt-launcher renders it from ``compute_env`` (None: the bare
    example domain, without the GPUs)."""
    pb2, pb2_grpc = HOOK_API_VERSIONS["v1alpha3"]
    domain = (EXAMPLE / "domain.xml").read_bytes()
    if compute_env is not None:
        domain = virt_launcher_domain(domain, vmi, compute_env)
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        answer = pb2_grpc.CallbacksStub(channel).OnDefineDomain(
            pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60
        )
    assert isinstance(answer.domainXML, bytes)
    return answer.domainXML


def _pci_sources(domain_xml: bytes) -> set[str]:
    sources = set()
    for hostdev in etree.fromstring(domain_xml).iterfind("devices/hostdev[@type='pci']"):
        address = hostdev.find("source/address")
        assert address is not None
        sources.add(
            "{:04x}:{:02x}:{:02x}.{:x}".format(
                *(int(address.get(k, "0"), 16) for k in ("domain", "bus", "slot", "function"))
            )
        )
    return sources


def _refusal(socket_path: Path, vmi: bytes, compute_env: dict[str, str] | None) -> grpc.Call:
    with pytest.raises(grpc.RpcError) as refused:
        _define(socket_path, vmi, compute_env)
    error = refused.value
    assert isinstance(error, grpc.Call)
    return error


def test_the_non_root_sidecar_reads_the_allocation_from_the_domain(
    gpu_node: Cluster, launchers: dict[str, Launcher]
) -> None:
    launcher = launchers["nonroot"]
    env = _compute_env(gpu_node, launcher)
    domain = _define(_hook_socket(launcher, gpu_node), _vmi(launcher.vmi), env)
    assert _pci_sources(domain) == set(env[RTX_ENV].split(","))


def test_the_non_root_sidecar_refuses_a_domain_without_the_vmis_gpus(
    gpu_node: Cluster, launchers: dict[str, Launcher]
) -> None:
    launcher = launchers["nonroot"]
    error = _refusal(_hook_socket(launcher, gpu_node), _vmi(launcher.vmi), None)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "'ua-gpu-gpu0'" in (error.details() or "")


def test_the_root_sidecar_reads_its_own_pods_allocation_from_the_kubelet(
    gpu_node: Cluster, launchers: dict[str, Launcher]
) -> None:
    launcher = launchers["root"]
    env = _compute_env(gpu_node, launcher)
    # The bare domain: the allocation can only have come from the kubelet's PodResources API.
    domain = _define(_hook_socket(launcher, gpu_node), _vmi(launcher.vmi), None)
    assert _pci_sources(domain) == set(env[RTX_ENV].split(","))


def test_the_root_sidecar_refuses_another_pods_vmi(gpu_node: Cluster, launchers: dict[str, Launcher]) -> None:
    error = _refusal(_hook_socket(launchers["root"], gpu_node), _vmi(launchers["nonroot"].vmi), None)
    assert error.code() in (
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ), error.details()
    assert launchers["nonroot"].vmi in (error.details() or "")
