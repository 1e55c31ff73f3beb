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
  device's state is visible in the slice instead of the device silently vanishing, and with a device taint
  (KEP 5055, ``DRADeviceTaints``, beta and on by default from 1.36): key :data:`TAINT_KEY`, the first problem's
  code as value (:func:`plugin.health.problem_code`), effect :data:`TAINT_EFFECT`, ``timeAdded`` when the
  plugin first saw the device unhealthy (:class:`TaintTimes`). A pool with a tainted device goes out in slices
  of at most :data:`MAX_DEVICES_PER_SLICE_WITH_TAINTS`. An API server with the gate off drops the field; the
  ``healthy`` attribute still says it (docs/dra.md, "Device taints").
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from plugin.dra.claims import is_dns_subdomain
from plugin.health import problem_code
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
    ATTR_PCIE_SWITCH,
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
"""``ResourceSliceMaxDevices``: devices in a slice none of whose devices has taints (counters, list attributes)."""
MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64
"""``ResourceSliceMaxDevicesWithAdvancedFeatures`` (k8s.io/api 1.36 ``resource/v1/types.go``): devices in a slice
of which any device has a taint."""
MAX_TAINTS_PER_DEVICE = 16
"""``DeviceTaintsMaxLength`` (we put at most one)."""
TAINT_KEY = f"{DRIVER_NAME}/unhealthy"
"""The key of the taint an unhealthy device carries: a label name in the driver's domain."""
TAINT_EFFECT = "NoSchedule"
"""No new allocation of the device unless the claim tolerates the taint; a claim already allocated keeps it and
its pod (a VM) keeps running. Not ``NoExecute``: that deletes every pod using the device, which for a VFIO GPU is
the VM's death (docs/dra.md, "Device taints")."""
TIME_ADDED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
"""``timeAdded`` as the API server writes a ``metav1.Time``: RFC 3339 in UTC, whole seconds."""
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
    switch = device.pcie_switch
    if switch is not None:
        attributes[ATTR_PCIE_SWITCH] = _string(switch)
    if device.mdev_type is not None:
        attributes[ATTR_VGPU_TYPE] = _string(device.mdev_type)
    if device.parent is not None:
        attributes[ATTR_PARENT_PCI_BUS_ID] = {"string": str(device.parent)}
    kept = {name: value for name, value in sorted(attributes.items()) if value is not None}
    assert len(kept) <= MAX_ATTRIBUTES_PER_DEVICE
    return kept


def format_time(seconds: float) -> str:
    """``seconds`` since the epoch as a ``timeAdded`` (:data:`TIME_ADDED`), cut to the second as Kubernetes does."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(seconds)))


def device_taints(device: Device, time_added: str | None = None) -> list[dict[str, Any]]:
    """The v1 ``taints`` of one device: none when healthy, else the one :data:`TAINT_KEY` taint whose value
    names the first problem; ``timeAdded`` when given (else the API server sets it at the write)."""
    if device.healthy:
        return []
    taint: dict[str, Any] = {"key": TAINT_KEY, "value": problem_code(device.reason), "effect": TAINT_EFFECT}
    if time_added is not None:
        taint["timeAdded"] = time_added
    return [taint]


def unhealthy_names(inventory: Inventory) -> set[str]:
    """The device names of ``inventory``'s unhealthy devices (those that carry a taint)."""
    return {
        device_name(device.kind, device.id)
        for resource in inventory.resources
        for device in resource.devices
        if not device.healthy
    }


def slice_devices(
    inventory: Inventory,
    product_names: ProductNames = _no_names,
    taint_times: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Every device of ``inventory`` as a v1 ``Device`` (``name``, ``attributes``, ``taints`` when unhealthy, with
    ``taint_times[name]`` as ``timeAdded``), sorted by name.

    The same device in two resources cannot happen in discovery; should it, the first wins and the rest are
    dropped, since two devices of one name in a pool would make the whole slice invalid."""
    times = taint_times or {}
    found: dict[str, dict[str, Any]] = {}
    for resource in inventory.resources:
        for device in resource.devices:
            name = device_name(device.kind, device.id)
            if name in found:
                continue
            entry: dict[str, Any] = {"name": name, "attributes": device_attributes(device, resource, product_names)}
            taints = device_taints(device, times.get(name))
            assert len(taints) <= MAX_TAINTS_PER_DEVICE
            if taints:
                entry["taints"] = taints
            found[name] = entry
    return [found[name] for name in sorted(found)]


class TaintTimes:
    """When each unhealthy device's taint was added, so ``timeAdded`` stays put while the taint does.

    :meth:`observe` takes each inventory: a device newly unhealthy gets the current time (``clock``, seconds
    since the epoch), one that stays unhealthy keeps its time, a healthy or vanished one is forgotten (its taint
    goes; a later problem is a new taint). :meth:`adopt` takes the slices on the API server: for a device this
    process has seen unhealthy at every observation since its first, a taint of ours there with an earlier
    ``timeAdded`` wins, so a restarted plugin keeps the time the taint has had since before the restart. A device
    this process saw healthy (or not at all) is never given a time from the server: a taint there is from before
    that (the write removing it failed), and this problem is a new one. No I/O."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._since: dict[str, str] = {}
        self._adoptable: set[str] | None = None
        """Devices unhealthy at every :meth:`observe` so far (None before the first)."""

    def observe(self, inventory: Inventory) -> dict[str, str]:
        names = unhealthy_names(inventory)
        now = format_time(self._clock())
        self._since = {name: self._since.get(name, now) for name in sorted(names)}
        self._adoptable = set(names) if self._adoptable is None else self._adoptable & names
        return dict(self._since)

    def adopt(self, published: Iterable[Mapping[str, Any]]) -> dict[str, str]:
        for obj in published:
            spec = obj.get("spec")
            devices = spec.get("devices") if isinstance(spec, Mapping) else None
            for device in devices if isinstance(devices, list) else ():
                if not isinstance(device, Mapping) or device.get("name") not in self._since:
                    continue
                if device["name"] not in (self._adoptable or ()):
                    continue
                name = str(device["name"])
                taints = device.get("taints")
                for taint in taints if isinstance(taints, list) else ():
                    if not isinstance(taint, Mapping) or taint.get("key") != TAINT_KEY:
                        continue
                    added = taint.get("timeAdded")
                    if taint.get("effect") == TAINT_EFFECT and isinstance(added, str) and TIME_ADDED.fullmatch(added):
                        self._since[name] = min(self._since[name], added)
        return dict(self._since)

    @property
    def times(self) -> dict[str, str]:
        return dict(self._since)


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
    taint_times: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The node's pool as ResourceSlices: one per :data:`MAX_DEVICES_PER_SLICE` devices (per
    :data:`MAX_DEVICES_PER_SLICE_WITH_TAINTS` when any device is tainted), none for no devices.
    ``taint_times``: the ``timeAdded`` of each tainted device by name (:class:`TaintTimes`)."""
    check_node_name(node_name)
    if not 1 <= max_devices <= MAX_DEVICES_PER_SLICE:
        raise ValueError(f"max_devices {max_devices} is outside 1..{MAX_DEVICES_PER_SLICE}")
    devices = slice_devices(inventory, product_names, taint_times)
    if any("taints" in device for device in devices):
        # Kubernetes counts per slice; the whole pool in runs of 64 keeps every run valid whatever its taints.
        max_devices = min(max_devices, MAX_DEVICES_PER_SLICE_WITH_TAINTS)
    runs = chunks(devices, max_devices)
    return [slice_object(node_name, run, generation, len(runs)) for run in runs]
