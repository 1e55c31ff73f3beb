"""Why a node does not give VMs its GPUs: node checks with a verdict and a fix each.

A GPU reaches a VM only if the whole chain holds: the IOMMU is on, vfio-pci is loaded, the GPU and every
function of its IOMMU group are on vfio-pci, ``/dev/vfio`` has the group's node, pci.ids names the card,
and the kubelet's device-plugin directory is where the plugin will register. ``xmlgen doctor`` runs these
checks on a node (or a fixture tree) and says for each what to do; the device plugin's own discovery
supplies the per-GPU verdicts, so doctor and plugin never disagree.

Pure reads under a host root; ``today`` is a parameter so that the age of pci.ids is testable.
"""

from __future__ import annotations

import datetime
import enum
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from plugin.config import PluginConfig
from plugin.inventory import Device, Inventory
from plugin.sysfs import discover_node
from schemas.errors import InputError
from schemas.kinds import PCI_PASSTHROUGH, kind_info

DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"
PCI_IDS_MAX_AGE_DAYS = 2 * 365
_VERSION = re.compile(r"^#\s*Version:\s*(\d{4})\.(\d{2})\.(\d{2})", re.MULTILINE)
_HEX_NAME = re.compile(r"/[0-9a-f]{4}$")


class Status(enum.StrEnum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    """One verdict: what was checked, the outcome, what was found, and how to fix it (when not OK)."""

    name: str
    status: Status
    detail: str
    fix: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return {"check": self.name, "status": self.status.value, "detail": self.detail, "fix": self.fix}


def _bind_to_vfio(address: str, bound: bool = True) -> str:
    """The commands; a function on no driver has no ``driver/unbind`` (the real kernel has no such file)."""
    unbind = f"echo {address} > /sys/bus/pci/devices/{address}/driver/unbind; " if bound else ""
    return (
        f"bind {address} to vfio-pci: echo vfio-pci > /sys/bus/pci/devices/{address}/driver_override; "
        f"{unbind}echo {address} > /sys/bus/pci/drivers_probe"
    )


def _iommu(root: Path) -> Check:
    groups = root / "sys/kernel/iommu_groups"
    count = len(os.listdir(groups)) if groups.is_dir() else 0
    if count:
        return Check("IOMMU", Status.OK, f"{count} IOMMU groups")
    return Check(
        "IOMMU",
        Status.FAIL,
        f"no IOMMU groups under {groups}",
        "turn the IOMMU on: VT-d / AMD-Vi in the firmware, and intel_iommu=on (or amd_iommu=on) iommu=pt on the "
        "kernel command line; reboot",
    )


def _vfio(root: Path, config: PluginConfig, inventory: Inventory | None) -> Iterator[Check]:
    drivers = [driver for driver in config.vfio_drivers if (root / "sys/bus/pci/drivers" / driver).is_dir()]
    vgpu_only = (
        inventory is not None
        and inventory.resources
        and not any(kind_info(resource.kind).needs_vfio_pci for resource in inventory.resources)
    )
    if drivers:
        yield Check("vfio-pci driver", Status.OK, f"loaded: {', '.join(drivers)}")
    elif vgpu_only:
        yield Check("vfio-pci driver", Status.OK, "not loaded, not needed: this node serves vGPUs only")
    else:
        yield Check(
            "vfio-pci driver",
            Status.FAIL,
            f"none of {', '.join(config.vfio_drivers)} is loaded",
            "modprobe vfio-pci, and load it at boot (echo vfio-pci > /etc/modules-load.d/vfio-pci.conf)",
        )
    container = root / "dev/vfio/vfio"
    if container.exists():
        yield Check("/dev/vfio/vfio", Status.OK, "present")
    else:
        yield Check("/dev/vfio/vfio", Status.FAIL, "missing", "modprobe vfio (the VFIO container node comes with it)")


def _gpu(device: Device, resource: str) -> Check:
    label = f"{kind_info(device.kind).label} {device.id}"
    where = f"{device.vendor_device} on {device.driver}, IOMMU group {device.iommu_group}"
    if device.mdev_type is not None:
        parent = f"GPU {device.parent}" if device.parent is not None else "a non-PCI parent"
        where = f"{device.mdev_type} on {parent}, IOMMU group {device.iommu_group}"
    if device.healthy:
        return Check(label, Status.OK, f"{where} → {resource}")
    fixes = [_bind_to_vfio(str(companion.address)) for companion in device.companions if not companion.viable]
    if device.iommu_group is not None and f"/dev/vfio/{device.iommu_group} is missing" in (device.reason or ""):
        fixes.append(
            f"the kernel keeps /dev/vfio/{device.iommu_group} while a function of group {device.iommu_group} is on "
            "vfio-pci (viable or not): check that the host's /dev/vfio is mounted under the host root"
        )
    return Check(label, Status.FAIL, f"{where} → {resource}: {device.reason}", "; ".join(fixes) or None)


def _gpus(inventory: Inventory) -> Iterator[Check]:
    mdevs_of: dict[str, list[str]] = {}
    for resource in inventory.resources:
        for device in resource.devices:
            yield _gpu(device, resource.name)
            if device.parent is not None:
                mdevs_of.setdefault(str(device.parent), []).append(resource.name)
    for ignored in inventory.ignored:
        if ignored.id in mdevs_of:
            names = sorted(set(mdevs_of[ignored.id]))
            count = len(mdevs_of[ignored.id])
            yield Check(
                f"GPU {ignored.id}",
                Status.OK,
                f"{ignored.vendor_device} on {ignored.driver}: vGPU parent of {count} vGPU(s) ({', '.join(names)})",
            )
            continue
        if not PCI_PASSTHROUGH.looks_like_id(ignored.id):  # an mdev whose parent is not a selected GPU: nothing to bind
            yield Check(f"vGPU {ignored.id}", Status.WARN, f"not offered to VMs, {ignored.reason}")
            continue
        fix = ignored.fix or (
            "if this node serves VMs (nvidia.com/gpu.workload.config=vm-passthrough), "
            f"{_bind_to_vfio(ignored.id, bound=ignored.driver is not None)}"
        )
        yield Check(
            f"GPU {ignored.id}",
            Status.WARN,
            f"{ignored.vendor_device}: not offered to VMs, {ignored.reason}",
            fix,
        )
    if not inventory.resources and not inventory.ignored:
        yield Check(
            "GPUs",
            Status.WARN,
            "no NVIDIA GPU and no vGPU found",
            "is this a GPU node? for vGPUs, create mdevs first (NVIDIA vGPU manager)",
        )


def pci_ids_version(path: Path) -> datetime.date | None:
    """The ``# Version: YYYY.MM.DD`` of a pci.ids file (read from its header only), or None."""
    try:
        with path.open("rb") as handle:
            head = handle.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return None
    match = _VERSION.search(head)
    if match is None:
        return None
    try:
        return datetime.date(*(int(part) for part in match.groups()))
    except ValueError:
        return None


def _pci_ids(inventory: Inventory, today: datetime.date) -> Iterator[Check]:
    if inventory.pci_ids_path is None:
        yield Check(
            "pci.ids",
            Status.WARN,
            "not found: resources are named by hex device ID (nvidia.com/1f08)",
            "apt-get install pci.ids (or hwdata), or pass --pci-ids",
        )
        return
    version = pci_ids_version(Path(inventory.pci_ids_path))
    hex_named = [resource.name for resource in inventory.resources if _HEX_NAME.search(resource.name)]
    if version is None:
        yield Check("pci.ids", Status.WARN, f"{inventory.pci_ids_path} has no Version line", "use Debian's pci.ids")
    elif (today - version).days > PCI_IDS_MAX_AGE_DAYS:
        yield Check(
            "pci.ids",
            Status.WARN,
            f"{inventory.pci_ids_path} is from {version.isoformat()}, {(today - version).days // 365} years old: "
            "newer GPUs are missing from it",
            "update pci.ids (apt-get install --only-upgrade pci.ids), or set name_overrides for new device IDs",
        )
    else:
        yield Check("pci.ids", Status.OK, f"{inventory.pci_ids_path}, version {version.isoformat()}")
    if hex_named:
        yield Check(
            "resource names",
            Status.WARN,
            f"named by hex device ID (missing from pci.ids): {', '.join(hex_named)}",
            "set name_overrides {VENDOR:DEVICE: NAME} in the plugin configuration, or update pci.ids",
        )


def _kubelet(root: Path, kubelet_dir: str) -> Check:
    directory = root / kubelet_dir.lstrip("/")
    if not directory.is_dir():
        return Check(
            "kubelet device-plugins dir",
            Status.FAIL,
            f"{kubelet_dir} is missing",
            "is this a Kubernetes node, and is --kubelet-dir right for this kubelet (--root-dir)?",
        )
    if (directory / "kubelet.sock").exists():
        return Check("kubelet device-plugins dir", Status.OK, f"{kubelet_dir} with kubelet.sock")
    return Check(
        "kubelet device-plugins dir",
        Status.WARN,
        f"{kubelet_dir} has no kubelet.sock",
        "is the kubelet running? the plugin waits for it and registers when it appears",
    )


def run_checks(
    config: PluginConfig,
    *,
    kubelet_dir: str = DEFAULT_KUBELET_DIR,
    today: datetime.date | None = None,
    image_root: Path = Path("/"),
) -> list[Check]:
    """Every check for the node under ``config.host_root``, in the order a person would fix them."""
    root = Path(config.host_root)
    if not (root / "sys").is_dir():
        raise InputError(f"no sys directory under the host root {str(root)!r}")
    inventory: Inventory | None
    try:
        inventory = discover_node(config, image_root=image_root)
    except InputError as exc:
        inventory = None
        discovery = [Check("discovery", Status.FAIL, str(exc), "check --host-root")]
    else:
        discovery = [*_gpus(inventory), *_pci_ids(inventory, today or datetime.date.today())]
    checks = [_iommu(root), *_vfio(root, config, inventory), *discovery]
    checks.append(_kubelet(root, kubelet_dir))
    return checks
