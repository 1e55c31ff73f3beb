"""Scenario 3: pods shaped as KubeVirt's virt-launcher pods, placed by the real scheduler onto node01.

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

import json
import os
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


def launcher_pod(vm: Doc, *, root: bool) -> Doc:
    """The parts of virt-controller's launcher pod the project relies on, for ``vm``.

    ``root``: a root VMI's pod (KubeVirt's ``Root`` gate): the pod runs as uid 0, and so does the sidecar.
    Otherwise KubeVirt's default non-root VMI: pod and sidecar as uid 107, the sidecar without capabilities
    (pkg/virt-controller/services/template.go, newSidecarContainerRenderer; rendercontainer.go)."""
    vmi = vm["metadata"]["name"]
    annotations = vm["spec"]["template"]["metadata"]["annotations"]
    (sidecar,) = json.loads(annotations["hooks.kubevirt.io/hookSidecars"])
    wanted: dict[str, int] = {}
    for gpu in vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"]:
        wanted[gpu["deviceName"]] = wanted.get(gpu["deviceName"], 0) + 1
    limits = {name: str(count) for name, count in wanted.items()}
    hook_mounts = [{"name": "hook-sidecar-sockets", "mountPath": "/var/run/kubevirt-hooks"}]
    sidecar_mounts = list(hook_mounts)
    volumes: list[dict[str, Any]] = [{"name": "hook-sidecar-sockets", "emptyDir": {}}]
    if "pvc" in sidecar:  # the PodResources option
        sidecar_mounts.append({"name": sidecar["pvc"]["name"], "mountPath": sidecar["pvc"]["volumePath"]})
        volumes.append({"name": sidecar["pvc"]["name"], "persistentVolumeClaim": {"claimName": sidecar["pvc"]["name"]}})
    container: dict[str, Any] = {
        "name": "hook-sidecar-0",
        "image": sidecar["image"],
        "imagePullPolicy": sidecar["imagePullPolicy"],
        "command": sidecar["command"],
        "args": sidecar["args"],
        "env": [{"name": "CONTAINER_NAME", "value": "hook-sidecar-0"}],
        "volumeMounts": sidecar_mounts,
    }
    if not root:  # newSidecarContainerRenderer: WithNonRoot and WithDropALLCapabilities for a non-root VMI
        container["securityContext"] = {"capabilities": {"drop": ["ALL"]}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"virt-launcher-{vmi}-{'k8sq2' if root else 'x7d4p'}",
            "namespace": NAMESPACE,
            "labels": {"kubevirt.io": "virt-launcher", "vm.kubevirt.io/name": vmi},
        },
        "spec": {
            # template.go's pod security context: uid 0 for a root VMI, else 107 with fsGroup 107.
            "securityContext": {"runAsUser": 0}
            if root
            else {"runAsUser": 107, "runAsGroup": 107, "fsGroup": 107, "runAsNonRoot": True},
            "hostname": vmi,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "compute",
                    "image": images.PROJECT_IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sleep", "infinity"],
                    "resources": {"limits": limits, "requests": limits},
                    "volumeMounts": hook_mounts,
                },
                container,
            ],
            "volumes": volumes,
        },
    }


def _ready(cluster: Cluster, name: str) -> Doc | None:
    pod: Doc = cluster.json("get", "pod", name, "-n", NAMESPACE)
    conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return pod if conditions.get("Ready") == "True" else None


def _start(cluster: Cluster, vm: Doc, *, root: bool) -> Launcher:
    pod = launcher_pod(vm, root=root)
    name = pod["metadata"]["name"]
    cluster.kubectl("delete", "pod", name, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    cluster.kubectl("create", f"--as={CONTROLLER}", "-f", "-", stdin=yaml.safe_dump(pod))
    running = wait_until(
        f"the launcher pod {name} Ready",
        lambda: _ready(cluster, name),
        explain=lambda: describe_pods(cluster, NAMESPACE),
    )
    return Launcher(vm["metadata"]["name"], running)


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
    (vm,) = [d for d in docs if d["kind"] == "VirtualMachine"]
    (root_vm,) = [d for d in root_docs if d["kind"] == "VirtualMachine"]
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


def _hook_socket(launcher: Launcher) -> Path:
    """The sidecar's socket in the pod's emptyDir, through a short link (sun_path holds 107 bytes)."""
    uid = launcher.pod["metadata"]["uid"]
    directory = Path(f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/hook-sidecar-sockets")
    link = Path(f"/run/kgp-cluster/hook-{uid[:8]}")
    if not link.is_symlink():
        os.symlink(directory, link)
    socket_path = link / "gpu-hostdev.sock"
    wait_until(f"the hook's socket {socket_path}", socket_path.exists, deadline=60)
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
    domain = _define(_hook_socket(launcher), _vmi(launcher.vmi), env)
    assert _pci_sources(domain) == set(env[RTX_ENV].split(","))


def test_the_non_root_sidecar_refuses_a_domain_without_the_vmis_gpus(
    gpu_node: Cluster, launchers: dict[str, Launcher]
) -> None:
    launcher = launchers["nonroot"]
    error = _refusal(_hook_socket(launcher), _vmi(launcher.vmi), None)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "'ua-gpu-gpu0'" in (error.details() or "")


def test_the_root_sidecar_reads_its_own_pods_allocation_from_the_kubelet(
    gpu_node: Cluster, launchers: dict[str, Launcher]
) -> None:
    launcher = launchers["root"]
    env = _compute_env(gpu_node, launcher)
    # The bare domain: the allocation can only have come from the kubelet's PodResources API.
    domain = _define(_hook_socket(launcher), _vmi(launcher.vmi), None)
    assert _pci_sources(domain) == set(env[RTX_ENV].split(","))


def test_the_root_sidecar_refuses_another_pods_vmi(gpu_node: Cluster, launchers: dict[str, Launcher]) -> None:
    error = _refusal(_hook_socket(launchers["root"]), _vmi(launchers["nonroot"].vmi), None)
    assert error.code() in (
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ), error.details()
    assert launchers["nonroot"].vmi in (error.details() or "")
