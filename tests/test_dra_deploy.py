"""deploy/dra: the DRA way validates strictly for Kubernetes 1.34+, builds, and says what the plugin needs.

- Every built-in object (DeviceClass, ResourceClaimTemplate, RBAC, DaemonSet …) goes through
  ``kubernetes-validate --strict`` for 1.34 (resource.k8s.io/v1 is GA there) and the newest the package knows;
  1.33 has no schema for DeviceClass v1, so the version we name is the one needed.
- The build (``kubectl kustomize deploy/dra``) holds the device plugin and the DRA plugin, never on one node.
- The DaemonSet mounts what ``serve --dra`` uses by default and its service account may do exactly what
  plugin/dra/kube.py does. The sample VM's claims reach the template's requests and a DeviceClass.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from launcher_hook.cli import cli as hook_cli
from launcher_hook.cli import serve as hook_serve
from plugin.cli import serve
from plugin.dra.options import DEFAULT_CDI_DIR, DEFAULT_PLUGIN_DIR, DEFAULT_REGISTRY_DIR
from schemas.dra import DEVICE_CLASSES
from tests.test_deploy import (
    DEPLOY,
    Doc,
    check_virtual_machine,
    container,
    is_kubevirt,
    kubernetes_validate,
    kustomize_build,
    load_all,
    manifest_files,
    one,
)

DRA = DEPLOY / "dra"
DRA_OLDEST_KUBERNETES = "1.34"
DRA_LABEL = "gpu-passthrough.kubevirt.io/dra"


@pytest.fixture(scope="module")
def built() -> list[Doc]:
    return kustomize_build(DRA)


@pytest.fixture(scope="module")
def example() -> list[Doc]:
    return kustomize_build(DRA / "example")


def dra_files() -> list[Path]:
    return [path for path in manifest_files() if path.is_relative_to(DRA)]


def assert_valid(files: list[Path], docs: list[Doc], version: str | None) -> None:
    lines = kubernetes_validate(files, version)
    problems = {level: found for level, found in lines.items() if level not in {"INFO", "WARN"}}
    assert not problems, problems
    passed = " ".join(lines.get("INFO", []))
    builtin = [doc for doc in docs if not is_kubevirt(doc)]
    for doc in builtin:
        assert f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}" in passed, doc["kind"]
    warned = lines.get("WARN", [])
    assert len(warned) == len(docs) - len(builtin), warned  # only KubeVirt's kinds lack a schema


@pytest.mark.parametrize("version", [DRA_OLDEST_KUBERNETES, None])
def test_dra_manifests_validate_strictly(version: str | None) -> None:
    files = dra_files()
    names = {path.relative_to(DRA).as_posix() for path in files}
    assert names == {
        "admission.yaml",
        "daemonset.yaml",
        "deviceclasses.yaml",
        "rbac.yaml",
        "example/namespace.yaml",
        "example/resourceclaimtemplate.yaml",
        "example/vm.yaml",
    }
    assert_valid(files, [doc for path in files for doc in load_all(path.read_text())], version)


def test_kubernetes_1_33_has_no_v1_device_class() -> None:
    lines = kubernetes_validate([DRA / "deviceclasses.yaml"], "1.33")
    assert any("Couldn't find schema for kind DeviceClass" in line for line in lines.get("WARN", []))


def test_built_output_validates_strictly(built: list[Doc], example: list[Doc], tmp_path: Path) -> None:
    for name, docs in (("dra", built), ("example", example)):
        output = tmp_path / f"{name}.yaml"
        output.write_text(yaml.safe_dump_all(docs))
        assert_valid([output], docs, DRA_OLDEST_KUBERNETES)


def test_strict_validation_refuses_a_misspelt_selector(tmp_path: Path) -> None:
    docs = load_all((DRA / "deviceclasses.yaml").read_text())
    docs[0]["spec"]["selectors"][0] = {"cell": docs[0]["spec"]["selectors"][0]["cel"]}
    broken = tmp_path / "deviceclasses.yaml"
    broken.write_text(yaml.safe_dump_all(docs))
    lines = kubernetes_validate([broken], DRA_OLDEST_KUBERNETES)
    assert set(lines) - {"INFO", "WARN"}, lines


def test_the_build_holds_both_plugins_never_on_one_node(built: list[Doc]) -> None:
    kinds = sorted((doc["kind"], doc["metadata"]["name"]) for doc in built)
    assert ("DaemonSet", "gpu-device-plugin") in kinds and ("DaemonSet", "gpu-dra-plugin") in kinds
    assert {name for kind, name in kinds if kind == "DeviceClass"} == set(DEVICE_CLASSES.values())
    assert all("namespace" not in doc["metadata"] for doc in built if doc["kind"] == "DeviceClass")

    def terms(name: str) -> list[list[dict[str, Any]]]:
        affinity = one(built, "DaemonSet", name)["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        return [term["matchExpressions"] for term in required]

    for term in terms("gpu-dra-plugin"):  # every way onto a node needs the label ...
        assert {"key": DRA_LABEL, "operator": "In", "values": ["true"]} in term
    for term in terms("gpu-device-plugin"):  # ... which keeps the device plugin away
        assert {"key": DRA_LABEL, "operator": "NotIn", "values": ["true"]} in term


def test_the_dra_daemonset_mounts_what_serve_dra_uses(built: list[Doc]) -> None:
    daemonset = one(built, "DaemonSet", "gpu-dra-plugin")
    main = container(daemonset)
    assert main["command"] == ["gpu-device-plugin"] and main["args"][:2] == ["serve", "--dra"]
    assert main["image"] == container(one(built, "DaemonSet", "gpu-device-plugin"))["image"]
    (node_name,) = [env for env in main["env"] if env["name"] == "GPU_PLUGIN_NODE_NAME"]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    option_names = {option.name for option in serve.params}
    assert {"dra", "node_name", "host_root", "metrics_address"} <= option_names
    volumes = {
        volume["name"]: volume["hostPath"]["path"] for volume in daemonset["spec"]["template"]["spec"]["volumes"]
    }
    mounts = {mount["mountPath"]: mount for mount in main["volumeMounts"]}
    for default in (DEFAULT_PLUGIN_DIR, DEFAULT_REGISTRY_DIR, Path(DEFAULT_CDI_DIR)):
        # the same path in the pod and on the node (CDI specs and the kubelet name node paths), writable
        (mount,) = [m for path, m in mounts.items() if default == Path(path) or default.is_relative_to(path)]
        assert volumes[mount["name"]] == mount["mountPath"] and not mount.get("readOnly", False), default
    assert mounts["/host/sys"]["readOnly"] and mounts["/host/dev/vfio"]["readOnly"]
    # Only its own plugin directory, never /var/lib/kubelet/plugins whole (every CSI and DRA driver's sockets).
    kubelet = Path("/var/lib/kubelet")
    under_kubelet = {Path(volume) for volume in volumes.values() if Path(volume).is_relative_to(kubelet)}
    assert under_kubelet == {DEFAULT_PLUGIN_DIR, DEFAULT_REGISTRY_DIR}
    assert {Path(path) for path in mounts if Path(path).is_relative_to(kubelet)} == under_kubelet
    security = main["securityContext"]
    assert security["privileged"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == "gpu-dra-plugin"


def test_rbac_grants_what_the_plugin_calls_and_no_more(built: list[Doc]) -> None:
    role = one(built, "ClusterRole", "gpu-dra-plugin")
    grants = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert grants == {  # the calls of plugin/dra/kube.py: list (its node's), create, replace, delete; no watch
        ("resource.k8s.io", "resourceslices"): sorted(["list", "create", "update", "delete"]),
        ("resource.k8s.io", "resourceclaims"): ["get"],
        ("", "nodes"): ["get"],
    }
    binding = one(built, "ClusterRoleBinding", "gpu-dra-plugin")
    account = one(built, "ServiceAccount", "gpu-dra-plugin")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpu-dra-plugin", "namespace": account["metadata"]["namespace"]}
    ]
    assert one(built, "DaemonSet", "gpu-dra-plugin")["metadata"]["namespace"] == account["metadata"]["namespace"]


def test_the_admission_policy_names_the_plugins_service_account_and_is_bound(built: list[Doc]) -> None:
    """The ValidatingAdmissionPolicy (its CEL: tests/test_dra_admission.py) applies to the very account the
    DaemonSet runs as, and is bound, so the API server enforces it."""
    account = one(built, "ServiceAccount", "gpu-dra-plugin")
    daemonset = one(built, "DaemonSet", "gpu-dra-plugin")
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    user = f"system:serviceaccount:{account['metadata']['namespace']}:{account['metadata']['name']}"
    policy = one(built, "ValidatingAdmissionPolicy", "gpu-dra-plugin-resourceslices")
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == f'request.userInfo.username == "{user}"'
    binding = one(built, "ValidatingAdmissionPolicyBinding", "gpu-dra-plugin-resourceslices")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_the_sample_vm_reaches_the_template_and_a_device_class(example: list[Doc]) -> None:
    vm = one(example, "VirtualMachine")
    check_virtual_machine(vm)
    template = one(example, "ResourceClaimTemplate")
    assert template["metadata"]["namespace"] == vm["metadata"]["namespace"]
    spec = vm["spec"]["template"]["spec"]
    claims = {claim["name"]: claim for claim in spec["resourceClaims"]}
    requests = {request["name"]: request for request in template["spec"]["spec"]["devices"]["requests"]}
    for gpu in spec["domain"]["devices"]["gpus"]:
        assert claims[gpu["claimName"]]["resourceClaimTemplateName"] == template["metadata"]["name"]
        assert requests[gpu["requestName"]]["exactly"]["deviceClassName"] in DEVICE_CLASSES.values()
    assert len({gpu["requestName"] for gpu in spec["domain"]["devices"]["gpus"]}) == len(requests)


def test_structural_check_catches_an_undeclared_claim(example: list[Doc]) -> None:
    vm = yaml.safe_load(yaml.safe_dump(one(example, "VirtualMachine")))
    vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"][0]["claimName"] = "other"
    with pytest.raises(AssertionError, match="claim other is not declared"):
        check_virtual_machine(vm)
    vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"][0]["deviceName"] = "nvidia.com/X"
    with pytest.raises(AssertionError, match="deviceName or a claim"):
        check_virtual_machine(vm)


def test_the_kubevirt_patch_appends_the_dra_gates() -> None:
    patch = yaml.safe_load((DRA / "kubevirt-patch.yaml").read_text())
    path = "/spec/configuration/developerConfiguration/featureGates/-"
    assert patch == [{"op": "add", "path": path, "value": gate} for gate in ("GPUsWithDRA", "HostDevicesWithDRA")]


def test_the_built_sample_vm_runs_the_hook_sidecar_without_pod_resources(example: list[Doc]) -> None:
    """The DRA sample's sidecar (docs/dra.md, "Merge with virt-launcher"): `launcher-hook serve` on its own env,
    no PodResources claim to mount (its GPUs come from claims); tests/test_hook_dra_sidecar.py runs it."""
    vm = one(example, "VirtualMachine")
    annotation = vm["spec"]["template"]["metadata"]["annotations"]["hooks.kubevirt.io/hookSidecars"]
    (sidecar,) = json.loads(annotation)
    assert sidecar["command"] == ["launcher-hook"] and "pvc" not in sidecar
    subcommand, *args = sidecar["args"]
    assert hook_cli.get_command(click.Context(hook_cli), subcommand) is hook_serve
    params = hook_serve.make_context("serve", args).params
    assert params["pod_resources_socket"] is None and params["environ_file"] is None
    assert not any(doc["kind"] == "PersistentVolumeClaim" for doc in example)
