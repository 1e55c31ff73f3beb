"""Moving the node's GPUs between the GPU Operator's workloads: ``container``, ``vm-passthrough``, ``vm-vgpu``.

The node-local core of a workload change (docs/node-agent.md, "Workloads"); it has no Kubernetes API access:
whoever watches the node's labels calls :func:`plan_transition` and, when the plan is not refused,
:func:`apply_transition`. Each NVIDIA GPU (every NVIDIA VGA or 3D controller that is not an SR-IOV VF, the GPUs
``bind --all`` and NVIDIA's GPU numbering count) gets a wanted workload: the :class:`Desired` default, or a
:class:`GpuOverride` (by address, which wins, or by ``VENDOR:DEVICE``). What each workload means:

- ``vm-passthrough``: the GPU's IOMMU group on its VFIO driver (:mod:`node_agent.bind`'s rules) and no vGPU on
  it (an SR-IOV GPU's VFs are turned off first: unbinding the PF's driver would remove them anyway);
- ``vm-vgpu``: the GPU on its host driver (the one the kernel's ``drivers_probe`` gives back, as ``unbind``
  does) and the vGPUs of the selected config (:mod:`node_agent.vgpu`'s difference-only plan);
- ``container``: the GPU on its host driver with no vGPU (MIG mode and GPU instances are left as they are).

A GPU's workload now is ``vm-passthrough`` on a VFIO driver, ``vm-vgpu`` on another driver with vGPUs, else
``container``. Planning reads only (nvidia-smi queries for MIG-capable GPUs at most). The whole transition is
refused, naming each GPU and why, when a GPU whose workload would change is allocated to a pod (``allocated``:
what the kubelet's PodResources API reports: GPU or VF addresses, mdev UUIDs), when a VM holds its IOMMU group
or one of its vGPUs, when its host driver is in use, or when the vGPU config cannot be applied to a GPU on its
host driver. Applying re-plans first (the node may have changed) and writes in this order: vGPUs to remove,
SR-IOV VFs to turn off, unbinds, binds, vGPU creation; a failure stops there and names the step and what was
already done (the state file's ``workload`` section says the same). A node already as desired gets no write.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from node_agent import vgpu as vgpus
from node_agent.bind import (
    Report,
    bind,
    bind_checks,
    driver_chooser,
    group_holders,
    groups_of,
    load_aliases,
    unbind,
    unbind_steps,
    unwritable,
)
from node_agent.kernel import AgentError, Kernel
from node_agent.mig import NVIDIA_SMI, MigTool, NvidiaSmi
from node_agent.state import read_state, write_section
from node_agent.sysfs import PciFunction, Sysfs, read_function
from node_agent.vgpu_config import VgpuSpec
from runtime.node import VFIO_DRIVERS
from schemas import node_agent_state as state_schema
from schemas.errors import InputError
from schemas.pci import PciAddress

WORKLOADS = ("container", "vm-passthrough", "vm-vgpu")
"""The values of the GPU Operator's ``nvidia.com/gpu.workload.config`` label."""
CONTAINER, PASSTHROUGH, VGPU = WORKLOADS
MAX_ALLOCATED = 65536
"""The most allocated device IDs one plan takes (a node has a few hundred devices at most)."""
SECTION_WORKLOAD = "workload"
"""The state file's section for the latest workload change."""


@dataclass(frozen=True, slots=True)
class GpuOverride:
    """One GPU's (``address``) or every ``device`` (vendor, device) GPU's workload; ``source`` names the config
    entry it came from, for errors."""

    workload: str
    address: str | None = None
    device: tuple[int, int] | None = None
    source: str = "a GPU override"

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise AgentError(f"{self.source}: workload {self.workload!r} is none of {', '.join(WORKLOADS)}")
        if (self.address is None) == (self.device is None):
            raise AgentError(f"{self.source}: name the GPU by address or by device, one of them")
        if self.address is not None:  # one spelling (lower case, with its domain), as sysfs names it
            try:
                object.__setattr__(self, "address", str(PciAddress.parse(self.address.strip().lower())))
            except InputError as exc:
                raise AgentError(f"{self.source}: {exc}") from None

    def matches(self, function: PciFunction) -> bool:
        if self.address is not None:
            return function.address == self.address
        return (function.vendor, function.device) == self.device


@dataclass(frozen=True)
class Desired:
    """What the node should serve: ``default`` for every GPU no override names; ``vgpu_specs`` is the selected
    vGPU config, applied to the GPUs whose workload is ``vm-vgpu``."""

    default: str
    overrides: tuple[GpuOverride, ...] = ()
    vgpu_specs: tuple[VgpuSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.default not in WORKLOADS:
            raise AgentError(f"workload {self.default!r} is none of {', '.join(WORKLOADS)}")


@dataclass(frozen=True, slots=True)
class GpuWorkload:
    address: str
    device: str
    """``vendor:device`` in hex."""
    current: str
    wanted: str


@dataclass(frozen=True)
class Transition:
    """What :func:`apply_transition` would do, every check made; ``refusals`` non-empty: nothing may be done."""

    desired: Desired
    allocated: frozenset[str]
    gpus: tuple[GpuWorkload, ...]
    remove_vgpus: tuple[str, ...] = ()
    """GPUs leaving ``vm-vgpu`` whose vGPUs all go."""
    disable_vfs: tuple[str, ...] = ()
    """SR-IOV GPUs going to ``vm-passthrough`` whose VFs are turned off before the bind."""
    unbind: tuple[str, ...] = ()
    """GPUs whose IOMMU group leaves VFIO for the host drivers."""
    bind: tuple[str, ...] = ()
    """GPUs whose IOMMU group goes onto VFIO."""
    vgpu_parents: tuple[str, ...] = ()
    """GPUs whose vGPUs are made what the config says (the ``vm-vgpu`` ones)."""
    vgpu_changes: tuple[str, ...] = ()
    """What differs from the vGPU config on the ``vm-vgpu`` GPUs already on their host driver."""
    refusals: tuple[str, ...] = ()
    claimed: Mapping[str, list[str]] = field(default_factory=dict)
    """vGPU ID → why it may not be removed (a pod's allocation)."""
    options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def workloads(self) -> dict[str, str]:
        """GPU address → the workload it gets."""
        return {gpu.address: gpu.wanted for gpu in self.gpus}

    @property
    def current(self) -> dict[str, str]:
        """GPU address → the workload it has now."""
        return {gpu.address: gpu.current for gpu in self.gpus}

    @property
    def changes(self) -> bool:
        """Whether a device the plugin advertises would appear or vanish (a GPU changing driver, a vGPU made or
        removed): only then is the plugin paused."""
        return bool(self.remove_vgpus or self.disable_vfs or self.unbind or self.bind or self.vgpu_changes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "default": self.desired.default,
            "workloads": self.workloads,
            "current": self.current,
            "changes": self.changes,
            "remove_vgpus": list(self.remove_vgpus),
            "disable_vfs": list(self.disable_vfs),
            "unbind": list(self.unbind),
            "bind": list(self.bind),
            "vgpu_parents": list(self.vgpu_parents),
            "vgpu_changes": list(self.vgpu_changes),
            "refusals": list(self.refusals),
        }


@dataclass(frozen=True)
class Outcome:
    """How :func:`apply_transition` ended: ``success`` (the node is as desired), ``refused`` (nothing written),
    ``failed`` (stopped at a step; ``message`` names it and what was done). ``workloads``: each GPU's workload
    now; ``vgpus``: the vGPUs of the ``vm-vgpu`` GPUs now (GPU → type → IDs)."""

    state: Literal["success", "failed", "refused"]
    message: str
    workloads: dict[str, str]
    done: tuple[str, ...] = ()
    vgpus: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    default: str = ""
    """The node's workload (the desired default: what the ``nvidia.com/gpu.workload.config`` label says)."""
    writes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "message": self.message,
            "workload": self.default,
            "workloads": self.workloads,
            "done": list(self.done),
            "vgpus": self.vgpus,
            "writes": self.writes,
        }


# -- reading ----------------------------------------------------------------------------------------------


def nvidia_gpus(fs: Sysfs) -> dict[str, PciFunction]:
    """Every NVIDIA GPU of the node that is not an SR-IOV VF, by address (NVIDIA's numbering's GPUs)."""
    if not fs.is_dir(fs.pci_devices):
        raise AgentError(f"{fs.pci_devices} does not exist: is {fs.root} the node's / (--host-root)?")
    return {address: read_function(fs, address) for address in sorted(vgpus.gpu_indexes(fs))}


def wanted_workloads(desired: Desired, gpus: Mapping[str, PciFunction]) -> dict[str, str]:
    """Each GPU's workload: the default, else the last device override matching it, else the last address
    override naming it (an address wins over a selector). An address that is no GPU of the node is an error."""
    for override in desired.overrides:
        if override.address is not None and override.address not in gpus:
            raise AgentError(
                f"{override.source}: {override.address} is no NVIDIA GPU of this node "
                f"(its GPUs: {', '.join(gpus) or 'none'})"
            )
    wanted = {}
    for address, function in gpus.items():
        choice = desired.default
        for override in desired.overrides:
            if override.device is not None and override.matches(function):
                choice = override.workload
        for override in desired.overrides:
            if override.address is not None and override.matches(function):
                choice = override.workload
        wanted[address] = choice
    return wanted


def current_workload(function: PciFunction, parent: vgpus.Parent | None) -> str:
    if function.driver in VFIO_DRIVERS or (function.driver is None and function.driver_override in VFIO_DRIVERS):
        return PASSTHROUGH
    if parent is not None and parent.vgpus():
        return VGPU
    return CONTAINER


def current_workloads(fs: Sysfs) -> dict[str, str]:
    """Each GPU's workload now (see the module doc)."""
    parents = {parent.name: parent for parent in vgpus.read_parents(fs, required=False)}
    return {address: current_workload(function, parents.get(address)) for address, function in nvidia_gpus(fs).items()}


def _normal(item: str) -> str | None:
    """A PCI address or an mdev UUID in its canonical spelling; None for anything else."""
    text = item.strip()
    try:
        return str(PciAddress.parse(text.lower()))
    except InputError:
        pass
    try:
        return str(uuid.UUID(text))
    except ValueError:
        return None


def _allocated(
    fs: Sysfs, allocated: Iterable[str], gpus: Mapping[str, PciFunction], parents: Mapping[str, vgpus.Parent]
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(vGPU ID → why it is claimed, GPU address → the allocated IDs on it) for the allocated device IDs: a
    GPU's address, a function of its IOMMU group, a VF (its PF's), a vGPU (mdev UUID or VF address). IDs that
    are none of these (another plugin's) name nothing here."""
    items = sorted(set(allocated))
    if len(items) > MAX_ALLOCATED:
        raise AgentError(f"{len(items)} allocated device IDs, more than the {MAX_ALLOCATED} a plan takes")
    owner = {vgpu: parent.name for parent in parents.values() for ids in parent.vgpus().values() for vgpu in ids}
    claimed: dict[str, list[str]] = {}
    on_gpu: dict[str, list[str]] = {}
    for item in items:
        key = _normal(item)
        if key is None:
            continue
        reason = f"allocated to a pod ({key}, as the kubelet's PodResources reports)"
        if key in owner:
            claimed[key] = [reason]
            on_gpu.setdefault(owner[key], []).append(key)
            continue
        if key in gpus:
            on_gpu.setdefault(key, []).append(key)
            continue
        link = fs.pci_devices / key
        if ":" in key and fs.lexists(link):
            physfn = fs.link_name(link / "physfn")
            if physfn is not None and physfn in gpus:
                on_gpu.setdefault(physfn, []).append(key)
                continue
            group = read_function(fs, key).iommu_group
            for address, function in gpus.items():
                if group is not None and function.iommu_group == group:
                    on_gpu.setdefault(address, []).append(key)
        elif ":" not in key and fs.lexists(fs.sys / "bus" / "mdev" / "devices" / key):
            parent = fs.inside(fs.sys / "bus" / "mdev" / "devices" / key).parent.name
            if parent in gpus:
                claimed[key] = [reason]
                on_gpu.setdefault(parent, []).append(key)
    return claimed, on_gpu


# -- planning ---------------------------------------------------------------------------------------------


def plan_transition(
    fs: Sysfs,
    kernel: Kernel,
    desired: Desired,
    allocated: frozenset[str] = frozenset(),
    *,
    allowed_groups: Iterable[int] = (),
    choose: Callable[[PciFunction], str] | None = None,
    remembered: dict[str, dict[int, str]] | None = None,
    nvidia_smi: str = NVIDIA_SMI,
    mig: MigTool | None = None,
) -> Transition:
    """What moving the node to ``desired`` takes (see the module doc); writes nothing. ``allowed_groups``: as
    ``bind --allow-group``; ``choose``: each function's VFIO driver (default: from the node's modules.alias);
    ``remembered``: SR-IOV type names of earlier runs (the state file's); ``mig``: the MIG tool (default:
    ``nvidia_smi`` through the kernel). :class:`AgentError` when the node cannot be read or an override names
    no GPU of it."""
    options: dict[str, Any] = {
        "allowed_groups": tuple(allowed_groups),
        "choose": choose,
        "remembered": remembered,
        "nvidia_smi": nvidia_smi,
        "mig": mig,
    }
    gpus = nvidia_gpus(fs)
    wanted = wanted_workloads(desired, gpus)
    parents = {parent.name: parent for parent in vgpus.read_parents(fs, required=False)}
    chooser = choose if choose is not None else driver_chooser(fs, load_aliases(fs) or [])
    memory = remembered or {}
    claimed, on_gpu = _allocated(fs, allocated, gpus, parents)
    plan = [
        GpuWorkload(address, function.vendor_device, current_workload(function, parents.get(address)), wanted[address])
        for address, function in gpus.items()
    ]
    refusals: list[str] = []
    for gpu in plan:
        if gpu.current != gpu.wanted and gpu.address in on_gpu:
            refusals.append(
                f"{gpu.address} ({gpu.device}) is allocated to a pod ({', '.join(on_gpu[gpu.address])}, as the "
                f"kubelet's PodResources reports): not moving it from {gpu.current} to {gpu.wanted}"
            )
    refusals.extend(_mixed_groups(gpus, wanted))

    leaving_vfio = [gpu.address for gpu in plan if gpu.wanted != PASSTHROUGH and unbind_steps(fs, gpus[gpu.address])]
    refusals.extend(_unbind_refusals(fs, kernel, leaving_vfio))

    remove = [gpu.address for gpu in plan if gpu.current == VGPU and gpu.wanted != VGPU]
    if remove:
        removal = vgpus.plan_all(fs, kernel, vgpus.NO_VGPUS, remove, memory, None, claimed)
        refusals.extend(error for step in removal for error in step.errors)

    onto_vfio = [gpu.address for gpu in plan if gpu.wanted == PASSTHROUGH]
    disable = [
        address
        for address in onto_vfio
        if address in parents and parents[address].kind == "sriov" and parents[address].vfs
    ]
    binding: list[str] = []
    if onto_vfio:
        report = Report()
        allow = set(options["allowed_groups"])
        for group, members in groups_of(fs, onto_vfio, report).items():
            try:
                moving = bind_checks(fs, kernel, group, members, onto_vfio, chooser, allow, report, frozenset(disable))
            except AgentError as exc:
                report.refused.append(f"IOMMU group {group}: {exc}")
                continue
            if moving:
                binding.extend(member.address for member in members if member.address in gpus)
        refusals.extend(report.refused)

    vgpu_gpus = [gpu.address for gpu in plan if gpu.wanted == VGPU]
    on_host = [address for address in vgpu_gpus if address not in leaving_vfio]
    changes = [
        f"{address}: its vGPUs are planned once it is on its host driver"
        for address in leaving_vfio
        if address in vgpu_gpus
    ]
    for address in on_host:
        if address not in parents:
            refusals.append(
                f"{address} ({gpus[address].vendor_device}, on {gpus[address].driver or 'no driver'}) is no vGPU "
                f"parent (no {fs.sys / 'class' / 'mdev_bus' / address} and no SR-IOV VFs): is the NVIDIA vGPU "
                "manager driver loaded?"
            )
    ready = [address for address in on_host if address in parents]
    if ready:
        tool = mig if mig is not None else NvidiaSmi(kernel, nvidia_smi)
        steps = vgpus.plan_all(fs, kernel, desired.vgpu_specs, ready, memory, tool, claimed)
        errors = [error for step in steps for error in step.errors]
        refusals.extend(errors)
        changes.extend(missing for missing in vgpus.pending(steps) if missing not in errors)
    return Transition(
        desired=desired,
        allocated=frozenset(allocated),
        gpus=tuple(plan),
        remove_vgpus=tuple(remove),
        disable_vfs=tuple(disable),
        unbind=tuple(leaving_vfio),
        bind=tuple(sorted(set(binding))),
        vgpu_parents=tuple(vgpu_gpus),
        vgpu_changes=tuple(changes),
        refusals=tuple(refusals),
        claimed=claimed,
        options=options,
    )


def _mixed_groups(gpus: Mapping[str, PciFunction], wanted: Mapping[str, str]) -> list[str]:
    """An IOMMU group moves whole: GPUs of one group wanting VFIO and not wanting it cannot both be served."""
    by_group: dict[int, list[str]] = {}
    for address, function in gpus.items():
        if function.iommu_group is not None:
            by_group.setdefault(function.iommu_group, []).append(address)
    refusals = []
    for group, addresses in sorted(by_group.items()):
        sides = {wanted[address] == PASSTHROUGH for address in addresses}
        if len(sides) > 1:
            named = ", ".join(f"{address} ({wanted[address]})" for address in addresses)
            refusals.append(
                f"IOMMU group {group} holds GPUs {named}: a group is on VFIO whole or not at all; give them one "
                "workload"
            )
    return refusals


def _unbind_refusals(fs: Sysfs, kernel: Kernel, addresses: list[str]) -> list[str]:
    """Why the groups of ``addresses`` cannot leave VFIO now (a VM holds one, an attribute is not writable)."""
    if not addresses:
        return []
    report = Report()
    refusals = []
    for group, members in groups_of(fs, addresses, report).items():
        steps = [step for member in members for step in unbind_steps(fs, member)]
        if not steps:
            continue
        held = group_holders(fs, kernel, group)
        if held is not None:
            names = ", ".join(member.address for member in members if member.address in addresses)
            refusals.append(f"IOMMU group {group} of {names} is in use by a VM: {'; '.join(held)}; not unbinding it")
            continue
        refusal = unwritable(fs, group, steps)
        if refusal is not None:
            refusals.append(refusal)
    return report.refused + refusals


# -- applying ---------------------------------------------------------------------------------------------


def apply_transition(
    fs: Sysfs,
    kernel: Kernel,
    transition: Transition,
    *,
    state_dir: Path | None = None,
    new_uuid: Callable[[], str] = lambda: str(uuid.uuid4()),
) -> Outcome:
    """Carry out ``transition`` (see the module doc): refused → nothing written; otherwise the node is planned
    again and, unless that refuses, changed step by step. With ``state_dir`` the state file's ``workload``
    section (and, when vGPUs were applied, its ``vgpu`` section) records the outcome."""
    start = kernel.writes
    default = transition.desired.default
    if transition.refusals:
        outcome = Outcome("refused", _refused(transition), transition.current, default=default)
        return _record(state_dir, outcome, kernel.writes - start)
    try:
        fresh = plan_transition(fs, kernel, transition.desired, transition.allocated, **transition.options)
    except AgentError as exc:
        outcome = Outcome("failed", f"re-reading the node before the first write: {exc}; nothing written", {})
        return _record(state_dir, outcome, kernel.writes - start, default)
    if fresh.refusals:
        outcome = Outcome("refused", "the node changed since the plan: " + _refused(fresh), fresh.current)
        return _record(state_dir, outcome, kernel.writes - start, default)
    if not fresh.changes:
        outcome = Outcome("success", "the node is as desired: nothing to do", fresh.workloads, vgpus=_vgpus(fs, fresh))
        return _record(state_dir, outcome, kernel.writes - start, default)
    progress = _Progress()
    try:
        _run(fs, kernel, fresh, progress, state_dir, new_uuid)
    except AgentError as exc:
        try:
            now = current_workloads(fs)
        except AgentError:
            now = {}
        done = tuple(progress.done)
        message = f"{progress.step} failed: {exc}; already done: {'; '.join(done) or 'nothing'}"
        return _record(state_dir, Outcome("failed", message, now, done), kernel.writes - start, default)
    done = tuple(progress.done)
    outcome = Outcome("success", "; ".join(done) or "done", fresh.workloads, done, _vgpus(fs, fresh))
    return _record(state_dir, outcome, kernel.writes - start, default)


@dataclass
class _Progress:
    step: str = "planning"
    done: list[str] = field(default_factory=list)


def _run(
    fs: Sysfs,
    kernel: Kernel,
    plan: Transition,
    progress: _Progress,
    state_dir: Path | None,
    new_uuid: Callable[[], str],
) -> None:
    """The steps of ``plan`` in order, each named in ``progress`` before it starts and recorded once done."""
    options = plan.options
    memory = options["remembered"] or {}
    done = progress.done
    if plan.remove_vgpus:
        progress.step = f"removing the vGPUs of {', '.join(plan.remove_vgpus)}"
        removed = vgpus.remove_all(fs, kernel, plan.remove_vgpus, memory, plan.claimed)
        done.append(f"removed {len(removed.changes)} vGPU(s) of {', '.join(plan.remove_vgpus)}")
    for address in plan.disable_vfs:
        progress.step = f"turning off the SR-IOV VFs of {address}"
        kernel.write(fs.pci_devices / address / "sriov_numvfs", "0")
        done.append(f"turned off the SR-IOV VFs of {address}")
    if plan.unbind:
        progress.step = f"unbinding {', '.join(plan.unbind)} from VFIO"
        report = unbind(fs, kernel, list(plan.unbind))
        if report.changed:
            done.append(f"unbound {', '.join(report.changed)} from VFIO")
        if report.refused:
            raise AgentError("; ".join(report.refused))
    if plan.bind:
        progress.step = f"binding {', '.join(plan.bind)} to VFIO"
        choose = options["choose"] or driver_chooser(fs, load_aliases(fs) or [])
        report = bind(fs, kernel, list(plan.bind), choose, options["allowed_groups"])
        if report.changed:
            done.append(f"bound {', '.join(report.changed)} to VFIO")
        if report.refused:
            raise AgentError("; ".join(report.refused))
    if plan.vgpu_parents:
        progress.step = f"applying the vGPU config to {', '.join(plan.vgpu_parents)}"
        tool = options["mig"] if options["mig"] is not None else NvidiaSmi(kernel, options["nvidia_smi"])
        applied = vgpus.apply(
            fs, kernel, plan.desired.vgpu_specs, plan.vgpu_parents, memory, new_uuid, tool, plan.claimed
        )
        if applied.changes:
            done.append(f"made {len(applied.changes)} vGPU change(s) on {', '.join(plan.vgpu_parents)}")
        _record_vgpus(state_dir, applied)


def _refused(transition: Transition) -> str:
    return "refused, nothing written: " + "; ".join(transition.refusals)


def _vgpus(fs: Sysfs, transition: Transition) -> dict[str, dict[str, list[str]]]:
    """The vGPUs of the ``vm-vgpu`` GPUs now."""
    wanted = set(transition.vgpu_parents)
    return {parent.name: parent.vgpus() for parent in vgpus.read_parents(fs, required=False) if parent.name in wanted}


def _record(state_dir: Path | None, outcome: Outcome, writes: int, default: str | None = None) -> Outcome:
    final = Outcome(
        outcome.state,
        outcome.message,
        outcome.workloads,
        outcome.done,
        outcome.vgpus,
        default if default is not None else outcome.default,
        writes,
    )
    if state_dir is not None:
        write_section(state_dir, SECTION_WORKLOAD, final.as_dict())
    return final


def _record_vgpus(state_dir: Path | None, report: vgpus.ApplyReport) -> None:
    """The state file's ``vgpu`` section after vGPUs were applied (its type names are what the plugin reads)."""
    if state_dir is None:
        return
    earlier = state_schema.section(read_state(state_dir), state_schema.SECTION_VGPU)
    kept = earlier.get(state_schema.TYPE_NAMES)
    names = {**(kept if isinstance(kept, dict) else {}), **report.type_names}
    section = {**earlier, "status": "success", **report.as_dict(), state_schema.TYPE_NAMES: names}
    section.pop("error", None)
    write_section(state_dir, state_schema.SECTION_VGPU, section)
