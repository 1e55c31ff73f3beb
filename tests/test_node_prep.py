"""``xmlgen simulate``'s first step: what the node agent would change, computed from the tree (read only)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from plugin.hostroot import HostRoot
from simkit.fixture_nodes import MIXED_NODE, NODE01, SRIOV_VGPU_NODE, VGPU_NODE, l40s_sriov
from simkit.sysfs_fixture import Node, build
from xmlgen.node_prep import node_preparation


def plan_of(node: Node, tmp_path: Path) -> tuple[str, list[str], list[str]]:
    root = build(node, tmp_path / node.name)
    before = sorted(str(path.relative_to(root)) for path in root.rglob("*"))
    plan = node_preparation(root)
    assert sorted(str(path.relative_to(root)) for path in root.rglob("*")) == before  # nothing written
    return plan.workload, plan.bind, plan.vgpu


def test_a_passthrough_node_binds_the_gpu_left_on_nvidia(tmp_path: Path) -> None:
    assert plan_of(NODE01, tmp_path) == (
        "vm-passthrough",
        ["0000:d8:00.0 (10de:1eb8, IOMMU group 118) is on nvidia, not vfio-pci", "/dev/vfio/118 does not exist"],
        [],
    )


def test_a_companion_on_a_host_driver_is_moved_with_its_group(tmp_path: Path) -> None:
    workload, bind, vgpu = plan_of(MIXED_NODE, tmp_path)
    assert (workload, vgpu) == ("vm-passthrough", [])
    assert bind == ["0000:86:00.1 (10de:1aef, IOMMU group 74) is on snd_hda_intel, not vfio-pci"]


def test_vgpu_nodes_with_their_vgpus_need_nothing(tmp_path: Path) -> None:
    for node in (VGPU_NODE, SRIOV_VGPU_NODE):
        workload, bind, vgpu = plan_of(node, tmp_path)
        assert (workload, bind, vgpu) == ("vm-vgpu", [], []), node.name
        assert not node_preparation(tmp_path / node.name).needed


def test_a_vgpu_gpu_without_vgpus_is_listed_for_vgpu_apply(tmp_path: Path) -> None:
    typed = SRIOV_VGPU_NODE.sriov_vgpus[0]
    bare = l40s_sriov(0xD7)[:2]  # the second L40S with its VFs disabled (sriov_numvfs 0)
    node = dataclasses.replace(
        SRIOV_VGPU_NODE,
        functions=(*SRIOV_VGPU_NODE.functions[: len(l40s_sriov(0x3A))], *bare),
        sriov_vgpus=(
            typed,
            dataclasses.replace(SRIOV_VGPU_NODE.sriov_vgpus[1], pf=bare[1].address, vfs=(), current=()),
        ),
    )
    assert plan_of(node, tmp_path) == ("vm-vgpu", [], ["0000:d8:00.0 (10DE:26B9, nvidia): no vGPU yet"])


def test_simulate_shows_the_preparation_first_only_when_needed() -> None:
    def stderr(node: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "xmlgen", "simulate", "--node", node],
            capture_output=True, text=True, input="", timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stderr

    shown = stderr("node01")
    assert shown.startswith("0. node preparation")
    assert shown.index("gpu-node-agent bind --all") < shown.index("1. node node01")
    assert "0. node preparation" not in stderr("sriov-vgpu")


def test_vf_counts_from_the_tree_are_bounded_by_the_pcie_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = build(SRIOV_VGPU_NODE, tmp_path / "n")
    pf = root / "sys" / "bus" / "pci" / "devices" / "0000:3b:00.0"
    (pf / "sriov_numvfs").write_text("4000000000\n")  # more than sriov_totalvfs (32), and than 16 bits
    looked: list[str] = []
    original = HostRoot.readlink_name

    def counting(self: HostRoot, path: str) -> str | None:
        looked.append(path)
        return original(self, path)

    monkeypatch.setattr(HostRoot, "readlink_name", counting)
    assert node_preparation(root).workload == "vm-vgpu"
    assert sum("/0000:3b:00.0/virtfn" in path for path in looked) == 32  # sriov_totalvfs, not 4e9


def test_gpus_split_into_vfs_without_vgpus_yet_wait_for_vgpu_apply_not_bind(tmp_path: Path) -> None:
    # After sriov-manage -e and before vgpu apply: VFs enabled, none typed. Binding the GPUs to vfio-pci would be
    # the wrong advice.
    untyped = tuple(dataclasses.replace(gpu, current=()) for gpu in SRIOV_VGPU_NODE.sriov_vgpus)
    node = dataclasses.replace(SRIOV_VGPU_NODE, sriov_vgpus=untyped)
    assert plan_of(node, tmp_path) == (
        "vm-vgpu",
        [],
        ["0000:3b:00.0 (10DE:26B9, nvidia): no vGPU yet", "0000:d8:00.0 (10DE:26B9, nvidia): no vGPU yet"],
    )
    assert node_preparation(tmp_path / node.name).why == "no vGPU yet, but 2 GPUs with SR-IOV vGPU VFs enabled"


def test_the_plan_names_the_driver_the_agent_would_choose_from_modules_alias(tmp_path: Path) -> None:
    """The step is the agent's own rule: where the node's modules.alias names a variant driver for the GPU
    (nvgrace_gpu_vfio_pci for a Grace Hopper GH100), the plan says that driver, not vfio-pci."""
    import os

    from simkit.agent_nodes import MODULES_ALIAS, grace_gpu

    node = Node(name="grace", functions=(grace_gpu(),))
    root = build(node, tmp_path / node.name)
    modules = root / "lib" / "modules" / os.uname().release
    modules.mkdir(parents=True)
    (modules / "modules.alias").write_text(MODULES_ALIAS)
    plan = node_preparation(root)
    assert plan.workload == "vm-passthrough"
    assert plan.bind[0].endswith("is on no driver, not nvgrace_gpu_vfio_pci"), plan.bind
