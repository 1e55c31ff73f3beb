"""The Go peers the unit tests run (KubeVirt's launcher harness, Helm), built by ``tests/cluster/build-peers.sh``
into the peers' cache outside the repository and looked up here.

``scripts/test.sh`` builds them before pytest (a cold build takes minutes); here a build is only looked up (or
made, if the script did not run). Without Go the tests skip, and fail under ``CI=true``
(:func:`tests.libvirt_support.missing`).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

from tests.libvirt_support import missing

ROOT = Path(__file__).resolve().parent.parent
BUILD_PEERS = ROOT / "tests" / "cluster" / "build-peers.sh"


@functools.cache
def _peer_bin(peer: str, timeout: float) -> Path | str:
    """The built ``peer``'s bin directory (the ``<peer>=<dir>`` line build-peers.sh prints), or why there is none."""
    if shutil.which("go") is None:
        return f"the Go toolchain is not on PATH ({peer} is built from tests/cluster/peers/{peer})"
    done = subprocess.run(
        ["bash", str(BUILD_PEERS), peer], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"build-peers.sh {peer} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    for line in done.stdout.splitlines():
        if line.startswith(f"{peer}="):
            return Path(line.partition("=")[2])
    raise AssertionError(f"build-peers.sh {peer} printed no {peer}=<dir>: {done.stdout!r}")


def peer_binary(peer: str, name: str, timeout: float) -> Path:
    """The built tool ``name`` of ``peer``, or a skip (a failure under CI=true) saying what is missing."""
    found = _peer_bin(peer, timeout)
    if isinstance(found, str):
        missing(found, "Go toolchain")
        raise AssertionError(found)  # unreachable
    return found / name
