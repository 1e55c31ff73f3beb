"""The per-GPU workload file, ``gpu-node-agent workload apply``, the validator readiness files and the node
labels for VM GPUs, on fixture trees through simkit.kernel_sim."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.kernel import AgentError
from node_agent.node_labels import (
    COUNT,
    PRODUCT,
    label_value,
    node_labels,
    owned,
    product_name,
    valid_label,
    vgpu_type_key,
)
from node_agent.sysfs import Sysfs, read_function
from node_agent.validations import OWNED, validation_files, write_validations
from node_agent.vgpu_config import parse_config, select_config
from node_agent.workload import Desired, GpuOverride, Outcome, apply_transition, plan_transition
from node_agent.workload_config import load_workload_config, parse_workload_config
from runtime.pciids import PciIds
from simkit.agent_nodes import build_mig_node
from simkit.kernel_sim import SimKernel
from tests.node_agent_support import agent, build_node, mdev_node, passthrough_node, report

CARD, OTHER, GRACE = "0000:86:00.0", "0000:af:00.0", "0009:01:00.0"
T4S = ("0000:3b:00.0", "0000:af:00.0")
PCI_IDS = """\
10de  NVIDIA Corporation
\t1eb8  TU104GL [Tesla T4]
\t1f08  TU106 [GeForce RTX 2060 Rev. A]
\t26b9  AD102GL [L40S]
"""
VGPU_CONFIG = """\
version: v1
vgpu-configs:
  t4:
    - devices: all
      vgpu-devices: {T4-1Q: 2}
"""


# -- the workload file -------------------------------------------------------------------------------------


def test_the_workload_file_names_gpus_by_address_or_selector() -> None:
    overrides = parse_workload_config(
        'version: v1\ngpus:\n  - {address: "0000:3B:00.0", workload: container}\n'
        '  - {device: "10DE:2236", workload: vm-passthrough}\n',
        "w.yaml",
    )
    assert overrides[0] == GpuOverride("container", address="0000:3b:00.0", source=overrides[0].source)
    assert overrides[1].device == (0x10DE, 0x2236) and overrides[1].workload == "vm-passthrough"
    assert "w.yaml, gpus[1]" in overrides[1].source
    assert parse_workload_config("version: v1\ngpus: []\n", "w.yaml") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus: []", "w.yaml: missing 'version'"),
        ("version: v2\ngpus: []", "unknown version 'v2'"),
        ("version: v1\ngpus: []\nother: 1", "unexpected field 'other'"),
        ("version: v1\ngpus: {a: 1}", "gpus must be a list"),
        ("version: v1\ngpus: [{address: '0000:3b:00.0'}]", r"gpus\[0\]: missing required field 'workload'"),
        ("version: v1\ngpus: [{address: '0000:3b:00.0', workload: vm}]", "workload 'vm' is none of container"),
        ("version: v1\ngpus: [{workload: container}]", "by 'address' or by 'device', exactly one"),
        (
            "version: v1\ngpus: [{address: '0000:3b:00.0', device: '10de:2236', workload: container}]",
            "exactly one",
        ),
        ("version: v1\ngpus: [{address: '3b:00.0', workload: container}]", r"gpus\[0\]: malformed PCI address"),
        ("version: v1\ngpus: [{device: 'T4', workload: container}]", r"gpus\[0\]: selector 'T4'"),
        ("version: v1\ngpus: [{device: 4318, workload: container}]", "is not VENDOR:DEVICE"),
        ("version: v1\ngpus: [{address: '0000:3b:00.0', workload: container, x: 1}]", "unexpected field 'x'"),
        (
            "version: v1\ngpus: [{address: '0000:3b:00.0', workload: container}, "
            "{address: '0000:3B:00.0', workload: vm-vgpu}]",
            r"gpus\[1\]: names the same GPU\(s\) as gpus\[0\]",
        ),
        ("version: v1\ngpus: [1", "is not valid YAML"),
    ],
)
def test_workload_file_errors_name_the_file_and_the_entry(text: str, message: str) -> None:
    with pytest.raises(AgentError, match=message) as caught:
        parse_workload_config(text, "w.yaml")
    assert "w.yaml" in str(caught.value)


def test_the_workload_file_is_read_bounded(tmp_path: Path) -> None:
    big = tmp_path / "w.yaml"
    big.write_text("version: v1\n" + "#" * (1024 * 1024 + 1))
    with pytest.raises(AgentError, match="workload config"):
        load_workload_config(big)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(AgentError, match="not a regular file"):
        load_workload_config(fifo)


# -- the command -------------------------------------------------------------------------------------------


@pytest.fixture
def card_sim(tmp_path: Path) -> SimKernel:
    return build_node(passthrough_node(), tmp_path / "root")


def test_workload_apply_keeps_the_configured_gpu_for_containers_and_writes_the_readiness_files(
    card_sim: SimKernel, tmp_path: Path
) -> None:
    config = tmp_path / "workloads.yaml"
    config.write_text(f"version: v1\ngpus:\n  - {{address: '{CARD}', workload: container}}\n")
    validations = tmp_path / "validations"
    result = agent(
        card_sim, "workload", "apply", "--workload", "vm-passthrough", "--config", str(config),
        "--validations-dir", str(validations),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    done = report(result)
    assert done["outcome"]["state"] == "success"
    assert done["plan"]["workloads"] == {CARD: "container", OTHER: "vm-passthrough", GRACE: "vm-passthrough"}
    fs = Sysfs(card_sim.root)
    assert read_function(fs, CARD).driver == "nouveau" and read_function(fs, OTHER).driver == "vfio-pci"
    assert (validations / "workload-type").read_text() == "vm-passthrough\n"
    assert (validations / "vfio-pci-ready").read_text() == ""
    assert sorted(os.listdir(validations)) == ["vfio-pci-ready", "workload-type"]
    assert done["validations"] == {"workload-type": True, "vfio-pci-ready": True, "host-vgpu-manager-ready": False,
                                   "vgpu-devices-ready": False}  # fmt: skip
    state = json.loads((card_sim.root.parent / "state/state.json").read_text())
    assert state["workload"]["state"] == "success" and state["workload"]["workload"] == "vm-passthrough"

    card_sim.hold(int(os.readlink(fs.pci_devices / OTHER / "iommu_group").rpartition("/")[2]))
    log = list(card_sim.log)
    refused = agent(
        card_sim, "workload", "apply", "--validations-dir", str(validations),
        env={"GPU_NODE_AGENT_WORKLOAD": "container"},
    )  # fmt: skip
    assert refused.exit_code == 1
    assert "refused, nothing written" in str(refused.exception) and "is in use by a VM" in str(refused.exception)
    assert report(refused)["outcome"]["state"] == "refused" and card_sim.log == log
    assert (validations / "workload-type").read_text() == "container\n"
    assert not (validations / "vfio-pci-ready").exists()  # not ready for what the node is asked to be


def test_an_unwritable_validations_directory_still_reports_the_outcome(card_sim: SimKernel, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = agent(
        card_sim, "workload", "apply", "--workload", "vm-passthrough", "--validations-dir", str(blocked / "v")
    )
    assert result.exit_code == 1 and "validator readiness files: cannot write" in str(result.exception)
    done = report(result)
    assert done["outcome"]["state"] == "success" and done["validations"] is None


def test_workload_apply_names_an_override_for_a_gpu_the_node_lacks(card_sim: SimKernel, tmp_path: Path) -> None:
    config = tmp_path / "workloads.yaml"
    config.write_text("version: v1\ngpus:\n  - {address: '0000:99:00.0', workload: container}\n")
    result = agent(
        card_sim, "workload", "apply", "--workload", "vm-passthrough", "--config", str(config),
        "--validations-dir", "",
    )  # fmt: skip
    assert result.exit_code == 1
    assert f"workload config {config}, gpus[0] (address 0000:99:00.0): 0000:99:00.0 is no NVIDIA GPU" in str(
        result.exception
    )
    assert card_sim.writes == 0


# -- readiness files ---------------------------------------------------------------------------------------


def test_readiness_files_follow_the_outcome_and_only_ours_are_touched(tmp_path: Path) -> None:
    directory = tmp_path / "validations"
    directory.mkdir()
    (directory / "driver-ready").write_text("IS_HOST_DRIVER=true\n")  # another component's
    workloads = {"0000:3b:00.0": "vm-vgpu", "0000:af:00.0": "vm-passthrough"}
    success = Outcome("success", "", workloads, vgpus={"0000:3b:00.0": {"nvidia-222": ["u"]}}, default="vm-vgpu")
    assert write_validations(directory, success, workloads) == dict.fromkeys(OWNED, True)
    assert (directory / "workload-type").read_text() == "vm-vgpu\n"
    for name in ("vfio-pci-ready", "host-vgpu-manager-ready", "vgpu-devices-ready"):
        assert (directory / name).read_text() == ""
    failed = Outcome("failed", "x", workloads, default="vm-vgpu")
    present = write_validations(directory, failed, workloads)
    assert present == {"workload-type": True, "vfio-pci-ready": False, "host-vgpu-manager-ready": False,
                       "vgpu-devices-ready": False}  # fmt: skip
    assert sorted(os.listdir(directory)) == ["driver-ready", "workload-type"]
    no_vgpus = Outcome("success", "", {"0000:3b:00.0": "vm-vgpu"}, default="vm-vgpu")
    files = validation_files(no_vgpus, no_vgpus.workloads)
    assert files["host-vgpu-manager-ready"] == "" and files["vgpu-devices-ready"] is None
    assert validation_files(Outcome("success", "", {"a": "container", "b": "vm-vgpu"}), {})["workload-type"] is None


# -- node labels -------------------------------------------------------------------------------------------


def test_vgpu_node_labels_count_types_and_name_the_product_in_gfds_style(tmp_path: Path) -> None:
    sim = build_node(mdev_node(), tmp_path / "root")
    fs = Sysfs(sim.root)
    specs = select_config(parse_config(VGPU_CONFIG, "c.yaml"), "t4", "c.yaml")
    transition = plan_transition(fs, sim, Desired("vm-vgpu", vgpu_specs=specs))
    outcome = apply_transition(fs, sim, transition)
    labels = node_labels(fs, outcome.workloads, PciIds.from_text(PCI_IDS))
    assert labels == {PRODUCT: "Tesla-T4", COUNT: "2", "nvidia.com/vgpu.type.T4-1Q": "4"}
    assert all(valid_label(key, value) and owned(key) for key, value in labels.items())
    assert node_labels(fs, outcome.workloads, None) == {COUNT: "2", "nvidia.com/vgpu.type.T4-1Q": "4"}
    mixed = {T4S[0]: "container", T4S[1]: "vm-vgpu"}  # GFD labels a node with container GPUs
    assert node_labels(fs, mixed, PciIds.from_text(PCI_IDS)) == {"nvidia.com/vgpu.type.T4-1Q": "2"}


def test_sriov_vgpu_labels_use_the_type_names_earlier_runs_kept(tmp_path: Path) -> None:
    sim = build_mig_node(tmp_path / "root")
    fs = Sysfs(sim.root)
    text = "version: v1\nvgpu-configs:\n  l:\n    - devices: [2]\n      vgpu-devices: {L40S-1B: 4}\n"
    specs = select_config(parse_config(text, "c.yaml"), "l", "c.yaml")
    desired = Desired("container", overrides=(GpuOverride("vm-vgpu", address="0000:d8:00.0"),), vgpu_specs=specs)
    outcome = apply_transition(fs, sim, plan_transition(fs, sim, desired))
    assert outcome.state == "success", outcome.message
    assert node_labels(fs, outcome.workloads, None) == {}  # every VF is taken: none lists the type's name
    names = {"0000:d8:00.0": {557: "NVIDIA L40S-1B"}}
    assert node_labels(fs, outcome.workloads, None, names) == {"nvidia.com/vgpu.type.L40S-1B": "4"}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("TU104GL [Tesla T4]", "Tesla-T4"),
        ("GA100 [A100 PCIe 40GB]", "A100-PCIe-40GB"),
        ("TU106 [GeForce RTX 2060 Rev. A]", "GeForce-RTX-2060-Rev.-A"),
        ("GA102 [GeForce RTX 3080 / 3090]", "GeForce-RTX-3080-3090"),
        ("AD102GL", "AD102GL"),
        ("[ -- ]", ""),
        ("X" * 100, "X" * 63),
    ],
)
def test_products_are_named_as_gfd_sanitises_and_stay_valid(name: str, expected: str) -> None:
    value = label_value(product_name(name))
    assert value == expected
    assert valid_label(PRODUCT, value)


@pytest.mark.parametrize(
    ("type_name", "key"),
    [
        ("GRID T4-1Q", "nvidia.com/vgpu.type.T4-1Q"),
        ("NVIDIA A100-1-5C", "nvidia.com/vgpu.type.A100-1-5C"),
        ("NVIDIA RTX Pro 6000 Blackwell DC-4Q", "nvidia.com/vgpu.type.RTX-Pro-6000-Blackwell-DC-4Q"),
        ("nvidia-222", "nvidia.com/vgpu.type.nvidia-222"),
        ("--", None),
        ("Q" * 80, "nvidia.com/vgpu.type." + "Q" * 53),
    ],
)
def test_vgpu_type_keys_are_valid_label_keys(type_name: str, key: str | None) -> None:
    assert vgpu_type_key(type_name) == key
    if key is not None:
        assert valid_label(key, "1") and owned(key)


@given(st.text(max_size=200))
def test_any_name_gives_a_valid_label_or_none(text: str) -> None:
    assert valid_label(PRODUCT, label_value(text))
    key = vgpu_type_key(text)
    assert key is None or valid_label(key, "3")


def test_the_label_syntax_check_refuses_what_kubernetes_refuses() -> None:
    assert valid_label("nvidia.com/gpu.count", "2") and valid_label("plain", "")
    assert not valid_label("nvidia.com/" + "a" * 64, "1")
    assert not valid_label("nvidia.com/gpu.product", "a" * 64)
    assert not valid_label("nvidia.com/gpu.product", "Tesla T4")
    assert not valid_label("nvidia.com/-x", "1") and not valid_label("Nvidia.com/x", "1")
    assert not valid_label("nvidia.com/x", "-a") and not valid_label("/x", "1")
    assert not owned("nvidia.com/gpu.memory") and not owned("nvidia.com/gpu.workload.config")
