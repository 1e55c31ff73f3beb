"""Mdevs whose parent is not a PCI function, offered only when the configuration opts in.

NVIDIA vGPUs hang under a PCI GPU and are selected by it (``pci_selectors``). The kernel's sample mdev drivers
(``mtty``, ``mdpy``, ``mbochs``) register virtual parents (``/sys/devices/virtual/mtty/mtty``) with no
``VENDOR:DEVICE``: they are offered when ``mdev_parent_selectors`` names the parent or ``mdev_type_selectors``
the mdev's type ID (both empty by default, so a node's NVIDIA behaviour does not change). The resource is
``<resource_domain>/<type name>``, as for a vGPU type; the device has no parent GPU (``parent`` None,
``vendor_device`` ``-``). Allocate's re-check needs nothing special: like any mdev it reads the ``iommu_group``
link, the group's members (the mdev alone) and ``/dev/vfio/<group>``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from plugin.inventory import Device, Ignored
from plugin.naming import mdev_resource_name

if TYPE_CHECKING:
    from plugin.node_scan import NodeScan
    from schemas.kinds import DeviceKind

NO_PCI_PARENT = "-"
"""``vendor_device`` of an mdev whose parent is not a PCI function."""


def scan_virtual_mdev(
    scan: NodeScan, kind: DeviceKind, uuid: str, link: str, parent_dir: str, type_dir: str, type_name: str
) -> None:
    """Offer the mdev at ``link`` (parent ``parent_dir`` is not a PCI function) if the configuration selects it,
    else list it as not offered with the reason."""
    parent_name = os.path.basename(parent_dir)
    type_id = os.path.basename(type_dir)
    driver = scan.fs.readlink_name(f"{link}/driver")
    if not scan.config.selects_virtual_mdev(parent_name, type_id):
        reason = (
            f"its parent {parent_name} ({scan.shown(parent_dir)}) is not a PCI function "
            f"(offer it with mdev_parent_selectors [{parent_name}] or mdev_type_selectors [{type_id}])"
        )
        scan.ignored.append(Ignored(uuid, NO_PCI_PARENT, driver, reason))
        return
    name = scan.checked_name(
        mdev_resource_name(type_name, scan.config.resource_domain),
        f"mdev type {type_id} ({type_name!r}) cannot be offered",
    )
    if name is None:
        scan.ignored.append(Ignored(uuid, NO_PCI_PARENT, driver, "its resource name is invalid"))
        return
    group = scan.read_group(f"{link}/iommu_group")
    problems = scan.vfio_problems(group)
    device = Device(
        id=uuid,
        kind=kind.key,
        vendor_device=NO_PCI_PARENT,
        iommu_group=group,
        numa_node=scan.numa(parent_dir),
        healthy=not problems,
        reason="; ".join(problems) or None,
        driver=driver,
        mdev_type=type_id,
    )
    scan.add(name, kind.key, device, type_name.strip())
