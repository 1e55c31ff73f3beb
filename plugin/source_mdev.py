"""vGPUs: mediated devices carved from a selected GPU, found under ``/sys/bus/mdev/devices``.

One resource per mdev type name (``GRID T4-1Q``), named as NVIDIA's plugin names it. An mdev hangs off its
parent GPU's vendor driver, so only the VFIO side (its IOMMU group and ``/dev/vfio``) decides its health.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from plugin.health import PciFunction, UsabilityRule
from plugin.hostroot import Directory
from plugin.inventory import Device, Ignored
from plugin.naming import mdev_resource_name
from plugin.node_scan import NodeScan
from plugin.virtual_mdev import scan_virtual_mdev
from schemas.errors import InputError
from schemas.kinds import MDEV_VGPU, DeviceKind
from schemas.pci import PciAddress


@dataclass(frozen=True, slots=True)
class MdevVgpuSource:
    """The :class:`~plugin.sources.DeviceSource` of mediated vGPUs."""

    kind: DeviceKind = MDEV_VGPU
    kubevirt_list: str = "mediatedDevices"
    kubevirt_selector: str = "mdevNameSelector"

    def scan(self, node: NodeScan) -> None:
        bus = f"/sys/bus/{self.kind.sysfs_bus}/devices"
        try:
            entries = sorted(node.fs.listdir(bus))
        except OSError:
            return  # no mdev support loaded: no vGPUs
        parents: dict[str, tuple[PciFunction, int]] = {}
        for entry in entries:
            link = f"{bus}/{entry}"
            try:
                uuid = str(self.kind.parse_id(entry))
            except InputError as exc:
                node.warnings.append(f"skipping {node.shown(link)}: {exc}")
                continue
            mdev_dir = node.link_target(link)
            # Relative links inside the mdev resolve from its real directory, not from the bus link.
            type_dir = node.link_target(f"{mdev_dir}/mdev_type") if mdev_dir else None
            # Only newlines are trimmed before naming, as NVIDIA's plugin does; the selector is fully trimmed.
            raw_name = node.read_text(f"{type_dir}/name") if type_dir else None
            type_name = raw_name.strip("\n") if raw_name is not None else None
            if mdev_dir is None or type_dir is None or not type_name or not type_name.strip():
                node.warnings.append(f"skipping mdev {uuid}: cannot read its mdev_type/name under {node.shown(link)}")
                continue
            parent_dir = os.path.dirname(mdev_dir)
            # A PCI function the bus scan read already needs no look: its mdevs are the common case. Known by
            # its name only under a PCI root: a virtual parent may be named anything, a scanned GPU's address too.
            if not (
                parent_dir.startswith(node.devices_dir + "/pci") and os.path.basename(parent_dir) in node.functions
            ) and not node.fs.exists(f"{parent_dir}/vendor"):
                # A real kernel's mdev parents need not be PCI functions (the kernel's samples mtty, mdpy and
                # mbochs are virtual devices): offered only by mdev_parent_selectors / mdev_type_selectors.
                scan_virtual_mdev(node, self.kind, uuid, link, parent_dir, type_dir, type_name)
                continue
            parent = node.read_function(parent_dir, os.path.basename(parent_dir))
            if parent is None:
                continue
            try:
                parent_address = PciAddress.parse(parent.name)
            except InputError as exc:
                node.warnings.append(f"skipping mdev {uuid}: its parent {node.shown(parent_dir)}: {exc}")
                continue
            driver = node.fs.readlink_name(f"{link}/driver")
            if not node.config.selects(parent.vendor, parent.device, parent.pci_class):
                node.ignored.append(
                    Ignored(uuid, parent.vendor_device, driver, f"its parent {parent.describe()} is not a selected GPU")
                )
                continue
            _, count = parents.get(parent.name, (parent, 0))
            parents[parent.name] = (parent, count + 1)
            name = node.checked_name(
                mdev_resource_name(type_name, node.config.resource_domain),
                f"mdev type {os.path.basename(type_dir)} ({type_name!r}) cannot be offered",
            )
            if name is None:
                node.ignored.append(Ignored(uuid, parent.vendor_device, driver, "its resource name is invalid"))
                continue
            group = node.read_group(f"{link}/iommu_group")
            problems = node.vfio_problems(group)
            root, path = node.topology(parent_dir)
            device = Device(
                id=uuid,
                kind=self.kind.key,
                vendor_device=parent.vendor_device,
                iommu_group=group,
                numa_node=node.numa(parent_dir),
                healthy=not problems,
                reason="; ".join(problems) or None,
                pcie_root=root,
                pcie_path=(*path, parent.name),
                driver=driver,
                parent=parent_address,
                mdev_type=os.path.basename(type_dir),
            )
            node.add(name, self.kind.key, device, type_name.strip())
        for parent, count in parents.values():
            if node.rule.driver_problem(parent.driver) is None:
                continue  # on a VFIO driver: the passthrough source's to explain
            # Its GPU is on the vendor's driver because it hosts vGPUs, not for want of vfio-pci.
            node.claim(parent.name)
            reason = f"a vGPU parent of {count} mdev(s): its mdevs are offered as vGPUs, not the GPU itself"
            node.ignored.append(Ignored(parent.name, parent.vendor_device, parent.driver, reason))

    def recheck_driver(self, device: Device, directory: Directory, rule: UsabilityRule) -> str | None:
        """An mdev stays on its vendor's driver: nothing to re-check beyond its group."""
        return None


MDEV_SOURCE = MdevVgpuSource()
