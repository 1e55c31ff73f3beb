"""The one rule for whether a device can go to a VM now: used by the scan and by Allocate's re-check.

Discovery decides health when it scans; Allocate re-reads the few links that can change between two scans
(the driver, the IOMMU group's members and their drivers, ``/dev/vfio``). Both ask :class:`UsabilityRule`, so
a device the scan calls healthy is one Allocate gives out, and the reasons read the same on both paths:

- a passthrough device must be on one of ``vfio_drivers`` (``vfio-pci``…);
- every other function of its IOMMU group must be viable for VFIO (no driver, a VFIO driver, or one of
  ``allowed_companion_drivers``), and no other selected GPU may share the group (docs/node.md);
- ``/dev/vfio/<group>`` and ``/dev/vfio/vfio`` must exist.

Pure: callers read the node (through :class:`~plugin.hostroot.HostRoot`) and pass the facts in.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from plugin.config import PluginConfig

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


@dataclass(frozen=True, slots=True)
class PciFunction:
    """One PCI function as read from sysfs (a GPU, or another function of its IOMMU group)."""

    name: str
    """The PCI address, as sysfs names it."""
    vendor: int
    device: int
    pci_class: int
    driver: str | None

    @property
    def vendor_device(self) -> str:
        return f"{self.vendor:04X}:{self.device:04X}"

    def describe(self) -> str:
        return f"{self.name} ({self.vendor_device} {class_label(self.pci_class)})"


@dataclass(frozen=True, slots=True)
class UsabilityRule:
    """What makes a device usable by a VM, from the plugin's configuration."""

    vfio_drivers: tuple[str, ...]
    allowed_companion_drivers: frozenset[str]
    selects: Callable[[int, int, int], bool]
    """Whether a function (vendor, device, class) is a GPU the plugin offers (see ``PluginConfig.selects``)."""

    @classmethod
    def from_config(cls, config: PluginConfig) -> UsabilityRule:
        return cls(tuple(config.vfio_drivers), frozenset(config.allowed_companion_drivers), config.selects)

    def on_vfio(self, driver: str | None) -> bool:
        return driver in self.vfio_drivers

    def driver_problem(self, driver: str | None) -> str | None:
        """Why a passthrough device on ``driver`` cannot be handed out; None when it is on a VFIO driver."""
        if self.on_vfio(driver):
            return None
        bound = f"bound to {driver}" if driver else "bound to no driver"
        return f"{bound}, not to {' or '.join(self.vfio_drivers)}"

    def member_viable(self, driver: str | None) -> bool:
        """Whether a function on ``driver`` lets its IOMMU group be used by VFIO."""
        return driver is None or driver in self.vfio_drivers or driver in self.allowed_companion_drivers

    def group_problems(self, group: int, others: Iterable[PciFunction]) -> list[str]:
        """Why the group's other functions keep the device from a VM: host drivers, another GPU in the group."""
        blocked: list[str] = []
        shared: list[str] = []
        for member in others:
            if not self.member_viable(member.driver):
                blocked.append(f"{member.describe()} is bound to {member.driver}")
            elif member.driver is not None and self.selects(member.vendor, member.device, member.pci_class):
                shared.append(member.name)
        problems = []
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
        return problems

    @staticmethod
    def vfio_problems(group: int | None, group_node_exists: bool, container_exists: bool) -> list[str]:
        """Why VFIO cannot open the device's group: no group, no ``/dev/vfio/<group>``, no ``/dev/vfio/vfio``."""
        problems = []
        if group is None:
            problems.append("no IOMMU group (is the IOMMU on? intel_iommu=on or amd_iommu=on)")
        elif not group_node_exists:
            problems.append(f"/dev/vfio/{group} is missing")
        if not container_exists:
            problems.append("/dev/vfio/vfio is missing (is the vfio module loaded?)")
        return problems


PROBLEM_CODES = (
    ("NoIOMMUGroup", re.compile(r"\bno IOMMU group\b")),
    ("IOMMUGroupNotViable", re.compile(r"\bIOMMU group \d+ is not viable\b")),
    ("IOMMUGroupShared", re.compile(r"\bIOMMU group \d+ is shared with GPU\b")),
    ("VFIOGroupNodeMissing", re.compile(r"/dev/vfio/\d+ is missing\b")),
    ("VFIOContainerMissing", re.compile(r"/dev/vfio/vfio is missing\b")),
)
"""A short, stable name for each problem :class:`UsabilityRule` reports, in the order the rule reports them
(the words of :meth:`~UsabilityRule.group_problems` and :meth:`~UsabilityRule.vfio_problems`)."""
UNKNOWN_PROBLEM = "Unhealthy"
"""The code of a reason no pattern of :data:`PROBLEM_CODES` names."""


def problem_code(reason: str | None) -> str:
    """The code of the first problem ``reason`` (an unhealthy device's ``reason``, problems joined by ``; ``)
    names, by position in the text: a CamelCase word of at most 20 letters, valid as a Kubernetes label value
    (the DRA device taint's value, docs/dra.md, "Device taints")."""
    found = [
        (match.start(), code)
        for code, pattern in PROBLEM_CODES
        if (match := pattern.search(reason or "")) is not None
    ]
    return min(found)[1] if found else UNKNOWN_PROBLEM
