"""Helpers for the discovery tests: build a fixture node into a temp dir and scan it deterministically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plugin.config import PluginConfig
from plugin.inventory import Inventory
from plugin.sysfs import discover_node
from simkit.sysfs_fixture import Node, build

FIXTURES = Path(__file__).parent / "fixtures"


def build_node(node: Node, tmp_path: Path) -> Path:
    return build(node, tmp_path / node.name)


def discover(root: Path, **config: Any) -> Inventory:
    """Discover under ``root`` with an empty image root, so the machine's own pci.ids never leaks in."""
    empty_image = root.parent / "empty-image"
    empty_image.mkdir(exist_ok=True)
    return discover_node(PluginConfig(host_root=str(root), **config), image_root=empty_image)
