"""The deploy/ examples stay in step with the code: the annotation parses, its command line is one the CLI
accepts, and the VM asks for the GPUs the README says; the plugin-API way (deploy/plugin-api) injects a
sidecar whose command line the CLI accepts and that listens where the Plugin CR sends virt-launcher."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from launcher_hook.cli import cli, make_source, serve
from launcher_hook.server import DEFAULT_PLUGIN_SOCKET, PLUGIN_NAME
from launcher_hook.sources import DomainSource
from schemas.vmi import parse_vmi
from tests.test_deploy import kustomize_build

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "hook-sidecar"


def documents(name: str) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all((DEPLOY / name).read_text()) if document]


def sidecars(vm: dict[str, Any]) -> list[dict[str, Any]]:
    annotation = vm["spec"]["template"]["metadata"]["annotations"]["hooks.kubevirt.io/hookSidecars"]
    parsed = json.loads(annotation)
    assert isinstance(parsed, list)
    return parsed


@pytest.mark.parametrize("name", ["vm-two-gpus.yaml", "vm-two-gpus-shim.yaml", "vm-two-gpus-root.yaml"])
def test_example_vm_asks_for_two_gpus_and_only_the_root_variant_mounts_pod_resources(name: str) -> None:
    (vm,) = documents(name)
    assert vm["kind"] == "VirtualMachine"
    vmi = parse_vmi(json.dumps(vm).encode())
    assert [gpu.device_name for gpu in vmi.spec.domain.devices.gpus] == ["nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"] * 2
    (sidecar,) = sidecars(vm)
    if name != "vm-two-gpus-root.yaml":
        assert "pvc" not in sidecar  # the domain source needs no volume (and a non-root sidecar no socket)
        return
    assert sidecar["pvc"] == {"name": "kubelet-pod-resources", "volumePath": "/var/lib/kubelet/pod-resources"}
    claims = {
        doc["metadata"]["name"]
        for doc in documents("pod-resources-volume.yaml")
        if doc["kind"] == "PersistentVolumeClaim"
    }
    assert sidecar["pvc"]["name"] in claims


def test_the_recommended_sidecar_reads_the_domain_as_kubevirt_starts_it() -> None:
    """``launcher-hook serve`` and nothing else: with the env KubeVirt gives a hook sidecar (CONTAINER_NAME, no
    device-plugin variable) the source is the domain of each call."""
    (vm,) = documents("vm-two-gpus.yaml")
    (sidecar,) = sidecars(vm)
    assert sidecar["command"] == ["launcher-hook"]
    subcommand, *args = sidecar["args"]
    assert cli.get_command(click.Context(cli), subcommand) is serve
    params = serve.make_context("serve", args).params
    assert params["pod_resources_socket"] is None and params["environ_file"] is None
    env = {"CONTAINER_NAME": "hook-sidecar-0", "HOSTNAME": "vm-with-gpus", "PATH": "/usr/bin"}
    source = make_source(params["pod_resources_socket"], params["environ_file"], params["container"], env)
    assert isinstance(source, DomainSource)
    (kustomization,) = documents("kustomization.yaml")
    assert kustomization["resources"] == ["namespace.yaml", "vm-two-gpus.yaml"]


def test_the_root_variants_sidecar_command_is_accepted_by_the_cli() -> None:
    (vm,) = documents("vm-two-gpus-root.yaml")
    (sidecar,) = sidecars(vm)
    assert sidecar["command"] == ["launcher-hook"]
    subcommand, *args = sidecar["args"]
    assert cli.get_command(click.Context(cli), subcommand) is serve
    sub = serve.make_context("serve", args)
    assert str(sub.params["pod_resources_socket"]) == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert str(sub.params["pod_resources_socket"]).startswith(sidecar["pvc"]["volumePath"] + "/")
    (plain,) = documents("vm-two-gpus.yaml")
    assert vm["spec"]["template"]["spec"] == plain["spec"]["template"]["spec"]  # the same VM otherwise


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
    (vm,) = documents("vm-two-gpus-root.yaml")
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


# -- the plugin-API way (deploy/plugin-api) ------------------------------------------------------------------

PLUGIN_DEPLOY = DEPLOY.parent / "plugin-api"
KUBEVIRT_PLUGIN_API = "plugin.kubevirt.io/v1alpha1"
KUBEVIRT_PLUGIN_SOCKETS_VOLUME = "kubevirt-plugin-sockets"  # virt-controller's emptyDir, mounted by compute
MAX_PLUGIN_SOCKET_PATH = 108  # KubeVirt's admission policy on Plugin socket paths


def plugin_documents(name: str) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all((PLUGIN_DEPLOY / name).read_text()) if document]


_CEL_TYPE = re.compile(r"\b(?:JSONPatch|Object(?:\.\w+)*)\s*\{")
_CEL_KEY = re.compile(r"([A-Za-z_]\w*)\s*:")


def cel_literal(expression: str) -> Any:
    """The value of a CEL expression made only of typed object literals, lists, strings and booleans (what a
    MutatingAdmissionPolicy's JSONPatch expression here is), as plain JSON: ``Object.spec.x{a: "b"}`` →
    ``{"a": "b"}``. Anything else in it fails to parse, so the test cannot pass on an expression it misread."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', expression)  # odd parts are string literals, left as they are
    for index in range(0, len(parts), 2):
        parts[index] = _CEL_KEY.sub(r'"\1":', _CEL_TYPE.sub("{", parts[index]))
    return json.loads("".join(parts))


def injected(policy: dict[str, Any]) -> dict[str, Any]:
    """The container the injector's JSON patch adds (and nothing else: no volume)."""
    ((mutation,),) = [policy["spec"]["mutations"]]
    assert mutation["patchType"] == "JSONPatch"
    patches = cel_literal(mutation["jsonPatch"]["expression"])
    assert [(patch["op"], patch["path"]) for patch in patches] == [("add", "/spec/containers/-")]
    value: dict[str, Any] = patches[0]["value"]
    return value


def test_cel_literal_reads_typed_objects_and_refuses_anything_else() -> None:
    assert cel_literal('[Object.spec.a{b: "c: d", e: [true]}]') == [{"b": "c: d", "e": [True]}]
    with pytest.raises(json.JSONDecodeError):
        cel_literal("[Object.spec.a{b: object.metadata.name}]")


def test_the_plugin_cr_points_virt_launcher_at_the_hooks_default_plugin_socket() -> None:
    (plugin,) = plugin_documents("plugin.yaml")
    assert (plugin["apiVersion"], plugin["kind"]) == (KUBEVIRT_PLUGIN_API, "Plugin")
    name = plugin["metadata"]["name"]
    assert name == PLUGIN_NAME
    spec = plugin["spec"]
    assert set(spec) <= {"condition", "failureStrategy", "domainHooks", "nodeHooks", "mutatingAdmissionPolicies"}
    assert spec["failureStrategy"] == "Fail"
    (hook,) = spec["domainHooks"]
    assert set(hook) <= {"sidecar", "cel", "condition", "failureStrategy", "timeout"}
    socket_path = hook["sidecar"]["socketPath"]
    # KubeVirt's rules for a sidecar socket path, and the path `serve --api plugins` listens on by default.
    assert socket_path.startswith(f"/var/run/kubevirt-plugin/{name}/") and socket_path.endswith(".sock")
    assert len(socket_path) <= MAX_PLUGIN_SOCKET_PATH
    assert socket_path == str(DEFAULT_PLUGIN_SOCKET)
    assert re.fullmatch(r"\d+s", hook["timeout"])
    (vm,) = documents("vm-two-gpus.yaml")
    # The condition picks the VMIs the injector serves: the VM's namespace and its GPUs' vendor domain.
    assert f'vmi.Namespace == "{vm["metadata"]["namespace"]}"' in spec["condition"]
    vendors = {gpu["deviceName"].split("/")[0] for gpu in vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"]}
    assert vendors == {"nvidia.com"}
    assert 'g.DeviceName.startsWith("nvidia.com/")' in spec["condition"]
    policy, _ = plugin_documents("sidecar-injector.yaml")
    assert spec["mutatingAdmissionPolicies"] == [{"name": policy["metadata"]["name"]}]


def test_the_injected_sidecar_serves_the_plugin_api_where_the_plugin_cr_says() -> None:
    policy, binding = plugin_documents("sidecar-injector.yaml")
    assert (policy["kind"], binding["kind"]) == ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert policy["spec"]["reinvocationPolicy"] == "Never" and policy["spec"]["failurePolicy"] == "Fail"
    container = injected(policy)
    (plugin,) = plugin_documents("plugin.yaml")
    (hook,) = plugin["spec"]["domainHooks"]

    assert container["command"] == ["launcher-hook"]
    subcommand, *args = container["args"]
    assert cli.get_command(click.Context(cli), subcommand) is serve
    params = serve.make_context("serve", args).params
    assert params["api"] == "plugins"
    assert str(params["plugin_socket_path"]) == hook["sidecar"]["socketPath"]

    mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
    sockets = mounts[KUBEVIRT_PLUGIN_SOCKETS_VOLUME]
    # Only the plugin's own sub-directory, mounted where the socket path puts it (KubeVirt refuses no subPath).
    assert sockets["subPath"] == plugin["metadata"]["name"]
    assert Path(sockets["mountPath"]) == Path(hook["sidecar"]["socketPath"]).parent
    # Non-root, so it could never reach the kubelet's PodResources socket: it reads the domain, mounting nothing else.
    assert list(mounts) == [KUBEVIRT_PLUGIN_SOCKETS_VOLUME]
    assert params["pod_resources_socket"] is None and params["environ_file"] is None
    assert isinstance(make_source(None, None, params["container"], {"PATH": "/usr/bin"}), DomainSource)
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["runAsNonRoot"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}

    # It goes only into the VM's namespace, the one with the claim; the conditions name the pieces above.
    (vm,) = documents("vm-two-gpus.yaml")
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": vm["metadata"]["namespace"]
    }
    conditions = " ".join(condition["expression"] for condition in policy["spec"]["matchConditions"])
    assert f'v.name == "{KUBEVIRT_PLUGIN_SOCKETS_VOLUME}"' in conditions
    assert f'!object.spec.containers.exists(c, c.name == "{container["name"]}")' in conditions
    assert 'r.startsWith("nvidia.com/")' in conditions


def test_the_plugin_overlay_is_the_same_vm_without_the_sidecar_annotation() -> None:
    kustomization = plugin_documents("kustomization.yaml")[0]
    assert kustomization["resources"] == ["../hook-sidecar", "plugin.yaml", "sidecar-injector.yaml"]
    (patch,) = kustomization["patches"]
    assert patch["target"]["name"] == documents("vm-two-gpus.yaml")[0]["metadata"]["name"]
    assert yaml.safe_load(patch["patch"]) == [{"op": "remove", "path": "/spec/template/metadata/annotations"}]
    (vm,) = documents("vm-two-gpus.yaml")
    assert list(vm["spec"]["template"]["metadata"]["annotations"]) == ["hooks.kubevirt.io/hookSidecars"]
    gate = {"op": "add", "path": "/spec/configuration/developerConfiguration/featureGates/-", "value": "Plugins"}
    assert yaml.safe_load((PLUGIN_DEPLOY / "kubevirt-patch.yaml").read_text()) == [gate]


def test_the_plugin_overlay_builds_the_plugin_way_only() -> None:
    built = kustomize_build(PLUGIN_DEPLOY)
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in built}
    hook_sidecar = {(doc["kind"], doc["metadata"]["name"]) for doc in kustomize_build(DEPLOY)}
    assert kinds - hook_sidecar == {
        ("Plugin", PLUGIN_NAME),
        ("MutatingAdmissionPolicy", "kubevirt-gpu-passthrough-sidecar"),
        ("MutatingAdmissionPolicyBinding", "kubevirt-gpu-passthrough-sidecar"),
    }
    assert hook_sidecar <= kinds
    (vm,) = [doc for doc in built if doc["kind"] == "VirtualMachine"]
    assert "hooks.kubevirt.io/hookSidecars" not in vm["spec"]["template"]["metadata"].get("annotations", {})
    assert parse_vmi(json.dumps(vm).encode()).spec.domain.devices.gpus
