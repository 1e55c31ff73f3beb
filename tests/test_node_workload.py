"""node_agent.workload over fixture trees through simkit.kernel_sim: every move between container,
vm-passthrough and vm-vgpu (mdev T4s, SR-IOV A100/H100 with MIG-backed vGPUs, consumer cards), refusals that
write nothing, a failure half-way named with what was done, a re-run that writes nothing, per-GPU workloads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from node_agent.kernel import AgentError
from node_agent.sysfs import Sysfs, read_function
from node_agent.vgpu_config import parse_config, select_config
from node_agent.workload import (
    Desired,
    GpuOverride,
    Outcome,
    Transition,
    apply_transition,
    current_workloads,
    plan_transition,
)
from simkit.agent_nodes import build_mig_node
from simkit.fixture_nodes import CLASS_3D, NVIDIA
from simkit.kernel_sim import SimKernel
from simkit.sysfs_fixture import Function, Node
from tests.node_agent_support import build_node, mdev_node, passthrough_node

T4S = ("0000:3b:00.0", "0000:af:00.0")
A100, H100, L40S = "0000:3b:00.0", "0000:86:00.0", "0000:d8:00.0"
CARD, OTHER, GRACE = "0000:86:00.0", "0000:af:00.0", "0009:01:00.0"
MDEV_CONFIG = """\
version: v1
vgpu-configs:
  t4:
    - devices: all
      vgpu-devices: {T4-1Q: 2}
"""
MIG_CONFIG = """\
version: v1
vgpu-configs:
  mig:
    - devices: [0]
      vgpu-devices: {A100-1-5C: 2, A100-2-10C: 1}
    - devices: [1]
      vgpu-devices: {H100-1-10C: 2}
    - devices: [2]
      vgpu-devices: {L40S-1B: 2}
"""


def specs(text: str, name: str) -> tuple:  # type: ignore[type-arg]
    return select_config(parse_config(text, "c.yaml"), name, "c.yaml")


def move(sim: SimKernel, desired: Desired, allocated: frozenset[str] = frozenset()) -> tuple[Transition, Outcome]:
    fs = Sysfs(sim.root)
    transition = plan_transition(fs, sim, desired, allocated)
    return transition, apply_transition(fs, sim, transition, state_dir=sim.root.parent / "state")


def drivers(sim: SimKernel, *addresses: str) -> list[str | None]:
    return [read_function(Sysfs(sim.root), address).driver for address in addresses]


def mdevs(sim: SimKernel, parent: str) -> list[str]:
    types = sim.root / "sys/class/mdev_bus" / parent / "mdev_supported_types"
    return sorted(uid for kind in types.iterdir() for uid in os.listdir(kind / "devices"))


def vf_types(sim: SimKernel, pf: str) -> list[int]:
    found = []
    for link in (sim.root / "sys/bus/pci/devices" / pf).glob("virtfn*"):
        current = int((Path(os.path.realpath(link)) / "nvidia/current_vgpu_type").read_text())
        if current:
            found.append(current)
    return sorted(found)


def numvfs(sim: SimKernel, pf: str) -> int:
    return int((sim.root / "sys/bus/pci/devices" / pf / "sriov_numvfs").read_text())


def state(sim: SimKernel) -> dict:  # type: ignore[type-arg]
    return dict(json.loads((sim.root.parent / "state/state.json").read_text()))


def group_of(sim: SimKernel, device: Path) -> int:
    return int(os.readlink(device / "iommu_group").rpartition("/")[2])


@pytest.fixture
def mdev_sim(tmp_path: Path) -> SimKernel:
    return build_node(mdev_node(), tmp_path / "root")


@pytest.fixture
def mig_sim(tmp_path: Path) -> SimKernel:
    return build_mig_node(tmp_path / "root")


@pytest.fixture
def card_sim(tmp_path: Path) -> SimKernel:
    return build_node(passthrough_node(), tmp_path / "root")


# -- every pair of workloads, both ways ----------------------------------------------------------------


def test_mdev_gpus_move_through_every_workload_both_ways(mdev_sim: SimKernel) -> None:
    t4 = specs(MDEV_CONFIG, "t4")
    sequence = [
        ("vm-vgpu", ("nvidia", "nvidia"), 2),
        ("container", ("nvidia", "nvidia"), 0),
        ("vm-passthrough", ("vfio-pci", "vfio-pci"), 0),
        ("vm-vgpu", ("nvidia", "nvidia"), 2),
        ("vm-passthrough", ("vfio-pci", "vfio-pci"), 0),
        ("container", ("nvidia", "nvidia"), 0),
    ]
    for workload, wanted_drivers, count in sequence:
        transition, outcome = move(mdev_sim, Desired(workload, vgpu_specs=t4))
        assert transition.refusals == (), transition.refusals
        assert transition.changes
        assert outcome.state == "success", outcome.message
        assert outcome.workloads == dict.fromkeys(T4S, workload)
        assert tuple(drivers(mdev_sim, *T4S)) == wanted_drivers, workload
        assert [len(mdevs(mdev_sim, t)) for t in T4S] == [count, count], workload
        assert current_workloads(Sysfs(mdev_sim.root)) == dict.fromkeys(T4S, workload)
        assert state(mdev_sim)["workload"]["state"] == "success"


def test_passthrough_to_vgpu_unbinds_before_it_creates(mdev_sim: SimKernel) -> None:
    t4 = specs(MDEV_CONFIG, "t4")
    assert move(mdev_sim, Desired("vm-passthrough"))[1].state == "success"
    start = len(mdev_sim.log)
    _, outcome = move(mdev_sim, Desired("vm-vgpu", vgpu_specs=t4))
    assert outcome.state == "success", outcome.message
    writes = [path for path, _ in mdev_sim.log[start:]]
    last_unbind = max(i for i, path in enumerate(writes) if path.endswith("drivers_probe"))
    first_create = min(i for i, path in enumerate(writes) if path.endswith("/create"))
    assert last_unbind < first_create
    assert outcome.done[0].startswith("unbound ")


def test_mig_backed_vgpus_move_through_every_workload_both_ways(mig_sim: SimKernel) -> None:
    mig = specs(MIG_CONFIG, "mig")
    gpus = (A100, H100, L40S)
    sequence = [
        "vm-vgpu",
        "vm-passthrough",
        "vm-vgpu",
        "container",
        "vm-passthrough",
        "container",
        "vm-vgpu",
    ]
    for workload in sequence:
        transition, outcome = move(mig_sim, Desired(workload, vgpu_specs=mig))
        assert transition.refusals == (), transition.refusals
        assert outcome.state == "success", f"{workload}: {outcome.message}"
        assert outcome.workloads == dict.fromkeys(gpus, workload)
        on = "vfio-pci" if workload == "vm-passthrough" else "nvidia"
        assert drivers(mig_sim, *gpus) == [on] * 3, workload
        if workload == "vm-vgpu":
            assert vf_types(mig_sim, A100) == [700, 700, 703]
            assert vf_types(mig_sim, H100) == [800, 800]
            assert vf_types(mig_sim, L40S) == [557, 557]
            assert mig_sim.mig_layout(A100)[0] and mig_sim.mig_layout(H100)[0]
            assert outcome.vgpus[A100] and outcome.vgpus[L40S]
        else:
            assert [vf_types(mig_sim, gpu) for gpu in gpus] == [[], [], []], workload
        if workload == "vm-passthrough":
            assert [numvfs(mig_sim, gpu) for gpu in gpus] == [0, 0, 0]  # VFs off before the PF's unbind
        assert current_workloads(Sysfs(mig_sim.root)) == dict.fromkeys(gpus, workload)
    assert state(mig_sim)["vgpu"]["type_names"][L40S]["557"] == "NVIDIA L40S-1B"


def test_consumer_cards_move_between_container_and_passthrough(card_sim: SimKernel) -> None:
    _, outcome = move(card_sim, Desired("vm-passthrough"))
    assert outcome.state == "success", outcome.message
    assert drivers(card_sim, CARD, "0000:86:00.1", OTHER, GRACE) == [
        "vfio-pci",
        "vfio-pci",
        "vfio-pci",
        "nvgrace_gpu_vfio_pci",
    ]
    _, outcome = move(card_sim, Desired("container"))
    assert outcome.state == "success", outcome.message
    assert drivers(card_sim, CARD, "0000:86:00.1", OTHER) == ["nouveau", "snd_hda_intel", "nouveau"]


# -- refusals write nothing ------------------------------------------------------------------------------


def test_a_vm_holding_a_passthrough_group_refuses_the_whole_transition(mdev_sim: SimKernel) -> None:
    assert move(mdev_sim, Desired("vm-passthrough"))[1].state == "success"
    held = group_of(mdev_sim, mdev_sim.root / "sys/bus/pci/devices" / T4S[1])
    mdev_sim.hold(held, pid=5150, comm="qemu-kvm")
    log, writes = list(mdev_sim.log), mdev_sim.writes
    transition, outcome = move(mdev_sim, Desired("container"))
    assert outcome.state == "refused"
    (refusal,) = transition.refusals
    assert f"IOMMU group {held} of {T4S[1]} is in use by a VM" in refusal and "pid 5150 (qemu-kvm)" in refusal
    assert mdev_sim.log == log and mdev_sim.writes == writes  # not even the free GPU moved
    assert drivers(mdev_sim, *T4S) == ["vfio-pci", "vfio-pci"]
    assert outcome.workloads == dict.fromkeys(T4S, "vm-passthrough")
    assert state(mdev_sim)["workload"]["state"] == "refused"


def test_a_vm_holding_a_vgpu_refuses_moving_its_gpu_to_passthrough(mdev_sim: SimKernel) -> None:
    assert move(mdev_sim, Desired("vm-vgpu", vgpu_specs=specs(MDEV_CONFIG, "t4")))[1].state == "success"
    uid = mdevs(mdev_sim, T4S[0])[0]
    mdev_sim.hold(group_of(mdev_sim, mdev_sim.root / "sys/bus/mdev/devices" / uid), pid=6000, comm="virt-launcher")
    log = list(mdev_sim.log)
    transition, outcome = move(mdev_sim, Desired("vm-passthrough"))
    assert outcome.state == "refused" and mdev_sim.log == log
    assert any(uid in refusal and "not removing vGPUs in use" in refusal for refusal in transition.refusals)
    assert len(mdevs(mdev_sim, T4S[1])) == 2  # the other GPU was not touched either


@pytest.mark.parametrize("kind", ["gpu", "companion"])
def test_an_allocated_gpu_refuses_a_change_of_its_workload(card_sim: SimKernel, kind: str) -> None:
    allocated = {"gpu": "0000:86:00.0", "companion": "0000:86:00.1"}[kind]
    log = list(card_sim.log)
    transition, outcome = move(card_sim, Desired("vm-passthrough"), frozenset({allocated.upper()}))
    assert outcome.state == "refused" and card_sim.log == log
    assert any(refusal.startswith(f"{CARD} (10de:1f08) is allocated to a pod") for refusal in transition.refusals)
    assert drivers(card_sim, CARD, OTHER) == ["nouveau", "nouveau"]


def test_an_allocated_mdev_refuses_leaving_vgpu_and_is_never_removed(mdev_sim: SimKernel) -> None:
    t4 = specs(MDEV_CONFIG, "t4")
    assert move(mdev_sim, Desired("vm-vgpu", vgpu_specs=t4))[1].state == "success"
    uid = mdevs(mdev_sim, T4S[0])[0]
    log = list(mdev_sim.log)
    transition, outcome = move(mdev_sim, Desired("container"), frozenset({uid.upper()}))
    assert outcome.state == "refused" and mdev_sim.log == log
    assert any(f"{T4S[0]} (10de:1eb8) is allocated to a pod ({uid}" in refusal for refusal in transition.refusals)
    one = specs(MDEV_CONFIG.replace("T4-1Q: 2", "T4-1Q: 1"), "t4")  # staying vm-vgpu, fewer vGPUs
    transition, outcome = move(mdev_sim, Desired("vm-vgpu", vgpu_specs=one), frozenset({uid}))
    assert outcome.state == "success", outcome.message
    assert uid in mdevs(mdev_sim, T4S[0]) and len(mdevs(mdev_sim, T4S[0])) == 1  # the other one went


def test_a_plan_refused_since_applies_nothing(mdev_sim: SimKernel) -> None:
    fs = Sysfs(mdev_sim.root)
    assert move(mdev_sim, Desired("vm-passthrough"))[1].state == "success"
    transition = plan_transition(fs, mdev_sim, Desired("container"))
    assert transition.refusals == ()
    mdev_sim.hold(group_of(mdev_sim, mdev_sim.root / "sys/bus/pci/devices" / T4S[0]))  # a VM starts meanwhile
    log = list(mdev_sim.log)
    outcome = apply_transition(fs, mdev_sim, transition)
    assert outcome.state == "refused" and outcome.message.startswith("the node changed since the plan")
    assert mdev_sim.log == log


# -- failure half-way, re-runs ---------------------------------------------------------------------------


def test_a_failure_half_way_is_failed_naming_the_step_and_what_was_done(mig_sim: SimKernel) -> None:
    mig = specs(MIG_CONFIG, "mig")
    assert move(mig_sim, Desired("vm-passthrough"))[1].state == "success"
    mig_sim.smi_failures.append("-cgi")  # the driver fails creating the A100's GPU instances
    transition, outcome = move(mig_sim, Desired("vm-vgpu", vgpu_specs=mig))
    assert transition.refusals == ()
    assert outcome.state == "failed"
    assert outcome.message.startswith(f"applying the vGPU config to {A100}, {H100}, {L40S} failed: ")
    assert f"already done: unbound {A100}" in outcome.message
    assert outcome.done == (f"unbound {A100}, {H100}, {L40S} from VFIO",)
    assert outcome.workloads[A100] == "container"  # on its host driver, no vGPU yet
    recorded = state(mig_sim)["workload"]
    assert recorded["state"] == "failed" and recorded["done"] == list(outcome.done)
    _, again = move(mig_sim, Desired("vm-vgpu", vgpu_specs=mig))  # a retry goes on from where it stopped
    assert again.state == "success", again.message
    assert vf_types(mig_sim, A100) == [700, 700, 703]


@pytest.mark.parametrize("workload", ["container", "vm-passthrough", "vm-vgpu"])
def test_a_rerun_with_the_node_as_desired_writes_nothing(mdev_sim: SimKernel, workload: str) -> None:
    desired = Desired(workload, vgpu_specs=specs(MDEV_CONFIG, "t4"))
    assert move(mdev_sim, desired)[1].state == "success"
    log = list(mdev_sim.log)
    transition, outcome = move(mdev_sim, desired)
    assert not transition.changes and outcome.state == "success"
    assert mdev_sim.log == log and outcome.writes == 0


# -- per-GPU workloads -----------------------------------------------------------------------------------


def test_overrides_keep_some_gpus_for_containers_and_send_the_rest_to_vms(card_sim: SimKernel) -> None:
    desired = Desired(
        "vm-passthrough",
        overrides=(
            GpuOverride("container", device=(0x10DE, 0x1F08)),  # both RTX 2060s by selector ...
            GpuOverride("vm-passthrough", address=OTHER.upper()),  # ... but an address wins (in any case)
        ),
    )
    transition, outcome = move(card_sim, desired)
    assert outcome.state == "success", outcome.message
    assert transition.workloads == {CARD: "container", OTHER: "vm-passthrough", GRACE: "vm-passthrough"}
    assert drivers(card_sim, CARD, "0000:86:00.1", OTHER, "0000:af:00.1", GRACE) == [
        "nouveau",
        "snd_hda_intel",
        "vfio-pci",
        "vfio-pci",
        "nvgrace_gpu_vfio_pci",
    ]


def test_an_override_naming_no_gpu_of_the_node_is_an_error(card_sim: SimKernel) -> None:
    desired = Desired("container", overrides=(GpuOverride("vm-passthrough", address="0000:99:00.0", source="x.yaml"),))
    with pytest.raises(AgentError, match=r"x.yaml: 0000:99:00.0 is no NVIDIA GPU of this node"):
        plan_transition(Sysfs(card_sim.root), card_sim, desired)


def test_unknown_workloads_are_refused_by_name() -> None:
    with pytest.raises(AgentError, match="workload 'vm' is none of container, vm-passthrough, vm-vgpu"):
        Desired("vm")
    with pytest.raises(AgentError, match="by address or by device"):
        GpuOverride("container")


def test_gpus_sharing_a_group_cannot_be_split_across_vfio(tmp_path: Path) -> None:
    node = Node(
        name="shared",
        functions=(
            Function("0000:01:00.0", NVIDIA, 0x1EB8, CLASS_3D, "nvidia", 9, 0),
            Function("0000:02:00.0", NVIDIA, 0x1EB8, CLASS_3D, "nvidia", 9, 0),
        ),
    )
    sim = build_node(node, tmp_path / "root")
    desired = Desired("vm-passthrough", overrides=(GpuOverride("container", address="0000:02:00.0"),))
    transition, outcome = move(sim, desired)
    assert outcome.state == "refused" and sim.writes == 0
    assert any(
        refusal.startswith("IOMMU group 9 holds GPUs 0000:01:00.0 (vm-passthrough), 0000:02:00.0 (container)")
        for refusal in transition.refusals
    )
    _, outcome = move(sim, Desired("vm-passthrough"))  # one workload for both: fine
    assert outcome.state == "success" and drivers(sim, "0000:01:00.0", "0000:02:00.0") == ["vfio-pci"] * 2
