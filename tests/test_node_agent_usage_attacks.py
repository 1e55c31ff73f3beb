"""Attacks on the node agent's host-use checks (node_agent/usage.py) that the first round (issue 22,
tests/test_node_agent_attacks.py) let through, each on the workstation fixture with its group allowed: a use
the host has of the NVMe drive, the NIC or a USB disk that the agent did not see, so ``bind`` would have taken
the device from under the host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node_agent.sysfs import Sysfs, read_function
from simkit.agent_nodes import (
    SHARED_GROUP,
    add_disk,
    add_interface,
    add_multipath_nvme,
    mount,
    passthrough_node,
    shared_group_node,
)
from simkit.kernel_sim import SimKernel
from simkit.sysfs_fixture import Node
from tests.node_agent_support import agent, build_node, report

USB, NIC, NVME = "0000:01:00.2", "0000:02:00.0", "0000:03:00.0"


def _idle_workstation(root: Path, *, partitions: int = 1) -> SimKernel:
    """The shared group with eth0 down and the NVMe not mounted (the host's root on another disk, 8:2)."""
    sim = build_node(shared_group_node(), root)
    add_interface(sim.root, NIC, "eth0", up=False)
    add_disk(sim.root, f"{NVME}/nvme/nvme0", "nvme0n1", 259, partitions=partitions)
    return sim


def _refused(sim: SimKernel, *args: str) -> str:
    result = agent(sim, "bind", "--all", "--allow-group", str(SHARED_GROUP), *args)
    assert result.exit_code == 1, result.output
    assert sim.writes == 0
    return str(result.exception)


def _mountinfo(sim: SimKernel, *lines: str) -> None:
    (sim.root / "proc/1").mkdir(parents=True, exist_ok=True)
    (sim.root / "proc/1/mountinfo").write_text("".join(f"{line}\n" for line in lines))


def test_a_btrfs_root_is_mounted_though_mountinfo_shows_an_anonymous_device_number(tmp_path: Path) -> None:
    """btrfs (Fedora's and openSUSE's default root) shows an anonymous ``0:N`` in mountinfo's third field,
    not the partition's 259:1; only the mount source names the partition."""
    sim = _idle_workstation(tmp_path / "root")
    _mountinfo(
        sim,
        "21 1 0:45 /@ / rw,relatime shared:1 - btrfs /dev/nvme0n1p1 rw,ssd,space_cache=v2,subvol=/@",
        "22 21 8:2 / /boot rw shared:2 - ext4 /dev/sda2 rw",
    )
    assert "block device nvme0n1p1 (259:1) is mounted on /" in _refused(sim)


def test_a_member_of_a_mounted_multi_device_btrfs_is_in_use(tmp_path: Path) -> None:
    """A btrfs RAID1 over sda2 and nvme0n1p1: mountinfo names only one device (sda2); the kernel lists every
    member under /sys/fs/btrfs/<fsid>/devices while the filesystem is mounted."""
    sim = _idle_workstation(tmp_path / "root")
    _mountinfo(sim, "21 1 0:45 / / rw shared:1 - btrfs /dev/sda2 rw")
    fsid = "2f6e4c1a-53b2-4c7e-9a41-0c5f3d1e2b7a"
    members = sim.root / "sys/fs/btrfs" / fsid / "devices"
    members.mkdir(parents=True)
    real = Path(os.path.realpath(sim.root / "sys/bus/pci/devices" / NVME)) / "nvme/nvme0/nvme0n1/nvme0n1p1"
    (members / "nvme0n1p1").symlink_to(os.path.relpath(real, members))
    assert f"block device nvme0n1p1 (259:1) is a device of the mounted btrfs filesystem {fsid}" in _refused(sim)


def test_a_disk_backing_a_loop_device_is_in_use(tmp_path: Path) -> None:
    """``losetup /dev/loop0 /dev/nvme0n1``: the loop driver holds the disk from inside the kernel (no process
    has it open, its holders/ stays empty); /sys/block/loop0/loop/backing_file names it."""
    sim = _idle_workstation(tmp_path / "root")
    mount(sim.root, "8:2", "/")
    loop = sim.root / "sys/devices/virtual/block/loop0"
    (loop / "loop").mkdir(parents=True)
    (loop / "loop/backing_file").write_text("/dev/nvme0n1\n")
    (sim.root / "sys/block").mkdir(exist_ok=True)
    (sim.root / "sys/block/loop0").symlink_to("../devices/virtual/block/loop0")
    assert "block device nvme0n1 (259:0) backs the loop device loop0" in _refused(sim)


def test_a_mount_point_with_a_space_is_named_as_it_is(tmp_path: Path) -> None:
    sim = _idle_workstation(tmp_path / "root")
    _mountinfo(sim, "21 1 259:1 / /mnt/my\\040disk rw shared:1 - ext4 /dev/nvme0n1p1 rw")
    assert "block device nvme0n1p1 (259:1) is mounted on /mnt/my disk;" in _refused(sim)


def test_a_usb_disk_behind_five_hubs_is_still_seen(tmp_path: Path) -> None:
    """USB allows five hubs between the root hub and a device; each hub nests its children one level deeper
    in sysfs, so the mounted partition is 13 levels below the controller's directory."""
    node = Node("desk", tuple(f for f in shared_group_node().functions if f.address not in (NIC, NVME)))
    sim = build_node(node, tmp_path / "root")
    hubs = "usb1/1-1/1-1.2/1-1.2.3/1-1.2.3.4/1-1.2.3.4.5/1-1.2.3.4.5:1.0"
    add_disk(sim.root, f"{USB}/{hubs}/host6/target6:0:0/6:0:0:0/block", "sdb", 8, partitions=1)
    mount(sim.root, "8:1", "/mnt/backup")
    result = agent(sim, "bind", "--all")
    assert result.exit_code == 1, result.output
    assert "block device sdb1 (8:1) is mounted on /mnt/backup" in str(result.exception)
    assert sim.writes == 0


def test_a_tree_deeper_than_the_walk_goes_counts_as_in_use(tmp_path: Path) -> None:
    """What lies below the walk's depth is not known to be unused: the function is refused, not half checked."""
    sim = _idle_workstation(tmp_path / "root")
    mount(sim.root, "8:2", "/")
    deep = Path(os.path.realpath(sim.root / "sys/bus/pci/devices" / NIC)).joinpath(*(f"d{i}" for i in range(40)))
    deep.mkdir(parents=True)
    message = _refused(sim)
    assert f"{NIC} (8086:10fb) is in use through its host driver ixgbe: more than" in message
    assert "levels below" in message


@pytest.mark.parametrize("flags", [None, "\x00\xffjunk", ""])
def test_an_interface_whose_flags_cannot_be_read_counts_as_possibly_up(tmp_path: Path, flags: str | None) -> None:
    """``operstate`` ``unknown`` is what many drivers report while up (no carrier detection); then only IFF_UP
    in ``flags`` tells, and flags that are missing or no number must not read as "down"."""
    sim = _idle_workstation(tmp_path / "root")
    mount(sim.root, "8:2", "/")
    directory = Path(os.path.realpath(sim.root / "sys/bus/pci/devices" / NIC)) / "net/eth0"
    (directory / "operstate").write_text("unknown\n")
    if flags is None:
        (directory / "flags").unlink()
    else:
        (directory / "flags").write_text(flags)
    assert "network interface eth0 may be up: its flags" in _refused(sim)


def test_a_group_whose_check_cannot_read_the_node_is_refused_and_the_others_are_still_done(tmp_path: Path) -> None:
    """A FIFO where the second card's DRM object has its uevent: that group is refused naming it; the first
    card's group (done before it) and the Grace GPU's (after it) are bound and recorded, as the rule "a group
    is the unit" says, instead of the command stopping half way with no report and no state."""

    sim = build_node(passthrough_node(), tmp_path / "root")
    card = Path(os.path.realpath(sim.root / "sys/bus/pci/devices/0000:af:00.0")) / "drm/card1"
    card.mkdir(parents=True)
    os.mkfifo(card / "uevent")
    result = agent(sim, "bind", "--all")
    assert result.exit_code == 1
    message = str(result.exception)
    assert "drm/card1/uevent: not a regular file (a FIFO)" in message and "nothing written to the group" in message
    fs = Sysfs(sim.root)
    drivers = {
        address: read_function(fs, address).driver for address in ("0000:86:00.0", "0000:af:00.0", "0009:01:00.0")
    }
    assert drivers == {"0000:86:00.0": "vfio-pci", "0000:af:00.0": "nouveau", "0009:01:00.0": "nvgrace_gpu_vfio_pci"}
    done = report(result)
    assert "0000:86:00.0" in done["changed"] and "0009:01:00.0" in done["changed"]
    assert "0000:af:00.0" not in done["changed"]
    assert "FIFO" in (tmp_path / "state/state.json").read_text()


def test_a_mounted_nvme_namespace_under_native_multipath_is_in_use(tmp_path: Path) -> None:
    """With native NVMe multipath (the default of most distributions' kernels) the namespace's disk hangs
    below the virtual nvme-subsystem device, not below the PCI function: only the controller is there."""
    sim = build_node(shared_group_node(), tmp_path / "root")
    add_interface(sim.root, NIC, "eth0", up=False)
    add_multipath_nvme(sim.root, NVME, "nvme0", "nvme-subsys0", "nvme0n1", partitions=2)
    mount(sim.root, "259:2", "/")
    message = _refused(sim)
    assert (
        f"{NVME} (144d:a808) is in use through its host driver nvme: block device nvme0n1p2 (259:2) is mounted"
        in message
    )


def test_a_nic_whose_interface_is_in_another_network_namespace_is_in_use(tmp_path: Path) -> None:
    """A NIC handed to a pod (Multus host-device, a CNF): its interface moved into the pod's network namespace,
    and the host's /sys (tagged with the host's namespace) shows no net/ entry below the function at all. A
    network function on a network driver with no interface in view is not known to be idle."""
    sim = build_node(shared_group_node(), tmp_path / "root")
    add_disk(sim.root, f"{NVME}/nvme/nvme0", "nvme0n1", 259)
    mount(sim.root, "8:2", "/")
    message = _refused(sim)
    assert f"{NIC} (8086:10fb) is in use through its host driver ixgbe: no network interface of it" in message


def test_a_function_its_own_group_does_not_list_is_refused_and_nothing_else_moves(tmp_path: Path) -> None:
    """A host whose sysfs disagrees with itself: the GPU's iommu_group link names the Grace GPU's group 200,
    whose devices/ lists only the Grace GPU. Binding "the GPU's group" then moved the Grace GPU, which nobody
    selected, left the selected GPU where it was, and reported success."""
    sim = build_node(passthrough_node(), tmp_path / "root")
    directory = Path(os.path.realpath(sim.root / "sys/bus/pci/devices/0000:86:00.0"))
    (directory / "iommu_group").unlink()
    (directory / "iommu_group").symlink_to("../../../../kernel/iommu_groups/200")
    result = agent(sim, "bind", "0000:86:00.0")
    assert result.exit_code == 1, result.output
    assert "IOMMU group 200 does not list 0000:86:00.0" in str(result.exception)
    assert sim.writes == 0
    assert read_function(Sysfs(sim.root), "0009:01:00.0").driver is None


def test_a_function_with_sriov_vfs_enabled_is_in_use(tmp_path: Path) -> None:
    """The 82599 has 8 VFs enabled (handed to pods or VMs on their own groups, which the walk never enters:
    they are sibling functions). Unbinding the PF's driver disables SR-IOV and removes every VF under them."""
    sim = _idle_workstation(tmp_path / "root")
    mount(sim.root, "8:2", "/")
    directory = Path(os.path.realpath(sim.root / "sys/bus/pci/devices" / NIC))
    (directory / "sriov_totalvfs").write_text("63\n")
    (directory / "sriov_numvfs").write_text("8\n")
    assert f"{NIC} (8086:10fb) is in use through its host driver ixgbe: 8 SR-IOV VFs are enabled" in _refused(sim)


def test_a_link_planted_at_the_state_files_temporary_name_is_not_followed(tmp_path: Path) -> None:
    """The temporary file's name is predictable (the pid: 1 in a container); a link planted there made the
    state write land wherever it pointed."""
    from node_agent.state import read_state, write_section

    state, outside = tmp_path / "state", tmp_path / "outside"
    state.mkdir()
    outside.write_text("untouched\n")
    (state / f".state.json.{os.getpid()}.tmp").symlink_to(outside)
    write_section(state, "bind", {"selected": [], "changed": []})
    assert outside.read_text() == "untouched\n"
    assert read_state(state)["bind"]["selected"] == []
    assert not (state / f".state.json.{os.getpid()}.tmp").exists()
