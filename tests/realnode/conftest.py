"""Session fixtures for the real-kernel suite: the guest's assets and one boot per scenario (boots are dear).

A missing piece (no Debian package registry, no qemu-system-x86, no gcc/make to build the mdev samples)
fails under ``CI=true`` and skips elsewhere, naming the piece. A guest that boots but misbehaves (timeout,
crash) always fails.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from tests.libvirt_support import missing as missing_piece
from tests.realnode.assets import AssetError, Assets, cache_root, ensure
from tests.realnode.guest import QBOOT, QEMU, BootError
from tests.realnode.scenarios import Scenario, run_scenario


def missing(reason: str) -> None:
    """Fail under CI=true, skip elsewhere (the project's one rule: tests.libvirt_support.missing)."""
    missing_piece(reason, "real-kernel piece missing")


@pytest.fixture(scope="session")
def realnode_assets() -> Assets:
    try:
        return ensure(log=False)
    except AssetError as exc:
        missing(f"cannot build the guest node (scripts/ensure-realnode.sh says more): {exc}")
        raise  # unreachable


def _scenario(assets: Assets, name: str, tmp: Path, *, iommu: bool) -> Scenario:
    try:
        done = run_scenario(assets, name, tmp, iommu=iommu)
    except BootError as exc:
        if f"{QEMU} is not installed" in str(exc) or str(QBOOT) in str(exc):
            missing(str(exc))
        raise
    _note_figures(name, done)
    return done


def _note_figures(name: str, done: Scenario) -> None:
    """Keep the last run's timings next to the cache (for docs/real-kernel.md's figures)."""
    figures = {"boot_seconds": round(done.boot.seconds, 1), "in_guest_seconds": done.observations.get("seconds")}
    for key, value in done.observations.items():
        if isinstance(value, dict):
            figures |= {f"{key}.{k}": v for k, v in value.items() if k.endswith("_after")}
    path = cache_root() / "last-suite.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known[name] = figures
    with contextlib.suppress(OSError):
        path.write_text(json.dumps(known, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def node(realnode_assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """One guest with the IOMMU on: discover/doctor, binding, the plugin, health flips, mdevs, VFIO, inner QEMU."""
    return _scenario(realnode_assets, "node", tmp_path_factory.mktemp("realnode-node"), iommu=True)


@pytest.fixture(scope="session")
def iommu_off(realnode_assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """One guest without an IOMMU (no intel-iommu device, intel_iommu=off)."""
    return _scenario(realnode_assets, "iommu_off", tmp_path_factory.mktemp("realnode-off"), iommu=False)
