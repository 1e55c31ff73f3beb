"""PCI passthrough GPUs: whole functions bound to a VFIO driver, found under ``/sys/bus/pci/devices``.

Only selected GPU functions become devices (docs/node.md; docs/protocols.md, "Resource names": NVIDIA's
plugin also advertises audio and USB functions and never checks a group's viability); the rest of each GPU's
IOMMU group are its companions, and :class:`~plugin.health.UsabilityRule` decides from them whether the GPU
is healthy. GPUs on a host driver (``nvidia``) are listed as not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugin.health import PciFunction, UsabilityRule
from plugin.hostroot import HostRoot
from plugin.inventory import Companion, Device, Ignored
from plugin.node_scan import NodeScan
from schemas.errors import InputError
from schemas.kinds import PCI_PASSTHROUGH, DeviceKind
from schemas.pci import PciAddress

VGPU_HOST_DRIVER = "nvidia"
"""The driver of a GPU whose VFs are SR-IOV vGPUs (:mod:`plugin.source_sriov_vgpu`)."""


@dataclass(frozen=True, slots=True)
class PciPassthroughSource:
    """The :class:`~plugin.sources.DeviceSource` of whole PCI GPUs."""

    kind: DeviceKind = PCI_PASSTHROUGH
    kubevirt_list: str = "pciHostDevices"
    kubevirt_selector: str = "pciVendorSelector"

    def scan(self, node: NodeScan) -> None:
        bus = f"/sys/bus/{self.kind.sysfs_bus}/devices"
        try:
            names = sorted(node.fs.listdir(bus))
        except OSError:
            raise InputError(
                f"no PCI devices under {node.shown(bus)!r}: is the host root {node.root!r} right "
                "(it must hold the node's /sys)?"
            ) from None
        vendors = node.config.selector_vendors()
        for name in names:
            directory = f"{bus}/{name}"
            vendor = node.read_int(f"{directory}/vendor", 16)
            if vendor not in vendors:
                continue
            function = node.read_function(directory, name, vendor)
            if function is None or not node.config.selects(function.vendor, function.device, function.pci_class):
                continue
            try:
                PciAddress.parse(name)
            except InputError as exc:
                node.warnings.append(f"skipping {node.shown(directory)}: {exc}")
                continue
            self._scan_gpu(node, directory, function)

    def _scan_gpu(self, node: NodeScan, directory: str, gpu: PciFunction) -> None:
        not_on_vfio = node.rule.driver_problem(gpu.driver)
        if not_on_vfio is not None:
            node.ignored.append(Ignored(gpu.name, gpu.vendor_device, gpu.driver, not_on_vfio))
            return
        vgpu_pf = self._vgpu_pf(node, directory)
        if vgpu_pf is not None:
            reason = (
                f"an SR-IOV VF of {vgpu_pf}, a GPU on {VGPU_HOST_DRIVER}: a vGPU VF works only on "
                f"{VGPU_HOST_DRIVER} with a vGPU type, never as a whole GPU"
            )
            fix = (
                f"give it back to {VGPU_HOST_DRIVER}: clear its driver_override, unbind it from {gpu.driver} and "
                "write it to /sys/bus/pci/drivers_probe (or disable the VFs: sriov_numvfs 0 on its GPU)"
            )
            node.ignored.append(Ignored(gpu.name, gpu.vendor_device, gpu.driver, reason, fix))
            return
        name = node.pci_name(gpu)
        if name is None:
            node.ignored.append(Ignored(gpu.name, gpu.vendor_device, gpu.driver, "its resource name is invalid"))
            return
        with node.fs.directory(directory) as handle:
            group = node.read_group_in(handle)
            numa = node.numa(directory, handle)
        problems: list[str] = []
        companions: list[Companion] = []
        if group is not None:
            others = [member for member in node.members(group) if member.name != gpu.name]
            problems.extend(node.rule.group_problems(group, others))
            companions = [
                Companion(
                    PciAddress.parse(member.name),
                    member.vendor_device,
                    member.pci_class,
                    member.driver,
                    node.rule.member_viable(member.driver),
                )
                for member in others
            ]
        problems.extend(node.vfio_problems(group))
        root, path = node.topology(node.link_target(directory))
        device = Device(
            id=gpu.name,
            kind=self.kind.key,
            vendor_device=gpu.vendor_device,
            iommu_group=group,
            numa_node=numa,
            healthy=not problems,
            reason="; ".join(problems) or None,
            companions=tuple(companions),
            pcie_root=root,
            pcie_path=path,
            driver=gpu.driver,
        )
        node.add(name, self.kind.key, device, gpu.vendor_device)

    @staticmethod
    def _vgpu_pf(node: NodeScan, directory: str) -> str | None:
        """The PF of the VF at ``directory`` when that PF is on NVIDIA's host driver, else None.

        NVIDIA GPUs have VFs only for SR-IOV vGPUs, made by the host driver (docs/node.md, "SR-IOV vGPUs"); such
        a VF moved to vfio-pci is no passthrough GPU, and offering it as one would advertise it twice over
        time, as a vGPU and as a GPU named after the PF's model."""
        pf = node.fs.readlink_name(f"{directory}/physfn")
        if pf is None:
            return None
        try:
            PciAddress.parse(pf)
        except InputError:
            return None
        if node.fs.readlink_name(f"{node.pci_dir}/{pf}/driver") != VGPU_HOST_DRIVER:
            return None
        return pf

    def recheck_driver(self, device: Device, fs: HostRoot, rule: UsabilityRule) -> str | None:
        """The GPU itself must still be on a VFIO driver."""
        problem = rule.driver_problem(fs.readlink_name(f"/sys/bus/{self.kind.sysfs_bus}/devices/{device.id}/driver"))
        return None if problem is None else f"it is now {problem}"


PCI_SOURCE = PciPassthroughSource()
