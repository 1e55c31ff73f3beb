"""What the node offers, as ``resource.k8s.io/v1`` ResourceSlice objects: the scheduler's view of our devices.

DRA has no registration of resource names: a driver describes each device it can give in ResourceSlices, and
claims pick devices by CEL over those descriptions (docs/dra.md, "Cluster side"). This module turns an
:class:`~plugin.inventory.Inventory` into those objects, as plain JSON-shaped dicts, with no I/O: the publisher
(:mod:`plugin.dra.kube`) sends them to the API server, ``xmlgen discover --dra-slices`` prints them, and the
tests validate them against Kubernetes' schema and run the DeviceClasses' selectors on them.

The shape follows Kubernetes' own types and validation (k8s.io/api/resource/v1 ``types.go``):

- One pool per node, named after the node (node-local devices), ``spec.nodeName`` set, ``spec.driver``
  :data:`~schemas.dra.DRIVER_NAME`. A pool of more than :data:`MAX_DEVICES_PER_SLICE` devices is split
  into several slices, each saying how many the pool has (``resourceSliceCount``) at which ``generation``.
- Device names from :func:`schemas.dra.device_name` (DNS labels from the PCI address or the mdev UUID).
- Attributes in the v1 wire form (``{"string": …}``, ``{"int": …}``, ``{"bool": …}``); the standard
  ``resource.kubernetes.io/pciBusID`` and ``pcieRoot`` where the device is a PCI function, the driver's own
  unqualified. A string value over :data:`MAX_STRING_VALUE` characters (a long pci.ids name) is left out
  rather than cut: a selector comparing it must not match a truncated name.
- Unhealthy devices are published with ``healthy: false`` (the DeviceClasses select ``healthy``), so a
  device's state is visible in the slice instead of the device silently vanishing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from plugin.dra.claims import is_dns_subdomain
from plugin.inventory import Device, Inventory, Resource
from schemas.dra import (
    ATTR_DEVICE_ID,
    ATTR_HEALTHY,
    ATTR_IOMMU_GROUP,
    ATTR_KIND,
    ATTR_MDEV_UUID,
    ATTR_NUMA_NODE,
    ATTR_PARENT_PCI_BUS_ID,
    ATTR_PCI_BUS_ID,
    ATTR_PCIE_ROOT,
    ATTR_PRODUCT_NAME,
    ATTR_RESOURCE_NAME,
    ATTR_VENDOR_ID,
    ATTR_VGPU_TYPE,
    DRIVER_NAME,
    KIND_VALUES,
    device_name,
)
from schemas.errors import InputError
from schemas.kinds import ResourceKind

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"

MAX_DEVICES_PER_SLICE = 128
"""``ResourceSliceMaxDevices`` (64 only for devices with taints, counters or list attributes: ours have none)."""
MAX_ATTRIBUTES_PER_DEVICE = 32
"""``ResourceSliceMaxAttributesAndCapacitiesPerDevice`` (we publish at most 12)."""
MAX_STRING_VALUE = 64
"""``DeviceAttributeMaxValueLength``: the longest string attribute value."""
MAX_NODE_NAME = 253
"""A node name (and so the pool name) is a DNS subdomain: apimachinery's ``IsDNS1123Subdomain`` bounds the whole
name, not each label (ValidateNodeName; ValidatePoolName checks each ``/`` part the same way)."""

ProductNames = Callable[[int, int], str | None]
"""``(vendor, device) -> name`` from pci.ids (``runtime.pciids.PciIds.device_name``), or None when unknown."""


def _no_names(vendor: int, device: int) -> str | None:
    return None


def _hex_ids(vendor_device: str) -> tuple[int, int] | None:
    vendor, sep, device = vendor_device.partition(":")
    try:
        return (int(vendor, 16), int(device, 16)) if sep else None
    except ValueError:
        return None


def _string(value: str) -> dict[str, Any] | None:
    return {"string": value} if len(value) <= MAX_STRING_VALUE else None


def device_attributes(device: Device, resource: Resource, product_names: ProductNames = _no_names) -> dict[str, Any]:
    """The v1 ``attributes`` map of one device: names from :mod:`schemas.dra`, values in the wire form."""
    attributes: dict[str, dict[str, Any] | None] = {
        ATTR_KIND: {"string": KIND_VALUES[device.kind]},
        ATTR_RESOURCE_NAME: _string(resource.name),
        ATTR_HEALTHY: {"bool": device.healthy},
    }
    ids = _hex_ids(device.vendor_device)
    if ids is not None:
        vendor, product = ids
        attributes[ATTR_VENDOR_ID] = {"string": f"{vendor:04x}"}
        attributes[ATTR_DEVICE_ID] = {"string": f"{product:04x}"}
        name = product_names(vendor, product)
        if name:
            attributes[ATTR_PRODUCT_NAME] = _string(name)
    if device.numa_node is not None:
        attributes[ATTR_NUMA_NODE] = {"int": device.numa_node}
    if device.iommu_group is not None:
        attributes[ATTR_IOMMU_GROUP] = {"int": device.iommu_group}
    if device.kind is ResourceKind.MDEV:
        attributes[ATTR_MDEV_UUID] = {"string": device.id}
    else:  # a PCI function: a whole GPU or an SR-IOV vGPU's VF
        attributes[ATTR_PCI_BUS_ID] = {"string": device.id}
    if device.pcie_root:
        attributes[ATTR_PCIE_ROOT] = _string(device.pcie_root)
    if device.mdev_type is not None:
        attributes[ATTR_VGPU_TYPE] = _string(device.mdev_type)
    if device.parent is not None:
        attributes[ATTR_PARENT_PCI_BUS_ID] = {"string": str(device.parent)}
    kept = {name: value for name, value in sorted(attributes.items()) if value is not None}
    assert len(kept) <= MAX_ATTRIBUTES_PER_DEVICE
    return kept


def slice_devices(inventory: Inventory, product_names: ProductNames = _no_names) -> list[dict[str, Any]]:
    """Every device of ``inventory`` as a v1 ``Device`` (``name`` + ``attributes``), sorted by name.

    The same device in two resources cannot happen in discovery; should it, the first wins and the rest are
    dropped, since two devices of one name in a pool would make the whole slice invalid."""
    found: dict[str, dict[str, Any]] = {}
    for resource in inventory.resources:
        for device in resource.devices:
            name = device_name(device.kind, device.id)
            found.setdefault(name, {"name": name, "attributes": device_attributes(device, resource, product_names)})
    return [found[name] for name in sorted(found)]


def check_node_name(node_name: str) -> str:
    """``node_name`` if it can name a node and a pool (a DNS subdomain), else an InputError naming it."""
    if not is_dns_subdomain(node_name, MAX_NODE_NAME):
        raise InputError(f"node name {node_name[:80]!r} is not a DNS subdomain (lower-case letters, digits, '-', '.')")
    return node_name


def chunks(devices: Sequence[dict[str, Any]], size: int = MAX_DEVICES_PER_SLICE) -> list[list[dict[str, Any]]]:
    """``devices`` in runs of at most ``size``; none at all for no devices (the pool is then not published)."""
    return [list(devices[start : start + size]) for start in range(0, len(devices), size)]


def generate_name(node_name: str) -> str:
    """``<node>-<driver>-``, the ``metadata.generateName`` of our slices (as Kubernetes' own publisher names
    them; the API server cuts a long prefix and appends five random characters)."""
    return f"{node_name}-{DRIVER_NAME}-"


def slice_object(node_name: str, devices: Iterable[dict[str, Any]], generation: int, count: int) -> dict[str, Any]:
    """One ResourceSlice of the node's pool holding ``devices``; the pool has ``count`` slices at ``generation``."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"generateName": generate_name(node_name)},
        "spec": {
            "driver": DRIVER_NAME,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": count},
            "devices": list(devices),
        },
    }


def build_slices(
    inventory: Inventory,
    node_name: str,
    generation: int = 1,
    product_names: ProductNames = _no_names,
    max_devices: int = MAX_DEVICES_PER_SLICE,
) -> list[dict[str, Any]]:
    """The node's pool as ResourceSlices: one per :data:`MAX_DEVICES_PER_SLICE` devices, none for no devices."""
    check_node_name(node_name)
    if not 1 <= max_devices <= MAX_DEVICES_PER_SLICE:
        raise ValueError(f"max_devices {max_devices} is outside 1..{MAX_DEVICES_PER_SLICE}")
    runs = chunks(slice_devices(inventory, product_names), max_devices)
    return [slice_object(node_name, run, generation, len(runs)) for run in runs]
