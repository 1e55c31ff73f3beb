"""Helm for the chart's tests: built from its Go module (``tests/cluster/peers/helm``, ``helm.sh/helm/v3`` at the
module's pin) by ``tests/cluster/build-peers.sh helm`` into the peers' cache outside the repository.

``scripts/test.sh`` builds it before pytest (a cold build takes about 6 minutes on 2 cores, a warm one a second);
here the build is only looked up (or made, if the script did not run). Without Go the tests skip, and fail under
``CI=true`` (:func:`tests.libvirt_support.missing`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.peer_support import peer_binary

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "kubevirt-gpu-passthrough"
BUILD_TIMEOUT = 1800.0  # a cold build on a busy 2-core machine takes about 6 minutes
HELM_TIMEOUT = 120.0


def helm_binary() -> Path:
    """The built ``helm``, or a skip (a failure under CI=true) saying what is missing."""
    return peer_binary("helm", "helm", BUILD_TIMEOUT)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``helm <args>``; with ``check`` an exit other than 0 fails with helm's own error."""
    done = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=HELM_TIMEOUT, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done
