"""Resolving a path under a configurable sysfs root without ever leaving it.

The hook reads sysfs under ``--sysfs-root`` (``/sys``, a fixture tree's ``sys``, a host's sysfs mounted
elsewhere): a PCI function's BARs (:mod:`runtime.pci_bars`) and its slot's functions, IOMMU group and drivers
(:mod:`runtime.pci_companions`). ``bus/pci/devices/<address>`` is a relative link into ``devices/pci…``, and
``iommu_group`` and ``driver`` are links too; each path is resolved and must stay inside the root, so a link
that leads anywhere else is refused, naming the device and the file. (The check and the use are two steps:
the root is sysfs, which only the kernel writes, or a tree of ours.)
"""

from __future__ import annotations

import os
from pathlib import Path

from schemas.errors import InputError


def resolved_root(root: Path, reading: str) -> Path:
    """``root`` resolved; an ``InputError`` naming it and what was being read when it is not a directory."""
    resolved = Path(os.path.realpath(root))
    if not resolved.is_dir():
        raise InputError(f"sysfs root {str(root)!r} is not a directory ({reading})")
    return resolved


def resolve_under(root: Path, resolved: Path, relative: str, device: str) -> Path:
    """``<root>/<relative>`` with every link resolved (``resolved``: the root, resolved); it must stay under
    the root. ``device`` names the culprit in the error (``PCI device 0000:86:00.0``)."""
    path = Path(os.path.realpath(resolved / relative))
    if path != resolved and resolved not in path.parents:
        raise InputError(
            f"{device}: {relative} under {str(root)!r} leads out of that root (to {str(path)!r}); refusing to read it"
        )
    return path
