"""Discovery: read a node's sysfs (under a host root) and return the :class:`~plugin.inventory.Inventory`.

This is where the node's offer is decided, and where NVIDIA's plugin goes wrong (docs/node.md; docs/protocols.md,
"Resource names"): it advertises every vfio-bound NVIDIA function, audio included, and never checks that an
IOMMU group is viable. Here each kind's :class:`~plugin.sources.DeviceSource` walks its part of sysfs and
:class:`~plugin.health.UsabilityRule` decides health, the same rule Allocate's re-check applies.

The scan only reads (``listdir``, ``readlink``, small files) under the host root and returns a value; it is
cheap enough to rerun for health checks (see ``bench/``). The node's files are not trusted (issue 11): every
read goes through :class:`~plugin.hostroot.HostRoot`; each refusal is a warning naming the file and the
reason (the manager logs it); the function or device concerned is left out or loses the attribute, never the
whole scan.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from plugin.config import PluginConfig
from plugin.hostroot import MAX_ATTRIBUTE_BYTES, MAX_LINKS, HostRoot, ReadError
from plugin.inventory import Inventory
from plugin.node_scan import MAX_NUMA_NODE, NodeScan
from plugin.sources import DEVICE_SOURCES
from runtime.pciids import PciIds, locate_pci_ids

__all__ = [
    "MAX_ATTRIBUTE_BYTES",
    "MAX_LINKS",
    "MAX_NUMA_NODE",
    "HostRoot",
    "ReadError",
    "discover_node",
    "scan",
]


def scan(host_root: Path, config: PluginConfig, pci_ids: PciIds | None, warnings: Iterable[str] = ()) -> Inventory:
    """Read ``<host_root>/sys`` and ``<host_root>/dev/vfio`` and return what the node offers.

    ``pci_ids`` names passthrough resources (None: hex names). ``warnings`` are carried into the result
    (e.g. from locating pci.ids). A host root without ``sys/bus/pci/devices`` is an ``InputError``.
    """
    node = NodeScan(os.path.abspath(host_root), config, pci_ids, list(warnings))
    try:
        for source in DEVICE_SOURCES.values():
            source.scan(node)
    finally:
        node.fs.close()
    return node.inventory()


def discover_node(config: PluginConfig, image_root: Path = Path("/")) -> Inventory:
    """Locate pci.ids (``config.pci_ids``, else under the host root, else under ``image_root``) and scan."""
    host_root = Path(config.host_root)
    explicit = Path(config.pci_ids) if config.pci_ids else None
    choice = locate_pci_ids(explicit, host_root, image_root)
    return scan(host_root, config, choice.database, choice.warnings)
