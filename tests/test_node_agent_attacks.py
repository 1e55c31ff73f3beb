"""Issue 22's node-agent findings, each reproduced on a fixture tree: a GPU's IOMMU group shared with a NIC
and an NVMe drive, links leading out of the host root, a readiness probe that opened every vGPU's group,
and SR-IOV VFs enabled before a config was refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from node_agent.cli import cli
from node_agent.kernel import AgentError, RealKernel
from node_agent.sysfs import Sysfs, read_function
from simkit.agent_nodes import (
    SHARED_GROUP,
    add_disk,
    add_interface,
    mount,
    shared_group_node,
)
from simkit.fixture_nodes import CLASS_3D, NVIDIA
from simkit.kernel_sim import SimKernel, VgpuType
from simkit.sysfs_fixture import Function, Node
from tests.node_agent_support import agent, build_node, mdev_node, passthrough_node, report

GPU, AUDIO, USB, NIC, NVME, PORT = (
    "0000:01:00.0",
    "0000:01:00.1",
    "0000:01:00.2",
    "0000:02:00.0",
    "0000:03:00.0",
    "0000:00:01.0",
)


def drivers(sim: SimKernel) -> dict[str, str | None]:
    fs = Sysfs(sim.root)
    return {address: read_function(fs, address).driver for address in (GPU, AUDIO, USB, NIC, NVME, PORT)}


@pytest.fixture
def workstation(tmp_path: Path) -> SimKernel:
    """The shared group with the NIC's eth0 up and the NVMe's first partition mounted on / (the host's disk)."""
    sim = build_node(shared_group_node(), tmp_path / "root")
    add_interface(sim.root, NIC, "eth0", up=True)
    add_disk(sim.root, f"{NVME}/nvme/nvme0", "nvme0n1", 259, partitions=2)
    mount(sim.root, "259:1", "/")
    return sim


# -- 1: bind --all takes the host's NIC and root disk ------------------------------------------------------


def test_bind_all_refuses_a_group_shared_with_a_nic_and_an_nvme_naming_each(workstation: SimKernel) -> None:
    before = drivers(workstation)
    result = agent(workstation, "bind", "--all")
    assert result.exit_code == 1
    message = str(result.exception)
    assert f"IOMMU group {SHARED_GROUP} also holds functions that are not the GPU's own" in message
    assert f"{NIC} (8086:10fb, network 0x020000, on ixgbe)" in message
    assert f"{NVME} (144d:a808, storage 0x010802, on nvme)" in message
    assert f"--allow-group {SHARED_GROUP}" in message
    for own in (GPU, AUDIO, USB, PORT):
        assert f"{own} (" not in message  # the card's functions and the switch port are not the problem
    assert workstation.writes == 0 and drivers(workstation) == before
    assert report(result)["writes"] == 0


def test_validate_says_the_shared_group_keeps_the_node_from_passthrough(workstation: SimKernel) -> None:
    result = agent(workstation, "validate", "--all", "--workload", "vm-passthrough")
    assert result.exit_code == 1
    assert f"{NIC} (8086:10fb, network 0x020000, on ixgbe)" in str(result.exception)


def test_an_allowed_group_is_still_refused_while_the_host_uses_its_devices(workstation: SimKernel) -> None:
    before = drivers(workstation)
    result = agent(workstation, "bind", "--all", "--allow-group", str(SHARED_GROUP))
    assert result.exit_code == 1
    message = str(result.exception)
    assert f"{NIC} (8086:10fb) is in use through its host driver ixgbe: network interface eth0 is up" in message
    assert (
        f"{NVME} (144d:a808) is in use through its host driver nvme: block device nvme0n1p1 (259:1) is mounted on /"
        in message
    )
    assert workstation.writes == 0 and drivers(workstation) == before


@pytest.mark.parametrize("use", ["swap", "holder", "open-node", "address", "no-mount-table"])
def test_every_host_use_of_a_device_counts(tmp_path: Path, use: str) -> None:
    sim = build_node(shared_group_node(), tmp_path / "root")
    add_interface(sim.root, NIC, "eth0", up=False)
    disk = add_disk(sim.root, f"{NVME}/nvme/nvme0", "nvme0n1", 259, partitions=2)
    expected = {
        "swap": "block device nvme0n1p2 is used as swap",
        "holder": "block device nvme0n1 is held by dm-0",
        "open-node": "pid 4243 (fio) holds /dev/nvme0n1",
        "address": "network interface eth0 has an address or a route",
        "no-mount-table": "block device nvme0n1 (259:0) may be mounted: no mount table is readable",
    }[use]
    if use != "no-mount-table":
        mount(sim.root, "8:2", "/")
    if use == "swap":
        (sim.root / "proc").mkdir(exist_ok=True)
        (sim.root / "proc/swaps").write_text(
            "Filename\tType\tSize\tUsed\tPriority\n/dev/nvme0n1p2  partition\t8388604\t0\t-2\n"
        )
    elif use == "holder":
        (disk / "holders" / "dm-0").mkdir()
    elif use == "open-node":
        sim.hold_node("/dev/nvme0n1", comm="fio")
    else:
        (sim.root / "proc/1/net").mkdir(parents=True)
        (sim.root / "proc/1/net/if_inet6").write_text("fe800000000000000000000000000001 02 40 20 80     eth0\n")
    result = agent(sim, "bind", "--all", "--allow-group", str(SHARED_GROUP))
    assert result.exit_code == 1
    assert expected in str(result.exception)
    assert sim.writes == 0


def test_an_allowed_idle_group_moves_whole_and_the_bridge_stays(tmp_path: Path) -> None:
    sim = build_node(shared_group_node(), tmp_path / "root")
    add_interface(sim.root, NIC, "eth0", up=False)
    add_disk(sim.root, f"{NVME}/nvme/nvme0", "nvme0n1", 259, partitions=1)
    mount(sim.root, "8:2", "/")  # the host's root is on another disk
    result = agent(sim, "bind", "--all", env={"GPU_NODE_AGENT_ALLOW_GROUPS": str(SHARED_GROUP)})
    assert result.exit_code == 0, result.output
    assert drivers(sim) == {
        GPU: "vfio-pci",
        AUDIO: "vfio-pci",
        USB: "vfio-pci",
        NIC: "vfio-pci",
        NVME: "vfio-pci",
        PORT: "pcieport",
    }
    allowed = agent(sim, "validate", "--all", "--allow-group", str(SHARED_GROUP))
    assert allowed.exit_code == 0, allowed.output


def test_a_mounted_usb_disk_on_the_cards_own_usb_controller_keeps_its_group(tmp_path: Path) -> None:
    """The group is the GPU's own (no opt-in needed), yet a disk on its USB-C port is the host's: deep below the
    controller's directory, as the USB and SCSI layers nest it."""
    node = Node("desk", tuple(f for f in shared_group_node().functions if f.address not in (NIC, NVME)))
    sim = build_node(node, tmp_path / "root")
    add_disk(sim.root, f"{USB}/usb1/1-1/1-1:1.0/host6/target6:0:0/6:0:0:0/block", "sdb", 8, partitions=1)
    mount(sim.root, "8:1", "/mnt/backup")
    result = agent(sim, "bind", "--all")
    assert result.exit_code == 1
    assert (
        f"{USB} (10de:1ada) is in use through its host driver xhci_hcd: "
        "block device sdb1 (8:1) is mounted on /mnt/backup" in str(result.exception)
    )
    assert sim.writes == 0


def test_a_non_nvidia_function_of_the_gpus_own_slot_is_a_companion(tmp_path: Path) -> None:
    functions = (
        *shared_group_node().functions[:3],
        Function("0000:01:00.3", 0x1B21, 0x2142, 0x0C0330, "xhci_hcd", SHARED_GROUP, 0, parent=PORT),
    )
    sim = build_node(Node("card", functions), tmp_path / "root")
    result = agent(sim, "bind", "--all")
    assert result.exit_code == 0, result.output
    assert read_function(Sysfs(sim.root), "0000:01:00.3").driver == "vfio-pci"


# -- 4: writes outside --host-root ---------------------------------------------------------------------


def _real_cli(root: Path, *args: str) -> object:
    """The real CLI (RealKernel: plain writes to the fixture's files) with vfio-pci already loaded."""
    return CliRunner().invoke(cli, [*args, "--host-root", str(root), "--state-dir", str(root.parent / "state")])


def _snapshot(root: Path) -> dict[str, str]:
    found = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            if not path.is_symlink():
                found[str(path)] = path.read_text(errors="replace")
    return found


@pytest.mark.parametrize("how", ["absolute", "climbing"])
@pytest.mark.parametrize("what", ["driver_override", "driver directory"])
def test_a_link_out_of_the_host_root_is_refused_before_any_write(
    tmp_path: Path, resolver: str, how: str, what: str
) -> None:
    sim = build_node(passthrough_node(), tmp_path / "root")
    sim.load_module("vfio_pci", sim.root)
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("driver_override", "unbind", "bind"):
        (outside / name).write_text("untouched\n")
    if what == "driver_override":  # the second function of the group: the first one's writes come before it
        link = Path(os.path.realpath(sim.root / "sys/bus/pci/devices/0000:86:00.1")) / "driver_override"
        target: Path = outside / "driver_override"
    else:
        link = sim.root / "sys/bus/pci/drivers/nouveau"
        target = outside
        for entry in link.iterdir():
            entry.unlink() if entry.is_symlink() or entry.is_file() else None
        link.rmdir()
    link.unlink(missing_ok=True)
    link.symlink_to(target if how == "absolute" else os.path.relpath(target, link.parent))
    before = _snapshot(sim.root)
    result = _real_cli(sim.root, "bind", "0000:86:00.0")
    assert result.exit_code == 1  # type: ignore[attr-defined]
    message = str(result.exception)  # type: ignore[attr-defined]
    assert "outside the host root" in message and str(link) in message
    assert all((outside / name).read_text() == "untouched\n" for name in ("driver_override", "unbind", "bind"))
    assert _snapshot(sim.root) == before  # not even the group's first function was touched


@pytest.mark.parametrize(
    "attribute",
    [
        "sys/bus/pci/devices/0000:86:00.0/driver_override",
        "sys/bus/mdev/devices/0b3a7e21-0000-4000-8000-000000000001/remove",
        "sys/bus/pci/devices/0000:86:00.0/nvidia/current_vgpu_type",
    ],
)
def test_the_real_kernel_writes_only_inside_the_host_root(tmp_path: Path, resolver: str, attribute: str) -> None:
    root = tmp_path / "root"
    build_node(passthrough_node(), root)
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / Path(attribute).name).write_text("untouched\n")
    parent = root / Path(attribute).parent
    if not parent.exists() or parent.is_symlink():
        parent.parent.mkdir(parents=True, exist_ok=True)
        parent.unlink(missing_ok=True)
        parent.symlink_to(os.path.relpath(outside / "dir", parent.parent))  # the directory leads out
    else:
        (root / attribute).unlink(missing_ok=True)
        (root / attribute).symlink_to(outside / "dir" / Path(attribute).name)
    kernel = RealKernel(Sysfs(root))
    with pytest.raises(AgentError, match="outside the host root"):
        kernel.write(root / attribute, "1")
    assert (outside / "dir" / Path(attribute).name).read_text() == "untouched\n"


def test_relative_sysfs_links_inside_the_root_keep_working(tmp_path: Path, resolver: str) -> None:
    root = tmp_path / "root"
    build_node(passthrough_node(), root)
    kernel = RealKernel(Sysfs(root))
    kernel.write(root / "sys/bus/pci/devices/0000:86:00.0/driver_override", "vfio-pci")  # through devices -> ../../..
    real = Path(os.path.realpath(root / "sys/bus/pci/devices/0000:86:00.0"))
    assert (real / "driver_override").read_text() == "vfio-pci" and kernel.writes == 1


# -- 7: the readiness probe opens every vGPU's VFIO group ------------------------------------------------


class CountingKernel(SimKernel):
    opened: int = 0

    def group_busy(self, node: Path) -> bool:
        self.opened += 1
        return super().group_busy(node)


def test_validate_vm_vgpu_never_opens_a_group_node(tmp_path: Path) -> None:
    from tests.test_node_agent_vgpu import CONFIG

    root = tmp_path / "root"
    build_node(mdev_node(), root)
    sim = CountingKernel(root)
    (tmp_path / "vgpu.yaml").write_text(CONFIG)
    env = {"GPU_NODE_AGENT_VGPU_CONFIG": str(tmp_path / "vgpu.yaml"), "GPU_NODE_AGENT_VGPU_SELECT": "mixed"}
    assert agent(sim, "vgpu", "apply", env=env).exit_code == 0
    sim.opened = 0
    result = agent(sim, "validate", "--workload", "vm-vgpu", env=env)
    assert result.exit_code == 0, result.output
    assert report(result)["ready"] is True
    assert sim.opened == 0  # /proc was asked; no /dev/vfio/<N> was opened (a VM's QEMU may be opening it)


# -- 8: vgpu apply enabled VFs before refusing -------------------------------------------------------------

L40S = "0000:41:00.0"


def _l40s(root: Path) -> SimKernel:
    from tests.test_node_agent_vgpu import CONFIG

    sim = build_node(Node("l40s", (Function(L40S, NVIDIA, 0x26B9, CLASS_3D, "nvidia", 40, 0),)), root)
    sim.add_sriov_gpu(L40S, 4, 0x26BA, (VgpuType(557, "NVIDIA L40S-1B", 32), VgpuType(558, "NVIDIA L40S-2B", 16)))
    (root.parent / "vgpu.yaml").write_text(CONFIG)
    return sim


def _apply(sim: SimKernel, name: str) -> object:
    return agent(sim, "vgpu", "apply", "--config", str(sim.root.parent / "vgpu.yaml"), "--select", name)


def _numvfs(sim: SimKernel) -> str:
    return (sim.root / "sys/bus/pci/devices" / L40S / "sriov_numvfs").read_text().strip()


def test_a_count_above_the_vfs_is_refused_before_the_vfs_are_enabled(tmp_path: Path) -> None:
    sim = _l40s(tmp_path / "root")
    result = _apply(sim, "l40s-5")
    assert result.exit_code == 1  # type: ignore[attr-defined]
    assert "the config asks for 5 vGPU(s) and the GPU has 4 VFs" in str(result.exception)  # type: ignore[attr-defined]
    assert sim.writes == 0 and _numvfs(sim) == "0"


def test_an_unknown_type_is_refused_before_any_write_when_the_types_are_known(tmp_path: Path) -> None:
    sim = _l40s(tmp_path / "root")
    assert _apply(sim, "l40s-1").exit_code == 0  # type: ignore[attr-defined]  # the state file learns the types
    assert _apply(sim, "clear").exit_code == 0  # type: ignore[attr-defined]
    sim.write(sim.root / "sys/bus/pci/devices" / L40S / "sriov_numvfs", "0")  # the operator turns the VFs off
    before = sim.writes
    result = _apply(sim, "unknown-type")
    assert result.exit_code == 1  # type: ignore[attr-defined]
    assert "cannot create vGPU type 'A100-4C': it offers 557 (NVIDIA L40S-1B), 558" in str(result.exception)  # type: ignore[attr-defined]
    assert sim.writes == before and _numvfs(sim) == "0"


def test_an_unknown_type_nothing_names_yet_leaves_the_vfs_as_they_were(tmp_path: Path) -> None:
    sim = _l40s(tmp_path / "root")
    result = _apply(sim, "unknown-type")
    assert result.exit_code == 1  # type: ignore[attr-defined]
    message = str(result.exception)  # type: ignore[attr-defined]
    assert "cannot create vGPU type 'A100-4C'" in message and "turned off again" in message
    assert _numvfs(sim) == "0"
    assert not list((sim.root / "sys/bus/pci/devices" / L40S).glob("virtfn*"))


def test_a_node_that_cannot_be_read_once_the_vfs_are_enabled_leaves_the_vfs_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-read after enabling the VFs fails (a VF's attribute unreadable, a /proc scan over its bound): the
    VFs enabled only to read their types are turned off again, as when a type proves unknown."""
    from node_agent import vgpu

    sim = _l40s(tmp_path / "root")
    real = vgpu.plan_all
    calls: list[int] = []

    def plan_all(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:  # the re-read with the VFs enabled
            assert _numvfs(sim) == "4"
            raise AgentError("sysfs attribute .../virtfn0/nvidia/creatable_vgpu_types: not a regular file (FIFO)")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(vgpu, "plan_all", plan_all)
    result = _apply(sim, "l40s-1")
    assert result.exit_code == 1  # type: ignore[attr-defined]
    message = str(result.exception)  # type: ignore[attr-defined]
    assert "not a regular file (FIFO)" in message and "turned off again" in message
    assert _numvfs(sim) == "0"
