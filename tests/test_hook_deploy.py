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
