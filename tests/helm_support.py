"""Helm for the chart's tests: built from its Go module (``tests/cluster/peers/helm``, ``helm.sh/helm/v3`` at the
module's pin) by ``tests/cluster/build-peers.sh helm`` into the peers' cache outside the repository.

``scripts/test.sh`` builds it before pytest (a cold build takes about 6 minutes on 2 cores, a warm one a second);
here the build is only looked up (or made, if the script did not run). Without Go the tests skip, and fail under
``CI=true`` (:func:`tests.libvirt_support.missing`).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

from tests.libvirt_support import missing

ROOT = Path(__file__).resolve().parent.parent
BUILD_PEERS = ROOT / "tests" / "cluster" / "build-peers.sh"
CHART = ROOT / "deploy" / "helm" / "kubevirt-gpu-passthrough"
BUILD_TIMEOUT = 1800.0  # a cold build on a busy 2-core machine takes about 6 minutes
HELM_TIMEOUT = 120.0


@functools.cache
def _peer_bin() -> Path | str:
    """The built helm peer's bin directory, or why there is none."""
    if shutil.which("go") is None:
        return "the Go toolchain is not on PATH (helm is built from tests/cluster/peers/helm)"
    done = subprocess.run(
        ["bash", str(BUILD_PEERS), "helm"], capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"build-peers.sh helm failed ({done.returncode}):\n{done.stderr[-4000:]}")
    for line in done.stdout.splitlines():
        if line.startswith("helm="):
            return Path(line.partition("=")[2])
    raise AssertionError(f"build-peers.sh helm printed no helm=<dir>: {done.stdout!r}")


def helm_binary() -> Path:
    """The built ``helm``, or a skip (a failure under CI=true) saying what is missing."""
    found = _peer_bin()
    if isinstance(found, str):
        missing(found, "Go toolchain")
        raise AssertionError(found)  # unreachable
    return found / "helm"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``helm <args>``; with ``check`` an exit other than 0 fails with helm's own error."""
    done = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=HELM_TIMEOUT, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done
