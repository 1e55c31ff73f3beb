"""gpu-node-agent vgpu apply / validate --workload vm-vgpu on fixture trees through simkit.kernel_sim:
mdev parents and SR-IOV vGPU VFs, only the difference written, held vGPUs never removed, errors named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from node_agent.kernel import AgentError
from node_agent.vgpu_config import parse_config
from simkit.fixture_nodes import CLASS_3D, NVIDIA
from simkit.kernel_sim import SimKernel, VgpuType
from simkit.sysfs_fixture import Function, Node
from tests.node_agent_support import agent, build_node, mdev_node, report

T4S = ("0000:3b:00.0", "0000:af:00.0")
L40S = "0000:41:00.0"
CONFIG = """\
version: v1
vgpu-configs:
  mixed:
    - devices: all
      device-filter: "0x1EB810DE"
      vgpu-devices: {nvidia-223: 1}
    - devices: [0]
      vgpu-devices: {T4-1Q: 2}
  fewer:
    - devices: all
      vgpu-devices: {nvidia-223: 1}
    - devices: [0]
      vgpu-devices: {"GRID T4-1Q": 1}
  clear:
    - devices: all
      vgpu-devices: {}
  none-here:
    - devices: all
      device-filter: ["0x20B510DE"]
      vgpu-devices: {T4-1Q: 1}
  too-many:
    - devices: all
      vgpu-devices: {T4-2Q: 5}
  unknown-type:
    - devices: all
      vgpu-devices: {A100-4C: 1}
  l40s-3:
    - devices: all
      vgpu-devices: {L40S-1B: 3}
  l40s-1:
    - devices: all
      vgpu-devices: {"NVIDIA L40S-1B": 1}
  l40s-2b:
    - devices: all
      vgpu-devices: {"558": 2}
  l40s-full:
    - devices: all
      vgpu-devices: {L40S-1B: 4}
  l40s-5:
    - devices: all
      vgpu-devices: {L40S-1B: 5}
"""


def mdevs(sim: SimKernel, parent: str, type_id: str) -> list[str]:
    return sorted(os.listdir(sim.root / "sys/class/mdev_bus" / parent / "mdev_supported_types" / type_id / "devices"))


def available(sim: SimKernel, parent: str, type_id: str) -> int:
    path = sim.root / "sys/class/mdev_bus" / parent / "mdev_supported_types" / type_id / "available_instances"
    return int(path.read_text())


@pytest.fixture
def mdev_sim(tmp_path: Path) -> SimKernel:
    sim = build_node(mdev_node(), tmp_path / "root")
    (tmp_path / "vgpu.yaml").write_text(CONFIG)
    return sim


def apply(sim: SimKernel, name: str, *extra: str) -> tuple[int, str, object]:
    result = agent(sim, "vgpu", "apply", "--config", str(sim.root.parent / "vgpu.yaml"), "--select", name, *extra)
    return result.exit_code, result.stdout, result.exception


def test_mdev_apply_creates_what_the_config_asks_on_each_gpu(mdev_sim: SimKernel) -> None:
    code, out, error = apply(mdev_sim, "mixed")
    assert code == 0, error
    assert len(mdevs(mdev_sim, T4S[0], "nvidia-222")) == 2
    assert mdevs(mdev_sim, T4S[1], "nvidia-222") == []  # index 1 is not in devices: [0]
    assert len(mdevs(mdev_sim, T4S[0], "nvidia-223")) == 0  # the last matching spec wins for GPU 0
    assert len(mdevs(mdev_sim, T4S[1], "nvidia-223")) == 1
    assert available(mdev_sim, T4S[0], "nvidia-222") == 2
    done = json.loads(out)
    assert done["writes"] == 3
    assert [c["action"] for c in done["changes"]] == ["create"] * 3
    for uid in mdevs(mdev_sim, T4S[0], "nvidia-222"):
        assert (mdev_sim.root / "sys/bus/mdev/devices" / uid / "iommu_group").exists()
    state = json.loads((mdev_sim.root.parent / "state/state.json").read_text())
    assert state["vgpu"]["status"] == "success" and state["vgpu"]["config"] == "mixed"
    assert sorted(state["vgpu"]["vgpus"][T4S[0]]["nvidia-222"]) == mdevs(mdev_sim, T4S[0], "nvidia-222")


def test_a_reapply_of_the_same_config_writes_nothing(mdev_sim: SimKernel) -> None:
    assert apply(mdev_sim, "mixed")[0] == 0
    before = mdev_sim.writes
    code, out, _ = apply(mdev_sim, "mixed")
    assert code == 0 and mdev_sim.writes == before
    assert json.loads(out)["changes"] == []


def test_a_changed_config_removes_only_the_surplus(mdev_sim: SimKernel) -> None:
    assert apply(mdev_sim, "mixed")[0] == 0
    kept_223 = mdevs(mdev_sim, T4S[1], "nvidia-223")
    first = mdevs(mdev_sim, T4S[0], "nvidia-222")
    code, out, error = apply(mdev_sim, "fewer")
    assert code == 0, error
    left = mdevs(mdev_sim, T4S[0], "nvidia-222")
    assert len(left) == 1 and left[0] in first
    assert mdevs(mdev_sim, T4S[1], "nvidia-223") == kept_223  # untouched, same UUID
    assert mdevs(mdev_sim, T4S[0], "nvidia-223") == []  # GPU 0 takes the last spec that matches it
    (change,) = json.loads(out)["changes"]
    assert change["action"] == "remove" and change["parent"] == T4S[0] and change["id"] in first
    assert json.loads(out)["writes"] == 1
    assert available(mdev_sim, T4S[0], "nvidia-222") == 3


def test_vgpus_a_vm_holds_are_never_removed_and_the_error_names_them(mdev_sim: SimKernel) -> None:
    assert apply(mdev_sim, "mixed")[0] == 0
    held = mdevs(mdev_sim, T4S[0], "nvidia-222")
    for pid, uid in enumerate(held, start=5000):
        group = int(os.readlink(mdev_sim.root / "sys/bus/mdev/devices" / uid / "iommu_group").rpartition("/")[2])
        mdev_sim.hold(group, pid=pid, comm="virt-launcher")
    before = mdev_sim.writes
    code, _, error = apply(mdev_sim, "fewer")
    assert code == 1 and isinstance(error, AgentError)
    message = str(error)
    assert f"{T4S[0]}: the config keeps 1 vGPU(s) of type nvidia-222, 2 exist and VMs hold" in message
    for uid in held:
        assert uid in message
    assert "pid 5000 (virt-launcher) holds /dev/vfio/" in message
    assert mdev_sim.writes == before  # refused before any write, on every parent
    assert mdevs(mdev_sim, T4S[0], "nvidia-222") == held
    state = json.loads((mdev_sim.root.parent / "state/state.json").read_text())
    assert state["vgpu"]["status"] == "failed" and "VMs hold" in state["vgpu"]["error"]
    mdev_sim.release(5000)  # one VM gone: its vGPU is the one removed
    assert apply(mdev_sim, "fewer")[0] == 0
    assert mdevs(mdev_sim, T4S[0], "nvidia-222") == [held[1]]


def test_a_gpu_no_spec_matches_is_left_as_it_is_and_an_empty_spec_clears(mdev_sim: SimKernel) -> None:
    assert apply(mdev_sim, "mixed")[0] == 0
    before = {(p, t): mdevs(mdev_sim, p, t) for p in T4S for t in ("nvidia-222", "nvidia-223")}
    writes = mdev_sim.writes
    assert apply(mdev_sim, "none-here")[0] == 0  # its device-filter matches no T4: nothing changes
    assert mdev_sim.writes == writes
    assert {(p, t): mdevs(mdev_sim, p, t) for p in T4S for t in ("nvidia-222", "nvidia-223")} == before
    assert apply(mdev_sim, "clear")[0] == 0
    assert all(mdevs(mdev_sim, p, t) == [] for p in T4S for t in ("nvidia-222", "nvidia-223"))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("too-many", "0000:3b:00.0: T4-2Q (nvidia-223) needs 5 more vGPU(s) and available_instances is 4"),
        (
            "unknown-type",
            "0000:3b:00.0 cannot create vGPU type 'A100-4C': it offers nvidia-222 (GRID T4-1Q), nvidia-223",
        ),
        ("nope", "has no config named 'nope' (it has: clear, fewer, l40s-1,"),
    ],
)
def test_errors_name_the_type_the_count_and_the_config(mdev_sim: SimKernel, name: str, message: str) -> None:
    code, _, error = apply(mdev_sim, name)
    assert code == 1 and message in str(error)
    assert mdev_sim.writes == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vgpu-configs: {a: [{devices: all, vgpu-devices: {}}]}", "missing 'version'"),
        ("version: v2\nvgpu-configs: {a: [{devices: all, vgpu-devices: {}}]}", "unknown version 'v2'"),
        ("version: v1\nvgpu-configs: {a: [{devices: all, vgpu-devices: {}, extra: 1}]}", "unexpected field 'extra'"),
        ("version: v1\nvgpu-configs: {a: [{devices: all, vgpu-devices: {}}]}\nother: 1", "unexpected field 'other'"),
        ("version: v1\nvgpu-configs: {a: [{devices: some, vgpu-devices: {}}]}", "devices must be 'all' or a list"),
        ("version: v1\nvgpu-configs: {a: [{devices: all}]}", "missing required field 'vgpu-devices'"),
        ("version: v1\nvgpu-configs: {a: [{devices: all, vgpu-devices: {T4-1Q: 0}}]}", "count 0 for T4-1Q"),
        ("version: v1\nvgpu-configs: {a: []}", "config 'a' needs at least one entry"),
        ("version: v1\nvgpu-configs: {a: [{devices: all, device-filter: T4, vgpu-devices: {}}]}", "'T4' is not a PCI"),
    ],
)
def test_the_config_is_nvidias_format_and_nothing_else(text: str, message: str) -> None:
    with pytest.raises(AgentError, match=message):
        parse_config(text, "c.yaml")


def test_device_filter_reads_nvidias_ids() -> None:
    (spec,) = parse_config(
        "version: v1\nvgpu-configs: {a: [{devices: [1], device-filter: [0x1EB810DE, '0x20B510DE'], "
        "vgpu-devices: {T4-1Q: 2}}]}",
        "c.yaml",
    )["a"]
    assert spec.device_filter == (0x1EB810DE, 0x20B510DE)
    assert spec.matches(1, 0x1EB810DE) and not spec.matches(0, 0x1EB810DE) and not spec.matches(1, 0x1EB710DE)


# -- SR-IOV vGPU (vGPU 17+) ------------------------------------------------------------------------------


def sriov_sim(root: Path, total_vfs: int = 4) -> SimKernel:
    node = Node("l40s-node", (Function(L40S, NVIDIA, 0x26B9, CLASS_3D, "nvidia", 40, 0),))
    sim = build_node(node, root)
    sim.add_sriov_gpu(
        L40S, total_vfs, 0x26BA, (VgpuType(557, "NVIDIA L40S-1B", 32), VgpuType(558, "NVIDIA L40S-2B", 16))
    )
    (root.parent / "vgpu.yaml").write_text(CONFIG)
    return sim


def vf_types(sim: SimKernel) -> dict[str, int]:
    pf = sim.root / "sys/bus/pci/devices" / L40S
    found = {}
    for link in sorted(pf.glob("virtfn*")):
        vf = Path(os.path.realpath(link))
        found[vf.name] = int((vf / "nvidia/current_vgpu_type").read_text())
    return found


def test_sriov_apply_enables_the_vfs_and_sets_their_types(tmp_path: Path) -> None:
    sim = sriov_sim(tmp_path / "root")
    code, out, error = apply(sim, "l40s-3")
    assert code == 0, error
    assert (sim.root / "sys/bus/pci/devices" / L40S / "sriov_numvfs").read_text() == "4\n"
    assert sorted(vf_types(sim).values()) == [0, 557, 557, 557]
    done = json.loads(out)
    assert done["writes"] == 4
    assert done["changes"][0] == {"parent": L40S, "action": "enable-vfs", "count": "4"}
    assert done["type_names"][L40S] == {"557": "NVIDIA L40S-1B", "558": "NVIDIA L40S-2B"}
    first_vf = min(vf_types(sim))
    assert (sim.root / "sys/bus/pci/devices" / first_vf / "physfn").exists()
    group = os.readlink(sim.root / "sys/bus/pci/devices" / first_vf / "iommu_group").rpartition("/")[2]
    assert (sim.root / "dev/vfio" / group).exists()
    before = sim.writes
    assert apply(sim, "l40s-3")[0] == 0 and sim.writes == before


def test_sriov_changed_config_removes_then_creates_another_type(tmp_path: Path) -> None:
    sim = sriov_sim(tmp_path / "root")
    assert apply(sim, "l40s-3")[0] == 0
    assert apply(sim, "l40s-1")[0] == 0
    assert sorted(vf_types(sim).values()) == [0, 0, 0, 557]
    # Homogeneous GPU: 2B is only creatable once the 1B is gone; the removal comes first.
    code, _, error = apply(sim, "l40s-2b")
    assert code == 0, error
    assert sorted(vf_types(sim).values()) == [0, 0, 558, 558]


def test_sriov_names_survive_in_the_state_when_every_vf_is_taken(tmp_path: Path) -> None:
    sim = sriov_sim(tmp_path / "root")
    assert apply(sim, "l40s-full")[0] == 0
    assert sorted(vf_types(sim).values()) == [557] * 4
    before = sim.writes
    code, _, error = apply(sim, "l40s-full")  # no VF lists a creatable type now: the state file knows 557
    assert code == 0, error
    assert sim.writes == before


def test_sriov_errors_and_held_vfs(tmp_path: Path) -> None:
    sim = sriov_sim(tmp_path / "root")
    assert apply(sim, "l40s-3")[0] == 0
    code, _, error = apply(sim, "l40s-5")
    assert code == 1 and "the config asks for 5 vGPU(s) and the GPU has 4 VFs" in str(error)
    code, _, error = apply(sim, "unknown-type")  # 558 is known from the first run's state: a homogeneous GPU
    assert code == 1 and "cannot create vGPU type 'A100-4C': it offers 557 (NVIDIA L40S-1B), 558" in str(error)
    taken = [vf for vf, current in vf_types(sim).items() if current]
    for pid, vf in enumerate(taken, start=6000):
        sim.hold(int(os.readlink(sim.root / "sys/bus/pci/devices" / vf / "iommu_group").rpartition("/")[2]), pid=pid)
    before = sim.writes
    code, _, error = apply(sim, "l40s-1")
    assert code == 1 and "VMs hold" in str(error) and taken[0] in str(error)
    assert sim.writes == before


def test_validate_vm_vgpu_says_what_is_missing_then_ready(mdev_sim: SimKernel) -> None:
    config = str(mdev_sim.root.parent / "vgpu.yaml")
    env = {"GPU_NODE_AGENT_VGPU_CONFIG": config, "GPU_NODE_AGENT_VGPU_SELECT": "mixed"}
    result = agent(mdev_sim, "validate", "--workload", "vm-vgpu", env=env)
    assert result.exit_code == 1
    assert "0000:3b:00.0: 2 T4-1Q vGPU(s) missing" in str(result.exception)
    assert apply(mdev_sim, "mixed")[0] == 0
    result = agent(mdev_sim, "validate", "--workload", "vm-vgpu", env=env)
    assert result.exit_code == 0, result.output
    assert report(result)["ready"] is True
    assert (mdev_sim.root.parent / "state/ready").exists()
    assert mdev_sim.writes == 3  # validate wrote nothing


def test_gpu_indexes_count_every_nvidia_gpu_as_nvidias_manager_does(tmp_path: Path) -> None:
    """A passthrough GPU at a lower address is GPU 0 even though it hosts no vGPU: the T4s are 1 and 2."""
    from dataclasses import replace

    node = mdev_node()
    node = replace(
        node, functions=(Function("0000:1a:00.0", NVIDIA, 0x2236, CLASS_3D, "vfio-pci", 9, 0), *node.functions)
    )
    sim = build_node(node, tmp_path / "root")
    (tmp_path / "vgpu.yaml").write_text(
        "version: v1\nvgpu-configs:\n  second:\n    - devices: [2]\n      vgpu-devices: {T4-1Q: 1}\n"
    )
    code, _, error = apply(sim, "second")
    assert code == 0, error
    assert mdevs(sim, T4S[0], "nvidia-222") == [] and len(mdevs(sim, T4S[1], "nvidia-222")) == 1


def test_a_node_without_vgpu_parents_is_named(tmp_path: Path) -> None:
    from simkit.agent_nodes import passthrough_node

    sim = build_node(passthrough_node(), tmp_path / "root")
    (tmp_path / "vgpu.yaml").write_text(CONFIG)
    code, _, error = apply(sim, "mixed")
    assert code == 1 and "no vGPU parent on this node" in str(error)
