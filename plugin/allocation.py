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

A server answers through one :class:`Allocator` (issue 12): the host root's descriptor stays open for the
server's life and what the scan already knows of each device (its paths, its group's expected members, its
companions' IDs and whether the rule calls them GPUs) is worked out once per scanned resource
(:class:`ResourcePlan`), so a call is left with the reads themselves (for one GPU with three companions: 7
path resolutions, 5 ``readlinkat``, 2 ``fstatat`` and a listing). What the host says is never kept: every call
reads it again, and :func:`allocate` gives the same answers from scratch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from plugin.config import PluginConfig
from plugin.health import PciFunction, UsabilityRule
from plugin.hostroot import Directory, HostRoot, SharedRoot
from plugin.inventory import VFIO_CONTAINER, VFIO_DEV_DIR, Device, NvSwitch, Resource
from plugin.sources import source_for
from schemas.companions import MAX_GPUS, companions_env_var, format_companions, select_companions
from schemas.errors import InputError
from schemas.fabric import board_switches, format_switches, switches_env_var
from schemas.kinds import ResourceKind
from schemas.pci import PciAddress

IOMMU_DEVICE = "/dev/iommu"
VFIO_CDEV_DIR = "/dev/vfio/devices"
PERMISSIONS = "mrw"
VFIO_CONTAINER_NAME = VFIO_CONTAINER.rpartition("/")[2]
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


@dataclass(frozen=True, slots=True)
class _Member:
    """A companion as the re-check reads it: what the scan knows of it, worked out once."""

    name: str
    """Its PCI address as sysfs names it (the group listing's entry)."""
    driver_link: str
    """``/sys/bus/pci/devices/<name>/driver``, read at every Allocate."""
    function: PciFunction
    """Its IDs and class (the driver is the scan's; a problem is described with the driver read now)."""
    address: PciAddress
    gpu: bool
    """Whether the rule's ``selects`` calls it a GPU the plugin offers (a pure function of its IDs and class)."""


@dataclass(frozen=True, slots=True)
class _DevicePlan:
    """What the re-check needs of one device that does not change between scans, worked out once (the paths,
    the group's expected members, the companions' IDs): only the reads themselves are left for each call."""

    device: Device
    sysfs: str
    group: int | None
    expected: frozenset[str]
    """The group's members as the scan saw them: the device and its companions."""
    members: tuple[_Member, ...]
    address: PciAddress | None
    """The GPU's address (a passthrough GPU resource), for the companion variable."""
    entries: dict[tuple[tuple[str | None, ...], tuple[bool, ...]], tuple[tuple[PciAddress, ...], str | None]] = field(
        default_factory=dict, compare=False
    )
    """The companion rule's answer by its inputs (each member's driver as read, whether it is one of the chosen
    GPUs): its companions and their entry in the variable. A pure function's results, not the host's state."""

    @classmethod
    def of(cls, device: Device, rule: UsabilityRule) -> _DevicePlan:
        members = []
        for companion in device.companions:
            name = str(companion.address)
            function = PciFunction(
                name,
                int(companion.vendor_device[:4], 16),
                int(companion.vendor_device[5:], 16),
                companion.pci_class,
                companion.driver,
            )
            gpu = rule.selects(function.vendor, function.device, function.pci_class)
            members.append(_Member(name, f"/sys/bus/pci/devices/{name}/driver", function, companion.address, gpu))
        return cls(
            device,
            _sysfs_dir(device),
            device.iommu_group,
            frozenset({device.id, *(member.name for member in members)}),
            tuple(members),
            _address(device.id) if device.kind is ResourceKind.PCI else None,
        )

    def recheck(
        self,
        root: str,
        fs: HostRoot,
        rule: UsabilityRule,
        container: bool,
        drivers: dict[str, str | None] | None = None,
        vfio: Directory | None = None,
    ) -> str | None:
        """:func:`recheck_device` through an open ``fs`` (one per Allocate); ``container``: /dev/vfio/vfio
        exists. ``drivers``, when given, gets each companion's driver as read now (by address); ``vfio``, when
        given, is a handle on ``/dev/vfio`` to look the group's node up in.

        The device's own links are read through one handle on its sysfs directory (one path resolution for
        both).
        """
        device = self.device
        group = self.group
        if group is None:
            return "it has no IOMMU group"
        sysfs = self.sysfs
        with fs.directory(sysfs) as handle:
            group_name = handle.readlink_name("iommu_group")
            if group_name is None:
                return f"{root}{sysfs}/iommu_group is gone (was IOMMU group {group}): the device was removed?"
            if group_name != str(group):
                return f"its IOMMU group changed from {group} to {group_name}"
            problem = source_for(device.kind).recheck_driver(device, handle, rule)
        try:
            listed = set(fs.listdir_few(f"/sys/kernel/iommu_groups/{group}/devices"))
        except OSError:
            return f"IOMMU group {group} is gone"
        expected = self.expected
        if listed != expected:
            added, removed = sorted(listed - expected), sorted(expected - listed)
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
        problems: list[str] = []
        if self.members:
            read = [(member, fs.readlink_name(member.driver_link)) for member in self.members]
            if drivers is not None:
                drivers.update((member.name, driver) for member, driver in read)
            viable = rule.member_viable
            # The rule's group_problems finds nothing exactly when every member is viable and none on a driver
            # is a GPU; only then is it skipped (it would ask ``selects`` again, for the same answer).
            if not all(viable(driver) and (driver is None or not member.gpu) for member, driver in read):
                others = [replace(member.function, driver=driver) for member, driver in read]
                problems = rule.group_problems(group, others)
        node = fs.exists(f"{VFIO_DEV_DIR}/{group}") if vfio is None else vfio.exists(str(group))
        problems += rule.vfio_problems(group, node, container)
        return "; ".join(problems) or None


def _address(device_id: str) -> PciAddress | None:
    try:
        return PciAddress.parse(device_id)
    except InputError:
        return None  # parsed again where it is needed, to raise there as before


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
        return _DevicePlan.of(device, rule).recheck(root, fs, rule, fs.exists(VFIO_CONTAINER))


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


class ResourcePlan:
    """Allocate for one resource as last scanned: what the scan already knows is worked out once (the devices by
    ID; per device, on its first request, its :class:`_DevicePlan`), so each call is left with reading the host.

    Keep one while the resource stays the same object (the server does, until the next scan replaces it); the
    rule must be the one the requests are judged by. Nothing read from the host is kept: every call re-reads.
    """

    def __init__(self, resource: Resource, rule: UsabilityRule = DEFAULT_RULE) -> None:
        self.resource = resource
        self.rule = rule
        self._by_id = {device.id: device for device in resource.devices}
        self._plans: dict[str, _DevicePlan] = {}
        self._env = resource.env
        self._companions_env = companions_env_var(resource.name) if resource.kind is ResourceKind.PCI else None
        self._switches_env = switches_env_var(resource.name) if resource.switches else None
        self._board = frozenset(self._by_id)
        self._switch_addresses = tuple(switch.address for switch in resource.switches)

    def _plan(self, device: Device) -> _DevicePlan:
        plan = self._plans.get(device.id)
        if plan is None:
            plan = self._plans[device.id] = _DevicePlan.of(device, self.rule)
        return plan

    def allocate(self, device_ids: Sequence[str], fs: HostRoot, root: str) -> Allocation:
        """:func:`allocate` through ``fs``, a :class:`HostRoot` of ``root`` (the host root as given, for
        messages)."""
        resource = self.resource
        if not device_ids:
            raise InvalidRequest(f"{resource.name}: no device IDs in the request")
        by_id = self._by_id
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
        plans = [self._plan(device) for device in chosen]
        rule = self.rule
        drivers: dict[str, str | None] | None = {} if self._companions_env is not None else None
        with fs.directory(VFIO_DEV_DIR) as vfio:  # one resolution for the container and every group's node
            container = vfio.exists(VFIO_CONTAINER_NAME)
            for plan in plans:
                problem = plan.recheck(root, fs, rule, container, drivers, vfio)
                if problem is not None:
                    raise DeviceUnavailable(f"{resource.name}: device {plan.device.id}: {problem}", plan.device.id)
            switches = self._carried_switches(device_ids, fs, vfio)
        iommu = fs.exists(IOMMU_DEVICE)
        specs = [_CONTAINER_SPEC]
        groups: set[int] = set()
        for device in chosen:
            group = device.iommu_group
            if group is not None and group not in groups:
                groups.add(group)
                specs.append(DeviceSpec.node(f"{VFIO_DEV_DIR}/{group}"))
        for switch in switches:
            if switch.iommu_group not in groups:
                groups.add(switch.iommu_group)
                specs.append(DeviceSpec.node(switch.vfio_group_path))
        if iommu:
            specs.append(DeviceSpec.node(IOMMU_DEVICE))
            cdevs: set[str] = set()
            for device in chosen:
                cdev = _vfio_cdev(device, fs)
                if cdev is not None and cdev not in cdevs:
                    cdevs.add(cdev)
                    specs.append(DeviceSpec.node(cdev))
        ids = tuple(device_ids)
        return Allocation(envs=self._envs(ids, plans, drivers, switches), device_specs=tuple(specs), device_ids=ids)

    def _envs(
        self,
        ids: tuple[str, ...],
        plans: Sequence[_DevicePlan],
        drivers: Mapping[str, str | None] | None,
        switches: Sequence[NvSwitch],
    ) -> dict[str, str]:
        """The allocation's variables: KubeVirt's, the companions' and the NVSwitches' (when they have a value)."""
        envs = {self._env: ",".join(ids)}
        if self._companions_env is not None and drivers is not None:
            companions = _companions(plans, drivers, self.rule)
            if companions is not None:
                envs[self._companions_env] = companions
        if switches and self._switches_env is not None:
            value = format_switches(switch.address for switch in switches)
            if value is not None:
                envs[self._switches_env] = value
        return envs

    def _carried_switches(self, device_ids: Sequence[str], fs: HostRoot, vfio: Directory) -> tuple[NvSwitch, ...]:
        """The NVSwitches this allocation carries (:func:`schemas.fabric.board_switches`: all of them for every
        GPU of the resource, else none), each re-checked now: still on a VFIO driver, its ``/dev/vfio`` node
        there. A switch that is not refuses the allocation, naming it: the board without its fabric is not what
        the VM asked for (docs/nvswitch.md)."""
        if self._switches_env is None or not board_switches(device_ids, self._board, self._switch_addresses):
            return ()
        resource = self.resource
        for switch in resource.switches:
            driver = fs.readlink_name(f"/sys/bus/pci/devices/{switch.address}/driver")
            problem = self.rule.driver_problem(driver)
            if problem is None and not vfio.exists(str(switch.iommu_group)):
                problem = f"{switch.vfio_group_path} is missing"
            if problem is not None:
                raise DeviceUnavailable(
                    f"{resource.name}: NVSwitch {switch.address} of the board: {problem}", str(switch.address)
                )
        return resource.switches


_CONTAINER_SPEC = DeviceSpec.node(VFIO_CONTAINER)


def allocate(
    resource: Resource,
    device_ids: Sequence[str],
    host_root: Path | str,
    rule: UsabilityRule = DEFAULT_RULE,
) -> Allocation:
    """Build one container's allocation for ``device_ids`` of ``resource``, re-checking each device on the host.

    Raises :class:`InvalidRequest` for no IDs, an unknown ID or an ID asked twice;
    :class:`DeviceUnavailable` for an unhealthy device (with its reason), a device whose IOMMU group changed or
    whose ``/dev/vfio/<group>`` is gone, or a host without ``/dev/vfio/vfio``. A server keeps an
    :class:`Allocator` instead (the same answers, less work per call).
    """
    root = os.fspath(host_root)
    with HostRoot(root) as fs:  # one root for the whole request: every device re-checked through it
        return ResourcePlan(resource, rule).allocate(device_ids, fs, root)


class Allocator:
    """Allocate for a server's life: the host root's descriptor (:class:`~plugin.hostroot.SharedRoot`) and the
    current resource's :class:`ResourcePlan` kept from one request to the next; each request still reads the
    host anew. Thread-safe (a request on each of the server's threads); :meth:`close` when the server stops.

    A refusal is checked once against the root having been replaced under the kept descriptor
    (:meth:`~plugin.hostroot.SharedRoot.renew`): if it was, the request is answered again through the new root.
    """

    def __init__(self, host_root: Path | str, rule: UsabilityRule = DEFAULT_RULE) -> None:
        self.root = os.fspath(host_root)
        self.rule = rule
        self._shared = SharedRoot(self.root)
        self._plan: ResourcePlan | None = None

    def allocate(self, resource: Resource, device_ids: Sequence[str]) -> Allocation:
        """:func:`allocate` of ``device_ids`` of ``resource`` (the one served now), with this server's rule."""
        plan = self._plan
        if plan is None or plan.resource is not resource:
            plan = self._plan = ResourcePlan(resource, self.rule)  # a new scan: worked out again, once
        try:
            with self._shared.borrow() as fs:
                return plan.allocate(device_ids, fs, self.root)
        except DeviceUnavailable:
            # Something was missing: asked only now whether the kept descriptor still names the host root (a
            # root replaced under it reads as empty where a fresh read, the scan's, sees the new one).
            if not self._shared.renew():
                raise
        with self._shared.borrow() as fs:
            return plan.allocate(device_ids, fs, self.root)

    def close(self) -> None:
        self._shared.close()

    def __enter__(self) -> Allocator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _companions(plans: Sequence[_DevicePlan], drivers: Mapping[str, str | None], rule: UsabilityRule) -> str | None:
    """The companion variable's value for the chosen passthrough GPUs, or None when none has a companion.

    The rule is :func:`schemas.companions.select_companions` (the hook applies it to sysfs where its source
    carries no companion variable), on the group's other members with their drivers as the re-check read them
    (``drivers``); a function that is itself one of the chosen GPUs is the VM's GPU, not a companion. Each GPU's
    entry is :func:`~schemas.companions.format_companions`'s, worked out once per combination of its inputs.
    """
    gpus = {_gpu_address(plan) for plan in plans}
    pairs: list[tuple[PciAddress, tuple[PciAddress, ...]]] = []
    entries: list[str] = []
    for plan in plans:
        if not plan.members:
            continue
        gpu = _gpu_address(plan)
        read = tuple(drivers.get(member.name) for member in plan.members)
        key = (read, tuple(member.address in gpus for member in plan.members))
        known = plan.entries.get(key)
        if known is None:
            members = zip((member.address for member in plan.members), read, strict=True)
            chosen = select_companions(gpu, members, rule.vfio_drivers, gpus)
            if len(plan.entries) >= _ENTRIES_KEPT:
                plan.entries.clear()
            known = plan.entries[key] = (chosen, format_companions([(gpu, chosen)]))
        pairs.append((gpu, known[0]))
        if known[1] is not None:
            entries.append(known[1])
    if len(entries) > MAX_GPUS or len(gpus) < len(plans):
        return format_companions(pairs)  # refused there, as the variable's one writer
    return ",".join(entries) or None


_ENTRIES_KEPT = 16
"""Combinations kept per GPU (a GPU's members change drivers rarely; this only bounds the memory)."""


def _gpu_address(plan: _DevicePlan) -> PciAddress:
    return plan.address if plan.address is not None else PciAddress.parse(plan.device.id)
