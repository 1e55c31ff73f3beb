"""``vgpu apply``: make the node's vGPUs what the selected config says, writing only the difference.

Two kinds of vGPU parents (docs/node-agent.md has the sysfs shapes and their sources):

- **mdev parents** (``/sys/class/mdev_bus/<parent>``): a type is a ``mdev_supported_types/<type>``
  directory; a vGPU is created by writing a new UUID to its ``create`` and removed by writing ``1`` to
  ``/sys/bus/mdev/devices/<uuid>/remove``. A config names a type by its directory (``nvidia-222``,
  ``mtty-2``), its ``name`` file (``GRID T4-1Q``), or that name without ``GRID ``/``NVIDIA `` (``T4-1Q``).
- **SR-IOV vGPU GPUs** (vGPU 17+; an NVIDIA PF with ``sriov_totalvfs``): VFs are enabled through
  ``sriov_numvfs`` when a config wants vGPUs there and none are; a vGPU is a VF whose
  ``nvidia/current_vgpu_type`` is a type ID from its ``nvidia/creatable_vgpu_types`` (``0`` removes it).
  A config names a type by its name (``NVIDIA L40S-1B`` or ``L40S-1B``) or its numeric ID.

Managed parents: every NVIDIA one unless ``--parent`` names them (the kernel's sample drivers, ``mtty``,
are only managed when named). GPU indexes (``devices: [0, 2]``) are NVIDIA's: every NVIDIA GPU that is not a
VF, in PCI address order; for each parent the last spec matching it wins, and a parent no spec matches is
left as it is (as NVIDIA's manager does).

Order: read everything, plan every parent (pure: :func:`plan_parent`), refuse before any write when a
type is unknown, a count cannot fit, or a vGPU to remove is held by a VM (named with its holder); then
check that every attribute about to be written opens inside the host root; then enable the VFs the config
needs, remove surplus vGPUs (freeing room) and create the missing ones, re-reading the room before each
creation. vGPUs already as asked are left alone, so a re-apply of the same config writes nothing.

MIG-backed types (``A100-1-5C``) on a MIG-capable SR-IOV GPU (:mod:`node_agent.mig`): the GPU's MIG step is
planned first (:func:`plan_mig`: mode, surplus vGPUs, GPU instances to destroy and where the missing ones go),
refused before any change like the rest, carried out through nvidia-smi, and the GPU's vGPUs are planned again
from what its VFs then offer.

An SR-IOV GPU whose VFs are off shows its types nowhere but in its own ``nvidia/creatable_vgpu_types``
(where the driver writes one) and in the state file (the names earlier runs saw). With neither, its type
names can only be checked once its VFs exist: then, and only then, the VFs are enabled first (after every
other check passed) and, should a name prove unknown, turned off again, so the node is left as it was.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from node_agent.bind import group_holders
from node_agent.kernel import AgentError, Kernel
from node_agent.mig import (
    MIG_GPUS,
    GiProfile,
    GpuInstance,
    MigBacked,
    MigGpu,
    MigState,
    MigTool,
    NvidiaSmi,
    mig_backed,
    place,
)
from node_agent.sysfs import NVIDIA_VENDOR, Sysfs, all_addresses, read_function
from node_agent.vgpu_config import VgpuSpec
from schemas.node_agent_state import TYPE_NAMES, encode_type_names

MAX_VFS = 4096


@dataclass(frozen=True, slots=True)
class MdevKind:
    type_id: str
    name: str
    available: int
    devices: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class VirtualFunction:
    address: str
    current: int
    creatable: tuple[tuple[int, str], ...]
    group: int | None


@dataclass(frozen=True, slots=True)
class Parent:
    """A GPU that hosts vGPUs, as sysfs shows it now."""

    name: str
    kind: str  # "mdev" | "sriov"
    device_id: int | None
    """``device << 16 | vendor`` for a PCI parent (device-filter); None otherwise (sample drivers)."""
    nvidia: bool
    mdev_types: tuple[MdevKind, ...] = ()
    vfs: tuple[VirtualFunction, ...] = ()
    total_vfs: int = 0
    groups: tuple[tuple[str, int | None], ...] = ()
    """Each existing vGPU's IOMMU group (mdev UUID or VF address → group)."""
    index: int = -1
    """The GPU index a config's ``devices`` names it by (see :func:`gpu_indexes`)."""
    listed: tuple[tuple[int, str], ...] = ()
    """An SR-IOV PF's own ``nvidia/creatable_vgpu_types``, where the driver writes one."""

    def vgpus(self) -> dict[str, list[str]]:
        """Existing vGPUs by type key (mdev type directory, or the SR-IOV type ID as text) → their IDs."""
        found: dict[str, list[str]] = {}
        for kind in self.mdev_types:
            if kind.devices:
                found[kind.type_id] = sorted(kind.devices)
        for vf in self.vfs:
            if vf.current:
                found.setdefault(str(vf.current), []).append(vf.address)
        return found


def display_names(name: str) -> set[str]:
    """How a config may call a type named ``name``: as is, or without NVIDIA's ``GRID ``/``NVIDIA `` prefix."""
    return {name, name.removeprefix("GRID "), name.removeprefix("NVIDIA ")}


def parse_creatable(text: str) -> tuple[tuple[int, str], ...]:
    """``creatable_vgpu_types``: a header ``ID    : vGPU Name``, then ``557   : NVIDIA L40S-1B`` lines."""
    entries = []
    for line in text.splitlines():
        number, separator, name = line.partition(":")
        if separator and number.strip().isdigit():
            entries.append((int(number.strip()), name.strip()))
    return tuple(entries)


# -- reading ----------------------------------------------------------------------------------------------


def _int(text: str | None, what: Path) -> int:
    try:
        return int((text or "").strip() or "0")
    except ValueError:
        raise AgentError(f"{what} reads {text!r}, not a number") from None


def _pci_ids(fs: Sysfs, directory: Path) -> tuple[int | None, bool]:
    vendor, device = fs.read(directory / "vendor"), fs.read(directory / "device")
    if vendor is None or device is None:
        return None, False
    try:
        vendor_id, device_id = int(vendor, 16), int(device, 16)
    except ValueError:
        return None, False
    return device_id << 16 | vendor_id, vendor_id == NVIDIA_VENDOR


def _mdev_parent(fs: Sysfs, name: str) -> Parent:
    directory = fs.inside(fs.sys / "class" / "mdev_bus" / name)
    device_id, nvidia = _pci_ids(fs, directory)
    kinds = []
    groups = []
    for type_id in fs.listdir(directory / "mdev_supported_types"):
        type_dir = directory / "mdev_supported_types" / type_id
        devices = tuple(fs.listdir(type_dir / "devices"))
        for uid in devices:
            group = fs.link_name(type_dir / "devices" / uid / "iommu_group")
            groups.append((uid, int(group) if group and group.isdigit() else None))
        kinds.append(
            MdevKind(
                type_id,
                fs.read(type_dir / "name") or type_id,
                _int(fs.read(type_dir / "available_instances"), type_dir / "available_instances"),
                devices,
            )
        )
    return Parent(name, "mdev", device_id, nvidia, mdev_types=tuple(kinds), groups=tuple(groups))


def _sriov_parent(fs: Sysfs, address: str, device_id: int) -> Parent:
    directory = fs.inside(fs.pci_devices / address)
    total = min(_int(fs.read(directory / "sriov_totalvfs"), directory / "sriov_totalvfs"), MAX_VFS)
    links = [name for name in fs.listdir(directory) if name.startswith("virtfn") and name[6:].isdigit()]
    vfs = []
    for link in sorted(links, key=lambda name: int(name[6:])):
        vf_dir = fs.inside(directory / link)
        current = _int(fs.read(vf_dir / "nvidia" / "current_vgpu_type"), vf_dir / "nvidia" / "current_vgpu_type")
        group = fs.link_name(vf_dir / "iommu_group")
        vfs.append(
            VirtualFunction(
                vf_dir.name,
                current,
                parse_creatable(fs.read(vf_dir / "nvidia" / "creatable_vgpu_types") or ""),
                int(group) if group and group.isdigit() else None,
            )
        )
    return Parent(
        address,
        "sriov",
        device_id,
        True,
        vfs=tuple(vfs),
        total_vfs=total,
        groups=tuple((vf.address, vf.group) for vf in vfs if vf.current),
        listed=parse_creatable(fs.read(directory / "nvidia" / "creatable_vgpu_types") or ""),
    )


def gpu_indexes(fs: Sysfs) -> dict[str, int]:
    """NVIDIA's GPU numbering, as vgpu-device-manager's: every NVIDIA display-class function that is not a
    VF, in PCI address order."""
    gpus = []
    for address in all_addresses(fs):
        if fs.lexists(fs.pci_devices / address / "physfn"):
            continue
        function = read_function(fs, address)
        if function.vendor == NVIDIA_VENDOR and function.is_gpu:
            gpus.append(address)
    return {address: index for index, address in enumerate(sorted(gpus))}


def read_parents(fs: Sysfs, names: Iterable[str] = (), required: bool = True) -> list[Parent]:
    """The managed vGPU parents, GPUs in index order then other parents by name: the ``names`` given, else
    every NVIDIA one. A GPU's index is :func:`gpu_indexes`'s; a parent that is no NVIDIA GPU (the kernel's
    sample drivers) is numbered after the GPUs, in name order. ``required=False``: a node without any is an
    empty list, not an error."""
    wanted = set(names)
    indexes = gpu_indexes(fs)
    parents: dict[str, Parent] = {}
    for name in fs.listdir(fs.sys / "class" / "mdev_bus"):
        parent = _mdev_parent(fs, name)
        if name in wanted or (not wanted and parent.nvidia):
            parents[name] = parent
    for address in indexes:
        if address in parents or (wanted and address not in wanted):
            continue
        directory = fs.pci_devices / address
        if fs.lexists(directory / "sriov_totalvfs"):
            function = read_function(fs, address)
            parents[address] = _sriov_parent(fs, address, function.device << 16 | function.vendor)
    missing = wanted - set(parents)
    if missing:
        raise AgentError(f"no vGPU parent named {', '.join(sorted(missing))} (no mdev_bus entry or SR-IOV GPU)")
    if not parents and required:
        raise AgentError(
            f"no vGPU parent on this node: no NVIDIA GPU in {fs.sys / 'class' / 'mdev_bus'} and no NVIDIA GPU with "
            "sriov_totalvfs (is the NVIDIA vGPU manager driver loaded?)"
        )
    others = sorted(name for name in parents if name not in indexes)
    numbered = {name: indexes[name] for name in parents if name in indexes}
    following = len(indexes)
    for name in others:
        numbered[name] = following
        following += 1
    ordered = sorted(parents, key=lambda name: numbered[name])
    return [replace(parents[name], index=numbered[name]) for name in ordered]


# -- planning (pure) ---------------------------------------------------------------------------------------


@dataclass
class ParentPlan:
    parent: Parent
    wanted: dict[str, int] = field(default_factory=dict)
    """Type key → count asked for (mdev type directory, or SR-IOV type ID as text)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Type key → the name the config used (for messages and the state file)."""
    remove: list[tuple[str, str]] = field(default_factory=list)
    """(type key, vGPU ID) to remove."""
    create: list[tuple[str, int]] = field(default_factory=list)
    """(type key, how many) to create."""
    errors: list[str] = field(default_factory=list)
    known: dict[int, str] = field(default_factory=dict)
    """SR-IOV type ID → name as seen when planning (the state file keeps them for later runs)."""
    unchecked: list[tuple[str, int]] = field(default_factory=list)
    """(type name, count) asked of an SR-IOV GPU whose VFs are off and whose types nothing names yet."""
    mig: MigPlan | None = None
    """The MIG step of a MIG-capable GPU; while it has steps, the vGPUs are planned again after it."""
    asked: tuple[tuple[str, int], ...] = ()

    @property
    def enables_vfs(self) -> bool:
        """Whether applying starts by enabling the parent's VFs (an SR-IOV GPU with none that gets vGPUs)."""
        return self.parent.kind == "sriov" and not self.parent.vfs and bool(self.wanted or self.unchecked)


def resolve_type(parent: Parent, wanted: str, known: dict[int, str]) -> str | None:
    """The type key of the config's type name ``wanted`` on ``parent``; None when the parent has no such type."""
    if parent.kind == "mdev":
        for kind in parent.mdev_types:
            if wanted == kind.type_id or wanted in display_names(kind.name):
                return kind.type_id
        return None
    for number, name in known.items():
        if wanted == str(number) or wanted in display_names(name):
            return str(number)
    return None


def known_sriov_types(parent: Parent, remembered: dict[int, str]) -> dict[int, str]:
    """Type ID → name from every VF's creatable list, the PF's own, and from earlier runs (a VF with a type
    lists none)."""
    known = dict(remembered)
    known.update(parent.listed)
    for vf in parent.vfs:
        known.update(vf.creatable)
    return known


def plan_parent(
    parent: Parent, asked: tuple[tuple[str, int], ...], remembered: dict[int, str], held: dict[str, list[str]]
) -> ParentPlan:
    """What must change on ``parent`` so it holds exactly ``asked`` (type name → count); ``held`` names the
    vGPUs a VM holds (ID → holders), which may not be removed."""
    plan = ParentPlan(parent)
    known = known_sriov_types(parent, remembered)
    plan.known = dict(known)
    unknowable = parent.kind == "sriov" and not parent.vfs and not known
    for name, count in asked:
        key = resolve_type(parent, name, known)
        if key is None and unknowable:
            plan.unchecked.append((name, count))  # checked once the VFs exist (see the module doc)
            continue
        if key is None:
            offered = (
                [f"{k.type_id} ({k.name})" for k in parent.mdev_types]
                if parent.kind == "mdev"
                else [f"{number} ({label})" for number, label in sorted(known.items())]
            )
            plan.errors.append(
                f"{parent.name} cannot create vGPU type {name!r}: it offers {', '.join(offered) or 'no type now'}"
            )
            continue
        plan.wanted[key] = plan.wanted.get(key, 0) + count
        plan.labels[key] = name
    if plan.errors:
        return plan
    existing = parent.vgpus()
    for key in sorted(existing):
        surplus = len(existing[key]) - plan.wanted.get(key, 0)
        if surplus <= 0:
            continue
        free = [vgpu for vgpu in existing[key] if vgpu not in held]
        if surplus > len(free):
            busy = [f"{vgpu} ({'; '.join(held[vgpu])})" for vgpu in existing[key] if vgpu in held]
            plan.errors.append(
                f"{parent.name}: the config keeps {plan.wanted.get(key, 0)} vGPU(s) of type {key}, "
                f"{len(existing[key])} exist and VMs hold {', '.join(busy)}: not removing vGPUs in use"
            )
            continue
        plan.remove.extend((key, vgpu) for vgpu in free[:surplus])
    removing = {key for key, _ in plan.remove}
    for key, count in sorted(plan.wanted.items()):
        missing = count - len(existing.get(key, []))
        if missing <= 0:
            continue
        plan.create.append((key, missing))
        if parent.kind == "mdev" and not removing:
            available = next(k.available for k in parent.mdev_types if k.type_id == key)
            if missing > available:
                plan.errors.append(
                    f"{parent.name}: {plan.labels[key]} ({key}) needs {missing} more vGPU(s) and "
                    f"available_instances is {available}"
                )
    if parent.kind == "sriov":
        in_use = sum(len(ids) for ids in existing.values()) - len(plan.remove)
        extra = sum(count for _, count in plan.create) + sum(count for _, count in plan.unchecked)
        room = (len(parent.vfs) or parent.total_vfs) - in_use
        if extra > room:
            plan.errors.append(
                f"{parent.name}: the config asks for {in_use + extra} vGPU(s) and the GPU has "
                f"{len(parent.vfs) or parent.total_vfs} VFs"
            )
    return plan


# -- MIG (planning is pure) ---------------------------------------------------------------------------------


@dataclass
class MigPlan:
    """What must change in a MIG-capable GPU's MIG state before its MIG-backed vGPUs can be created."""

    parent: Parent
    gpu: MigGpu
    state: MigState
    enable: bool
    """The MIG mode the config needs (on for MIG-backed types, off for time-sliced ones)."""
    clear: list[str] = field(default_factory=list)
    """VFs whose vGPU goes first (all of them when the mode changes)."""
    destroy: list[int] = field(default_factory=list)
    """GPU instance IDs to destroy (only instances no remaining vGPU can run on)."""
    create: list[tuple[GiProfile, int]] = field(default_factory=list)
    """(profile, first memory slice) of each GPU instance to create."""
    errors: list[str] = field(default_factory=list)

    @property
    def mode_change(self) -> bool:
        return self.state.current != self.enable or self.state.pending != self.enable

    @property
    def steps(self) -> bool:
        return bool(self.clear or self.destroy or self.create or self.mode_change)


def _pci_id(parent: Parent) -> str:
    device = parent.device_id or 0
    return f"{device & 0xFFFF:04x}:{device >> 16:04x}"


def mig_gpu(parent: Parent) -> MigGpu | None:
    """The MIG profiles of an SR-IOV vGPU GPU the agent knows as MIG-capable; None for any other parent."""
    if parent.kind != "sriov" or parent.device_id is None:
        return None
    return MIG_GPUS.get(parent.device_id >> 16)


def wants_mig_state(parent: Parent, asked: tuple[tuple[str, int], ...], remembered: dict[int, str]) -> bool:
    """Whether planning ``parent`` needs its MIG state: it is MIG-capable and the config asks for MIG-backed
    types, or a type it offers or holds is MIG-backed (its MIG mode is on). Other GPUs never run nvidia-smi."""
    if mig_gpu(parent) is None:
        return False
    names = [name for name, _ in asked]
    names.extend(known_sriov_types(parent, remembered).values())
    return any(mig_backed(name) is not None for name in names)


def plan_mig(
    parent: Parent,
    gpu: MigGpu,
    state: MigState,
    asked: tuple[tuple[str, int], ...],
    remembered: dict[int, str],
    held: dict[str, list[str]],
) -> MigPlan | None:
    """The MIG step ``parent`` needs for ``asked`` (None: none, MIG stays off and the config is time-sliced).

    With the mode changing, every vGPU goes first (VFs off, mode, GPU reset, VFs on); otherwise only the
    surplus vGPUs of MIG-backed types go, GPU instances of a profile are destroyed only when no vGPU stays on
    that profile (nvidia-smi cannot tell which instance runs which vGPU), and the missing instances are placed
    beside the kept ones. Every error is found here, before anything changes."""
    backed = [(name, count, mig_backed(name)) for name, count in asked]
    wanted_types = [(name, count, found) for name, count, found in backed if found is not None]
    if not wanted_types and not state.current and not state.pending:
        return None
    plan = MigPlan(parent, gpu, state, enable=bool(wanted_types))
    where = f"{parent.name} ({gpu.model})"
    wanted: dict[str, int] = {}
    profiles: dict[str, GiProfile] = {}
    for name, count, found in wanted_types:
        assert found is not None
        profile = gpu.profile(found.profile)
        if profile is None:
            offered = ", ".join(p.name for p in gpu.profiles)
            plan.errors.append(f"{where} has no GPU instance profile {found.profile} for {name!r} (it has {offered})")
            continue
        wanted[profile.name] = wanted.get(profile.name, 0) + count
        profiles[profile.name] = profile
    if plan.errors:
        return plan
    existing = parent.vgpus()
    if plan.mode_change:
        everything = sorted(vf for vfs in existing.values() for vf in vfs)
        busy = [f"{vf} ({'; '.join(held[vf])})" for vf in everything if vf in held]
        if busy:
            plan.errors.append(
                f"{parent.name}: turning MIG mode {'on' if plan.enable else 'off'} removes every vGPU of the GPU "
                f"and VMs hold {', '.join(busy)}: not removing vGPUs in use"
            )
        if state.processes:
            plan.errors.append(
                f"{parent.name}: MIG mode cannot change while processes use the GPU: {', '.join(state.processes)}"
            )
        plan.clear = everything
        plan.destroy = sorted((gi.gi_id for gi in state.instances), reverse=True) if state.current else []
        kept: list[GpuInstance] = []
    else:
        kept = _mig_surplus(plan, existing, wanted_types, wanted, remembered, held)
    if plan.enable:
        have: dict[str, int] = {}
        for instance in kept:
            profile = gpu.by_id(instance.profile_id)
            if profile is not None:
                have[profile.name] = have.get(profile.name, 0) + 1
        new = [profiles[name] for name, count in wanted.items() for _ in range(max(count - have.get(name, 0), 0))]
        placed = place(gpu, kept, new) if new else []
        if placed is None:
            layout = ", ".join(f"{name} x{count}" for name, count in wanted.items())
            plan.errors.append(
                f"{where}: GPU instances {layout} do not fit beside the {len(kept)} kept on its memory slices "
                "(the profiles' placements in NVIDIA's MIG user guide)"
            )
        else:
            plan.create = placed
    return plan


def _mig_surplus(
    plan: MigPlan,
    existing: dict[str, list[str]],
    wanted_types: Sequence[tuple[str, int, MigBacked | None]],
    wanted: dict[str, int],
    remembered: dict[int, str],
    held: dict[str, list[str]],
) -> list[GpuInstance]:
    """With MIG mode staying on: the surplus vGPUs (into ``plan.clear``), the GPU instances no remaining vGPU can
    run on (into ``plan.destroy``); returns the instances kept."""
    parent, gpu, state = plan.parent, plan.gpu, plan.state
    known = known_sriov_types(parent, remembered)
    remaining: dict[str, int] = {}
    for key in sorted(existing):
        name = known.get(int(key), "")
        backing = mig_backed(name) if name else None
        keep = sum(count for asked_name, count, _ in wanted_types if name and asked_name in display_names(name))
        vfs = existing[key]
        surplus = len(vfs) - keep
        free = [vf for vf in vfs if vf not in held]
        if surplus > len(free):
            busy = [f"{vf} ({'; '.join(held[vf])})" for vf in vfs if vf in held]
            plan.errors.append(
                f"{parent.name}: the config keeps {keep} vGPU(s) of type {key} ({name or 'unknown'}), "
                f"{len(vfs)} exist and VMs hold {', '.join(busy)}: not removing vGPUs in use"
            )
            continue
        plan.clear.extend(free[: max(surplus, 0)])
        if backing is not None:
            remaining[backing.profile] = remaining.get(backing.profile, 0) + min(len(vfs), keep)
    by_profile: dict[str, list[int]] = {}
    for instance in state.instances:
        profile = gpu.by_id(instance.profile_id)
        by_profile.setdefault(profile.name if profile else str(instance.profile_id), []).append(instance.gi_id)
    for name, ids in sorted(by_profile.items()):
        extra = len(ids) - wanted.get(name, 0)
        if extra > 0 and not remaining.get(name):
            plan.destroy.extend(sorted(ids, reverse=True)[:extra])
    kept = [instance for instance in state.instances if instance.gi_id not in plan.destroy]
    return kept


def mig_pending(plan: MigPlan) -> list[str]:
    name = plan.parent.name
    missing = []
    if plan.mode_change:
        missing.append(
            f"{name}: MIG mode is {'on' if plan.state.current else 'off'}, the config needs it "
            f"{'on' if plan.enable else 'off'}"
        )
    missing.extend(f"{name}: the vGPU on {vf} is not in the config's MIG layout" for vf in plan.clear)
    missing.extend(f"{name}: GPU instance {gi} is not in the config" for gi in plan.destroy)
    missing.extend(f"{name}: GPU instance {profile.name} at slice {start} missing" for profile, start in plan.create)
    return missing


def asked_for(parent: Parent, specs: tuple[VgpuSpec, ...]) -> tuple[tuple[str, int], ...] | None:
    """What the config asks of ``parent``: as NVIDIA's manager applies specs in order, each matching spec
    replacing the GPU's config, the last spec matching its index and device-filter wins; None when no spec
    matches (the parent is then left as it is)."""
    asked = None
    for spec in specs:
        if spec.matches(parent.index, parent.device_id):
            asked = spec.vgpu_devices
    return asked


# -- applying ----------------------------------------------------------------------------------------------


@dataclass
class ApplyReport:
    changes: list[dict[str, str]] = field(default_factory=list)
    vgpus: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    type_names: dict[str, dict[str, str]] = field(default_factory=dict)
    writes: int = 0
    mig_commands: list[str] = field(default_factory=list)
    """The changing nvidia-smi commands run (none when the MIG layout was already right)."""

    def as_dict(self) -> dict[str, object]:
        return {
            "changes": self.changes,
            "vgpus": self.vgpus,
            TYPE_NAMES: self.type_names,
            "writes": self.writes,
            "mig_commands": self.mig_commands,
        }


def _held(
    fs: Sysfs, kernel: Kernel | None, parent: Parent, claimed: Mapping[str, list[str]] | None = None
) -> dict[str, list[str]]:
    """Who holds each of ``parent``'s vGPUs: a VM (its group node), or what ``claimed`` says (a pod the kubelet
    allocated it to, a VM not started yet)."""
    held: dict[str, list[str]] = {}
    for vgpu, _ in parent.groups:
        if claimed and vgpu in claimed:
            held[vgpu] = list(claimed[vgpu])
    for vgpu, group in parent.groups:
        if group is None:
            continue
        holders = group_holders(fs, kernel, group)
        if holders is not None:
            held[vgpu] = [*holders, *held.get(vgpu, [])]
    return held


def _numvfs(fs: Sysfs, parent: Parent) -> Path:
    return fs.pci_devices / parent.name / "sriov_numvfs"


def _enable_vfs(fs: Sysfs, kernel: Kernel, parent: Parent, report: ApplyReport) -> None:
    kernel.write(_numvfs(fs, parent), str(parent.total_vfs))
    report.changes.append({"parent": parent.name, "action": "enable-vfs", "count": str(parent.total_vfs)})


def _targets(fs: Sysfs, plans: list[ParentPlan]) -> list[Path]:
    """The attributes a run of ``plans`` writes that are known before the first write (a VF to give a type
    is chosen at the time; its attribute is opened inside the root then, before that write)."""
    paths = [_numvfs(fs, plan.parent) for plan in plans if plan.enables_vfs or (plan.mig and plan.mig.mode_change)]
    for plan in plans:
        if plan.mig is not None:
            paths.extend(fs.pci_devices / vf / "nvidia" / "current_vgpu_type" for vf in plan.mig.clear)
    for plan in plans:
        for _, vgpu in plan.remove:
            if plan.parent.kind == "mdev":
                paths.append(fs.sys / "bus" / "mdev" / "devices" / vgpu / "remove")
            else:
                paths.append(fs.pci_devices / vgpu / "nvidia" / "current_vgpu_type")
        if plan.parent.kind == "mdev":
            paths.extend(_type_dir(fs, plan.parent, key) / "create" for key, _ in plan.create)
    return paths


def plan_all(
    fs: Sysfs,
    kernel: Kernel | None,
    specs: tuple[VgpuSpec, ...],
    parent_names: Iterable[str],
    remembered: dict[str, dict[int, str]],
    mig: MigTool | None = None,
    claimed: Mapping[str, list[str]] | None = None,
) -> list[ParentPlan]:
    """Every managed parent's plan (reading the node and who holds its vGPUs: without a ``kernel``, from /proc
    only, never opening a group node, as a read-only probe must). ``mig`` reads the MIG state of MIG-capable
    GPUs (queries only); a parent whose MIG step has changes gets only that step now, its vGPUs planned after.
    ``claimed``: vGPU ID → who else holds it (a pod's allocation), never removed like a VM's."""
    plans = []
    for parent in read_parents(fs, parent_names):
        asked = asked_for(parent, specs)
        if asked is None:
            continue
        memory = remembered.get(parent.name, {})
        held = _held(fs, kernel, parent, claimed)
        gpu = mig_gpu(parent)
        if gpu is None:
            refused = [
                f"{parent.name} ({_pci_id(parent)}) does not support MIG: cannot create the MIG-backed vGPU type "
                f"{name!r}"
                for name, _ in asked
                if mig_backed(name) is not None
                and resolve_type(parent, name, known_sriov_types(parent, memory)) is None
            ]
            if refused:
                plans.append(ParentPlan(parent, errors=refused, asked=asked))
                continue
        step = None
        if gpu is not None and mig is not None and wants_mig_state(parent, asked, memory):
            step = plan_mig(parent, gpu, mig.state(parent.name), asked, memory, held)
        if step is not None and (step.steps or step.errors):
            plans.append(ParentPlan(parent, errors=list(step.errors), mig=step, asked=asked))
            continue
        plan = plan_parent(parent, asked, memory, held)
        plan.mig, plan.asked = step, asked
        plans.append(plan)
    return plans


def pending(plans: list[ParentPlan]) -> list[str]:
    """What differs from the config (empty: the node holds exactly the configured vGPUs)."""
    missing = [error for plan in plans for error in plan.errors]
    for plan in plans:
        if plan.mig is not None and not plan.errors:
            missing.extend(mig_pending(plan.mig))
        missing.extend(f"{plan.parent.name}: {count} {plan.labels[key]} vGPU(s) missing" for key, count in plan.create)
        missing.extend(
            f"{plan.parent.name}: {count} {name} vGPU(s) missing (its VFs are off)" for name, count in plan.unchecked
        )
        missing.extend(f"{plan.parent.name}: {vgpu} ({key}) is not in the config" for key, vgpu in plan.remove)
    return missing


def apply(
    fs: Sysfs,
    kernel: Kernel,
    specs: tuple[VgpuSpec, ...],
    parent_names: Iterable[str] = (),
    remembered: dict[str, dict[int, str]] | None = None,
    new_uuid: Callable[[], str] = lambda: str(uuid.uuid4()),
    mig: MigTool | None = None,
    claimed: Mapping[str, list[str]] | None = None,
) -> ApplyReport:
    """Make the managed parents' vGPUs what ``specs`` asks (see the module doc); returns what changed.
    ``claimed``: as :func:`plan_all`'s."""
    names = list(parent_names)
    memory = remembered or {}
    report = ApplyReport()
    start = kernel.writes
    tool = mig if mig is not None else NvidiaSmi(kernel)
    plans = plan_all(fs, kernel, specs, names, memory, tool, claimed)
    errors = [error for plan in plans for error in plan.errors]
    if errors:
        raise AgentError("; ".join(errors))
    for path in _targets(fs, plans):
        fs.check_writable(path)  # a link out of the host root: refused here, nothing written
    enabled = [plan.parent for plan in plans if plan.enables_vfs]
    for parent in enabled:
        _enable_vfs(fs, kernel, parent, report)
    if enabled:
        try:
            plans = plan_all(fs, kernel, specs, names, memory, tool, claimed)  # with the VFs and the types they offer
            errors = [error for plan in plans for error in plan.errors]
        except AgentError as exc:  # the node could not be read again: as a refusal, the VFs go off again
            errors = [str(exc)]
        if errors:
            for parent in enabled:
                kernel.write(_numvfs(fs, parent), "0")
            turned = ", ".join(parent.name for parent in enabled)
            raise AgentError(
                "; ".join(errors) + f" (the VFs of {turned} were enabled to read the types they offer, and turned "
                "off again: the node is as it was)"
            )
    stepped = [plan for plan in plans if plan.mig is not None and plan.mig.steps]
    for plan in stepped:
        assert plan.mig is not None
        _mig_step(fs, kernel, tool, plan.mig, report)
    if stepped:
        plans = [plan for plan in plans if plan not in stepped] + _replan(fs, kernel, stepped, memory, claimed)
    for plan in plans:
        _remove(fs, kernel, plan, report)
    for plan in plans:
        _create(fs, kernel, plan, report, new_uuid)
    _finish(fs, names, memory, plans, report)
    report.writes = kernel.writes - start
    report.mig_commands = list(tool.commands)
    return report


def _finish(
    fs: Sysfs, names: list[str], memory: dict[str, dict[int, str]], plans: list[ParentPlan], report: ApplyReport
) -> None:
    """The report's vGPUs and SR-IOV type names as the node now has them."""
    planned = {plan.parent.name: plan.known for plan in plans}
    for parent in read_parents(fs, names):
        report.vgpus[parent.name] = parent.vgpus()
        if parent.kind == "sriov":
            known = {**planned.get(parent.name, {}), **known_sriov_types(parent, memory.get(parent.name, {}))}
            report.type_names.update(encode_type_names({parent.name: known}))


NO_VGPUS = (VgpuSpec(None, (), ()),)
"""A config asking every GPU for no vGPU (what a GPU leaving ``vm-vgpu`` gets)."""


def remove_all(
    fs: Sysfs,
    kernel: Kernel,
    parent_names: Iterable[str],
    remembered: dict[str, dict[int, str]] | None = None,
    claimed: Mapping[str, list[str]] | None = None,
) -> ApplyReport:
    """Remove every vGPU of the named parents, refusing (before any write) when a VM or ``claimed`` holds one;
    MIG mode and GPU instances are left as they are (no nvidia-smi runs)."""
    names = list(parent_names)
    memory = remembered or {}
    report = ApplyReport()
    start = kernel.writes
    plans = plan_all(fs, kernel, NO_VGPUS, names, memory, None, claimed)
    errors = [error for plan in plans for error in plan.errors]
    if errors:
        raise AgentError("; ".join(errors))
    for path in _targets(fs, plans):
        fs.check_writable(path)
    for plan in plans:
        _remove(fs, kernel, plan, report)
    _finish(fs, names, memory, plans, report)
    report.writes = kernel.writes - start
    return report


def _type_dir(fs: Sysfs, parent: Parent, key: str) -> Path:
    return fs.sys / "class" / "mdev_bus" / parent.name / "mdev_supported_types" / key


def _remove(fs: Sysfs, kernel: Kernel, plan: ParentPlan, report: ApplyReport) -> None:
    for key, vgpu in plan.remove:
        if plan.parent.kind == "mdev":
            kernel.write(fs.sys / "bus" / "mdev" / "devices" / vgpu / "remove", "1")
        else:
            kernel.write(fs.pci_devices / vgpu / "nvidia" / "current_vgpu_type", "0")
        report.changes.append({"parent": plan.parent.name, "action": "remove", "type": key, "id": vgpu})


def _create(fs: Sysfs, kernel: Kernel, plan: ParentPlan, report: ApplyReport, new_uuid: Callable[[], str]) -> None:
    parent = plan.parent
    for key, count in plan.create:
        label = plan.labels[key]
        if parent.kind == "mdev":
            type_dir = _type_dir(fs, parent, key)
            fs.inside(type_dir)
            available = _int(fs.read(type_dir / "available_instances"), type_dir / "available_instances")
            if count > available:
                raise AgentError(
                    f"{parent.name}: {label} ({key}) needs {count} more vGPU(s) and available_instances is {available}"
                )
            for _ in range(count):
                uid = new_uuid()
                kernel.write(type_dir / "create", uid)
                report.changes.append({"parent": parent.name, "action": "create", "type": key, "id": uid})
            continue
        for _ in range(count):
            now = _sriov_parent(fs, parent.name, parent.device_id or 0)
            free = [vf for vf in now.vfs if not vf.current]
            chosen = next((vf for vf in free if int(key) in dict(vf.creatable)), None)
            if chosen is None:
                offered = sorted({f"{n} ({name})" for vf in free for n, name in vf.creatable})
                raise AgentError(
                    f"{parent.name}: no free VF can take {label} (type {key}) now; "
                    f"they offer {', '.join(offered) or 'nothing'}"
                )
            kernel.write(fs.pci_devices / chosen.address / "nvidia" / "current_vgpu_type", key)
            report.changes.append({"parent": parent.name, "action": "create", "type": key, "id": chosen.address})


def _mig_step(fs: Sysfs, kernel: Kernel, tool: MigTool, plan: MigPlan, report: ApplyReport) -> None:
    """Carry out ``plan``'s MIG step: the vGPUs that go, the GPU instances that go, the mode (VFs off, mode,
    GPU reset when the change is pending, VFs on), the new GPU instances. A failure stops here with the
    error; whatever was done is what the next apply starts from (it plans from what is there)."""
    parent, name = plan.parent, plan.parent.name
    for vf in plan.clear:
        kernel.write(fs.pci_devices / vf / "nvidia" / "current_vgpu_type", "0")
        report.changes.append({"parent": name, "action": "remove", "id": vf})
    for gi_id in plan.destroy:
        tool.destroy(name, gi_id)
        report.changes.append({"parent": name, "action": "destroy-gpu-instance", "id": str(gi_id)})
    if plan.mode_change:
        numvfs = _int(fs.read(_numvfs(fs, parent)), _numvfs(fs, parent))
        if numvfs:
            kernel.write(_numvfs(fs, parent), "0")
            report.changes.append({"parent": name, "action": "disable-vfs", "count": str(numvfs)})
        wanted = "on" if plan.enable else "off"
        if plan.state.pending != plan.enable:
            tool.set_mode(name, plan.enable)
            report.changes.append({"parent": name, "action": "mig-mode", "mode": wanted})
        if tool.state(name).current != plan.enable:
            tool.reset(name)
            report.changes.append({"parent": name, "action": "gpu-reset"})
            if tool.state(name).current != plan.enable:
                raise AgentError(f"{name}: MIG mode is still not {wanted} after a GPU reset")
        kernel.write(_numvfs(fs, parent), str(parent.total_vfs))
        report.changes.append({"parent": name, "action": "enable-vfs", "count": str(parent.total_vfs)})
    if plan.create:
        tool.create(name, [(profile.profile_id, start) for profile, start in plan.create])
        layout = ",".join(f"{profile.name}@{start}" for profile, start in plan.create)
        report.changes.append({"parent": name, "action": "create-gpu-instances", "instances": layout})


def _replan(
    fs: Sysfs,
    kernel: Kernel,
    stepped: list[ParentPlan],
    memory: dict[str, dict[int, str]],
    claimed: Mapping[str, list[str]] | None = None,
) -> list[ParentPlan]:
    """The vGPU plans of the GPUs whose MIG step just ran, read afresh (their VFs now list the MIG-backed types
    their new GPU instances can take)."""
    plans = []
    for old in stepped:
        parent = replace(_sriov_parent(fs, old.parent.name, old.parent.device_id or 0), index=old.parent.index)
        plan = plan_parent(parent, old.asked, memory.get(parent.name, {}), _held(fs, kernel, parent, claimed))
        if plan.errors:
            raise AgentError(
                "; ".join(plan.errors) + f" (the MIG step of {parent.name} is done: its GPU instances are in place)"
            )
        plans.append(plan)
    return plans
