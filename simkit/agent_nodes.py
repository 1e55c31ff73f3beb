"""Nodes as they are before the node agent runs, for its tests, its benchmark and ``xmlgen simulate``.

:func:`build_node` writes a :class:`~simkit.sysfs_fixture.Node` (plus a ``modules.alias`` for the running
kernel's release and the ``/sys/class/mdev_bus`` links of its mdev parents) and returns the
:class:`~simkit.kernel_sim.SimKernel` that gives the agent's writes their effect on it.
"""

from __future__ import annotations

import os
from pathlib import Path

from simkit.fixture_nodes import (
    CLASS_3D,
    CLASS_AUDIO,
    CLASS_SERIAL_BUS,
    CLASS_USB_XHCI,
    CLASS_VGA,
    NVIDIA,
    root_port,
)
from simkit.kernel_sim import (
    A100_40GB_PROFILES,
    GPU_80GB_PROFILES,
    MigVgpuType,
    SimKernel,
    VgpuType,
)
from simkit.sysfs_fixture import Function, MdevType, Node, build

GH100 = 0x2342
MODULES_ALIAS = """\
# Aliases extracted from modules themselves.
alias pci:v000010DEd*sv*sd*bc03sc*i* nouveau
alias vfio_pci:v000010DEd00002342sv*sd*bc03sc02i00* nvgrace_gpu_vfio_pci
alias vfio_pci:v000010DEd00002345sv*sd*bc03sc02i00* nvgrace_gpu_vfio_pci
alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci
alias pci:v*d*sv*sd*bc04sc03i* snd_hda_intel
"""


def consumer_card(root_bus: int, gpu_driver: str | None = "nouveau") -> tuple[Function, ...]:
    """An RTX 2060 as a desktop node has it before binding: four functions in one group on host drivers."""
    port = root_port(root_bus)
    group = (port.iommu_group or 0) + 2
    below = f"0000:{root_bus + 1:02x}:00"
    return (
        port,
        Function(f"{below}.0", NVIDIA, 0x1F08, CLASS_VGA, gpu_driver, group, port.numa_node, parent=port.address),
        Function(
            f"{below}.1", NVIDIA, 0x10F9, CLASS_AUDIO, "snd_hda_intel", group, port.numa_node, parent=port.address
        ),
        Function(f"{below}.2", NVIDIA, 0x1ADA, CLASS_USB_XHCI, "xhci_hcd", group, port.numa_node, parent=port.address),
        Function(
            f"{below}.3", NVIDIA, 0x1ADB, CLASS_SERIAL_BUS, "nvidia-gpu", group, port.numa_node, parent=port.address
        ),
    )


def grace_gpu() -> Function:
    """A GH100 3D controller on no driver: modules.alias names nvgrace_gpu_vfio_pci for it."""
    return Function("0009:01:00.0", NVIDIA, GH100, CLASS_3D, None, 200, 0)


def passthrough_node() -> Node:
    return Node(name="agent-node", functions=(*consumer_card(0x85), *consumer_card(0xAE), grace_gpu()))


def mdev_node(available: int = 4) -> Node:
    """Two T4s on nvidia with two time-sliced mdev types each, no mdev yet."""
    functions = (
        Function("0000:3b:00.0", NVIDIA, 0x1EB8, CLASS_3D, "nvidia", 30, 0),
        Function("0000:af:00.0", NVIDIA, 0x1EB8, CLASS_3D, "nvidia", 31, 1),
    )
    types = tuple(
        MdevType(parent, type_id, name, available)
        for parent in ("0000:3b:00.0", "0000:af:00.0")
        for type_id, name in (("nvidia-222", "GRID T4-1Q"), ("nvidia-223", "GRID T4-2Q"))
    )
    return Node(name="vgpu-node", functions=functions, mdev_types=types)


def build_node(node: Node, root: Path, *, modules_alias: str | None = MODULES_ALIAS) -> SimKernel:
    build(node, root)
    for parent in {t.parent for t in node.mdev_types}:
        link = root / "sys" / "class" / "mdev_bus" / parent
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.realpath(root / "sys" / "bus" / "pci" / "devices" / parent)
        link.symlink_to(os.path.relpath(target, link.parent))
    if modules_alias is not None:
        path = root / "lib" / "modules" / os.uname().release / "modules.alias"
        path.parent.mkdir(parents=True)
        path.write_text(modules_alias)
    return SimKernel(root)


INTEL = 0x8086
SAMSUNG = 0x144D
CLASS_NVME = 0x010802
SHARED_GROUP = 7


def shared_group_node() -> Node:
    """A workstation without ACS: an RTX 2060 (VGA + audio) behind an Intel switch port, an Intel 82599 NIC
    (``8086:10fb``, ``ixgbe``) and a Samsung NVMe drive (``144d:a808``, ``nvme``) all in IOMMU group 7."""
    group = SHARED_GROUP
    port = Function("0000:00:01.0", INTEL, 0x1901, 0x060400, "pcieport", group, 0)
    return Node(
        name="workstation",
        functions=(
            port,
            Function("0000:01:00.0", NVIDIA, 0x1F08, CLASS_VGA, "nouveau", group, 0, parent=port.address),
            Function("0000:01:00.1", NVIDIA, 0x10F9, CLASS_AUDIO, "snd_hda_intel", group, 0, parent=port.address),
            Function("0000:01:00.2", NVIDIA, 0x1ADA, CLASS_USB_XHCI, "xhci_hcd", group, 0, parent=port.address),
            Function("0000:02:00.0", INTEL, 0x10FB, 0x020000, "ixgbe", group, 0, parent=port.address),
            Function("0000:03:00.0", SAMSUNG, 0xA808, CLASS_NVME, "nvme", group, 0, parent=port.address),
        ),
    )


def _device_dir(root: Path, address: str) -> Path:
    return Path(os.path.realpath(root / "sys" / "bus" / "pci" / "devices" / address))


def _kobject(directory: Path, uevent: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "uevent").write_text("".join(f"{key}={value}\n" for key, value in uevent.items()))
    return directory


def add_interface(root: Path, address: str, name: str, *, up: bool) -> Path:
    """``net/<name>`` below the function, as its network driver makes it (``operstate``, ``flags``)."""
    directory = _kobject(_device_dir(root, address) / "net" / name, {"INTERFACE": name, "IFINDEX": "2"})
    (directory / "operstate").write_text("up\n" if up else "down\n")
    (directory / "flags").write_text("0x1003\n" if up else "0x1002\n")
    return directory


def add_disk(root: Path, below: str, name: str, major: int, partitions: int = 0) -> Path:
    """A disk ``name`` (and its partitions) ``below`` (a path under the function's directory, e.g.
    ``0000:03:00.0/nvme/nvme0``), with ``dev``, ``uevent`` and an empty ``holders``, as the block layer makes it."""
    address, _, rest = below.partition("/")
    return _disk(_device_dir(root, address) / rest, name, major, partitions)


def _disk(parent: Path, name: str, major: int, partitions: int) -> Path:
    disk = _kobject(parent / name, {"MAJOR": str(major), "MINOR": "0", "DEVNAME": name, "DEVTYPE": "disk"})
    (disk / "dev").write_text(f"{major}:0\n")
    (disk / "holders").mkdir()
    separator = "p" if name[-1].isdigit() else ""  # nvme0n1p1, sdb1: the kernel's own naming
    for index in range(1, partitions + 1):
        part = _kobject(
            disk / f"{name}{separator}{index}",
            {"MAJOR": str(major), "MINOR": str(index), "DEVNAME": f"{name}{separator}{index}", "DEVTYPE": "partition"},
        )
        (part / "dev").write_text(f"{major}:{index}\n")
        (part / "holders").mkdir()
    return disk


def add_multipath_nvme(
    root: Path, address: str, controller: str, subsystem: str, namespace: str, major: int = 259, partitions: int = 0
) -> Path:
    """An NVMe drive as a kernel with native NVMe multipath shows it (``nvme_core.multipath=Y``, the default
    where ``CONFIG_NVME_MULTIPATH`` is set: Fedora, RHEL, SUSE, Ubuntu): the controller ``nvme/<controller>``
    below the PCI function, the namespace's disk (and partitions) below the virtual subsystem device
    ``/sys/devices/virtual/nvme-subsystem/<subsystem>``, which links each of its controllers by name, and
    ``/sys/class/nvme-subsystem/<subsystem>``. Returns the disk's directory."""
    ctrl = _kobject(
        _device_dir(root, address) / "nvme" / controller, {"MAJOR": "240", "MINOR": "0", "DEVNAME": controller}
    )
    subsys = _kobject(root / "sys/devices/virtual/nvme-subsystem" / subsystem, {})
    (subsys / controller).symlink_to(os.path.relpath(ctrl, subsys))
    link = root / "sys/class/nvme-subsystem" / subsystem
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(subsys, link.parent))
    return _disk(subsys, namespace, major, partitions)


def mount(root: Path, number: str, point: str, pid: str = "1") -> None:
    """A line of ``/proc/<pid>/mountinfo`` mounting the block device ``number`` (``259:1``) on ``point``."""
    path = root / "proc" / pid / "mountinfo"
    path.parent.mkdir(parents=True, exist_ok=True)
    count = len(path.read_text().splitlines()) if path.exists() else 0
    with path.open("a") as table:
        table.write(f"{30 + count} 1 {number} / {point} rw,relatime shared:1 - ext4 /dev/x rw\n")


A100_PCIE_40GB = 0x20F1
H100_PCIE = 0x2331
L40S = 0x26B9
MIG_GPU_VFS = 16
"""VFs per MIG-capable GPU in these trees (``sriov_totalvfs``)."""


def _named(prefix: str, entries: tuple[tuple[int, str, str], ...]) -> tuple[MigVgpuType, ...]:
    return tuple(MigVgpuType(type_id, f"NVIDIA {prefix}-{name}", profile) for type_id, name, profile in entries)


A100_MIG_TYPES = _named(
    "A100",
    (
        (700, "1-5C", "1g.5gb"),
        (701, "1-5CME", "1g.5gb+me"),
        (702, "1-10C", "1g.10gb"),
        (703, "2-10C", "2g.10gb"),
        (704, "3-20C", "3g.20gb"),
        (705, "4-20C", "4g.20gb"),
        (706, "7-40C", "7g.40gb"),
    ),
)
"""MIG-backed vGPU types of an A100 40GB, named as NVIDIA's vGPU docs name them; the IDs are fixture values."""
A100_TIME_SLICED = (VgpuType(690, "NVIDIA A100-10C", 4), VgpuType(691, "NVIDIA A100-40C", 1))
H100_MIG_TYPES = _named(
    "H100",
    (
        (800, "1-10C", "1g.10gb"),
        (801, "1-10CME", "1g.10gb+me"),
        (802, "1-20C", "1g.20gb"),
        (803, "2-20C", "2g.20gb"),
        (804, "3-40C", "3g.40gb"),
        (805, "4-40C", "4g.40gb"),
        (806, "7-80C", "7g.80gb"),
    ),
)
H100_TIME_SLICED = (VgpuType(790, "NVIDIA H100-20C", 4), VgpuType(791, "NVIDIA H100-80C", 1))


def mig_node() -> Node:
    """An A100 PCIe 40GB (``0000:3b:00.0``, GPU 0) and an H100 PCIe 80GB (``0000:86:00.0``, GPU 1) on ``nvidia``
    with the vGPU manager (SR-IOV, VFs off, MIG mode off), and an L40S (``0000:d8:00.0``, GPU 2, no MIG)."""
    return Node(
        name="mig-node",
        functions=(
            Function("0000:3b:00.0", NVIDIA, A100_PCIE_40GB, CLASS_3D, "nvidia", 30, 0),
            Function("0000:86:00.0", NVIDIA, H100_PCIE, CLASS_3D, "nvidia", 31, 1),
            Function("0000:d8:00.0", NVIDIA, L40S, CLASS_3D, "nvidia", 32, 1),
        ),
    )


def build_mig_node(root: Path) -> SimKernel:
    """:func:`mig_node` through the simulator: the A100 and H100 MIG-capable, each with its MIG-backed and
    time-sliced vGPU types; the L40S with time-sliced types only."""
    return mig_capable(build_node(mig_node(), root))


def mig_capable(sim: SimKernel) -> SimKernel:
    """What the simulator knows of :func:`mig_node`'s GPUs beyond the tree (their SR-IOV vGPU types, the A100's
    and H100's MIG profiles): for a tree :func:`build_mig_node` built, also in another process
    (``python -m simkit.sim_agent`` with ``SIMKIT_NODE=mig``)."""
    sim.add_sriov_gpu("0000:3b:00.0", MIG_GPU_VFS, A100_PCIE_40GB, A100_TIME_SLICED)
    sim.add_mig("0000:3b:00.0", A100_40GB_PROFILES, A100_MIG_TYPES)
    sim.add_sriov_gpu("0000:86:00.0", MIG_GPU_VFS, H100_PCIE, H100_TIME_SLICED)
    sim.add_mig("0000:86:00.0", GPU_80GB_PROFILES, H100_MIG_TYPES)
    sim.add_sriov_gpu("0000:d8:00.0", 4, 0x26BA, (VgpuType(557, "NVIDIA L40S-1B", 32),))
    return sim
