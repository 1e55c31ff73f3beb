"""The names the project's DRA driver publishes and reads, declared once (issue 16).

Dynamic Resource Allocation (``resource.k8s.io/v1``) has three parties that must agree on names: the kubelet
plugin that publishes ResourceSlices and prepares claims (``plugin/dra``), the DeviceClasses and sample claims
in ``deploy/`` whose CEL selectors read the attributes, and the hook, which finds a claimed device through the
metadata file the driver writes for it (docs/dra.md). The device-plugin path has the same kind of agreement in
:mod:`schemas.naming`; this module is its DRA counterpart.

- Driver name: a DNS subdomain, the domain of the driver's own attributes (an unqualified attribute name in a
  slice belongs to it).
- Device names: DNS labels (at most 63 characters, ``[a-z0-9-]``), stable across restarts: derived from the PCI
  address or the mdev UUID, never from an index.
- Attributes: the standard ones Kubernetes defines for every driver (``resource.kubernetes.io/…``) and the
  driver's own, one constant each, so a selector in ``deploy/`` and the publisher cannot drift apart.
"""

from __future__ import annotations

from schemas.errors import InputError
from schemas.kinds import ResourceKind
from schemas.mdev import parse_mdev_uuid
from schemas.pci import PciAddress

DRIVER_NAME = "gpu-passthrough.kubevirt.io"
"""The DRA driver name: ResourceSlices' ``spec.driver``, the kubelet plugin's registered name, the CDI vendor."""

MAX_DEVICE_NAME = 63
"""A device name is a DNS label."""

# Standard attributes (Kubernetes' ``k8s.io/dynamic-resource-allocation/deviceattribute``).
ATTR_PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
"""The PCI address of a device that is a PCI function (``0000:86:00.0``): passthrough GPUs, SR-IOV vGPU VFs."""
ATTR_PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
"""The PCIe root complex the device hangs under (``pci0000:85``), for aligning devices of one claim."""

# The driver's own attributes (unqualified in a slice: they belong to DRIVER_NAME).
ATTR_KIND = "kind"
"""The device kind, :data:`KIND_VALUES`: ``passthrough``, ``mdev-vgpu`` or ``sriov-vgpu``."""
ATTR_RESOURCE_NAME = "resourceName"
"""The device plugin's name for the same devices (``nvidia.com/TU106_GEFORCE_RTX_2060_REV__A``)."""
ATTR_PRODUCT_NAME = "productName"
ATTR_VENDOR_ID = "vendorID"
"""Four lower-case hex digits (``10de``)."""
ATTR_DEVICE_ID = "deviceID"
"""Four lower-case hex digits of the GPU (a vGPU: of its parent GPU)."""
ATTR_NUMA_NODE = "numaNode"
ATTR_IOMMU_GROUP = "iommuGroup"
ATTR_PCIE_SWITCH = "pcieSwitch"
"""The upstream port of the host PCIe switch a GPU is below (``0000:01:00.0``), when it is one: a claim's GPUs
matched on it share a switch, and the hook gives them one GPUDirect P2P clique (docs/p2p.md)."""
ATTR_VGPU_TYPE = "vgpuType"
"""A vGPU's type: an mdev type ID (``nvidia-230``) or an SR-IOV vGPU's type name."""
ATTR_PARENT_PCI_BUS_ID = "parentPciBusID"
"""A vGPU's parent GPU."""
ATTR_MDEV_UUID = "mdevUUID"
ATTR_HEALTHY = "healthy"
"""Whether the device can be given now (the device plugin's health, the same rule)."""

KIND_VALUES: dict[ResourceKind, str] = {
    ResourceKind.PCI: "passthrough",
    ResourceKind.MDEV: "mdev-vgpu",
    ResourceKind.SRIOV_VGPU: "sriov-vgpu",
}
"""The ``kind`` attribute's value per device kind."""

DEVICE_CLASSES: dict[ResourceKind, str] = {
    ResourceKind.PCI: f"passthrough.{DRIVER_NAME}",
    ResourceKind.MDEV: f"mdev-vgpu.{DRIVER_NAME}",
    ResourceKind.SRIOV_VGPU: f"sriov-vgpu.{DRIVER_NAME}",
}
"""The DeviceClass deploy/ ships per kind (a DNS subdomain each)."""

CDI_KIND = f"{DRIVER_NAME}/claim"
"""The CDI ``kind`` of the devices the plugin writes: one CDI device per prepared claim request."""


def device_name(kind: ResourceKind, device_id: str) -> str:
    """The slice's name for a device: ``pci-0000-86-00-0`` for a PCI function, ``mdev-<uuid>`` for an mdev."""
    if kind is ResourceKind.MDEV:
        return f"mdev-{parse_mdev_uuid(device_id)}"
    address = PciAddress.parse(device_id)
    return "pci-" + str(address).replace(":", "-").replace(".", "-")


def device_id_of(name: str) -> tuple[str, str]:
    """The inverse of :func:`device_name`: ``("pci", "0000:86:00.0")`` or ``("mdev", uuid)``; InputError when
    ``name`` is not a name this driver gives."""
    prefix, _, rest = name.partition("-")
    if len(name) > MAX_DEVICE_NAME:
        raise InputError(f"DRA device name {name[:80]!r} is longer than {MAX_DEVICE_NAME} characters")
    if prefix == "mdev":
        return "mdev", parse_mdev_uuid(rest)
    if prefix == "pci":
        parts = rest.split("-")
        if len(parts) == 4:
            text = f"{parts[0]}:{parts[1]}:{parts[2]}.{parts[3]}"
            address = PciAddress.parse(text)
            if device_name(ResourceKind.PCI, str(address)) == name:
                return "pci", str(address)
    raise InputError(f"{name!r} is not a device name of DRA driver {DRIVER_NAME}")
