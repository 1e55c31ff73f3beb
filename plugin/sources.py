"""One device source per kind behind a small protocol: how discovery and Allocate reach each kind's devices.

The kinds themselves (env prefix, sysfs bus, ID form) are rows of :data:`schemas.kinds.DEVICE_KINDS`; what
only the plugin needs (walking sysfs for that kind, the kind's part of Allocate's re-check, its KubeVirt
``permittedHostDevices`` list) is a :class:`DeviceSource`, as NVIDIA's k8s-device-plugin keeps discovery
behind its resource manager interface. Nothing else in ``plugin/`` compares kinds: it looks the source up in
:data:`DEVICE_SOURCES`. Adding a kind: its row in ``schemas/kinds.py``, one module here, and its line below.
"""

from __future__ import annotations

from typing import Any, Protocol

from plugin.health import UsabilityRule
from plugin.hostroot import Directory
from plugin.inventory import Device, Inventory
from plugin.node_scan import NodeScan
from plugin.source_mdev import MDEV_SOURCE
from plugin.source_pci import PCI_SOURCE
from plugin.source_sriov_vgpu import SRIOV_VGPU_SOURCE
from schemas.kinds import DeviceKind, ResourceKind


class DeviceSource(Protocol):
    """Where the devices of one kind come from on a node, and what Allocate re-checks for that kind."""

    @property
    def kind(self) -> DeviceKind:
        """The kind's row of the kind table."""
        ...

    @property
    def kubevirt_list(self) -> str:
        """The list of KubeVirt's ``permittedHostDevices`` this kind's resources go in (``pciHostDevices``)."""
        ...

    @property
    def kubevirt_selector(self) -> str:
        """The selector field of an entry of that list (``pciVendorSelector``)."""
        ...

    def scan(self, node: NodeScan) -> None:
        """Walk the node's sysfs for this kind and file each device with ``node.add``."""
        ...

    def recheck_driver(self, device: Device, directory: Directory, rule: UsabilityRule) -> str | None:
        """The kind's own part of Allocate's re-check (e.g. still on a VFIO driver), read through ``directory``,
        a handle on the device's sysfs directory; None when fine."""
        ...


DEVICE_SOURCES: dict[ResourceKind, DeviceSource] = {
    source.kind.key: source for source in (PCI_SOURCE, MDEV_SOURCE, SRIOV_VGPU_SOURCE)
}
"""Every kind's source, scanned in this order."""


def source_for(kind: ResourceKind) -> DeviceSource:
    return DEVICE_SOURCES[kind]


def permitted_host_devices(inventory: Inventory) -> dict[str, Any]:
    """KubeVirt's ``permittedHostDevices`` for this node, every resource served by an external provider."""
    lists: dict[str, list[dict[str, Any]]] = {source.kubevirt_list: [] for source in DEVICE_SOURCES.values()}
    for resource in inventory.resources:
        source = DEVICE_SOURCES[resource.kind]
        for selector in resource.selectors:
            lists[source.kubevirt_list].append(
                {source.kubevirt_selector: selector, "resourceName": resource.name, "externalResourceProvider": True}
            )
    return {"permittedHostDevices": lists}
