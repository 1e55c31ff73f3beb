"""Scenario 1: ``deploy/`` and each of its parts and variants, applied to the real API server.

Every object must be accepted server-side with strict field validation (an unknown or misspelt field is an
error, not a warning), KubeVirt's kinds by KubeVirt's own CRD schemas (``kubevirt-crds``). The admission
policies are then evaluated by the API server's own CEL: the PodResources-claim policy (of the root-VMI option,
``deploy/hook-sidecar/vm-two-gpus-root.yaml``, not in the kustomization) refuses a pod of the wrong shape with its
message, and the plugin-API sidecar injector mutates a virt-launcher-shaped pod.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.support import DEPLOY, Cluster, Doc

pytestmark = pytest.mark.cluster

CONTROLLER = "system:serviceaccount:kubevirt:kubevirt-controller"
IMAGE = "registry.example.com/kubevirt-gpu-passthrough:0.1.0"


def _with_components(cluster: Cluster, tmp_path: Path, *components: str) -> Path:
    """A kustomization of the whole of ``deploy/`` (built) plus copies of the named ``deploy/components``
    (kustomize takes no path outside a kustomization's own root)."""
    root = tmp_path / "-".join(components)
    root.mkdir()
    (root / "deploy.yaml").write_text(cluster.kubectl("kustomize", str(DEPLOY)).stdout)
    for name in components:
        shutil.copytree(DEPLOY / "components" / name, root / "components" / name)
    (root / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["deploy.yaml"],
                "components": [f"components/{name}" for name in components],
            }
        )
    )
    return root


@pytest.fixture(scope="module")
def applied(cluster: Cluster) -> Iterator[list[Doc]]:
    """The top-level ``deploy/``, applied for real. Its DaemonSets mount the machine's own /sys: they place
    nothing while the node has no workload label, and go with this module (the later scenarios point them at
    the fixture tree; the node agent must never run against this machine's sysfs)."""
    docs = cluster.kustomize(DEPLOY)
    cluster.apply(docs)
    yield docs
    cluster.kubectl("delete", "daemonset", "--all", "-n", "kubevirt-gpu-passthrough", "--wait=true")


def test_the_whole_of_deploy_is_accepted_and_stored(cluster: Cluster, applied: list[Doc]) -> None:
    for doc in applied:
        namespace = doc["metadata"].get("namespace")
        where = ["-n", namespace] if namespace else []
        stored = cluster.json(
            "get",
            f"{doc['kind']}.{doc['apiVersion'].split('/')[0]}" if "/" in doc["apiVersion"] else doc["kind"],
            doc["metadata"]["name"],
            *where,
        )
        assert stored["metadata"]["name"] == doc["metadata"]["name"]
    kinds = {doc["kind"] for doc in applied}
    assert {"DaemonSet", "VirtualMachine", "KubeVirt"} <= kinds
    # The recommended hook reads the domain: nothing of the node's kubelet directory is in the build.
    assert not kinds & {"PersistentVolume", "PersistentVolumeClaim", "ValidatingAdmissionPolicy"}


ROOT_OPTION = ("pod-resources-volume.yaml", "pod-resources-policy.yaml", "vm-two-gpus-root.yaml")
"""The PodResources option for root VMIs (deploy/README.md, "PodResources needs root"): plain files, applied as
``kubectl apply -f`` each."""


def _root_option() -> list[Doc]:
    return [
        doc for name in ROOT_OPTION for doc in yaml.safe_load_all((DEPLOY / "hook-sidecar" / name).read_text()) if doc
    ]


@pytest.mark.parametrize(
    "part",
    [
        "device-plugin",
        "node-agent",
        "hook-sidecar",
        "hook-sidecar-root-option",
        "kubevirt-standalone",
        "dra",
        "dra/example",
        "plugin-api",
    ],
)
def test_each_part_and_variant_is_accepted_server_side(cluster: Cluster, applied: list[Doc], part: str) -> None:
    if part == "kubevirt-standalone":
        docs = [doc for doc in applied if doc["kind"] == "KubeVirt"]
    elif part == "hook-sidecar-root-option":
        docs = _root_option()
    else:
        docs = cluster.kustomize(DEPLOY / part)
    assert docs
    done = cluster.apply(docs, "--dry-run=server")
    assert done.stderr.strip() == "" or "Warning" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "components",
    [("gpu-operator",), ("default-workload-vm-passthrough",), ("gpu-operator", "default-workload-vm-passthrough")],
)
def test_each_component_is_accepted_server_side(
    cluster: Cluster, applied: list[Doc], tmp_path: Path, components: tuple[str, ...]
) -> None:
    docs = cluster.kustomize(_with_components(cluster, tmp_path, *components))
    cluster.apply(docs, "--dry-run=server")


def _refusal(cluster: Cluster, doc: Doc) -> str:
    """The API server's error for ``doc`` (server-side apply, strict, dry run); fails if it is accepted."""
    done = cluster.apply([doc], "--dry-run=server", check=False)
    assert done.returncode != 0, f"{doc['kind']} {doc['metadata']['name']} was accepted"
    return done.stderr


def test_strict_field_validation_is_on(cluster: Cluster, applied: list[Doc]) -> None:
    """The check above can fail: a misspelt field in a DaemonSet is refused by the real API server."""
    (daemonset,) = [d for d in applied if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpu-device-plugin"]
    broken = copy.deepcopy(daemonset)
    broken["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Never"
    assert "imagePulPolicy" in _refusal(cluster, broken)


def test_kubevirts_schema_refuses_a_vm_it_does_not_know(cluster: Cluster, applied: list[Doc]) -> None:
    (vm,) = [d for d in applied if d["kind"] == "VirtualMachine"]
    broken = copy.deepcopy(vm)
    broken["spec"]["template"]["spec"]["domain"]["devices"]["gpus"][0]["deviceNmae"] = "x"
    assert "deviceNmae" in _refusal(cluster, broken)


def _launcher_pod(name: str, sidecar: dict[str, Any] | None = None) -> Doc:
    """A pod shaped as virt-controller renders a virt-launcher pod with the hook sidecar (its parts we test)."""
    containers: list[dict[str, Any]] = [
        {
            "name": "compute",
            "image": IMAGE,
            "command": ["sleep", "infinity"],
            "resources": {"limits": {"nvidia.com/TU106_GEFORCE_RTX_2060_REV__A": "2"}},
        }
    ]
    if sidecar is not None:
        containers.append(sidecar)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "gpu-vms", "labels": {"kubevirt.io": "virt-launcher"}},
        "spec": {
            # virt-controller renders launcher pods without the API token (KubeVirt's template service).
            "automountServiceAccountToken": False,
            "containers": containers,
            "volumes": [
                {"name": "hook-sidecar-sockets", "emptyDir": {}},
                {"name": "kubevirt-plugin-sockets", "emptyDir": {}},
                {"name": "kubelet-pod-resources", "persistentVolumeClaim": {"claimName": "kubelet-pod-resources"}},
            ],
        },
    }


def _sidecar(command: list[str], args: list[str]) -> dict[str, Any]:
    return {
        "name": "hook-sidecar-0",
        "image": IMAGE,
        "command": command,
        "args": args,
        "volumeMounts": [{"name": "kubelet-pod-resources", "mountPath": "/var/lib/kubelet/pod-resources"}],
    }


def _create(cluster: Cluster, pod: Doc, *, as_user: str | None) -> tuple[int, str, str]:
    who = [f"--as={as_user}"] if as_user else []
    done = cluster.kubectl(
        "create", "--dry-run=server", "-o", "yaml", *who, "-f", "-", stdin=yaml.safe_dump(pod), check=False
    )
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def controller_may_create_pods(cluster: Cluster, applied: list[Doc]) -> None:
    """RBAC for KubeVirt's controller account in ``gpu-vms`` (KubeVirt's install grants it cluster-wide), and the
    PodResources option's claim and policy, applied for real."""
    cluster.apply([doc for doc in _root_option() if doc["kind"] != "VirtualMachine"])
    cluster.let_virt_controller_create_pods("gpu-vms")


def test_the_claim_policy_refuses_a_pod_not_made_by_virt_controller(
    cluster: Cluster, applied: list[Doc], controller_may_create_pods: None
) -> None:
    pod = _launcher_pod("vap-not-controller", _sidecar(["launcher-hook"], ["serve"]))
    rc, _out, err = _create(cluster, pod, as_user=None)
    assert rc != 0
    assert "only KubeVirt's virt-controller may create pods that mount the kubelet-pod-resources claim" in err


def test_the_claim_policy_refuses_a_sidecar_that_is_not_the_hook(
    cluster: Cluster, applied: list[Doc], controller_may_create_pods: None
) -> None:
    pod = _launcher_pod("vap-wrong-shape", _sidecar(["sh"], ["-c", "sleep infinity"]))
    rc, _out, err = _create(cluster, pod, as_user=CONTROLLER)
    assert rc != 0
    assert "only a hook sidecar running this project's image as `launcher-hook serve`" in err
    pod = _launcher_pod("vap-own-socket", _sidecar(["launcher-hook"], ["serve", "--socket=/tmp/x.sock"]))
    rc, _out, err = _create(cluster, pod, as_user=CONTROLLER)
    assert rc != 0
    assert "(no --socket or\n--plugin-socket)" in err or "no --socket or --plugin-socket" in err.replace("\n", " ")


def test_the_claim_policy_admits_the_hook_sidecar_from_virt_controller(
    cluster: Cluster, applied: list[Doc], controller_may_create_pods: None
) -> None:
    pod = _launcher_pod(
        "vap-hook",
        _sidecar(["launcher-hook"], ["serve", "--pod-resources-socket", "/var/lib/kubelet/pod-resources/kubelet.sock"]),
    )
    rc, out, err = _create(cluster, pod, as_user=CONTROLLER)
    assert rc == 0, err
    assert yaml.safe_load(out)["metadata"]["name"] == "vap-hook"


@pytest.fixture(scope="module")
def injector(cluster: Cluster, applied: list[Doc]) -> None:
    docs = [
        d
        for d in cluster.kustomize(DEPLOY / "plugin-api")
        if d["kind"] in ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")
    ]
    assert len(docs) == 2
    cluster.apply(docs)


def test_the_sidecar_injector_mutates_a_virt_launcher_pod(
    cluster: Cluster, injector: None, controller_may_create_pods: None
) -> None:
    pod = _launcher_pod("map-launcher")
    pod["spec"]["volumes"] = [v for v in pod["spec"]["volumes"] if v["name"] != "kubelet-pod-resources"]

    def created() -> Doc | None:
        rc, out, _err = _create(cluster, pod, as_user=CONTROLLER)
        mutated: Doc = yaml.safe_load(out) if rc == 0 else {}
        names = [c["name"] for c in mutated.get("spec", {}).get("containers", [])]
        return mutated if "gpu-passthrough-hook" in names else None

    from tests.cluster.support import wait_until

    # A new policy takes effect once the API server's policy informer has it (seconds).
    mutated = wait_until("the MutatingAdmissionPolicy to inject the hook", created, deadline=60)
    hook = next(c for c in mutated["spec"]["containers"] if c["name"] == "gpu-passthrough-hook")
    assert hook["image"] == IMAGE
    assert hook["command"] == ["launcher-hook"]
    assert hook["args"] == ["serve", "--api", "plugins"]  # non-root: it reads the domain MutateDomain carries
    assert "env" not in hook
    assert hook["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert hook["securityContext"]["runAsNonRoot"] is True
    assert {m["name"]: m.get("readOnly", False) for m in hook["volumeMounts"]} == {"kubevirt-plugin-sockets": False}
    assert {v["name"] for v in mutated["spec"]["volumes"]} == {v["name"] for v in pod["spec"]["volumes"]}
    compute = next(c for c in mutated["spec"]["containers"] if c["name"] == "compute")
    assert compute["resources"]["limits"] == {"nvidia.com/TU106_GEFORCE_RTX_2060_REV__A": "2"}
    # Not a launcher pod, or no GPU: left alone.
    plain = _launcher_pod("map-plain")
    plain["metadata"]["labels"] = {"app": "other"}
    plain["spec"]["volumes"] = [v for v in plain["spec"]["volumes"] if v["name"] != "kubelet-pod-resources"]
    rc, out, err = _create(cluster, plain, as_user=CONTROLLER)
    assert rc == 0, err
    assert [c["name"] for c in yaml.safe_load(out)["spec"]["containers"]] == ["compute"]
