"""``bind`` / ``unbind``: each selected GPU and every other function of its IOMMU group onto (off) VFIO.

The plan for one function is pure (:func:`bind_steps`, :func:`unbind_steps`: which attribute gets which
value); :func:`bind` and :func:`unbind` read the node, refuse what must not be touched, and hand the writes
to the :class:`~node_agent.kernel.Kernel`. Rules (docs/node-agent.md):

- a whole IOMMU group moves: VFIO can only use a group whose every function is on a VFIO driver (or none);
  PCI-to-PCI bridges in the group stay on their driver, as VFIO allows, whoever made them;
- only the GPU's own functions move: the selected functions, other NVIDIA functions and the functions of a
  selected GPU's slot (its audio, USB, UCSI: the card's companions), none of them a storage, network or
  other bridge function. A group holding anything else (a NIC, an NVMe drive, another vendor's device, a
  host or ISA bridge) is refused naming every such function and its driver, unless the operator allowed
  that group by number (``--allow-group N``; docs/node-agent.md states the risk);
- a function already on its VFIO driver gets no write (a re-run writes nothing);
- nothing is unbound from a group a VM holds (its ``/dev/vfio/<N>`` answers ``EBUSY``) or from a host
  driver the host uses (:mod:`node_agent.usage`: device nodes a process has open, a mounted or swapped-on or
  held block device, a network interface that is up or has an address, a network function whose interface
  is not in the host's /sys: moved into a pod's network namespace, SR-IOV VFs enabled), allowed group or
  not; the error names the function and the use;
- every attribute a group's writes go to is opened inside the host root first (:meth:`Sysfs.check_writable`):
  a link leading out of it refuses the group before its first write;
- a group is the unit: a refused group is left as it was, the other groups are still done, and the
  command fails naming every refusal; a group whose check cannot read the node (a FIFO or a link out of the
  root where an attribute should be) is such a refusal, naming the file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.drivers import MAX_MODULES_ALIAS, VfioAlias, choose_module, driver_of_module, parse_vfio_aliases
from node_agent.kernel import AgentError, Kernel
from node_agent.sysfs import NVIDIA_VENDOR, PciFunction, Sysfs, all_addresses, holders, read_function
from node_agent.usage import HostUse, walk
from runtime.node import VFIO_DRIVERS
from schemas.companions import same_slot
from schemas.pci import PciAddress

NETWORK_CLASS = 0x02
FOREIGN_CLASSES = {0x01: "storage", NETWORK_CLASS: "network", 0x06: "bridge"}
"""PCI base classes never moved as part of a GPU's group (a PCI-to-PCI bridge stays on its driver instead)."""
_CLASS_NAMES = {**FOREIGN_CLASSES, 0x03: "display", 0x04: "multimedia", 0x0C: "serial bus"}

_SELECTOR = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{4}")


@dataclass(frozen=True, slots=True)
class Step:
    """One write: ``value`` to the attribute ``path``."""

    path: Path
    value: str


@dataclass
class Report:
    """What a bind/unbind did: functions changed, functions already right, refusals (each names its culprit)."""

    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    drivers: dict[str, str] = field(default_factory=dict)
    writes: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "changed": self.changed,
            "unchanged": self.unchanged,
            "refused": self.refused,
            "drivers": self.drivers,
            "writes": self.writes,
        }


def parse_selector(text: str) -> tuple[int, int]:
    """``VVVV:DDDD`` (hex) → (vendor, device)."""
    if _SELECTOR.fullmatch(text) is None:
        raise AgentError(f"selector {text!r}: expected VENDOR:DEVICE in hex, e.g. 10de:2236")
    vendor, device = text.split(":")
    return int(vendor, 16), int(device, 16)


def select(fs: Sysfs, addresses: Iterable[str], selectors: Iterable[str], nvidia_gpus: bool) -> list[str]:
    """The selected functions: the given addresses, every function matching a ``VVVV:DDDD`` selector, and
    with ``nvidia_gpus`` every NVIDIA display-class function (VGA or 3D controller)."""
    chosen: set[str] = set()
    for address in addresses:
        chosen.add(str(PciAddress.parse(address)))
    wanted = {parse_selector(text) for text in selectors}
    if wanted or nvidia_gpus:
        for address in all_addresses(fs):
            function = read_function(fs, address)
            if (function.vendor, function.device) in wanted or (
                nvidia_gpus and function.vendor == NVIDIA_VENDOR and function.is_gpu
            ):
                chosen.add(address)
    return sorted(chosen)


def bind_steps(fs: Sysfs, function: PciFunction, driver: str) -> list[Step]:
    """The writes that move ``function`` onto ``driver``: none when it is there already."""
    if function.driver == driver:
        return []
    steps = []
    if function.driver_override != driver:
        steps.append(Step(fs.pci_devices / function.address / "driver_override", driver))
    if function.driver is not None:
        steps.append(Step(fs.pci_drivers / function.driver / "unbind", function.address))
    steps.append(Step(fs.pci_drivers / driver / "bind", function.address))
    return steps


def unbind_steps(fs: Sysfs, function: PciFunction) -> list[Step]:
    """The writes that hand ``function`` back to the kernel's choice: none when it is not on (or pinned to)
    a VFIO driver. The override is cleared first, so the reprobe picks the device's own driver."""
    on_vfio = function.driver in VFIO_DRIVERS
    if not on_vfio and function.driver_override not in VFIO_DRIVERS:
        return []
    steps = []
    if function.driver_override is not None:
        steps.append(Step(fs.pci_devices / function.address / "driver_override", "\n"))
    if on_vfio:
        steps.append(Step(fs.pci_drivers / str(function.driver) / "unbind", function.address))
    if on_vfio or function.driver is None:
        steps.append(Step(fs.sys / "bus" / "pci" / "drivers_probe", function.address))
    return steps


def groups_of(fs: Sysfs, selected: list[str], report: Report) -> dict[int, list[PciFunction]]:
    """Selected functions grouped by IOMMU group, with every other (non-PCI-bridge) function of each group. A
    function or group that cannot be read is a refusal naming it (the other groups are still done)."""
    groups: dict[int, list[PciFunction]] = {}
    for address in selected:
        try:
            function = read_function(fs, address)
        except AgentError as exc:
            report.refused.append(f"{address}: {exc}; nothing written to its group")
            continue
        if function.iommu_group is None:
            report.refused.append(
                f"{address} ({function.vendor_device}) has no IOMMU group: the IOMMU is off (intel_iommu=on / "
                "amd_iommu=on on the kernel command line) or the device is not behind one; VFIO cannot use it"
            )
            continue
        if function.iommu_group in groups:
            continue
        try:
            listed = fs.group_members(function.iommu_group)
        except AgentError as exc:
            report.refused.append(f"IOMMU group {function.iommu_group}: {exc}; nothing written to the group")
            continue
        if address not in listed:  # the node's sysfs disagrees with itself: moving "its group" moves others
            report.refused.append(
                f"IOMMU group {function.iommu_group} does not list {address} in "
                f"{fs.sys / 'kernel' / 'iommu_groups' / str(function.iommu_group) / 'devices'}, though its "
                f"iommu_group link names the group; nothing written to the group"
            )
            continue
        try:
            members = [read_function(fs, member) for member in listed]
        except AgentError as exc:
            report.refused.append(f"IOMMU group {function.iommu_group}: {exc}; nothing written to the group")
            continue
        groups[function.iommu_group] = [member for member in members if not member.is_bridge]
    return groups


def class_name(function: PciFunction) -> str:
    base = function.pci_class >> 16
    return f"{_CLASS_NAMES.get(base, 'class')} 0x{function.pci_class:06x}"


def foreign(members: list[PciFunction], selected: Iterable[str]) -> list[PciFunction]:
    """The members of a group that are not the selected GPUs' own functions (see the module's rules)."""
    chosen = set(selected)
    gpus = [PciAddress.parse(member.address) for member in members if member.address in chosen]
    found = []
    for member in members:
        if member.address in chosen:
            continue
        own = member.pci_class >> 16 not in FOREIGN_CLASSES and (
            member.vendor == NVIDIA_VENDOR or any(same_slot(gpu, PciAddress.parse(member.address)) for gpu in gpus)
        )
        if not own:
            found.append(member)
    return found


def foreign_refusal(group: int, others: list[PciFunction]) -> str:
    names = "; ".join(f"{m.address} ({m.vendor_device}, {class_name(m)}, on {m.driver or 'no driver'})" for m in others)
    return (
        f"IOMMU group {group} also holds functions that are not the GPU's own: {names}; not binding the group "
        f"(those devices would leave the host with it: move the GPU to a slot of its own, or, knowing they go "
        f"to VMs too, allow it with --allow-group {group})"
    )


def _nvidia_nodes(fs: Sysfs, function: PciFunction) -> list[str]:
    """``/dev/nvidia<minor>`` of a GPU on the ``nvidia`` driver (its minor from /proc/driver/nvidia)."""
    info = fs.proc / "driver" / "nvidia" / "gpus" / function.address / "information"
    try:
        text = fs.read(info) or ""
    except AgentError:
        return []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Device Minor" and value.strip().isdigit():
            return [f"/dev/nvidia{value.strip()}"]
    return []


def group_holders(fs: Sysfs, kernel: Kernel | None, group: int) -> list[str] | None:
    """Who holds the VFIO group ``group``: None when nobody; otherwise the holders found in /proc, or
    ``["a process in another PID namespace"]``-style wording when only the group's EBUSY tells. Without a
    ``kernel`` (a read-only probe) only /proc is asked: the group node is never opened."""
    node = fs.group_node(group)
    if not fs.lexists(node):
        return None
    found = holders(fs, {f"/dev/vfio/{group}"})
    if found:
        return found
    if kernel is not None and kernel.group_busy(node):
        return [f"an unknown process ({node} answers EBUSY; not found in {fs.proc})"]
    return None


def _refusal(
    fs: Sysfs,
    kernel: Kernel,
    group: int,
    members: list[PciFunction],
    leaving: list[PciFunction],
    vfs_going: frozenset[str] = frozenset(),
) -> str | None:
    """Why the functions in ``leaving`` (about to be unbound from their driver) must stay; None when they may go.
    ``vfs_going``: PFs whose SR-IOV VFs the caller turns off before the unbind (their VFs are no reason)."""
    if any(member.driver in VFIO_DRIVERS for member in members):
        held = group_holders(fs, kernel, group)
        if held is not None:
            names = ", ".join(f"{m.address} ({m.vendor_device}, on {m.driver})" for m in leaving)
            return f"IOMMU group {group} is in use by a VM: {'; '.join(held)}; not unbinding {names}"
    owners: dict[str, PciFunction] = {}
    uses: dict[str, list[str]] = {}
    host = HostUse(fs)
    for member in leaving:
        if member.driver in VFIO_DRIVERS:
            continue
        usage = walk(fs, fs.inside(fs.pci_devices / member.address))
        nodes = [
            *member.device_nodes,
            *usage.nodes,
            *(_nvidia_nodes(fs, member) if member.driver == "nvidia" else []),
        ]
        owners.update(dict.fromkeys(nodes, member))
        reasons = host.reasons(usage)
        numvfs = fs.read(fs.pci_devices / member.address / "sriov_numvfs")
        # Unbinding a PF's driver disables SR-IOV: every VF goes, whoever has it.
        if numvfs and numvfs != "0" and member.address not in vfs_going:
            reasons.append(f"{numvfs} SR-IOV VFs are enabled (its virtfn* links); unbinding its driver removes them")
        if member.pci_class >> 16 == NETWORK_CLASS and not usage.interfaces:
            reasons.append(
                f"no network interface of it is in {fs.sys} (which shows the host's network namespace): it may have "
                f"been moved into a pod's; if it is idle, unbind it from {member.driver} first"
            )
        if reasons:
            uses.setdefault(member.address, []).extend(reasons)
    for line in holders(fs, set(owners)) if owners else []:  # one /proc scan for the whole group
        node = line.rpartition(" holds ")[2]
        # A line that names no node is the scan cut short: it cannot tell, so every owner counts as held.
        addresses = [owners[node].address] if node in owners else sorted({m.address for m in owners.values()})
        for address in addresses:
            uses.setdefault(address, []).append(line)
    if not uses:
        return None
    by_address = {member.address: member for member in leaving}
    named = [
        f"{address} ({by_address[address].vendor_device}) is in use through its host driver "
        f"{by_address[address].driver}: {'; '.join(reasons)}"
        for address, reasons in uses.items()
    ]
    return f"{'; '.join(named)}; not unbinding it (IOMMU group {group} left as it is)"


def _apply(kernel: Kernel, steps: list[Step]) -> None:
    for step in steps:
        kernel.write(step.path, step.value)


def unwritable(fs: Sysfs, group: int, steps: Iterable[Step]) -> str | None:
    """Why one of ``steps`` could not be written inside the host root (checked before the group's first write)."""
    for step in steps:
        try:
            fs.check_writable(step.path)
        except AgentError as exc:
            return f"IOMMU group {group}: {exc}; nothing written to the group"
    return None


def load_aliases(fs: Sysfs, release: str | None = None) -> list[VfioAlias] | None:
    """The ``vfio_pci:`` aliases of the running kernel's modules.alias under the host root, read through the
    host root's resolver; None when the file is absent (every device then takes vfio-pci)."""
    path = fs.root / "lib" / "modules" / (release or os.uname().release) / "modules.alias"
    text = fs.read(path, MAX_MODULES_ALIAS)
    return None if text is None else parse_vfio_aliases(text)


def driver_chooser(fs: Sysfs, aliases: list[VfioAlias]) -> Callable[[PciFunction], str]:
    def choose(function: PciFunction) -> str:
        return driver_of_module(choose_module(function.modalias, aliases))

    return choose


def ensure_driver(fs: Sysfs, kernel: Kernel, driver: str) -> None:
    """Load ``driver``'s module when ``/sys/bus/pci/drivers/<driver>`` is missing; fail naming it otherwise."""
    if fs.is_dir(fs.pci_drivers / driver):
        return
    module = driver.replace("-", "_")
    kernel.load_module(module, fs.root)
    if not fs.is_dir(fs.pci_drivers / driver):
        raise AgentError(f"loaded {module}, yet {fs.pci_drivers / driver} does not exist")


def bind_checks(
    fs: Sysfs,
    kernel: Kernel,
    group: int,
    members: list[PciFunction],
    selected: list[str],
    choose: Callable[[PciFunction], str],
    allow: set[int],
    report: Report,
    vfs_going: frozenset[str] = frozenset(),
) -> list[PciFunction] | None:
    """Every check binding ``group`` needs, writing and loading nothing: the functions that move (None: nothing
    to move, or refused into ``report``); :class:`AgentError` when the node cannot be read or checked."""
    others = foreign(members, selected)
    if others and group not in allow:
        report.refused.append(foreign_refusal(group, others))
        return None
    targets = {member.address: choose(member) for member in members}
    report.drivers.update(targets)
    moving = [member for member in members if member.driver != targets[member.address]]
    if not moving:
        report.unchanged.extend(member.address for member in members)
        return None
    leaving = [member for member in moving if member.driver is not None]
    refusal = _refusal(fs, kernel, group, members, leaving, vfs_going) if leaving else None
    if refusal is not None:
        report.refused.append(refusal)
        return None
    return moving


def _bind_plan(
    fs: Sysfs,
    kernel: Kernel,
    group: int,
    members: list[PciFunction],
    selected: list[str],
    choose: Callable[[PciFunction], str],
    allow: set[int],
    report: Report,
) -> list[tuple[PciFunction, list[Step]]] | None:
    """The writes that bind ``group``, every check made (None: nothing to write, or refused into ``report``);
    :class:`AgentError` when the node cannot be read or checked. Nothing is written here (a missing VFIO
    driver's module is loaded)."""
    moving = bind_checks(fs, kernel, group, members, selected, choose, allow, report)
    if moving is None:
        return None
    targets = report.drivers
    for driver in sorted({targets[member.address] for member in moving}):
        ensure_driver(fs, kernel, driver)
    plans = [(member, bind_steps(fs, member, targets[member.address])) for member in members]
    refusal = unwritable(fs, group, (step for _, steps in plans for step in steps))
    if refusal is not None:
        report.refused.append(refusal)
        return None
    return plans


def bind(
    fs: Sysfs,
    kernel: Kernel,
    selected: list[str],
    choose: Callable[[PciFunction], str],
    allowed: Iterable[int] = (),
) -> Report:
    """Bind every selected function's whole IOMMU group to its VFIO driver (see the module's rules);
    ``allowed``: the groups the operator lets move with functions that are not the GPU's own."""
    report = Report()
    start = kernel.writes
    allow = set(allowed)
    for group, members in groups_of(fs, selected, report).items():
        try:
            plans = _bind_plan(fs, kernel, group, members, selected, choose, allow, report)
        except AgentError as exc:  # the node could not be read or checked: this group is refused, whole
            report.refused.append(f"IOMMU group {group}: {exc}; nothing written to the group")
            continue
        if plans is None:
            continue
        for member, steps in plans:
            if not steps:
                report.unchanged.append(member.address)
                continue
            _apply(kernel, steps)
            now = read_function(fs, member.address)
            target = report.drivers[member.address]
            if now.driver != target:
                raise AgentError(
                    f"{member.address} ({member.vendor_device}) is on {now.driver or 'no driver'} after binding it "
                    f"to {target} (IOMMU group {group})"
                )
            report.changed.append(member.address)
    report.writes = kernel.writes - start
    return report


def unbind(fs: Sysfs, kernel: Kernel, selected: list[str]) -> Report:
    """Clear ``driver_override`` and let the kernel reprobe every function of each selected group that is on
    (or pinned to) a VFIO driver; a group a VM holds is refused."""
    report = Report()
    start = kernel.writes
    for group, members in groups_of(fs, selected, report).items():
        plans = [(member, unbind_steps(fs, member)) for member in members]
        moving = [member for member, steps in plans if steps]
        if not moving:
            report.unchanged.extend(member.address for member in members)
            continue
        held = group_holders(fs, kernel, group)
        if held is not None:
            names = ", ".join(f"{m.address} ({m.vendor_device}, on {m.driver or 'no driver'})" for m in moving)
            report.refused.append(f"IOMMU group {group} is in use by a VM: {'; '.join(held)}; not unbinding {names}")
            continue
        refusal = unwritable(fs, group, (step for _, steps in plans for step in steps))
        if refusal is not None:
            report.refused.append(refusal)
            continue
        for member, steps in plans:
            if not steps:
                report.unchanged.append(member.address)
                continue
            _apply(kernel, steps)
            now = read_function(fs, member.address)
            report.changed.append(member.address)
            report.drivers[member.address] = now.driver or ""
    report.writes = kernel.writes - start
    return report


def missing_bindings(
    fs: Sysfs, selected: list[str], choose: Callable[[PciFunction], str], allowed: Iterable[int] = ()
) -> list[str]:
    """What keeps the selected GPUs from VMs: a group holding functions that are not the GPU's own (unless
    ``allowed``), each function of their groups not on its VFIO driver, and a group node that does not
    exist; empty when the node is ready for ``vm-passthrough``. Reads only."""
    if not selected:
        return ["no GPU selected: nothing matches the selection on this node"]
    report = Report()
    missing: list[str] = []
    allow = set(allowed)
    for group, members in groups_of(fs, selected, report).items():
        others = foreign(members, selected)
        if others and group not in allow:
            missing.append(foreign_refusal(group, others))
            continue
        for member in members:
            driver = choose(member)
            if member.driver != driver:
                missing.append(
                    f"{member.address} ({member.vendor_device}, IOMMU group {group}) is on "
                    f"{member.driver or 'no driver'}, not {driver}"
                )
        if not fs.lexists(fs.group_node(group)):
            missing.append(f"{fs.group_node(group)} does not exist")
    return report.refused + missing
