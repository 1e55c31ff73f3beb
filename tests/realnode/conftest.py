"""Session fixtures for the real-kernel suite: the guest's assets and one boot per scenario (boots are dear).

A missing piece (no Debian package registry, no qemu-system-x86, no gcc/make to build the mdev samples)
fails under ``CI=true`` and skips elsewhere, naming the piece. A guest that boots but misbehaves (timeout,
crash) always fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.realnode.assets import AssetError, Assets, ensure
from tests.realnode.guest import QBOOT, QEMU, BootError
from tests.realnode.scenarios import Scenario, run_scenario


def missing(reason: str) -> None:
    """Fail under CI, skip elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"real-kernel piece missing under CI=true: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def realnode_assets() -> Assets:
    try:
        return ensure(log=False)
    except AssetError as exc:
        missing(f"cannot build the guest node (scripts/ensure-realnode.sh says more): {exc}")
        raise  # unreachable


def _scenario(assets: Assets, name: str, tmp: Path, *, iommu: bool) -> Scenario:
    try:
        return run_scenario(assets, name, tmp, iommu=iommu)
    except BootError as exc:
        if f"{QEMU} is not installed" in str(exc) or str(QBOOT) in str(exc):
            missing(str(exc))
        raise


@pytest.fixture(scope="session")
def node(realnode_assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """One guest with the IOMMU on: discover/doctor, binding, the plugin, health flips, mdevs, VFIO, inner QEMU."""
    return _scenario(realnode_assets, "node", tmp_path_factory.mktemp("realnode-node"), iommu=True)


@pytest.fixture(scope="session")
def iommu_off(realnode_assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """One guest without an IOMMU (no intel-iommu device, intel_iommu=off)."""
    return _scenario(realnode_assets, "iommu_off", tmp_path_factory.mktemp("realnode-off"), iommu=False)
