"""Scenario 3: a pod shaped as KubeVirt's virt-launcher pod, placed by the real scheduler onto node01.

Its ``compute`` container asks for two GPUs: the real kubelet asks the plugin for its preferred pair, calls
Allocate, and the container's environment gets ``PCI_RESOURCE_…`` and ``PCI_COMPANIONS_…`` with the device nodes
in ``/dev/vfio``. The pod runs as KubeVirt runs a default non-root VMI's (uid 107, the sidecar without any
capability). The hook sidecar (``launcher-hook serve``, as the VM's annotation in ``deploy/hook-sidecar`` runs it:
no volume) is called ``OnDefineDomain`` on its socket with the domain virt-launcher would send (the example
domain with the hostdevs virt-launcher renders from compute's env, ``tests/launcher_render_support``): it reads
the allocation from that domain and the companions from its own read-only sysfs, and refuses a domain that lacks
a GPU the VMI asks for.
"""

from __future__ import annotations

import copy
import json
import os
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
    ready_pod,
    wait_until,
)
from tests.launcher_render_support import virt_launcher_domain

pytestmark = pytest.mark.cluster

NAMESPACE = "gpu-vms"
VMI = "vm-two-gpus"
POD = "virt-launcher-vm-two-gpus-k8sq2"
CONTROLLER = "system:serviceaccount:kubevirt:kubevirt-controller"
SAME_NUMA = ({"0000:3b:00.0", "0000:5e:00.0"}, {"0000:86:00.0", "0000:af:00.0"})
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seed-node01"


def launcher_pod(vm: Doc) -> Doc:
    """The parts of virt-controller's launcher pod the project relies on, for ``vm`` (deploy/hook-sidecar)."""
    annotations = vm["spec"]["template"]["metadata"]["annotations"]
    (sidecar,) = json.loads(annotations["hooks.kubevirt.io/hookSidecars"])
    gpus = vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"]
    wanted: dict[str, int] = {}
    for gpu in gpus:
        wanted[gpu["deviceName"]] = wanted.get(gpu["deviceName"], 0) + 1
    limits = {name: str(count) for name, count in wanted.items()}
    hook_mounts = [{"name": "hook-sidecar-sockets", "mountPath": "/var/run/kubevirt-hooks"}]
    sidecar_mounts = list(hook_mounts)
    volumes: list[dict[str, Any]] = [{"name": "hook-sidecar-sockets", "emptyDir": {}}]
    if "pvc" in sidecar:  # the PodResources option (vm-two-gpus-root.yaml)
        sidecar_mounts.append({"name": sidecar["pvc"]["name"], "mountPath": sidecar["pvc"]["volumePath"]})
        volumes.append({"name": sidecar["pvc"]["name"], "persistentVolumeClaim": {"claimName": sidecar["pvc"]["name"]}})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": POD,
            "namespace": NAMESPACE,
            "labels": {"kubevirt.io": "virt-launcher", "vm.kubevirt.io/name": VMI},
        },
        "spec": {
            "hostname": VMI,
            "automountServiceAccountToken": False,
            # A non-root VMI's pod (KubeVirt's default): template.go computePodSecurityContext.
            "securityContext": {"runAsUser": 107, "runAsGroup": 107, "runAsNonRoot": True, "fsGroup": 107},
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
                {
                    "name": "hook-sidecar-0",
                    "image": sidecar["image"],
                    "imagePullPolicy": sidecar["imagePullPolicy"],
                    "command": sidecar["command"],
                    "args": sidecar["args"],
                    "env": [{"name": "CONTAINER_NAME", "value": "hook-sidecar-0"}],
                    # newSidecarContainerRenderer: WithNonRoot and WithDropALLCapabilities for a non-root VMI.
                    "securityContext": {"capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": sidecar_mounts,
                },
            ],
            "volumes": volumes,
        },
    }


@pytest.fixture(scope="module")
def launcher(gpu_node: Cluster) -> Doc:
    cluster = gpu_node
    docs = cluster.kustomize(DEPLOY / "hook-sidecar")
    cluster.apply(docs)
    binding = cluster.kubectl(
        "create",
        "rolebinding",
        "kgp-virt-controller",
        "-n",
        NAMESPACE,
        "--clusterrole=edit",
        "--serviceaccount=kubevirt:kubevirt-controller",
        "--dry-run=client",
        "-o",
        "yaml",
    ).stdout
    cluster.kubectl("apply", "-f", "-", stdin=binding)
    (vm,) = [d for d in docs if d["kind"] == "VirtualMachine"]
    pod = launcher_pod(vm)
    cluster.kubectl("delete", "pod", POD, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    cluster.kubectl("create", f"--as={CONTROLLER}", "-f", "-", stdin=yaml.safe_dump(pod))
    running = wait_until(
        "the launcher pod Ready",
        lambda: ready_pod(cluster, NAMESPACE, "kubevirt.io=virt-launcher"),
        explain=lambda: describe_pods(cluster, NAMESPACE),
    )
    return running


def test_the_real_scheduler_placed_it_and_the_kubelet_admitted_it(gpu_node: Cluster, launcher: Doc) -> None:
    assert launcher["spec"]["nodeName"] == "node01"
    assert launcher["spec"]["schedulerName"] == "default-scheduler"
    assert gpu_node.allocatable(RTX) == 4


def test_compute_has_the_preferred_pair_its_companions_and_the_device_nodes(gpu_node: Cluster, launcher: Doc) -> None:
    env = env_of(gpu_node.exec(NAMESPACE, POD, "compute", "env"))
    pair = set(env[RTX_ENV].split(","))
    assert pair in SAME_NUMA, f"{RTX_ENV}={env[RTX_ENV]}: not two GPUs of one NUMA node"
    companions = env["PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"]
    for gpu in sorted(pair):
        slot = gpu[:-1]
        assert f"{gpu}={slot}1+{slot}2+{slot}3" in companions.split(","), companions
    listing = gpu_node.exec(NAMESPACE, POD, "compute", "ls", "-l", "/dev/vfio")
    nodes = {line.split()[-1]: line[0] for line in listing.splitlines() if line[:1] in "cb-"}
    assert nodes.get("vfio") == "c", listing
    assert sum(1 for name, kind in nodes.items() if name.isdigit() and kind == "c") == 2, listing


def _hook_socket(launcher: Doc) -> Path:
    """The sidecar's socket in the pod's emptyDir, through a short link (sun_path holds 107 bytes)."""
    uid = launcher["metadata"]["uid"]
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


def test_the_non_root_sidecar_reads_the_allocation_from_the_domain(gpu_node: Cluster, launcher: Doc) -> None:
    env = env_of(gpu_node.exec(NAMESPACE, POD, "compute", "env"))
    allocated = set(env[RTX_ENV].split(","))
    domain = etree.fromstring(_define(_hook_socket(launcher), _vmi(VMI), env))
    sources = set()
    for hostdev in domain.iterfind("devices/hostdev[@type='pci']"):
        address = hostdev.find("source/address")
        assert address is not None
        sources.add(
            "{:04x}:{:02x}:{:02x}.{:x}".format(
                *(int(address.get(k, "0"), 16) for k in ("domain", "bus", "slot", "function"))
            )
        )
    gpus = {a for a in sources if a.endswith(".0")}
    assert gpus == allocated
    assert len(sources) == 8  # each card's four functions (companions read from sysfs: the domain has none)


def test_the_sidecar_refuses_a_domain_without_the_vmis_gpus(gpu_node: Cluster, launcher: Doc) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _define(_hook_socket(launcher), _vmi(VMI), None)
    error = refused.value
    assert isinstance(error, grpc.Call)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "'ua-gpu-gpu0'" in (error.details() or "")


def test_the_pod_is_as_the_vm_asks(launcher: Doc) -> None:
    vm = yaml.safe_load((DEPLOY / "hook-sidecar" / "vm-two-gpus.yaml").read_text())
    expected = launcher_pod(copy.deepcopy(vm))
    compute = next(c for c in launcher["spec"]["containers"] if c["name"] == "compute")
    assert compute["resources"]["limits"] == expected["spec"]["containers"][0]["resources"]["limits"]
