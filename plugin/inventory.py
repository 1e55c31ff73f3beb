"""What a node offers, as one immutable value: resources, each with its devices.

Discovery produces it, the device plugin servers consume it (one server per resource: name, env var,
socket, device list with health and topology), and ``xmlgen discover`` prints it. Keeping it a plain frozen
value with no I/O means every consumer sees the same facts and tests can build one by hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from schemas.naming import ResourceKind, env_var_for, socket_name_for
from schemas.pci import PciAddress
from schemas.pci_topology import switch_of

VFIO_DEV_DIR = "/dev/vfio"
VFIO_CONTAINER = "/dev/vfio/vfio"


@dataclass(frozen=True, slots=True)
class Companion:
    """Another function of a GPU's IOMMU group: it goes to the VM with the GPU (or blocks it)."""

    address: PciAddress
    vendor_device: str
    """``VENDOR:DEVICE`` upper-case hex, e.g. ``10DE:10F9``."""
    pci_class: int
    driver: str | None
    viable: bool
    """False when its driver keeps the group from being used by VFIO."""


@dataclass(frozen=True, slots=True)
class NvSwitch:
    """An NVSwitch of the node's HGX board, on a VFIO driver: it goes to the VM that gets every GPU of the board
    (:func:`schemas.fabric.board_switches`, docs/nvswitch.md)."""

    address: PciAddress
    vendor_device: str
    iommu_group: int
    driver: str
    numa_node: int | None = None

    @property
    def vfio_group_path(self) -> str:
        return f"{VFIO_DEV_DIR}/{self.iommu_group}"


@dataclass(frozen=True, slots=True)
class Device:
    """One allocatable unit: a whole GPU (PCI function) or one mediated device."""

    id: str
    """The kubelet device ID: the PCI address (``0000:86:00.0``) or the mdev UUID (lower case)."""
    kind: ResourceKind
    vendor_device: str
    """``VENDOR:DEVICE`` of the GPU, or of the mdev's parent GPU."""
    iommu_group: int | None
    numa_node: int | None
    """None when the kernel does not know (sysfs says ``-1``)."""
    healthy: bool
    reason: str | None
    """Why the device is unhealthy; None when healthy."""
    companions: tuple[Companion, ...] = ()
    pcie_root: str | None = None
    """The PCIe root complex the GPU hangs under, as sysfs names it (``pci0000:85``)."""
    pcie_path: tuple[str, ...] = ()
    """Bridges from the root port down to the device's parent (``0000:85:00.0``, …; for an mdev, ending with its
    GPU); empty for a function on the root bus."""
    driver: str | None = None
    parent: PciAddress | None = None
    """For a vGPU, the GPU it is carved from (an mdev's parent, an SR-IOV VF's physical function)."""
    mdev_type: str | None = None
    """For a vGPU, its type ID: an mdev's (``nvidia-230``), an SR-IOV VF's ``current_vgpu_type`` (``1147``)."""

    @property
    def pcie_switch(self) -> str | None:
        """The upstream port of the host PCIe switch the device is below (a vGPU: its GPU is), or None
        (:func:`schemas.pci_topology.switch_of`: the rule the hook's GPUDirect cliques use, docs/p2p.md)."""
        path = self.pcie_path[:-1] if self.kind is ResourceKind.MDEV else self.pcie_path
        return switch_of(path)

    @property
    def health(self) -> str:
        """The kubelet's health string: exactly ``Healthy`` or ``Unhealthy``."""
        return "Healthy" if self.healthy else "Unhealthy"

    @property
    def vfio_group_path(self) -> str | None:
        """``/dev/vfio/<group>``, the node the device plugin mounts into the VM's pod, if the device has a group."""
        return None if self.iommu_group is None else f"{VFIO_DEV_DIR}/{self.iommu_group}"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "iommu_group": self.iommu_group,
            "numa_node": self.numa_node,
            "healthy": self.healthy,
            "reason": self.reason,
            "companions": [str(companion.address) for companion in self.companions],
        }


@dataclass(frozen=True, slots=True)
class Resource:
    """One extended resource (one device plugin server): its name, kind and devices sorted by ID."""

    name: str
    kind: ResourceKind
    devices: tuple[Device, ...]
    selectors: tuple[str, ...]
    """What KubeVirt's ``permittedHostDevices`` matches: ``VENDOR:DEVICE`` IDs (pci) or mdev type names (mdev)."""
    switches: tuple[NvSwitch, ...] = ()
    """The node's NVSwitches, carried by an allocation of every device of this (passthrough GPU) resource."""

    @property
    def env(self) -> str:
        """The variable Allocate sets and virt-launcher reads, e.g. ``PCI_RESOURCE_NVIDIA_COM_…``."""
        return env_var_for(self.name, self.kind)

    @property
    def socket(self) -> str:
        """The plugin's socket file name in the kubelet's device-plugin dir: ``kubevirt-<NAME>.sock``."""
        return socket_name_for(self.name)

    @property
    def healthy_count(self) -> int:
        return sum(1 for device in self.devices if device.healthy)

    def device(self, device_id: str) -> Device:
        for device in self.devices:
            if device.id == device_id:
                return device
        raise KeyError(device_id)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "env": self.env,
            "socket": self.socket,
            "devices": [device.to_json() for device in self.devices],
            **({"nvswitches": [str(switch.address) for switch in self.switches]} if self.switches else {}),
        }


@dataclass(frozen=True, slots=True)
class Ignored:
    """A function or mdev that looked like a GPU but is not offered, and why (e.g. bound to ``nvidia``)."""

    id: str
    vendor_device: str
    driver: str | None
    reason: str
    fix: str | None = None
    """What would get it offered, when its source knows better than binding it to vfio-pci (``xmlgen doctor``)."""


@dataclass(frozen=True, slots=True)
class Inventory:
    """Everything a node offers: resources sorted by name, plus what was left out and the warnings."""

    resources: tuple[Resource, ...]
    ignored: tuple[Ignored, ...] = ()
    warnings: tuple[str, ...] = ()
    pci_ids_path: str | None = None
    """The pci.ids names came from; None when none was found (hex names)."""

    def resource(self, name: str) -> Resource:
        for resource in self.resources:
            if resource.name == name:
                return resource
        raise KeyError(name)

    @property
    def resource_names(self) -> tuple[str, ...]:
        return tuple(resource.name for resource in self.resources)

    def to_json(self) -> dict[str, Any]:
        """``{"resources": [{"name", "kind", "env", "socket", "devices": [...]}]}``, as ``xmlgen discover --json``."""
        return {"resources": [resource.to_json() for resource in self.resources]}

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"
