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
from plugin.inventory import Companion, Device, Ignored
from plugin.node_scan import NodeScan
from schemas.errors import InputError
from schemas.kinds import PCI_PASSTHROUGH, DeviceKind
from schemas.pci import PciAddress


@dataclass(frozen=True, slots=True)
class _Gpu:
    """A selected GPU function and what its directory said, read in the scan's first pass."""

    function: PciFunction
    group: int | None
    numa: int | None
    sysfs_dir: str | None
    """Its real directory (``/sys/devices/pci…/<BDF>``), links resolved inside the host root."""


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
        # First every function of a selected vendor (its group members are then read already), then each GPU.
        for name in names:
            directory = f"{bus}/{name}"
            vendor = node.read_int(f"{directory}/vendor", 16)  # the one read a function of another vendor costs
            if vendor not in vendors:
                continue
            with node.fs.directory(directory) as handle:
                function = node.read_function_in(handle, name, vendor)
                if function is None or not node.config.selects(function.vendor, function.device, function.pci_class):
                    continue
                try:
                    PciAddress.parse(name)
                except InputError as exc:
                    node.warnings.append(f"skipping {node.shown(directory)}: {exc}")
                    continue
                if node.rule.driver_problem(function.driver) is not None:
                    gpus.append(_Gpu(function, None, None, None))  # not offered: nothing more to read
                    continue
                group = node.read_group_in(handle)
                numa = node.numa(directory, handle)
                gpus.append(_Gpu(function, group, numa, handle.resolved()))
        for gpu in gpus:
            self._scan_gpu(node, gpu)

    def _scan_gpu(self, node: NodeScan, found: _Gpu) -> None:
        gpu = found.function
        not_on_vfio = node.rule.driver_problem(gpu.driver)
        if not_on_vfio is not None:
            node.ignored.append(Ignored(gpu.name, gpu.vendor_device, gpu.driver, not_on_vfio))
            return
        name = node.pci_name(gpu)
        if name is None:
            node.ignored.append(Ignored(gpu.name, gpu.vendor_device, gpu.driver, "its resource name is invalid"))
            return
        group = found.group
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
        root, path = node.topology(found.sysfs_dir)
        device = Device(
            id=gpu.name,
            kind=self.kind.key,
            vendor_device=gpu.vendor_device,
            iommu_group=group,
            numa_node=found.numa,
            healthy=not problems,
            reason="; ".join(problems) or None,
            companions=tuple(companions),
            pcie_root=root,
            pcie_path=path,
            driver=gpu.driver,
        )
        node.add(name, self.kind.key, device, gpu.vendor_device)

    def recheck_driver(self, device: Device, directory: Directory, rule: UsabilityRule) -> str | None:
        """The GPU itself must still be on a VFIO driver (``directory``: its sysfs directory)."""
        problem = rule.driver_problem(directory.readlink_name("driver"))
        return None if problem is None else f"it is now {problem}"


PCI_SOURCE = PciPassthroughSource()
