"""The virt-launcher pod KubeVirt's virt-controller renders for the VMs in deploy/ (``launcher-pod``: the VM
controller's SetupVMIFromVM, virt-api's defaulting and ``pkg/virt-controller/services``' template service, at
the pinned kubevirt.io/kubevirt; docs/kubevirt-harness.md, "The launcher pod"). The real-cluster suite runs
this pod; these tests pin what the project relies on in it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubevirt_harness_support import harness_binary

pytestmark = pytest.mark.kubevirt

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RTX = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"


def render(vm: Path, *args: str) -> dict[str, Any]:
    binary = harness_binary("launcher-pod")
    done = subprocess.run(
        [str(binary), "--vm", str(vm), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    documents = list(yaml.safe_load_all(done.stdout))
    assert len(documents) == 1
    pod: dict[str, Any] = documents[0]
    assert (pod["apiVersion"], pod["kind"]) == ("v1", "Pod")
    return pod


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {container["name"]: container for container in pod["spec"]["containers"]}


def test_the_hook_sidecar_vm_gets_its_gpus_and_the_sidecar() -> None:
    pod = render(DEPLOY / "hook-sidecar" / "vm-two-gpus.yaml", "--namespace", "gpu-vms")
    assert pod["metadata"]["generateName"] == "virt-launcher-vm-with-gpus-"
    assert pod["metadata"]["namespace"] == "gpu-vms"
    assert "ownerReferences" not in pod["metadata"]  # its VMI does not exist in the cluster
    assert pod["metadata"]["labels"]["kubevirt.io"] == "virt-launcher"
    by_name = containers(pod)
    compute = by_name["compute"]
    assert compute["resources"]["requests"][RTX] == "2" and compute["resources"]["limits"][RTX] == "2"
    sidecar = by_name["hook-sidecar-0"]  # from the hooks.kubevirt.io/hookSidecars annotation
    assert sidecar["image"] == "registry.example.com/kubevirt-gpu-passthrough:0.1.0"
    assert (sidecar["command"], sidecar["args"]) == (["launcher-hook"], ["serve"])
    mounts = {mount["name"]: mount for mount in sidecar["volumeMounts"]}
    # the hook's socket directory appears to compute as /var/run/kubevirt-hooks/hook-sidecar-0/ (pkg/hooks
    # Collect reads the sub-directories)
    assert mounts["hook-sidecar-sockets"] == {
        "mountPath": "/var/run/kubevirt-hooks",
        "name": "hook-sidecar-sockets",
        "subPath": "hook-sidecar-0",
    }
    assert "kubelet-pod-resources" not in mounts  # the recommended hook reads virt-launcher's domain
    compute_mounts = {mount["name"]: mount["mountPath"] for mount in compute["volumeMounts"]}
    assert compute_mounts["hook-sidecar-sockets"] == "/var/run/kubevirt-hooks"
    assert RTX not in sidecar.get("resources", {}).get("requests", {})  # only compute asks for the GPUs


def test_the_root_vm_mounts_the_pod_resources_claim_in_the_sidecar() -> None:
    pod = render(DEPLOY / "hook-sidecar" / "vm-two-gpus-root.yaml")
    sidecar = containers(pod)["hook-sidecar-0"]
    assert sidecar["args"] == ["serve", "--pod-resources-socket", "/var/lib/kubelet/pod-resources/kubelet.sock"]
    mounts = {mount["name"]: mount["mountPath"] for mount in sidecar["volumeMounts"]}
    assert mounts["kubelet-pod-resources"] == "/var/lib/kubelet/pod-resources"
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    assert volumes["kubelet-pod-resources"]["persistentVolumeClaim"]["claimName"] == "kubelet-pod-resources"


def test_the_shim_vm_renders_too() -> None:
    pod = render(DEPLOY / "hook-sidecar" / "vm-two-gpus-shim.yaml", "--namespace", "gpu-vms")
    assert containers(pod)["compute"]["resources"]["limits"][RTX] == "2"
    assert "hook-sidecar-0" in containers(pod)


def test_the_plugin_api_vm_gets_kubevirts_plugin_socket_volume(tmp_path: Path) -> None:
    """deploy/plugin-api/ is the VM without the annotation, with the Plugins gate: virt-controller adds the
    plugin socket volume to compute (docs/protocols.md, "KubeVirt plugin API"), and no sidecar."""
    vm = yaml.safe_load((DEPLOY / "hook-sidecar" / "vm-two-gpus.yaml").read_text())
    del vm["spec"]["template"]["metadata"]["annotations"]  # deploy/plugin-api/kustomization.yaml's patch
    vm_file, kubevirt = tmp_path / "vm.yaml", tmp_path / "kubevirt.yaml"
    vm_file.write_text(yaml.safe_dump(vm))
    cr = yaml.safe_load((DEPLOY / "kubevirt" / "kubevirt-cr.yaml").read_text())
    cr["spec"]["configuration"]["developerConfiguration"]["featureGates"] = ["Plugins"]
    kubevirt.write_text(yaml.safe_dump(cr))
    pod = render(vm_file, "--kubevirt", str(kubevirt))
    assert "hook-sidecar-0" not in containers(pod)
    mounts = {mount["name"]: mount["mountPath"] for mount in containers(pod)["compute"]["volumeMounts"]}
    assert mounts.get("kubevirt-plugin-sockets") == "/var/run/kubevirt-plugin", mounts
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    assert "emptyDir" in volumes["kubevirt-plugin-sockets"]


def test_the_dra_vm_asks_for_its_claims_not_for_device_plugin_resources() -> None:
    pod = render(DEPLOY / "dra" / "example" / "vm.yaml")
    compute = containers(pod)["compute"]
    assert not [name for name in compute["resources"].get("limits", {}) if name.startswith("nvidia.com/")]
    assert pod["spec"].get("resourceClaims"), pod["spec"]
    assert compute["resources"].get("claims"), compute["resources"]


def test_a_file_that_is_not_a_vm_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n")
    binary = harness_binary("launcher-pod")
    done = subprocess.run([str(binary), "--vm", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and done.stdout == ""
    assert str(path) in done.stderr
