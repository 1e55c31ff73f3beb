"""Facts about the node's kernel both the plugin and its tools rely on (docs/node.md).

A GPU is ready for passthrough when bound to a VFIO driver: ``vfio-pci``, or a variant driver built on it
such as ``nvgrace_gpu_vfio_pci`` (Grace Hopper). Discovery, Allocate's re-check, the configuration default and
the fixture trees that stand in for a node all use this one list.
"""

from __future__ import annotations

VFIO_DRIVER_NAMES: tuple[str, ...] = ("vfio-pci", "nvgrace_gpu_vfio_pci")
"""The VFIO drivers, in the order the configuration lists them by default."""
VFIO_DRIVERS: frozenset[str] = frozenset(VFIO_DRIVER_NAMES)
