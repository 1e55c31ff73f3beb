"""What one scan of a node knows, shared by the per-kind device sources (:mod:`plugin.sources`).

Each kind's source walks its own part of sysfs; what they all need lives here: bounded reads through
:class:`~plugin.hostroot.HostRoot` (a refusal becomes a warning naming the file), PCI functions and IOMMU
group members read once per scan, topology and NUMA, resource naming (pci.ids, overrides), the health rule
(:class:`~plugin.health.UsabilityRule`) and the resources collected so far. Reading is linear in the number of
functions: non-selected vendors cost one ``vendor`` read each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from plugin.config import PluginConfig
from plugin.health import PciFunction, UsabilityRule
from plugin.hostroot import Directory, HostRoot, ReadError
from plugin.inventory import Companion, Device, Ignored, Inventory, NvSwitch, Resource
from plugin.naming import pci_resource_name
from runtime.pciids import PciIds
from schemas.errors import InputError
from schemas.fabric import MAX_SWITCHES
from schemas.naming import ResourceKind, env_var_for, validate_resource_name
from schemas.pci import PciAddress

MAX_NUMA_NODE = 1023
"""The kernel has at most ``1 << CONFIG_NODES_SHIFT`` (≤ 1024) NUMA nodes; a larger ``numa_node`` is nonsense."""

PciIdentity = tuple[int, int, int]
"""A PCI function's (vendor, device, class), as its ``vendor``, ``device`` and ``class`` files give them."""

_UEVENT_IDENTITY = re.compile(r"^PCI_CLASS=([0-9A-F]{4,6})\nPCI_ID=([0-9A-F]{4}):([0-9A-F]{4})$", re.MULTILINE)
"""The two lines of a PCI function's ``uevent`` that name it, as the kernel's ``pci_uevent`` writes them."""


def parse_pci_uevent(text: str) -> PciIdentity | None:
    """(vendor, device, class) from a PCI function's ``uevent`` text, or None.

    The kernel (docs/node.md, "PCI functions in sysfs") writes ``PCI_CLASS=`` (the 24-bit class, upper-case
    hex, at least four digits) and on the next line ``PCI_ID=VVVV:DDDD`` (upper-case hex, four digits each).
    Only exactly that is taken, once: a missing, repeated, reordered or malformed line (a hand-written tree, a
    kernel that says less) is None, and the caller reads the ``vendor``, ``device`` and ``class`` files instead.
    """
    match = _UEVENT_IDENTITY.search(text)
    if match is None or text.count("PCI_ID=") != 1 or text.count("PCI_CLASS=") != 1:
        return None
    return int(match[2], 16), int(match[3], 16), int(match[1], 16)


@dataclass
class NodeScan:
    """State of one scan, shared by the per-kind sources; discarded when :func:`plugin.sysfs.scan` returns."""

    root: str
    config: PluginConfig
    pci_ids: PciIds | None
    warnings: list[str]
    rule: UsabilityRule = field(init=False)
    pci_dir: str = ""
    groups_dir: str = ""
    devices_dir: str = ""
    vfio_container: bool = True
    ignored: list[Ignored] = field(default_factory=list)
    devices: dict[tuple[str, ResourceKind], list[Device]] = field(default_factory=dict)
    selectors: dict[tuple[str, ResourceKind], set[str]] = field(default_factory=dict)
    names: dict[str, str | None] = field(default_factory=dict)
    group_members: dict[int, tuple[PciFunction, ...]] = field(default_factory=dict)
    functions: dict[str, PciFunction] = field(default_factory=dict)
    """Functions already read, by name: a GPU's group members were mostly read by the bus scan."""
    variables: dict[str, str] = field(default_factory=dict)
    """Allocation variable → the resource that has it (KubeVirt's variable for a name: :func:`env_var_for`)."""
    claims: dict[str, int] = field(default_factory=dict)
    """Devices a later source said are its own (``claim``): ID → how many ``ignored`` entries came before."""
    switches: list[tuple[PciFunction, int | None, int | None]] = field(default_factory=list)
    """The NVSwitch functions found, each with its IOMMU group and NUMA node (:meth:`found_switch`)."""

    fs: HostRoot = field(init=False)

    def __post_init__(self) -> None:
        self.fs = HostRoot(self.root)
        self.rule = UsabilityRule.from_config(self.config)
        self.pci_dir = "/sys/bus/pci/devices"
        self.groups_dir = "/sys/kernel/iommu_groups"
        self.devices_dir = "/sys/devices"
        self.vfio_container = self.fs.exists("/dev/vfio/vfio")

    # -- reading (in-root paths, through self.fs) ----------------------------------------------------------

    def shown(self, path: str) -> str:
        """A path for messages: as on the host (under the host root)."""
        return self.fs.host_path(path)

    def read_text(self, path: str) -> str | None:
        """A file's text, or None if absent or unusable (then a warning says why)."""
        try:
            return self.fs.read(path)
        except ReadError as exc:
            self.warnings.append(f"ignoring {self.root.rstrip('/')}{exc}")
            return None

    def read_int(self, path: str, base: int) -> int | None:
        """A file's integer (None if absent, unreadable or not a number; an unusable file is warned)."""
        try:
            text = self.fs.read(path)
        except ReadError as exc:
            self.warnings.append(f"ignoring {self.root.rstrip('/')}{exc}")
            return None
        return _as_int(text, base)

    def read_int_in(self, directory: Directory, name: str, base: int) -> int | None:
        """``read_int`` of ``<directory>/<name>`` through a directory handle (one path resolution for many)."""
        try:
            text = directory.read(name)
        except ReadError as exc:
            self.warnings.append(f"ignoring {self.root.rstrip('/')}{exc}")
            return None
        return _as_int(text, base)

    def identity_in(self, handle: Directory) -> PciIdentity | None:
        """(vendor, device, class) of the PCI function whose directory handle this is, from its ``uevent`` in one
        read; None when that file is missing, unusable (warned) or says nothing usable: then read the files."""
        try:
            text = handle.read("uevent")
        except ReadError as exc:
            self.warnings.append(f"ignoring {self.root.rstrip('/')}{exc}")
            return None
        return None if text is None else parse_pci_uevent(text)

    def read_group(self, link: str) -> int | None:
        return _as_group(self.fs.readlink_name(link))

    def read_group_in(self, directory: Directory) -> int | None:
        """The IOMMU group of the device whose directory handle this is (its ``iommu_group`` link)."""
        return _as_group(directory.readlink_name("iommu_group"))

    def link_target(self, path: str) -> str | None:
        """Where a symlink leads, resolved inside the host root (in-root path), or None."""
        return self.fs.resolve(path)

    def read_function(self, directory: str, name: str, vendor: int | None = None) -> PciFunction | None:
        cached = self.functions.get(name)
        if cached is not None:
            return cached
        with self.fs.directory(directory) as handle:
            return self.read_function_in(handle, name, vendor)

    def read_function_in(self, handle: Directory, name: str, vendor: int | None = None) -> PciFunction | None:
        """``read_function`` through an open handle on the function's directory (the caller reads more there).

        Vendor, device and class come from ``uevent`` in one read; from the ``vendor``, ``device`` and
        ``class`` files when it says nothing usable, or names another vendor than the ``vendor`` file the
        caller read already (``vendor``). The driver always comes from the ``driver`` link: ``uevent``'s
        ``DRIVER=`` is not read (a tree whose link changed may keep an old one)."""
        cached = self.functions.get(name)
        if cached is not None:
            return cached
        identity = self.identity_in(handle)
        if identity is None or (vendor is not None and identity[0] != vendor):
            identity = self._identity_from_files(handle, name, vendor)
            if identity is None:
                return None
        function = PciFunction(name, *identity, handle.readlink_name("driver"))
        self.functions[name] = function
        return function

    def _identity_from_files(self, handle: Directory, name: str, vendor: int | None) -> PciIdentity | None:
        """(vendor, device, class) from the three files (``vendor`` unless the caller read it); None warned."""
        if vendor is None:
            vendor = self.read_int_in(handle, "vendor", 16)
        device = self.read_int_in(handle, "device", 16)
        pci_class = self.read_int_in(handle, "class", 16)
        if vendor is None or device is None or pci_class is None:
            self.warnings.append(
                f"PCI function {name}: cannot read vendor, device or class under {self.shown(handle.path)}"
            )
            return None
        return vendor, device, pci_class

    def members(self, group: int) -> tuple[PciFunction, ...]:
        cached = self.group_members.get(group)
        if cached is not None:
            return cached
        directory = f"{self.groups_dir}/{group}/devices"
        try:
            names = sorted(self.fs.listdir(directory))
        except OSError:
            self.warnings.append(f"IOMMU group {group}: cannot list {self.shown(directory)}")
            names = []
        functions = []
        for name in names:
            function = self.read_function(f"{directory}/{name}", name)
            if function is not None:
                functions.append(function)
        members = tuple(functions)
        self.group_members[group] = members
        return members

    def topology(self, device_dir: str | None) -> tuple[str | None, tuple[str, ...]]:
        """The root complex (``pci0000:85``) and the bridges down to ``device_dir``'s parent."""
        prefix = self.devices_dir + "/"
        if device_dir is None or not device_dir.startswith(prefix):
            return None, ()
        parts = device_dir[len(prefix) :].split("/")
        if not parts[0].startswith("pci"):
            return None, ()
        return parts[0], tuple(parts[1:-1])

    def numa(self, directory: str, handle: Directory | None = None) -> int | None:
        """The NUMA node of the device at ``directory``; None when unknown (``-1``) or out of range (warned)."""
        if handle is None:
            node = self.read_int(f"{directory}/numa_node", 10)
        else:
            node = self.read_int_in(handle, "numa_node", 10)
        if node is None or node < 0:
            return None
        if node > MAX_NUMA_NODE:
            self.warnings.append(
                f"{self.shown(directory)}/numa_node says {str(node)[:24]}, past the kernel's largest NUMA node "
                f"{MAX_NUMA_NODE}: no topology for its devices"
            )
            return None
        return node

    def group_facts(self, name: str, group: int | None) -> tuple[list[str], tuple[Companion, ...]]:
        """What the IOMMU group of the function ``name`` says about it: the problems that keep it from a VM
        (other members on host drivers, the group node or container missing) and its companions (every other
        member, each with whether its driver lets the group stay viable)."""
        problems: list[str] = []
        companions: tuple[Companion, ...] = ()
        if group is not None:
            others = [member for member in self.members(group) if member.name != name]
            problems.extend(self.rule.group_problems(group, others))
            companions = tuple(
                Companion(
                    PciAddress.parse(member.name),
                    member.vendor_device,
                    member.pci_class,
                    member.driver,
                    self.rule.member_viable(member.driver),
                )
                for member in others
            )
        problems.extend(self.vfio_problems(group))
        return problems, companions

    def vfio_problems(self, group: int | None) -> list[str]:
        group_node = group is not None and self.fs.exists(f"/dev/vfio/{group}")
        return self.rule.vfio_problems(group, group_node, self.vfio_container)

    # -- naming --------------------------------------------------------------------------------------------

    def pci_name(self, function: PciFunction) -> str | None:
        key = function.vendor_device
        if key in self.names:
            return self.names[key]
        name = self.config.override_for(function.vendor, function.device)
        if name is None:
            known = self.pci_ids.device_name(function.vendor, function.device) if self.pci_ids else None
            name = pci_resource_name(known, function.device, self.config.resource_domain)
            if known is None and self.pci_ids is not None:
                self.warnings.append(
                    f"{key} is not in {self.pci_ids.path}: named {name}; "
                    f"set name_overrides {{{key}: NAME}} for a descriptive name"
                )
        checked = self.checked_name(name, f"set name_overrides {{{key}: NAME}}")
        self.names[key] = checked
        return checked

    def checked_name(self, name: str, fix: str) -> str | None:
        try:
            return validate_resource_name(name)
        except InputError as exc:
            self.warnings.append(f"{exc}; {fix}")
            return None

    def claim(self, device_id: str) -> None:
        """Say the calling source explains ``device_id``: what sources before it recorded as not offered is
        dropped (an SR-IOV vGPU VF is on ``nvidia``, which the passthrough source refuses)."""
        self.claims.setdefault(device_id, len(self.ignored))

    def add(self, name: str, kind: ResourceKind, device: Device, selector: str) -> None:
        """File ``device`` under resource ``name``; a name another kind already uses is ignored (one kind each),
        and so is a name whose allocation variable another resource already has: virt-launcher finds devices by
        that variable (upper-cased, ``.`` and ``/`` as ``_``), so ``nvidia.com/nvidia.l40s-1q`` and
        ``nvidia.com/NVIDIA_L40S-1Q`` would hand a VM each other's devices."""
        for other_name, other in self.devices:
            if other_name == name and other is not kind:
                reason = f"resource {name} is already a {other} resource"
                self.ignored.append(Ignored(device.id, device.vendor_device, device.driver, reason))
                return
        variable = env_var_for(name, kind)
        owner = self.variables.setdefault(variable, name)
        if owner != name:
            reason = (
                f"resource {name} would be allocated through {variable}, which resource {owner} already has "
                "(KubeVirt upper-cases a resource name and turns '.' and '/' into '_')"
            )
            self.ignored.append(Ignored(device.id, device.vendor_device, device.driver, reason))
            return
        self.devices.setdefault((name, kind), []).append(device)
        self.selectors.setdefault((name, kind), set()).add(selector)

    def found_switch(self, function: PciFunction, group: int | None, numa: int | None) -> None:
        """Note an NVSwitch (:func:`schemas.fabric.is_nvswitch`); :meth:`inventory` decides where it goes."""
        self.switches.append((function, group, numa))

    def _board_switches(self) -> tuple[str | None, tuple[NvSwitch, ...]]:
        """The passthrough GPU resource that carries the node's NVSwitches and the switches, or (None, ()).

        Every switch must be usable by VFIO (its driver, its group, its ``/dev/vfio`` node), and there must be
        one NVIDIA passthrough GPU resource to carry them (docs/nvswitch.md); otherwise each switch is listed as
        not offered, saying why. Switches on no VFIO driver at all are the shared NVSwitch model's: the host's
        Fabric Manager drives them, and they are no VM's."""
        if not self.switches:
            return None, ()
        problems: dict[str, str] = {}
        for function, group, _numa in self.switches:
            found, _companions = self.group_facts(function.name, group)
            driver = self.rule.driver_problem(function.driver)
            if driver is not None:
                problems[function.name] = driver  # what else its group says matters only once it is on VFIO
            elif found:
                problems[function.name] = "; ".join(found)
        holders = sorted(
            name
            for name, kind in self.devices
            if kind is ResourceKind.PCI and any(d.vendor_device.startswith("10DE:") for d in self.devices[name, kind])
        )
        on_vfio = 0
        if len(self.switches) > MAX_SWITCHES:
            why = f"{len(self.switches)} NVSwitches, more than a board has ({MAX_SWITCHES} at most): no VM gets any"
            fix = None
        elif problems:
            on_vfio = sum(1 for function, _group, _numa in self.switches if self.rule.on_vfio(function.driver))
            usable = len(self.switches) - len(problems)
            why = (
                "the host's Fabric Manager drives the NVLink fabric (shared NVSwitch model): no VM gets a switch"
                if on_vfio == 0
                else f"only {usable} of the node's {len(self.switches)} NVSwitches are usable by VFIO: no VM gets any"
            )
            fix = "for full passthrough, bind every NVSwitch to vfio-pci (gpu-node-agent bind --all --select 10de:22a3)"
        elif len(holders) != 1:
            why = (
                "no NVIDIA passthrough GPU resource to carry the NVSwitches"
                if not holders
                else f"{len(holders)} NVIDIA passthrough GPU resources ({', '.join(holders)}): which GPUs form "
                "the board is not known, so no VM gets a switch"
            )
            fix = None
        else:
            switches = tuple(
                NvSwitch(PciAddress.parse(function.name), function.vendor_device, group, function.driver, numa)
                for function, group, numa in sorted(self.switches, key=lambda item: item[0].name)
                if group is not None and function.driver is not None
            )
            return holders[0], switches
        for function, _group, _numa in self.switches:
            reason = problems.get(function.name)
            text = f"an NVSwitch: {why}" + (f" ({reason})" if reason and on_vfio else "")
            self.ignored.append(Ignored(function.name, function.vendor_device, function.driver, text, fix))
        return None, ()

    def inventory(self) -> Inventory:
        holder, switches = self._board_switches()
        resources = [
            Resource(
                name=name,
                kind=kind,
                devices=tuple(sorted(devices, key=lambda device: device.id)),
                selectors=tuple(sorted(self.selectors[name, kind])),
                switches=switches if name == holder and kind is ResourceKind.PCI else (),
            )
            for (name, kind), devices in self.devices.items()
        ]
        resources.sort(key=lambda resource: (resource.name, resource.kind.value))
        # A device one kind's source offers, or claims, is not "not offered" because an earlier source passed it
        # by (an SR-IOV vGPU VF is on nvidia, which the passthrough source refuses).
        offered = {device.id for devices in self.devices.values() for device in devices}
        ignored = [
            item
            for index, item in enumerate(self.ignored)
            if item.id not in offered and index >= self.claims.get(item.id, 0)
        ]
        return Inventory(
            resources=tuple(resources),
            ignored=tuple(sorted(ignored, key=lambda item: item.id)),
            warnings=tuple(self.warnings),
            pci_ids_path=self.pci_ids.path if self.pci_ids else None,
        )


def _as_int(text: str | None, base: int) -> int | None:
    if text is None:
        return None
    try:
        return int(text, base)  # int() ignores the surrounding whitespace (the newline) itself
    except ValueError:
        return None


def _as_group(name: str | None) -> int | None:
    """An ``iommu_group`` link's last component as a group number; None unless a plain (short) number."""
    if name is None or not name.isdigit() or len(name) > 9:
        return None
    return int(name)
