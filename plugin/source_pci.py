"""PCI passthrough GPUs: whole functions bound to a VFIO driver, found under ``/sys/bus/pci/devices``.

Only selected GPU functions become devices (docs/node.md; docs/protocols.md, "Resource names": NVIDIA's
plugin also advertises audio and USB functions and never checks a group's viability); the rest of each GPU's
IOMMU group are its companions, and :class:`~plugin.health.UsabilityRule` decides from them whether the GPU
is healthy. GPUs on a host driver (``nvidia``) are listed as not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugin.health import PciFunction, UsabilityRule
from plugin.hostroot import Directory
from plugin.inventory import Device, Ignored
from plugin.node_scan import NodeScan
from schemas.errors import InputError
from schemas.fabric import is_nvswitch
from schemas.kinds import PCI_PASSTHROUGH, DeviceKind
from schemas.pci import PciAddress

VGPU_HOST_DRIVER = "nvidia"
"""The driver of a GPU whose VFs are SR-IOV vGPUs (:mod:`plugin.source_sriov_vgpu`)."""


@dataclass(frozen=True, slots=True)
class _Gpu:
    """A selected GPU function and what its directory said, read in the scan's first pass."""

    function: PciFunction
    group: int | None
    numa: int | None
    sysfs_dir: str | None
    """Its real directory (``/sys/devices/pci…/<BDF>``), links resolved inside the host root."""
    physfn: str | None
    """The last component of its ``physfn`` link (the PF's address when it is an SR-IOV VF), else None."""


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
        gpus: list[_Gpu] = []
        prefix = bus + "/"
        # First every function of a selected vendor (its group members are then read already), then each GPU.
        for name in names:
            directory = prefix + name
            # The one read a function of another vendor costs: its vendor file. Not its uevent, which names it
            # completely but costs the kernel more to make (docs/node.md, "PCI functions in sysfs").
            vendor = node.read_int(directory + "/vendor", 16)
            if vendor not in vendors:
                continue
            with node.fs.directory(directory) as handle:
                function = node.read_function_in(handle, name, vendor)
                if function is not None and is_nvswitch(function.vendor, function.pci_class):
                    node.found_switch(function, node.read_group_in(handle), node.numa(directory, handle))
                    continue
                if function is None or not node.config.selects(function.vendor, function.device, function.pci_class):
                    continue
                try:
                    PciAddress.parse(name)
                except InputError as exc:
                    node.warnings.append(f"skipping {node.shown(directory)}: {exc}")
                    continue
                if node.rule.driver_problem(function.driver) is not None:
                    gpus.append(_Gpu(function, None, None, None, None))  # not offered: nothing more to read
                    continue
                group = node.read_group_in(handle)
                numa = node.numa(directory, handle)
                physfn = handle.readlink_name("physfn")
                gpus.append(_Gpu(function, group, numa, handle.resolved(), physfn))
        for gpu in gpus:
            self._scan_gpu(node, gpu)

    def _scan_gpu(self, node: NodeScan, found: _Gpu) -> None:
        gpu = found.function
        not_on_vfio = node.rule.driver_problem(gpu.driver)
        if not_on_vfio is not None:
            node.ignored.append(Ignored(gpu.name, gpu.vendor_device, gpu.driver, not_on_vfio))
            return
        vgpu_pf = self._vgpu_pf(node, found.physfn)
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
        group = found.group
        problems, companions = node.group_facts(gpu.name, group)
        root, path = node.topology(found.sysfs_dir)
        device = Device(
            id=gpu.name,
            kind=self.kind.key,
            vendor_device=gpu.vendor_device,
            iommu_group=group,
            numa_node=found.numa,
            healthy=not problems,
            reason="; ".join(problems) or None,
            companions=companions,
            pcie_root=root,
            pcie_path=path,
            driver=gpu.driver,
        )
        node.add(name, self.kind.key, device, gpu.vendor_device)

    @staticmethod
    def _vgpu_pf(node: NodeScan, pf: str | None) -> str | None:
        """``pf`` (a VF's ``physfn`` link, read with the VF's directory open) when that PF is on NVIDIA's host
        driver, else None.

        NVIDIA GPUs have VFs only for SR-IOV vGPUs, made by the host driver (docs/node.md, "SR-IOV vGPUs"); such
        a VF moved to vfio-pci is no passthrough GPU, and offering it as one would advertise it twice over
        time, as a vGPU and as a GPU named after the PF's model."""
        if pf is None:
            return None
        try:
            PciAddress.parse(pf)
        except InputError:
            return None
        if node.fs.readlink_name(f"{node.pci_dir}/{pf}/driver") != VGPU_HOST_DRIVER:
            return None
        return pf

    def recheck_driver(self, device: Device, directory: Directory, rule: UsabilityRule) -> str | None:
        """The GPU itself must still be on a VFIO driver (``directory``: its sysfs directory)."""
        problem = rule.driver_problem(directory.readlink_name("driver"))
        return None if problem is None else f"it is now {problem}"


PCI_SOURCE = PciPassthroughSource()
