"""What the node agent would change on a node before the plugin serves it: the first step ``xmlgen simulate`` shows.

Computed from the node's tree alone, read only (nothing is written): which functions
``gpu-node-agent bind --all`` would move onto the VFIO driver, by the agent's own rule
(``node_agent.bind.missing_bindings``: every NVIDIA GPU's whole IOMMU group, the driver from modules.alias), and which
vGPU-capable GPUs have no vGPU yet, for ``gpu-node-agent vgpu apply``. Which of the two the node is for is
its ``nvidia.com/gpu.workload.config`` label, which a tree does not carry: a node with any vGPU (an mdev, an
SR-IOV VF with a vGPU type) or any GPU on ``nvidia`` with SR-IOV VFs enabled (made for vGPUs, not yet given a
type) is taken as a ``vm-vgpu`` node, any other as a ``vm-passthrough`` node
(deploy/README.md, "The node agent").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.bind import driver_chooser, missing_bindings, select
from node_agent.cli import load_aliases
from node_agent.sysfs import Sysfs
from plugin.hostroot import HostRoot, ReadError
from runtime.node import VFIO_DRIVERS
from schemas.mdev import looks_like_mdev_uuid

NVIDIA = 0x10DE
PCI_DIR = "/sys/bus/pci/devices"
MAX_FUNCTIONS = 65536
"""At most this many PCI functions are looked at (a PCI domain has 65,536 routing IDs)."""
MAX_VFS = 65535
"""The most VFs a PF can have (``TotalVFs`` is a 16-bit field of the SR-IOV capability)."""


@dataclass(frozen=True, slots=True)
class _Function:
    name: str
    vendor: int
    device: int
    pci_class: int
    driver: str | None

    def describe(self) -> str:
        return f"{self.name} ({self.vendor:04X}:{self.device:04X}, {self.driver or 'no driver'})"


@dataclass
class NodePreparation:
    """What the agent would do, as lines for a person: the command and each change."""

    workload: str
    why: str
    bind: list[str] = field(default_factory=list)
    """One line per function ``bind`` would move: ``0000:d8:00.0 (10DE:1EB8, nvidia) → vfio-pci``."""
    vgpu: list[str] = field(default_factory=list)
    """One line per GPU without vGPUs: what ``vgpu apply`` would create there."""

    @property
    def needed(self) -> bool:
        return bool(self.bind or self.vgpu)

    def lines(self) -> list[str]:
        out = [f"  the node looks like a {self.workload} node ({self.why})"]
        if self.bind:
            out.append("  gpu-node-agent bind --all would move onto the VFIO driver:")
            out.extend(f"    {line}" for line in self.bind)
        if self.vgpu:
            out.append("  gpu-node-agent vgpu apply --config FILE --select NAME would create vGPUs on:")
            out.extend(f"    {line}" for line in self.vgpu)
        return out


def _read_int(fs: HostRoot, path: str, base: int) -> int | None:
    try:
        text = fs.read(path)
    except ReadError:
        return None
    if text is None:
        return None
    try:
        return int(text.strip(), base)
    except ValueError:
        return None


def _function(fs: HostRoot, name: str) -> _Function | None:
    directory = f"{PCI_DIR}/{name}"
    vendor, device = _read_int(fs, f"{directory}/vendor", 16), _read_int(fs, f"{directory}/device", 16)
    pci_class = _read_int(fs, f"{directory}/class", 16)
    if vendor is None or device is None or pci_class is None:
        return None
    return _Function(name, vendor, device, pci_class, fs.readlink_name(f"{directory}/driver"))


def _vgpus_of(fs: HostRoot, gpu: _Function) -> tuple[bool, int, int]:
    """(whether ``gpu`` can host vGPUs, how many it has, how many SR-IOV VFs it has enabled): mdevs below it, or
    SR-IOV VFs with a vGPU type."""
    directory = f"{PCI_DIR}/{gpu.name}"
    count = 0
    capable = False
    vfs = 0
    if fs.exists(f"{directory}/mdev_supported_types"):
        capable = True
        with contextlib.suppress(OSError):  # an unreadable parent counts as none
            count += sum(1 for entry in fs.listdir(directory) if looks_like_mdev_uuid(entry))
    total = _read_int(fs, f"{directory}/sriov_totalvfs", 10) or 0
    if gpu.driver == "nvidia" and total > 0:
        capable = True
        # sriov_numvfs never exceeds sriov_totalvfs, a 16-bit field of the SR-IOV capability: a larger number is
        # no count to loop over.
        enabled = _read_int(fs, f"{directory}/sriov_numvfs", 10) or 0
        vfs = max(0, min(enabled, total, MAX_VFS))
        for index in range(vfs):
            vf = fs.readlink_name(f"{directory}/virtfn{index}")
            if vf is not None and (_read_int(fs, f"{PCI_DIR}/{vf}/nvidia/current_vgpu_type", 10) or 0) != 0:
                count += 1
    return capable, count, vfs


def node_preparation(host_root: Path) -> NodePreparation:
    """What ``gpu-node-agent`` would change on the node under ``host_root`` (nothing is written)."""
    with HostRoot(str(host_root)) as fs:
        try:
            names = sorted(fs.listdir(PCI_DIR))[:MAX_FUNCTIONS]
        except OSError:
            names = []
        functions = {name: function for name in names if (function := _function(fs, name)) is not None}
        gpus = [
            function
            for function in functions.values()
            if function.vendor == NVIDIA
            and function.pci_class >> 16 == 0x03
            and not fs.exists(f"{PCI_DIR}/{function.name}/physfn")  # a VF is the vGPU side's
        ]
        vgpus = {gpu.name: _vgpus_of(fs, gpu) for gpu in gpus}
        total = sum(count for _, count, _ in vgpus.values())
        split = sum(1 for _, _, vfs in vgpus.values() if vfs)
        if total or split:
            # VFs enabled on a GPU on nvidia are there for SR-IOV vGPUs (sriov-manage -e): such a node is
            # waiting for vgpu apply, and binding its GPUs to vfio-pci would undo that.
            why = (
                f"it has {total} vGPU{'s' if total != 1 else ''}"
                if total
                else f"no vGPU yet, but {split} GPU{'s' if split != 1 else ''} with SR-IOV vGPU VFs enabled"
            )
            plan = NodePreparation("vm-vgpu", why)
            for gpu in gpus:
                capable, count, _ = vgpus[gpu.name]
                if capable and not count:
                    plan.vgpu.append(f"{gpu.describe()}: no vGPU yet")
            return plan
        on_vfio = sum(1 for gpu in gpus if gpu.driver in VFIO_DRIVERS)
        plan = NodePreparation("vm-passthrough", f"no vGPU; {on_vfio} of {len(gpus)} NVIDIA GPUs on a VFIO driver")
        # The agent's own rule (node_agent.bind): the whole IOMMU group of every NVIDIA GPU, each function onto
        # the VFIO driver the node's modules.alias names, bridges left alone; read only, nothing is written.
        agent_fs = Sysfs(host_root)
        selected = select(agent_fs, [], [], nvidia_gpus=True)
        if selected:
            missing = missing_bindings(agent_fs, selected, driver_chooser(agent_fs, load_aliases(agent_fs)))
            plan.bind = [line.replace(str(host_root), "", 1) for line in missing]
        return plan
