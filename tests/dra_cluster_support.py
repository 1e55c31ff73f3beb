"""Helpers for the DRA cluster-side tests: fixture nodes as ResourceSlices, synthetic inventories, validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate

from plugin.dra.slices import build_slices
from plugin.inventory import Device, Inventory, Resource
from runtime.pciids import PciIds
from schemas.kinds import ResourceKind
from simkit.fixture_nodes import NODES
from simkit.sysfs_fixture import Node
from tests.discovery_support import build_node, discover

DRA_OLDEST_KUBERNETES = "1.34"
"""resource.k8s.io/v1 (ResourceSlice, DeviceClass, ResourceClaim) is GA from Kubernetes 1.34."""
NEWEST_KUBERNETES = kubernetes_validate.utils.latest_version()


def node_inventory(node: Node, tmp_path: Path) -> tuple[Inventory, PciIds | None]:
    """Discover a fixture node; also the pci.ids it was named from (for productName)."""
    inventory = discover(build_node(node, tmp_path))
    pci_ids = PciIds.load(Path(inventory.pci_ids_path)) if inventory.pci_ids_path else None
    return inventory, pci_ids


def node_slices(node: Node, tmp_path: Path) -> list[dict[str, Any]]:
    inventory, pci_ids = node_inventory(node, tmp_path)
    if pci_ids is None:
        return build_slices(inventory, node.name)
    return build_slices(inventory, node.name, product_names=pci_ids.device_name)


def all_fixture_slices(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    return {name: node_slices(node, tmp_path) for name, node in NODES.items()}


def many_gpus(count: int, healthy: bool = True) -> Inventory:
    """An inventory of ``count`` passthrough GPUs (``0000:BB:SS.0``), more than one slice holds when over 128."""
    devices = tuple(
        Device(
            id=f"0000:{1 + index // 32:02x}:{index % 32:02x}.0",
            kind=ResourceKind.PCI,
            vendor_device="10DE:1F08",
            iommu_group=index,
            numa_node=index % 2,
            healthy=healthy,
            reason=None if healthy else "test",
        )
        for index in range(count)
    )
    return Inventory((Resource("nvidia.com/TU106_GEFORCE_RTX_2060_REV__A", ResourceKind.PCI, devices, ("10DE:1F08",)),))


def validate_strictly(obj: dict[str, Any], version: str) -> None:
    """kubernetes-validate --strict for Kubernetes ``version``; raises its ValidationError."""
    kubernetes_validate.validate(obj, version, strict=True)
