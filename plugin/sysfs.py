"""Discovery: read a node's sysfs (under a host root) and return the :class:`~plugin.inventory.Inventory`.

This is where the node's offer is decided, and where NVIDIA's plugin goes wrong (FACTS.md §6-7): it
advertises every vfio-bound NVIDIA function, audio included, and never checks that an IOMMU group is
viable. Here only selected GPU functions become devices; the rest of each GPU's group are its companions,
and a companion on a host driver (``snd_hda_intel``, ``xhci_hcd``…) makes the GPU unhealthy with a reason
that names it. GPUs on a host driver (``nvidia``) are listed as not offered. vGPUs come from
``/sys/bus/mdev/devices``, one resource per mdev type name.

The scan only reads (``listdir``, ``readlink``, small files) under the host root and returns a value; it is
cheap enough to rerun for health checks (see ``bench/``). Reading is linear in the number of functions:
non-selected vendors cost one ``vendor`` read each.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from plugin.config import PluginConfig
from plugin.inventory import Companion, Device, Ignored, Inventory, Resource
from plugin.naming import mdev_resource_name, pci_resource_name
from plugin.pciids import PciIds, locate_pci_ids
from schemas.errors import InputError
from schemas.mdev import parse_mdev_uuid
from schemas.naming import ResourceKind, validate_resource_name
from schemas.pci import PciAddress

_CLASS_LABELS = {
    0x0300: "VGA",
    0x0302: "3D controller",
    0x0380: "display controller",
    0x0403: "audio",
    0x0C03: "USB",
    0x0C80: "serial bus",
    0x0604: "PCI bridge",
    0x0200: "Ethernet",
    0x0207: "InfiniBand",
    0x0108: "NVMe",
}


def class_label(pci_class: int) -> str:
    """A short human name for a PCI class code (``0x040300`` → ``audio``)."""
    return _CLASS_LABELS.get(pci_class >> 8, f"class {pci_class:06x}")


def _read(path: str) -> str | None:
    text = _read_raw(path)
    return None if text is None else text.strip()


def _read_raw(path: str) -> str | None:
    # os.open/os.read: a third of the cost of open() for sysfs's one-line attribute files.
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(descriptor, 4096):
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(descriptor)


def _read_int(path: str, base: int) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def _link_name(path: str) -> str | None:
    """The last component of a symlink's target (``driver`` → ``vfio-pci``), or None when absent."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def _link_target(path: str) -> str | None:
    """Where a symlink points, as a normalised absolute path (sysfs links are relative and symlink-free)."""
    try:
        target = os.readlink(path)
    except OSError:
        return None
    return os.path.normpath(os.path.join(os.path.dirname(path), target))


@dataclass(frozen=True, slots=True)
class _Function:
    """One PCI function as read from sysfs."""

    name: str
    vendor: int
    device: int
    pci_class: int
    driver: str | None

    @property
    def vendor_device(self) -> str:
        return f"{self.vendor:04X}:{self.device:04X}"

    def describe(self) -> str:
        return f"{self.name} ({self.vendor_device} {class_label(self.pci_class)})"


@dataclass
class _Scan:
    """State of one scan; discarded when :func:`scan` returns."""

    root: str
    config: PluginConfig
    pci_ids: PciIds | None
    warnings: list[str]
    pci_dir: str = ""
    groups_dir: str = ""
    devices_dir: str = ""
    vfio_container: bool = True
    ignored: list[Ignored] = field(default_factory=list)
    devices: dict[tuple[str, ResourceKind], list[Device]] = field(default_factory=dict)
    selectors: dict[tuple[str, ResourceKind], set[str]] = field(default_factory=dict)
    names: dict[str, str | None] = field(default_factory=dict)
    group_members: dict[int, tuple[_Function, ...]] = field(default_factory=dict)
    functions: dict[str, _Function] = field(default_factory=dict)
    """Functions already read, by name: a GPU's group members were mostly read by the bus scan."""

    def __post_init__(self) -> None:
        self.pci_dir = f"{self.root}/sys/bus/pci/devices"
        self.groups_dir = f"{self.root}/sys/kernel/iommu_groups"
        self.devices_dir = f"{self.root}/sys/devices"
        self.vfio_container = os.path.exists(f"{self.root}/dev/vfio/vfio")

    # -- reading -------------------------------------------------------------------------------------------

    def read_function(self, directory: str, name: str, vendor: int | None = None) -> _Function | None:
        cached = self.functions.get(name)
        if cached is not None:
            return cached
        if vendor is None:
            vendor = _read_int(f"{directory}/vendor", 16)
        device = _read_int(f"{directory}/device", 16)
        pci_class = _read_int(f"{directory}/class", 16)
        if vendor is None or device is None or pci_class is None:
            self.warnings.append(f"PCI function {name}: cannot read vendor, device or class under {directory}")
            return None
        function = _Function(name, vendor, device, pci_class, _link_name(f"{directory}/driver"))
        self.functions[name] = function
        return function

    def members(self, group: int) -> tuple[_Function, ...]:
        cached = self.group_members.get(group)
        if cached is not None:
            return cached
        directory = f"{self.groups_dir}/{group}/devices"
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            self.warnings.append(f"IOMMU group {group}: cannot list {directory}")
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

    def numa(self, directory: str) -> int | None:
        node = _read_int(f"{directory}/numa_node", 10)
        return None if node is None or node < 0 else node

    def vfio_problems(self, group: int | None) -> list[str]:
        problems = []
        if group is None:
            problems.append("no IOMMU group (is the IOMMU on? intel_iommu=on or amd_iommu=on)")
        elif not os.path.exists(f"{self.root}/dev/vfio/{group}"):
            problems.append(f"/dev/vfio/{group} is missing")
        if not self.vfio_container:
            problems.append("/dev/vfio/vfio is missing (is the vfio module loaded?)")
        return problems

    # -- naming --------------------------------------------------------------------------------------------

    def pci_name(self, function: _Function) -> str | None:
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

    def add(self, name: str, kind: ResourceKind, device: Device, selector: str) -> None:
        other = ResourceKind.MDEV if kind is ResourceKind.PCI else ResourceKind.PCI
        if (name, other) in self.devices:
            reason = f"resource {name} is already a {other} resource"
            self.ignored.append(Ignored(device.id, device.vendor_device, device.driver, reason))
            return
        self.devices.setdefault((name, kind), []).append(device)
        self.selectors.setdefault((name, kind), set()).add(selector)

    # -- the two device kinds ------------------------------------------------------------------------------

    def scan_pci(self) -> None:
        try:
            names = sorted(os.listdir(self.pci_dir))
        except OSError:
            raise InputError(
                f"no PCI devices under {self.pci_dir!r}: is the host root {self.root or '/'!r} right "
                "(it must hold the node's /sys)?"
            ) from None
        vendors = self.config.selector_vendors()
        for name in names:
            directory = f"{self.pci_dir}/{name}"
            vendor = _read_int(f"{directory}/vendor", 16)
            if vendor not in vendors:
                continue
            function = self.read_function(directory, name, vendor)
            if function is None or not self.config.selects(function.vendor, function.device, function.pci_class):
                continue
            try:
                PciAddress.parse(name)
            except InputError as exc:
                self.warnings.append(f"skipping {directory}: {exc}")
                continue
            self.scan_gpu(directory, function)

    def scan_gpu(self, directory: str, gpu: _Function) -> None:
        config = self.config
        if gpu.driver not in config.vfio_drivers:
            bound = f"bound to {gpu.driver}" if gpu.driver else "bound to no driver"
            self.ignored.append(
                Ignored(gpu.name, gpu.vendor_device, gpu.driver, f"{bound}, not to {' or '.join(config.vfio_drivers)}")
            )
            return
        name = self.pci_name(gpu)
        if name is None:
            self.ignored.append(Ignored(gpu.name, gpu.vendor_device, gpu.driver, "its resource name is invalid"))
            return
        group = _read_group(f"{directory}/iommu_group")
        problems: list[str] = []
        companions: list[Companion] = []
        if group is not None:
            blocked: list[str] = []
            shared: list[str] = []
            for member in self.members(group):
                if member.name == gpu.name:
                    continue
                viable = (
                    member.driver is None
                    or member.driver in config.vfio_drivers
                    or member.driver in config.allowed_companion_drivers
                )
                if not viable:
                    blocked.append(f"{member.describe()} is bound to {member.driver}")
                elif member.driver is not None and config.selects(member.vendor, member.device, member.pci_class):
                    shared.append(member.name)
                companions.append(
                    Companion(
                        PciAddress.parse(member.name), member.vendor_device, member.pci_class, member.driver, viable
                    )
                )
            if blocked:
                problems.append(
                    f"IOMMU group {group} is not viable: {'; '.join(blocked)} "
                    f"(bind {'it' if len(blocked) == 1 else 'them'} to vfio-pci or unbind)"
                )
            if shared:
                problems.append(
                    f"IOMMU group {group} is shared with GPU {', '.join(shared)}: "
                    "GPUs of one group cannot go to different VMs"
                )
        problems.extend(self.vfio_problems(group))
        root, path = self.topology(_link_target(directory))
        device = Device(
            id=gpu.name,
            kind=ResourceKind.PCI,
            vendor_device=gpu.vendor_device,
            iommu_group=group,
            numa_node=self.numa(directory),
            healthy=not problems,
            reason="; ".join(problems) or None,
            companions=tuple(companions),
            pcie_root=root,
            pcie_path=path,
            driver=gpu.driver,
        )
        self.add(name, ResourceKind.PCI, device, gpu.vendor_device)

    def scan_mdevs(self) -> None:
        bus = f"{self.root}/sys/bus/mdev/devices"
        try:
            entries = sorted(os.listdir(bus))
        except OSError:
            return  # no mdev support loaded: no vGPUs
        for entry in entries:
            link = f"{bus}/{entry}"
            try:
                uuid = parse_mdev_uuid(entry)
            except InputError as exc:
                self.warnings.append(f"skipping {link}: {exc}")
                continue
            mdev_dir = _link_target(link)
            # Relative links inside the mdev resolve from its real directory, not from the bus link.
            type_dir = _link_target(f"{mdev_dir}/mdev_type") if mdev_dir else None
            # Only newlines are trimmed before naming, as NVIDIA's plugin does; the selector is fully trimmed.
            raw_name = _read_raw(f"{type_dir}/name") if type_dir else None
            type_name = raw_name.strip("\n") if raw_name is not None else None
            if mdev_dir is None or type_dir is None or not type_name or not type_name.strip():
                self.warnings.append(f"skipping mdev {uuid}: cannot read its mdev_type/name under {link}")
                continue
            parent_dir = os.path.dirname(mdev_dir)
            if not os.path.exists(f"{parent_dir}/vendor"):
                # A real kernel's mdev parents need not be PCI functions (the kernel's samples mtty, mdpy and
                # mbochs are virtual devices): no VENDOR:DEVICE to select them by.
                where = parent_dir.removeprefix(self.root)
                reason = f"its parent {os.path.basename(parent_dir)} ({where}) is not a PCI function"
                self.ignored.append(Ignored(uuid, "-", _link_name(f"{link}/driver"), reason))
                continue
            parent = self.read_function(parent_dir, os.path.basename(parent_dir))
            if parent is None:
                continue
            try:
                parent_address = PciAddress.parse(parent.name)
            except InputError as exc:
                self.warnings.append(f"skipping mdev {uuid}: its parent {parent_dir}: {exc}")
                continue
            driver = _link_name(f"{link}/driver")
            if not self.config.selects(parent.vendor, parent.device, parent.pci_class):
                self.ignored.append(
                    Ignored(uuid, parent.vendor_device, driver, f"its parent {parent.describe()} is not a selected GPU")
                )
                continue
            name = self.checked_name(
                mdev_resource_name(type_name, self.config.resource_domain),
                f"mdev type {os.path.basename(type_dir)} ({type_name!r}) cannot be offered",
            )
            if name is None:
                self.ignored.append(Ignored(uuid, parent.vendor_device, driver, "its resource name is invalid"))
                continue
            group = _read_group(f"{link}/iommu_group")
            problems = self.vfio_problems(group)
            root, path = self.topology(parent_dir)
            device = Device(
                id=uuid,
                kind=ResourceKind.MDEV,
                vendor_device=parent.vendor_device,
                iommu_group=group,
                numa_node=self.numa(parent_dir),
                healthy=not problems,
                reason="; ".join(problems) or None,
                pcie_root=root,
                pcie_path=(*path, parent.name),
                driver=driver,
                parent=parent_address,
                mdev_type=os.path.basename(type_dir),
            )
            self.add(name, ResourceKind.MDEV, device, type_name.strip())

    def inventory(self) -> Inventory:
        resources = [
            Resource(
                name=name,
                kind=kind,
                devices=tuple(sorted(devices, key=lambda device: device.id)),
                selectors=tuple(sorted(self.selectors[name, kind])),
            )
            for (name, kind), devices in self.devices.items()
        ]
        resources.sort(key=lambda resource: (resource.name, resource.kind.value))
        return Inventory(
            resources=tuple(resources),
            ignored=tuple(sorted(self.ignored, key=lambda item: item.id)),
            warnings=tuple(self.warnings),
            pci_ids_path=self.pci_ids.path if self.pci_ids else None,
        )


def _read_group(link: str) -> int | None:
    name = _link_name(link)
    if name is None:
        return None
    try:
        return int(name)
    except ValueError:
        return None


def scan(host_root: Path, config: PluginConfig, pci_ids: PciIds | None, warnings: Iterable[str] = ()) -> Inventory:
    """Read ``<host_root>/sys`` and ``<host_root>/dev/vfio`` and return what the node offers.

    ``pci_ids`` names passthrough resources (None: hex names). ``warnings`` are carried into the result
    (e.g. from locating pci.ids). A host root without ``sys/bus/pci/devices`` is an ``InputError``.
    """
    # A host root of "/" must not make paths "//sys/…" (POSIX keeps a leading "//" through normpath).
    state = _Scan(os.path.abspath(host_root).rstrip("/"), config, pci_ids, list(warnings))
    state.scan_pci()
    state.scan_mdevs()
    return state.inventory()


def discover_node(config: PluginConfig, image_root: Path = Path("/")) -> Inventory:
    """Locate pci.ids (``config.pci_ids``, else under the host root, else under ``image_root``) and scan."""
    host_root = Path(config.host_root)
    explicit = Path(config.pci_ids) if config.pci_ids else None
    choice = locate_pci_ids(explicit, host_root, image_root)
    warnings = []
    if choice.database is None:
        warnings.append(
            f"no pci.ids found (looked at {', '.join(choice.searched)}): resources are named by hex device ID "
            "(nvidia.com/1f08); pass --pci-ids or set name_overrides"
        )
    return scan(host_root, config, choice.database, warnings)
