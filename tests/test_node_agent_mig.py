"""gpu-node-agent vgpu apply with MIG-backed vGPU types on fixture A100 40GB and H100 80GB trees through
simkit.kernel_sim (whose ``run`` stands in for nvidia-smi): MIG mode and GPU instances first, then the vGPUs,
only the difference, held vGPUs never touched, invalid layouts refused before anything changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from node_agent.kernel import AgentError
from node_agent.mig import mig_backed
from node_agent.vgpu_config import parse_config
from simkit.agent_nodes import build_mig_node
from simkit.kernel_sim import SimKernel
from tests.node_agent_support import agent

A100 = "0000:3b:00.0"
H100 = "0000:86:00.0"
L40S = "0000:d8:00.0"
CONFIG = """\
version: v1
vgpu-configs:
  mig-mixed:
    - devices: [0]
      vgpu-devices: {A100-1-5C: 2, A100-2-10C: 1, A100-3-20C: 1}
    - devices: [1]
      vgpu-devices: {H100-1-10C: 3, H100-4-40C: 1}
  mig-retype:
    - devices: [0]
      vgpu-devices: {A100-1-5C: 2, A100-2-10C: 1, A100-1-10C: 2}
    - devices: [1]
      vgpu-devices: {H100-1-10C: 3, H100-4-40C: 1}
  misfit:
    - devices: [0]
      vgpu-devices: {A100-3-20C: 2, A100-1-5C: 1}
  too-many-me:
    - devices: [1]
      vgpu-devices: {H100-1-10CME: 2}
  not-mig:
    - devices: [2]
      vgpu-devices: {A100-1-5C: 1}
  wrong-profile:
    - devices: [1]
      vgpu-devices: {A100-1-5C: 1}
  time-sliced:
    - devices: [0]
      vgpu-devices: {A100-10C: 2}
  mig-and-l40s:
    - devices: [0]
      vgpu-devices: {A100-1-5C: 2}
    - devices: [2]
      vgpu-devices: {L40S-1B: 1}
"""
CHANGING = ("-mig", "-r", "-cgi", "-dci", "-dgi")


@pytest.fixture
def sim(tmp_path: Path) -> SimKernel:
    kernel = build_mig_node(tmp_path / "root")
    (tmp_path / "vgpu.yaml").write_text(CONFIG)
    return kernel


def apply(
    sim: SimKernel, name: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[int, dict[str, object], BaseException | None]:
    config = str(sim.root.parent / "vgpu.yaml")
    result = agent(sim, "vgpu", "apply", "--config", config, "--select", name, *extra, env=env)
    return result.exit_code, (json.loads(result.stdout) if result.exit_code == 0 else {}), result.exception


def changing(sim: SimKernel) -> list[list[str]]:
    """The nvidia-smi commands run that change the GPU (queries left out)."""
    return [argv for argv in sim.commands if any(word in CHANGING for word in argv)]


def vgpus(sim: SimKernel, pf: str) -> dict[str, int]:
    """VF address → current_vgpu_type, for the VFs with a vGPU."""
    found = {}
    for link in (sim.root / "sys/bus/pci/devices" / pf).glob("virtfn*"):
        vf = Path(os.path.realpath(link))
        current = int((vf / "nvidia/current_vgpu_type").read_text())
        if current:
            found[vf.name] = current
    return found


def counts(sim: SimKernel, pf: str) -> dict[int, int]:
    tally: dict[int, int] = {}
    for current in vgpus(sim, pf).values():
        tally[current] = tally.get(current, 0) + 1
    return tally


def test_type_names_map_to_profiles_as_nvidias_manager_reads_them() -> None:
    assert mig_backed("A100-1-5C") is not None and mig_backed("A100-1-5C").profile == "1g.5gb"  # type: ignore[union-attr]
    assert mig_backed("NVIDIA H100-3-40C").profile == "3g.40gb"  # type: ignore[union-attr]
    assert mig_backed("A100-1-5CME").profile == "1g.5gb+me"  # type: ignore[union-attr]
    assert mig_backed("DC-1-24CGFX").profile == "1g.24gb+gfx"  # type: ignore[union-attr]
    assert mig_backed("A100-40C") is None and mig_backed("nvidia-222") is None and mig_backed("558") is None


def test_a_mig_backed_config_creates_gpu_instances_then_vgpus_on_an_a100_and_an_h100(sim: SimKernel) -> None:
    code, done, error = apply(sim, "mig-mixed")
    assert code == 0, error
    assert sim.mig_layout(A100) == (True, [("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4)])
    assert sim.mig_layout(H100) == (True, [("4g.40gb", 0), ("1g.10gb", 4), ("1g.10gb", 5), ("1g.10gb", 6)])
    assert counts(sim, A100) == {700: 2, 703: 1, 704: 1}
    assert counts(sim, H100) == {800: 3, 805: 1}
    assert not (sim.root / "sys/bus/pci/devices" / L40S / "virtfn0").exists()  # no spec matches GPU 2
    actions = [(change["parent"], change["action"]) for change in done["changes"]]  # type: ignore[attr-defined]
    a100 = [action for parent, action in actions if parent == A100]
    assert a100[:4] == ["mig-mode", "gpu-reset", "enable-vfs", "create-gpu-instances"]
    assert a100[4:] == ["create"] * 4
    state = json.loads((sim.root.parent / "state/state.json").read_text())
    assert state["vgpu"]["status"] == "success"
    assert state["vgpu"]["type_names"][A100]["704"] == "NVIDIA A100-3-20C"


def test_a_mig_gpu_beside_a_gpu_whose_vfs_are_turned_on_still_gets_its_mig_step(sim: SimKernel) -> None:
    """Enabling the L40S's VFs re-plans every GPU: the A100's MIG step must survive that (was: planned again
    without nvidia-smi, its vGPUs silently missing and the apply reported as done)."""
    code, _, error = apply(sim, "mig-and-l40s")
    assert code == 0, error
    assert sim.mig_layout(A100) == (True, [("1g.5gb", 0), ("1g.5gb", 1)])
    assert counts(sim, A100) == {700: 2}
    assert counts(sim, L40S) == {557: 1}


def test_a_reapply_changes_nothing(sim: SimKernel) -> None:
    assert apply(sim, "mig-mixed")[0] == 0
    writes, commands = sim.writes, len(changing(sim))
    code, done, error = apply(sim, "mig-mixed")
    assert code == 0, error
    assert sim.writes == writes and len(changing(sim)) == commands
    assert done["changes"] == [] and done["writes"] == 0


def test_a_changed_type_replans_only_what_differs(sim: SimKernel) -> None:
    assert apply(sim, "mig-mixed")[0] == 0
    before_a100, before_h100 = vgpus(sim, A100), vgpus(sim, H100)
    code, _, error = apply(sim, "mig-retype")
    assert code == 0, error
    # The 3g.20gb GPU instance and its vGPU go; two 1g.10gb take its memory slices; the rest is untouched.
    assert sim.mig_layout(A100) == (
        True,
        [("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("1g.10gb", 4), ("1g.10gb", 6)],
    )
    after = vgpus(sim, A100)
    kept = {vf: kind for vf, kind in before_a100.items() if kind != 704}
    assert {vf: kind for vf, kind in after.items() if vf in kept} == kept
    assert counts(sim, A100) == {700: 2, 703: 1, 702: 2}
    assert vgpus(sim, H100) == before_h100
    retyped = [argv for argv in changing(sim) if A100 in argv]
    assert not any("-mig" in argv or "-r" in argv for argv in retyped[-4:])  # MIG mode stays on: no reset


def test_a_vgpu_a_vm_holds_blocks_the_change_with_its_name(sim: SimKernel) -> None:
    assert apply(sim, "mig-mixed")[0] == 0
    (held,) = [vf for vf, kind in vgpus(sim, A100).items() if kind == 704]
    group = int(os.readlink(sim.root / "sys/bus/pci/devices" / held / "iommu_group").rpartition("/")[2])
    sim.hold(group, pid=5100, comm="virt-launcher")
    writes, commands = sim.writes, len(changing(sim))
    code, _, error = apply(sim, "mig-retype")
    assert code == 1 and isinstance(error, AgentError)
    assert "VMs hold" in str(error) and held in str(error) and "pid 5100 (virt-launcher)" in str(error)
    assert sim.writes == writes and len(changing(sim)) == commands  # nothing written, no nvidia-smi change
    code, _, error = apply(sim, "time-sliced")  # leaving MIG mode would take every vGPU: refused as well
    assert code == 1 and held in str(error)
    state = json.loads((sim.root.parent / "state/state.json").read_text())
    assert state["vgpu"]["status"] == "failed"
    sim.release(5100)
    assert apply(sim, "mig-retype")[0] == 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("misfit", f"{A100} (A100 PCIe 40GB): GPU instances 3g.20gb x2, 1g.5gb x1 do not fit"),
        ("too-many-me", f"{H100} (H100 PCIe 80GB): GPU instances 1g.10gb+me x2 do not fit"),
        ("not-mig", f"{L40S} (10de:26b9) does not support MIG: cannot create the MIG-backed vGPU type 'A100-1-5C'"),
        ("wrong-profile", f"{H100} (H100 PCIe 80GB) has no GPU instance profile 1g.5gb for 'A100-1-5C'"),
    ],
)
def test_an_invalid_layout_is_refused_naming_the_culprit_before_anything_changes(
    sim: SimKernel, name: str, message: str
) -> None:
    code, _, error = apply(sim, name)
    assert code == 1 and message in str(error), error
    assert sim.writes == 0 and changing(sim) == []


def test_time_sliced_and_mig_backed_types_on_one_gpu_are_refused_in_the_config() -> None:
    text = "version: v1\nvgpu-configs:\n  both:\n    - devices: all\n      vgpu-devices: {A100-1-5C: 1, A100-10C: 1}\n"
    with pytest.raises(AgentError, match=r"both\[0\]: A100-1-5C is MIG-backed and A100-10C is time-sliced"):
        parse_config(text, "c.yaml")


def test_mig_mode_waits_for_no_process_on_the_gpu(sim: SimKernel) -> None:
    sim.gpu_process(A100, 3131, "python3")
    code, _, error = apply(sim, "mig-mixed")
    assert code == 1 and f"{A100}: MIG mode cannot change while processes use the GPU: pid 3131 (python3)" in str(error)
    assert sim.writes == 0 and changing(sim) == []


def test_leaving_mig_for_time_sliced_types_turns_mig_off(sim: SimKernel) -> None:
    assert apply(sim, "mig-mixed")[0] == 0
    code, _, error = apply(sim, "time-sliced")
    assert code == 0, error
    assert sim.mig_layout(A100) == (False, [])
    assert counts(sim, A100) == {690: 2}
    assert counts(sim, H100) == {800: 3, 805: 1}  # GPU 1 matches no spec of this config: left as it is


def test_a_failure_midway_is_named_and_the_next_apply_completes(sim: SimKernel) -> None:
    sim.smi_failures.append("-cgi")  # the driver refuses the first GPU instance creation once
    code, _, error = apply(sim, "mig-mixed")
    assert code == 1 and "-cgi" in str(error) and "Unknown Error" in str(error)
    code, _, error = apply(sim, "mig-mixed")
    assert code == 0, error
    assert counts(sim, A100) == {700: 2, 703: 1, 704: 1} and counts(sim, H100) == {800: 3, 805: 1}


def test_the_nvidia_smi_command_is_configurable(sim: SimKernel) -> None:
    code, _, error = apply(sim, "mig-mixed", "--nvidia-smi", "/run/nvidia/driver/usr/bin/nvidia-smi")
    assert code == 0, error
    assert {argv[0] for argv in sim.commands} == {"/run/nvidia/driver/usr/bin/nvidia-smi"}
    code, _, error = apply(sim, "mig-retype", env={"GPU_NODE_AGENT_NVIDIA_SMI": "/opt/none/smi-tool"})
    assert code == 1 and "cannot run /opt/none/smi-tool" in str(error)


def test_validate_names_missing_gpu_instances_and_vgpus_then_is_ready(sim: SimKernel) -> None:
    env = {"GPU_NODE_AGENT_VGPU_CONFIG": str(sim.root.parent / "vgpu.yaml"), "GPU_NODE_AGENT_VGPU_SELECT": "mig-mixed"}
    result = agent(sim, "validate", "--workload", "vm-vgpu", env=env)
    assert result.exit_code == 1 and f"{A100}: MIG mode is off" in str(result.exception)
    assert apply(sim, "mig-mixed")[0] == 0
    writes, commands = sim.writes, len(changing(sim))
    result = agent(sim, "validate", "--workload", "vm-vgpu", env=env)
    assert result.exit_code == 0, result.output
    assert sim.writes == writes and len(changing(sim)) == commands
