"""What ``serve --dra`` is told (paths, pool, scan interval) and its defaults, apart from the DRA machinery.

``gpu-device-plugin serve`` builds its command line from these defaults whether or not ``--dra`` is given; the
DRA servicers, prepare core and generated kubelet stubs they would pull in cost a device plugin's start about a
third of its import time (issue 12: start to registered), so the CLI imports them only when ``--dra`` or
``--print-slices`` asks for them. This module imports nothing heavier than :mod:`schemas.dra`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.dra import DRIVER_NAME

DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
"""Where the kubelet's plugin watcher looks for registration sockets."""
DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/plugins") / DRIVER_NAME
"""The plugin's own directory on the node (``dra.sock``, the checkpoint, the metadata files)."""
DEFAULT_CDI_DIR = "/var/run/cdi"
"""Where the container runtime reads CDI specs."""
DEFAULT_SCAN_INTERVAL = 5.0
"""Seconds between periodic rescans when no event came."""


@dataclass(frozen=True)
class DraOptions:
    plugin_dir: Path = DEFAULT_PLUGIN_DIR
    """The plugin's own directory: ``dra.sock``, the checkpoint, the metadata files (the same path in the
    plugin's container and on the node: CDI mounts name node paths)."""
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    cdi_dir: Path = Path(DEFAULT_CDI_DIR)
    claims_dir: Path | None = None
    pool: str | None = None
    """The node's pool name in its ResourceSlices (the node name); None: any pool is accepted."""
    scan_interval: float = DEFAULT_SCAN_INTERVAL
