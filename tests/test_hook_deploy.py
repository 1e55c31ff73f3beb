"""The deploy/ examples stay in step with the code: the annotation parses, its command line is one the CLI
accepts, and the VM asks for the GPUs the README says."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from launcher_hook.cli import cli, serve
from schemas.vmi import parse_vmi

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "hook-sidecar"


def documents(name: str) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all((DEPLOY / name).read_text()) if document]


def sidecars(vm: dict[str, Any]) -> list[dict[str, Any]]:
    annotation = vm["spec"]["template"]["metadata"]["annotations"]["hooks.kubevirt.io/hookSidecars"]
    parsed = json.loads(annotation)
    assert isinstance(parsed, list)
    return parsed


@pytest.mark.parametrize("name", ["vm-two-gpus.yaml", "vm-two-gpus-shim.yaml"])
def test_example_vm_asks_for_two_gpus_and_mounts_pod_resources(name: str) -> None:
    (vm,) = documents(name)
    assert vm["kind"] == "VirtualMachine"
    vmi = parse_vmi(json.dumps(vm).encode())
    assert [gpu.device_name for gpu in vmi.spec.domain.devices.gpus] == ["nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"] * 2
    (sidecar,) = sidecars(vm)
    assert sidecar["pvc"] == {"name": "kubelet-pod-resources", "volumePath": "/var/lib/kubelet/pod-resources"}
    claims = {
        doc["metadata"]["name"]
        for doc in documents("pod-resources-volume.yaml")
        if doc["kind"] == "PersistentVolumeClaim"
    }
    assert sidecar["pvc"]["name"] in claims


def test_example_sidecar_command_is_accepted_by_the_cli() -> None:
    (vm,) = documents("vm-two-gpus.yaml")
    (sidecar,) = sidecars(vm)
    assert sidecar["command"] == ["launcher-hook"]
    subcommand, *args = sidecar["args"]
    assert cli.get_command(click.Context(cli), subcommand) is serve
    sub = serve.make_context("serve", args)
    assert str(sub.params["pod_resources_socket"]) == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert str(sub.params["pod_resources_socket"]).startswith(sidecar["pvc"]["volumePath"] + "/")


def test_the_vms_namespace_enforces_pod_security_baseline_and_warns_restricted() -> None:
    (namespace,) = documents("namespace.yaml")
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"
    (vm,) = documents("vm-two-gpus.yaml")
    assert vm["metadata"]["namespace"] == namespace["metadata"]["name"]


def test_only_the_hook_sidecar_may_mount_the_pod_resources_claim() -> None:
    policy, binding = documents("pod-resources-policy.yaml")
    assert (policy["kind"], binding["kind"]) == ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE"}
    assert set(rule["resources"]) == {"pods", "pods/ephemeralcontainers"}
    (vm,) = documents("vm-two-gpus.yaml")
    (sidecar,) = sidecars(vm)
    # The binding covers the VM's namespace, the policy names the sidecar's claim and accepts the sidecar as written.
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": vm["metadata"]["namespace"]
    }
    variables = {variable["name"]: variable["expression"] for variable in policy["spec"]["variables"]}
    assert f"claimName == '{sidecar['pvc']['name']}'" in variables["claimVolumes"]
    prefix = variables["imagePrefix"].strip("\"'")
    assert sidecar["image"].startswith(prefix) and prefix.endswith(":")
    assert sidecar["command"] == ["launcher-hook"] and sidecar["args"][0] == "serve"
    assert not any(arg.startswith("--socket") for arg in sidecar["args"])
    expressions = " ".join(validation["expression"] for validation in policy["spec"]["validations"])
    assert "system:serviceaccount:kubevirt:kubevirt-controller" in expressions
    assert "c.command == ['launcher-hook']" in expressions and "c.args[0] == 'serve'" in expressions
    assert "ephemeralContainers" in expressions and "initContainers" in expressions
    assert "o.image == c.image" in expressions


def test_the_pod_resources_volume_is_the_directory_and_claimed_read_only() -> None:
    volume, claim = documents("pod-resources-volume.yaml")
    assert volume["spec"]["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}
    assert volume["spec"]["accessModes"] == claim["spec"]["accessModes"] == ["ReadOnlyMany"]
