"""What one container gets from ``Allocate``: the env var virt-launcher reads and the VFIO device nodes.

This is policy, kept apart from gRPC so that it can be tested on fixture trees and reasoned about alone:

- the env var (``PCI_RESOURCE_…`` / ``MDEV_PCI_RESOURCE_…``, docs/protocols.md, "KubeVirt env naming") holds exactly
  the requested IDs, in request order, comma-separated: virt-launcher hands them to the VM's GPUs in that order;
- for a passthrough GPU resource, ``PCI_COMPANIONS_…`` (:mod:`schemas.companions`) lists each GPU's companions:
  the other functions of its IOMMU group that are on a VFIO driver now (as the re-check reads them) and on the
  GPU's bus and slot, which the hook puts in the GPU's guest slot; left out when no GPU has one;
- DeviceSpecs: ``/dev/vfio/vfio`` (the legacy container) and each needed ``/dev/vfio/<group>`` once; when the
  host has iommufd (``/dev/iommu``), also ``/dev/iommu`` and each device's ``/dev/vfio/devices/vfioN`` cdev
  (a kernel with iommufd but without VFIO device cdevs has no ``vfio-dev`` entry: the group node is enough
  there). Paths are the node's real paths, never prefixed by the host root the plugin reads through:
  the container runtime resolves them on the node. Permissions ``mrw``;
- refusals name the device and are plain domain errors: an ID the resource does not have is the caller's
  mistake (:class:`InvalidRequest`); a device known to be unhealthy, or whose IOMMU group changed under us
  since the last scan, cannot be given now (:class:`DeviceUnavailable`). The gRPC adapter
  (:mod:`plugin.server`) maps them to ``INVALID_ARGUMENT`` and ``FAILED_PRECONDITION``; nothing here imports
  grpc.

The re-check (:func:`recheck_device`) reads only a few links and directory entries per device, so Allocate
stays in the low milliseconds: the ``iommu_group`` link, the group's ``devices`` listing, the driver links
(the GPU's and its companions') and the ``/dev/vfio/<group>`` node. A full rescan is the manager's job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from plugin.config import PluginConfig
from plugin.health import PciFunction, UsabilityRule
from plugin.hostroot import HostRoot
from plugin.inventory import VFIO_CONTAINER, VFIO_DEV_DIR, Device, Resource
from plugin.sources import source_for
from schemas.companions import companions_env_var, format_companions, select_companions
from schemas.kinds import ResourceKind
from schemas.pci import PciAddress

IOMMU_DEVICE = "/dev/iommu"
VFIO_CDEV_DIR = "/dev/vfio/devices"
PERMISSIONS = "mrw"
DEFAULT_RULE = UsabilityRule.from_config(PluginConfig())
"""The usability rule of the default configuration (the server passes the configured one)."""


class AllocationError(Exception):
    """Allocate must refuse: ``message`` names the device (``device_id``, when one is to blame)."""

    def __init__(self, message: str, device_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.device_id = device_id


class InvalidRequest(AllocationError):
    """The caller's mistake: no IDs, an ID the resource does not have, an ID asked twice."""


class DeviceUnavailable(AllocationError):
    """The request is well formed but cannot be met now: an unhealthy device, a changed IOMMU group, no VFIO."""


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One device node for the container: same path inside and on the node, ``mrw``."""

    container_path: str
    host_path: str
    permissions: str = PERMISSIONS

    @classmethod
    def node(cls, path: str) -> DeviceSpec:
        return cls(path, path, PERMISSIONS)


@dataclass(frozen=True, slots=True)
class Allocation:
    """One container's answer: env vars and device nodes, in the order they should be sent."""

    envs: Mapping[str, str]
    device_specs: tuple[DeviceSpec, ...]
    device_ids: tuple[str, ...] = field(default=())

    @property
    def devices(self) -> tuple[DeviceSpec, ...]:
        """Alias of :attr:`device_specs` (the protobuf field is called ``devices``)."""
        return self.device_specs


_SYSFS_DEVICES = {kind: f"/sys/bus/{kind.info.sysfs_bus}/devices/" for kind in ResourceKind}


def _sysfs_dir(device: Device) -> str:
    return _SYSFS_DEVICES[device.kind] + device.id


def recheck_device(device: Device, host_root: Path | str, rule: UsabilityRule = DEFAULT_RULE) -> str | None:
    """Is ``device`` still usable as the last scan saw it? None if so, else why not (naming the group).

    Reads, under ``host_root``: the device's ``iommu_group`` link and the group's ``devices`` directory (its
    members must be the device and the companions the scan saw), then applies the scan's own rule
    (:class:`~plugin.health.UsabilityRule`) to what it reads now: the kind's driver check (a PCI GPU still on a
    VFIO driver), each companion's ``driver`` link, ``/dev/vfio/<group>`` and ``/dev/vfio/vfio``.
    """
    root = os.fspath(host_root)
    if device.iommu_group is None:
        return "it has no IOMMU group"
    with HostRoot(root) as fs:  # links resolved inside the host root, as discovery does
        return _recheck(device, root, fs, rule, fs.exists(VFIO_CONTAINER))


def _recheck(
    device: Device,
    root: str,
    fs: HostRoot,
    rule: UsabilityRule,
    container: bool,
    drivers: dict[str, str | None] | None = None,
) -> str | None:
    """:func:`recheck_device` through an open ``fs`` (one per Allocate); ``container``: /dev/vfio/vfio exists.
    ``drivers``, when given, gets each companion's driver as read now (by address).

    The device's own links are read through one handle on its sysfs directory (one path resolution for both).
    """
    if device.iommu_group is None:
        return "it has no IOMMU group"
    sysfs = _sysfs_dir(device)
    with fs.directory(sysfs) as handle:
        group_name = handle.readlink_name("iommu_group")
        if group_name is None:
            return f"{root}{sysfs}/iommu_group is gone (was IOMMU group {device.iommu_group}): the device was removed?"
        if group_name != str(device.iommu_group):
            return f"its IOMMU group changed from {device.iommu_group} to {group_name}"
        problem = source_for(device.kind).recheck_driver(device, handle, rule)
    group = device.iommu_group
    try:
        members = set(fs.listdir(f"/sys/kernel/iommu_groups/{group}/devices"))
    except OSError:
        return f"IOMMU group {group} is gone"
    companions = [(str(companion.address), companion) for companion in device.companions]
    expected = {device.id, *(name for name, _ in companions)}
    if members != expected:
        added, removed = sorted(members - expected), sorted(expected - members)
        change = "; ".join(
            part
            for part in (
                f"now also holds {', '.join(added)}" if added else "",
                f"no longer holds {', '.join(removed)}" if removed else "",
            )
            if part
        )
        return f"IOMMU group {group} changed since the last scan: {change}"
    if problem is not None:
        return problem
    others = [
        PciFunction(
            name,
            int(companion.vendor_device[:4], 16),
            int(companion.vendor_device[5:], 16),
            companion.pci_class,
            fs.readlink_name(f"/sys/bus/pci/devices/{name}/driver"),
        )
        for name, companion in companions
    ]
    if drivers is not None:
        drivers.update((function.name, function.driver) for function in others)
    problems = rule.group_problems(group, others) if others else []
    problems += rule.vfio_problems(group, fs.exists(f"{VFIO_DEV_DIR}/{group}"), container)
    return "; ".join(problems) or None


def vfio_cdev(device: Device, host_root: Path | str) -> str | None:
    """The device's iommufd cdev, ``/dev/vfio/devices/vfioN`` (a node path), or None if it has none.

    The kernel lists it as ``<sysfs device>/vfio-dev/vfioN``; the node must exist under the host root.
    """
    with HostRoot(os.fspath(host_root)) as fs:
        return _vfio_cdev(device, fs)


def _vfio_cdev(device: Device, fs: HostRoot) -> str | None:
    try:
        names = fs.listdir(f"{_sysfs_dir(device)}/vfio-dev")
    except OSError:
        return None
    for name in sorted(names):
        if name.startswith("vfio") and name[4:].isdigit():
            path = f"{VFIO_CDEV_DIR}/{name}"
            return path if fs.exists(path) else None
    return None


def _refuse_unknown(resource: Resource, device_id: str) -> AllocationError:
    return InvalidRequest(f"{resource.name}: unknown device ID {device_id!r}", device_id)


def allocate(
    resource: Resource,
    device_ids: Sequence[str],
    host_root: Path | str,
    rule: UsabilityRule = DEFAULT_RULE,
) -> Allocation:
    """Build one container's allocation for ``device_ids`` of ``resource``, re-checking each device on the host.

    Raises :class:`InvalidRequest` for no IDs, an unknown ID or an ID asked twice;
    :class:`DeviceUnavailable` for an unhealthy device (with its reason), a device whose IOMMU group changed or
    whose ``/dev/vfio/<group>`` is gone, or a host without ``/dev/vfio/vfio``.
    """
    root = os.fspath(host_root)
    if not device_ids:
        raise InvalidRequest(f"{resource.name}: no device IDs in the request")
    by_id = {device.id: device for device in resource.devices}
    chosen: list[Device] = []
    seen: set[str] = set()
    for device_id in device_ids:
        device = by_id.get(device_id)
        if device is None:
            raise _refuse_unknown(resource, device_id)
        if device_id in seen:
            raise InvalidRequest(f"{resource.name}: device ID {device_id!r} is asked twice", device_id)
        seen.add(device_id)
        chosen.append(device)
    for device in chosen:
        if not device.healthy:
            raise DeviceUnavailable(
                f"{resource.name}: device {device.id} is unhealthy: {device.reason or 'no reason recorded'}",
                device.id,
            )
    drivers: dict[str, str | None] | None = {} if resource.kind is ResourceKind.PCI else None
    with HostRoot(root) as fs:  # one root for the whole request: every device re-checked through it
        container = fs.exists(VFIO_CONTAINER)
        for device in chosen:
            problem = _recheck(device, root, fs, rule, container, drivers)
            if problem is not None:
                raise DeviceUnavailable(f"{resource.name}: device {device.id}: {problem}", device.id)
        iommu = fs.exists(IOMMU_DEVICE)
        specs = [DeviceSpec.node(VFIO_CONTAINER)]
        groups: set[int] = set()
        for device in chosen:
            group = device.iommu_group
            if group is not None and group not in groups:
                groups.add(group)
                specs.append(DeviceSpec.node(f"{VFIO_DEV_DIR}/{group}"))
        if iommu:
            specs.append(DeviceSpec.node(IOMMU_DEVICE))
            cdevs: set[str] = set()
            for device in chosen:
                cdev = _vfio_cdev(device, fs)
                if cdev is not None and cdev not in cdevs:
                    cdevs.add(cdev)
                    specs.append(DeviceSpec.node(cdev))
    ids = tuple(device_ids)
    envs = {resource.env: ",".join(ids)}
    if drivers is not None:
        companions = _companions(chosen, drivers, rule)
        if companions is not None:
            envs[companions_env_var(resource.name)] = companions
    return Allocation(envs=envs, device_specs=tuple(specs), device_ids=ids)


def _companions(chosen: Sequence[Device], drivers: Mapping[str, str | None], rule: UsabilityRule) -> str | None:
    """The companion variable's value for the chosen passthrough GPUs, or None when none has a companion.

    The rule is :func:`schemas.companions.select_companions` (the hook applies it to sysfs where its source
    carries no companion variable), on the group's other members with their drivers as the re-check read them
    (``drivers``); a function that is itself one of the chosen GPUs is the VM's GPU, not a companion.
    """
    gpus = {PciAddress.parse(device.id) for device in chosen}
    pairs: list[tuple[PciAddress, tuple[PciAddress, ...]]] = []
    for device in chosen:
        if not device.companions:
            continue
        gpu = PciAddress.parse(device.id)
        members = ((companion.address, drivers.get(str(companion.address))) for companion in device.companions)
        pairs.append((gpu, select_companions(gpu, members, rule.vfio_drivers, gpus)))
    return format_companions(pairs) if pairs else None
