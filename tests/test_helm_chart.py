"""deploy/helm/kubevirt-gpu-passthrough: the chart renders exactly what the kustomize tree builds.

One source of truth, two front ends (docs/helm.md, "Drift"): the templates are written by hand, and for every
kustomize build and component of ``deploy/`` a values combination (:data:`VARIANTS`) must render exactly the
objects that build holds. **Nothing may differ**: the same set of objects (apiVersion, kind, namespace, name),
each equal field by field as parsed YAML; only the order of the objects and of mapping keys is free (the
order of lists is not: it is part of an object). The chart adds no label of Helm's own for that reason.
:func:`test_every_kustomization_of_deploy_has_a_variant` fails when ``deploy/`` gains a kustomization or a
component the chart does not offer.

Every rendered object also passes the checks tests/test_deploy.py applies to the kustomize output:
``kubernetes-validate --strict`` for the oldest Kubernetes the variant needs and the newest the package knows
(built-in kinds), the structural checks for KubeVirt's kinds. ``helm`` is built from its Go module
(tests/helm_support.py); ``helm lint --strict`` runs on the chart.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm_support import CHART, helm
from tests.test_deploy import (
    DEPLOY,
    OLDEST_KUBERNETES,
    PLUGIN_API_OLDEST_KUBERNETES,
    Doc,
    is_kubevirt,
    kubernetes_validate,
    kubevirt_checker,
    kustomize_build,
    load_all,
)
from tests.test_dra_deploy import DRA_OLDEST_KUBERNETES
from tests.test_node_agent_deploy import build_with

ROOT = DEPLOY.parent
DOCS = ROOT / "docs" / "helm.md"
Key = tuple[str, str, str, str]

# -- the variants --------------------------------------------------------------------------------------------

OFF_CR = {"kubevirt.createCR": False}
NO_NODE = {"sandboxWorkloads.enabled": False}
NO_AGENTS = {"vfioManager.enabled": False, "vgpuDeviceManager.enabled": False}
NO_WAIT = {"sandboxDevicePlugin.waitForNodeAgent.enabled": False}


@dataclass(frozen=True)
class Variant:
    """A kustomize build (a directory of deploy/, or deploy/ with extra components) and the chart values that
    render the same objects; ``kubernetes``: the oldest release its objects validate for."""

    build: str
    values: dict[str, Any]
    components: tuple[str, ...] = ()
    kubernetes: str = OLDEST_KUBERNETES
    covers: tuple[str, ...] = field(default=())


VARIANTS: dict[str, Variant] = {
    "deploy": Variant(".", {}, covers=(".", "kubevirt", "components/wait-for-node-agent")),
    "deploy + components/default-workload-vm-passthrough": Variant(
        ".",
        {"sandboxWorkloads.defaultWorkload": "vm-passthrough"},
        components=("default-workload-vm-passthrough",),
        covers=("components/default-workload-vm-passthrough",),
    ),
    "deploy + components/gpu-operator": Variant(
        ".", {"gpuOperator.deployLabels": True}, components=("gpu-operator",), covers=("components/gpu-operator",)
    ),
    "deploy + components/node-label-protocol": Variant(
        ".",
        {"nodeLabelProtocol.enabled": True},
        components=("node-label-protocol",),
        covers=("components/node-label-protocol",),
    ),
    "device-plugin": Variant(
        "device-plugin", {**OFF_CR, "examples.vm": False, **NO_AGENTS, **NO_WAIT}, covers=("device-plugin",)
    ),
    "node-agent": Variant(
        "node-agent",
        {**OFF_CR, "examples.vm": False, "sandboxDevicePlugin.enabled": False, "namespace.create": False},
        covers=("node-agent",),
    ),
    "hook-sidecar": Variant("hook-sidecar", {**OFF_CR, **NO_NODE}, covers=("hook-sidecar",)),
    "plugin-api": Variant(
        "plugin-api",
        {**OFF_CR, **NO_NODE, "launcherHook.api": "plugins"},
        kubernetes=PLUGIN_API_OLDEST_KUBERNETES,
        covers=("plugin-api",),
    ),
    "dra": Variant(
        "dra",
        {**OFF_CR, "examples.vm": False, **NO_AGENTS, **NO_WAIT, "dra.enabled": True},
        kubernetes=DRA_OLDEST_KUBERNETES,
        covers=("dra",),
    ),
    "dra/example": Variant(
        "dra/example",
        {**OFF_CR, **NO_NODE, "examples.vm": False, "examples.draVM": True},
        kubernetes=DRA_OLDEST_KUBERNETES,
        covers=("dra/example",),
    ),
}


def set_flags(values: dict[str, Any]) -> list[str]:
    """``--set-json key=<json>`` for each dotted key (typed: a boolean stays a boolean)."""
    return [flag for dotted, value in values.items() for flag in ("--set-json", f"{dotted}={json.dumps(value)}")]


def render(values: dict[str, Any], chart: Path = CHART, *, check: bool = True) -> list[Doc]:
    done = helm("template", "kgp", str(chart), *set_flags(values), check=check)
    return load_all(done.stdout)


def refusal(values: dict[str, Any]) -> str:
    done = helm("template", "kgp", str(CHART), *set_flags(values), check=False)
    assert done.returncode != 0, f"rendered: {values}"
    return done.stderr


def kustomized(variant: Variant, tmp_path: Path) -> list[Doc]:
    if variant.components:
        return build_with(tmp_path, *variant.components)
    return kustomize_build(DEPLOY / variant.build)


def key(doc: Doc) -> Key:
    meta = doc["metadata"]
    return (doc["apiVersion"], doc["kind"], meta.get("namespace", ""), meta["name"])


def differences(helm_docs: list[Doc], kustomize_docs: list[Doc]) -> list[str]:
    """Every difference between the two sets of objects, each naming the object and the field."""
    ours, theirs = {key(d): d for d in helm_docs}, {key(d): d for d in kustomize_docs}
    assert len(ours) == len(helm_docs) and len(theirs) == len(kustomize_docs), "an object twice"
    found = [f"only the chart renders {k}" for k in sorted(set(ours) - set(theirs))]
    found += [f"only kustomize builds {k}" for k in sorted(set(theirs) - set(ours))]

    def walk(a: object, b: object, where: str) -> Iterator[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            for name in sorted(set(a) | set(b)):
                if name not in b:
                    yield f"{where}.{name}: only in the chart"
                elif name not in a:
                    yield f"{where}.{name}: only in kustomize's"
                else:
                    yield from walk(a[name], b[name], f"{where}.{name}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                yield from walk(x, y, f"{where}[{i}]")
        elif a != b or type(a) is not type(b):
            yield f"{where}: the chart's {a!r}, kustomize's {b!r}"

    for k in sorted(set(ours) & set(theirs)):
        found += [f"{k[1]} {k[3]}{line}" for line in walk(ours[k], theirs[k], "")]
    return found


# -- the same objects -------------------------------------------------------------------------------------------


def test_helm_lint_passes_strictly() -> None:
    done = helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout, done.stdout
    assert "[ERROR]" not in done.stdout and "[WARNING]" not in done.stdout, done.stdout


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_variant_renders_exactly_the_kustomize_build(name: str, tmp_path: Path) -> None:
    variant = VARIANTS[name]
    rendered = render(variant.values)
    built = kustomized(variant, tmp_path)
    assert rendered and built
    assert differences(rendered, built) == []


def test_every_kustomization_of_deploy_has_a_variant() -> None:
    """A kustomization or component added to deploy/ fails here until the chart offers it (a variant covers it)."""
    kustomizations = {
        path.parent.relative_to(DEPLOY).as_posix()
        for path in DEPLOY.rglob("kustomization.yaml")
        if not path.is_relative_to(CHART.parent)
    }
    covered = [where for variant in VARIANTS.values() for where in variant.covers]
    assert sorted(covered) == sorted(set(covered))
    assert set(covered) == kustomizations


def test_the_comparison_catches_a_drifted_template(tmp_path: Path) -> None:
    """The check can fail: one changed line in a copy of the chart is reported, naming the object and field."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    template = chart / "templates" / "device-plugin.yaml"
    text = template.read_text()
    assert text.count("terminationGracePeriodSeconds: 15") == 1
    template.write_text(text.replace("terminationGracePeriodSeconds: 15", "terminationGracePeriodSeconds: 16"))
    assert differences(render({}, chart), kustomize_build(DEPLOY)) == [
        "DaemonSet gpu-device-plugin.spec.template.spec.terminationGracePeriodSeconds: the chart's 16, kustomize's 15"
    ]
    (chart / "files" / "vgpu-config.yaml").write_text("version: v1\nvgpu-configs: {}\n")
    found = differences(render({}, chart), kustomize_build(DEPLOY))
    assert any(line.startswith("only the chart renders ('v1', 'ConfigMap'") for line in found), found


@pytest.mark.parametrize(
    ("copy", "source"),
    [
        ("vgpu-config.yaml", "node-agent/vgpu-config.yaml"),
        ("workloads.yaml", "components/node-label-protocol/workloads.yaml"),
    ],
)
def test_the_charts_config_files_are_deploys(copy: str, source: str) -> None:
    """The chart's files/ are copies (a chart cannot read outside its directory): byte for byte the same."""
    assert (CHART / "files" / copy).read_bytes() == (DEPLOY / source).read_bytes()


# -- every rendered object passes deploy's checks ----------------------------------------------------------------


BUILTIN_GROUPS = ("v1", "apps/", "networking.k8s.io/", "rbac.authorization.k8s.io/", "admissionregistration.k8s.io/",
                  "resource.k8s.io/")  # fmt: skip


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_rendered_object_passes_deploys_checks(name: str, tmp_path: Path) -> None:
    variant = VARIANTS[name]
    rendered = render(variant.values)
    builtin = [doc for doc in rendered if doc["apiVersion"] == "v1" or doc["apiVersion"].startswith(BUILTIN_GROUPS)]
    kubevirt = [doc for doc in rendered if is_kubevirt(doc)]
    others = [doc for doc in rendered if doc not in builtin and doc not in kubevirt]
    # The Plugin CR (plugin.kubevirt.io) has neither a schema nor a structural check in test_deploy.py;
    # test_hook_deploy.py checks the kustomize one, which the chart's equals (above).
    assert [doc["kind"] for doc in others] == (["Plugin"] if name == "plugin-api" else [])
    for doc in kubevirt:
        kubevirt_checker(doc)
    if not builtin:
        return
    output = tmp_path / "rendered.yaml"
    output.write_text(yaml.safe_dump_all(builtin))
    for version in (variant.kubernetes, None):
        lines = kubernetes_validate([output], version)
        problems = {level: found for level, found in lines.items() if level not in {"INFO", "WARN"}}
        assert not problems, problems
        assert not lines.get("WARN"), lines["WARN"]
        passed = " ".join(lines.get("INFO", []))
        for doc in builtin:
            assert f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}" in passed, doc["kind"]


# -- values of the chart's own ----------------------------------------------------------------------------------


def by_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def images(docs: list[Doc]) -> dict[str, str]:
    """Every image the objects name: containers, the hook annotation, the sidecar injector's CEL."""
    found: dict[str, str] = {}
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            found[f"{doc['metadata']['name']}/{container['name']}"] = container["image"]
        annotation = doc.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations", {})
        if "hooks.kubevirt.io/hookSidecars" in annotation:
            (sidecar,) = json.loads(annotation["hooks.kubevirt.io/hookSidecars"])
            found[f"{doc['metadata']['name']}/hook"] = sidecar["image"]
        if doc["kind"] == "MutatingAdmissionPolicy":
            expression = doc["spec"]["mutations"][0]["jsonPatch"]["expression"]
            (line,) = [line for line in expression.splitlines() if "image:" in line]
            found[f"{doc['metadata']['name']}/injected"] = line.split('"')[1]
    return found


def test_one_image_setting_moves_every_image_and_each_component_may_have_its_own() -> None:
    everything = {"dra.enabled": True, "examples.draVM": True}
    default = images(render(everything))
    assert set(default.values()) == {"registry.example.com/kubevirt-gpu-passthrough:0.1.0"}
    assert len(default) == 7
    moved = images(render({**everything, "sandboxDevicePlugin.repository": "reg.local:5000/team",
                           "sandboxDevicePlugin.version": "sha256:" + "ab" * 32}))  # fmt: skip
    assert set(moved.values()) == {"reg.local:5000/team/kubevirt-gpu-passthrough@sha256:" + "ab" * 32}
    own = images(render({"vfioManager.image": "agent", "vfioManager.version": "2", "launcherHook.version": "3"}))
    assert own["gpu-node-agent-passthrough/gpu-node-agent"] == "registry.example.com/agent:2"
    assert own["gpu-node-agent-vgpu/gpu-node-agent"] == "registry.example.com/kubevirt-gpu-passthrough:0.1.0"
    assert own["vm-with-gpus/hook"] == "registry.example.com/kubevirt-gpu-passthrough:3"
    injected = images(render({"launcherHook.api": "plugins", "launcherHook.repository": "hooks.example"}))
    assert injected["kubevirt-gpu-passthrough-sidecar/injected"] == "hooks.example/kubevirt-gpu-passthrough:0.1.0"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"sandboxWorkloads.defaultWorkload": "vm-vgpu"}, "sandboxWorkloads.defaultWorkload=vm-vgpu is not offered"),
        ({"gpuOperator.deployLabels": True, "sandboxWorkloads.defaultWorkload": "vm-passthrough"},
         "the GPU Operator applies its own default"),
        ({**NO_AGENTS}, "sandboxDevicePlugin.waitForNodeAgent.enabled without vfioManager or vgpuDeviceManager"),
        ({"sandboxWorkloads.defaultWorkload": "vm"}, "at '/sandboxWorkloads/defaultWorkload'"),
        ({"sandboxDevicePlugin.enable": False},
         "at '/sandboxDevicePlugin': additional properties 'enable' not allowed"),
        ({"sandboxDevicePlugin.version": '0.1.0", "privileged": true, "x": "'}, "at '/sandboxDevicePlugin/version'"),
        ({"sandboxDevicePlugin.repository": "reg\n  evil: true"}, "at '/sandboxDevicePlugin/repository'"),
        ({"daemonsets.priorityClassName": "x\n      hostNetwork: true"}, "at '/daemonsets/priorityClassName'"),
        ({"namespace.name": "Kube System"}, "at '/namespace/name'"),
        ({"vgpuDeviceManager.config.default": "a b"}, "at '/vgpuDeviceManager/config/default'"),
        ({"sandboxDevicePlugin.waitForNodeAgent.timeoutSeconds": "600; reboot"},
         "at '/sandboxDevicePlugin/waitForNodeAgent/timeoutSeconds'"),
    ],
)  # fmt: skip
def test_values_without_meaning_are_refused_naming_the_value(values: dict[str, Any], message: str) -> None:
    assert message in refusal(values)


def test_sandbox_workloads_off_renders_no_node_component() -> None:
    docs = render({**NO_NODE})
    assert not by_kind(docs, "DaemonSet") and not by_kind(docs, "ServiceAccount")
    assert sorted(key(doc)[1:] for doc in docs) == [
        ("KubeVirt", "kubevirt", "kubevirt"),
        ("Namespace", "", "gpu-vms"),
        ("VirtualMachine", "gpu-vms", "vm-with-gpus"),
    ]


def test_the_vgpu_config_is_named_as_kustomize_names_it(tmp_path: Path) -> None:
    """The ConfigMap's hash suffix: another selected config, built by kustomize from a copy of node-agent/."""
    copy = tmp_path / "node-agent"
    shutil.copytree(DEPLOY / "node-agent", copy)
    kustomization = copy / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count("selected=L40S-1Q") == 1
    kustomization.write_text(text.replace("selected=L40S-1Q", "selected=T4-1Q"))
    values = {**VARIANTS["node-agent"].values, "vgpuDeviceManager.config.default": "T4-1Q"}
    rendered = render(values)
    assert differences(rendered, kustomize_build(copy)) == []
    (default,) = by_kind(render(VARIANTS["node-agent"].values), "ConfigMap")
    assert list(by_kind(rendered, "ConfigMap")) != [default]


def test_an_own_vgpu_configmap_is_referred_to_and_not_rendered() -> None:
    docs = render({"vgpuDeviceManager.config.name": "my-vgpu-configs", "vgpuDeviceManager.config.default": "T4-1Q"})
    assert not by_kind(docs, "ConfigMap")
    pod = by_kind(docs, "DaemonSet")["gpu-node-agent-vgpu"]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert {"name": "GPU_NODE_AGENT_VGPU_SELECT", "value": "T4-1Q"} in agent["env"]
    (config,) = [volume for volume in pod["volumes"] if volume["name"] == "config"]
    assert config["configMap"]["name"] == "my-vgpu-configs"


def test_env_is_set_or_added_by_name_and_args_replace_as_in_the_operator() -> None:
    docs = render({
        "vfioManager.env": [{"name": "GPU_NODE_AGENT_HOST_ROOT", "value": "/other"}, {"name": "EXTRA", "value": "1"}],
        "sandboxDevicePlugin.args": ["serve", "--host-root", "/host", "--log-format", "text"],
    })  # fmt: skip
    daemonsets = by_kind(docs, "DaemonSet")
    (agent,) = daemonsets["gpu-node-agent-passthrough"]["spec"]["template"]["spec"]["containers"]
    assert agent["env"] == [
        {"name": "GPU_NODE_AGENT_STATE_DIR", "value": "/run/kubevirt-gpu-passthrough/node-agent"},
        {"name": "GPU_NODE_AGENT_HOST_ROOT", "value": "/other"},
        {"name": "EXTRA", "value": "1"},
    ]
    (plugin,) = daemonsets["gpu-device-plugin"]["spec"]["template"]["spec"]["containers"]
    assert plugin["args"] == ["serve", "--host-root", "/host", "--log-format", "text"]


def test_dra_keeps_the_plugin_off_dra_nodes_in_every_term_and_gates_the_cr() -> None:
    docs = render({"dra.enabled": True, "sandboxWorkloads.defaultWorkload": "vm-passthrough"})
    plugin = by_kind(docs, "DaemonSet")["gpu-device-plugin"]["spec"]["template"]["spec"]
    terms = plugin["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2
    off_dra = {"key": "gpu-passthrough.kubevirt.io/dra", "operator": "NotIn", "values": ["true"]}
    assert all(term["matchExpressions"][-1] == off_dra for term in terms)
    gates = by_kind(docs, "KubeVirt")["kubevirt"]["spec"]["configuration"]["developerConfiguration"]["featureGates"]
    assert gates == ["Sidecar", "GPUsWithDRA", "HostDevicesWithDRA"]
    plugins = by_kind(render({"launcherHook.api": "plugins"}), "KubeVirt")["kubevirt"]
    assert plugins["spec"]["configuration"]["developerConfiguration"]["featureGates"] == ["Sidecar", "Plugins"]


def test_the_docs_name_every_variant() -> None:
    text = DOCS.read_text()
    for name, variant in VARIANTS.items():
        assert f"| {name} |" in text, name
        for dotted, value in variant.values.items():
            assert f"`{dotted}={json.dumps(value).strip(chr(34))}`" in text, (name, dotted)
