"""Test helpers for the hook sidecar: short socket dirs, an in-process hook server, a PodResources stand-in.

Unix socket paths are limited to 107 bytes, so sockets live in short ``/tmp/hk*`` directories rather than
pytest's deep ``tmp_path``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc

from launcher_hook.allocation import parse_environ
from launcher_hook.server import HookServer
from launcher_hook.service import HookService
from runtime.sockets import socket_is_live
from simkit.podresources_standin import Container, Pod

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "seed-node01"
RTX = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
RTX_VAR = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
SEED_PCI = {"ua-gpu0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0"}


def seed_case() -> tuple[bytes, bytes, dict[str, str]]:
    """The bundled KubeVirt-shaped example: domain XML, VMI JSON (two RTX 2060 GPUs) and compute's env."""
    return (
        (EXAMPLE / "domain.xml").read_bytes(),
        (EXAMPLE / "vmi.json").read_bytes(),
        parse_environ((EXAMPLE / "compute.environ").read_bytes()),
    )


@contextmanager
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hk", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def running_hook(service: HookService, socket_path: Path) -> Iterator[HookServer]:
    server = HookServer(socket_path, service)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0.5)


@contextmanager
def unix_channel(socket_path: Path) -> Iterator[grpc.Channel]:
    channel = grpc.insecure_channel(f"unix:{socket_path}")
    try:
        yield channel
    finally:
        channel.close()


STARTED: list[subprocess.Popen[bytes]] = []
"""Every server process a test started (``tests.test_hook_cli.start_serve``); the conftest's reaper kills those
still running after each test, so a test that fails half way leaves no server behind (one outlived a failed
CI run)."""


def reap_started() -> None:
    """Kill and reap what :data:`STARTED` holds that still runs; forget the rest."""
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=20)


def wait_for_socket(path: Path, timeout: float = 20.0) -> None:
    """Until the server answers on ``path``: its socket file exists from ``bind`` on but accepts connections only
    once gRPC's server has started (``listen``); a call in between is refused (seen on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not (path.is_socket() and socket_is_live(path)):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear and answer within {timeout} s")
        time.sleep(0.02)


def launcher_pod(gpus: Sequence[str], namespace: str = "cxl", vmi: str = "vm-with-gpu") -> Pod:
    """A virt-launcher pod as the kubelet reports it: compute has the GPUs and KubeVirt's own devices."""
    return Pod(
        namespace,
        f"virt-launcher-{vmi}-x7k2p",
        [
            Container(
                "compute",
                [("devices.kubevirt.io/kvm", ["kvm0"]), ("devices.kubevirt.io/tun", ["tun3"]), (RTX, list(gpus))],
            ),
            Container("hook-sidecar-0"),
        ],
    )
