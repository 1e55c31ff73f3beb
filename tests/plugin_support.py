"""Helpers for the device plugin's server and lifecycle tests: short socket dirs, a running plugin, tree changes.

The plugin runs for real (in-process :class:`~plugin.manager.PluginManager` in a thread, or the
``gpu-device-plugin serve`` process) against :class:`~simkit.kubelet_standin.KubeletStandIn` over unix
sockets, on fixture trees from :mod:`simkit.sysfs_fixture`. The functions below change a tree the way the
kernel would while the plugin runs: a ``/dev/vfio`` group node removed or restored, a driver rebound, a card
hot-added, an mdev created.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from plugin.allocation import Allocation, AllocationError
from plugin.config import PluginConfig
from plugin.manager import PluginManager
from plugin.metrics import PluginMetrics
from runtime.pciids import PciIds
from simkit.sysfs_fixture import Function, Node, build

ROOT = Path(__file__).resolve().parent.parent
WAIT = 5.0
"""Generous wait for a condition (behaviour, not timing, is what the tests check)."""


@contextmanager
def short_dir() -> Iterator[Path]:
    """A temp dir under /tmp with a short name: unix socket paths must stay under 108 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="kp", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def build_tree(node: Node, base: Path) -> Path:
    """Write ``node`` to ``<base>/root`` and return that host root."""
    return build(node, base / "root")


def manager_for(host_root: Path, kubelet_dir: Path, scan_interval: float = 0.2) -> PluginManager:
    """A manager on ``host_root``, named by the tree's own pci.ids (never the machine's)."""
    pci_ids_path = host_root / "usr" / "share" / "misc" / "pci.ids"
    pci_ids = PciIds.load(pci_ids_path) if pci_ids_path.is_file() else None
    return PluginManager(
        PluginConfig(host_root=str(host_root)),
        kubelet_dir,
        scan_interval=scan_interval,
        pci_ids=pci_ids,
        metrics=PluginMetrics(),  # kept, as serve --metrics-address does, so that tests can scrape them
    )


@contextmanager
def running(manager: PluginManager) -> Iterator[PluginManager]:
    """Run ``manager`` in a thread until the block ends; then stop it and check it ended."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            manager.run()
        except BaseException as exc:  # surfaced in the test
            errors.append(exc)

    thread = threading.Thread(target=target, name="plugin-manager", daemon=True)
    thread.start()
    try:
        assert manager.ready.wait(WAIT), "the plugin did not get ready"
        yield manager
    finally:
        manager.request_stop()
        thread.join(WAIT)
        assert not thread.is_alive(), "the plugin did not stop"
    if errors:
        raise errors[0]


def wait_until(condition: Callable[[], bool], timeout: float = WAIT, what: str = "condition") -> None:
    """Wait for ``condition`` (for checks with no event to block on, such as a file appearing)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def sockets(directory: Path) -> list[str]:
    """Names of the unix sockets in ``directory``."""
    return sorted(entry.name for entry in directory.iterdir() if entry.is_socket())


# -- changing the tree as the kernel would ---------------------------------------------------------------


def remove_group_node(host_root: Path, group: int) -> None:
    (host_root / "dev" / "vfio" / str(group)).unlink()


def restore_group_node(host_root: Path, group: int) -> None:
    (host_root / "dev" / "vfio" / str(group)).write_text("")


def rebind(host_root: Path, address: str, driver: str | None) -> None:
    """Point ``address``'s ``driver`` link at ``driver`` (None: unbind), as a driver rebind does."""
    device_dir = (host_root / "sys" / "bus" / "pci" / "devices" / address).resolve()
    link = device_dir / "driver"
    if link.is_symlink():
        old_driver_link = link.resolve() / address
        link.unlink()
        if old_driver_link.is_symlink():
            old_driver_link.unlink()
    if driver is None:
        return
    driver_dir = host_root / "sys" / "bus" / "pci" / "drivers" / driver
    driver_dir.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(driver_dir, device_dir))
    (driver_dir / address).symlink_to(os.path.relpath(device_dir, driver_dir))


def hot_add(host_root: Path, *functions: Function) -> None:
    """Write new PCI functions (and their /dev/vfio group nodes) into a live tree, as a hot-plug does."""
    build(Node(name="hot-added", functions=functions), host_root)


def add_mdev(host_root: Path, uuid: str, parent: str, type_id: str, group: int) -> None:
    """Create mdev ``uuid`` of ``type_id`` on GPU ``parent``, with its own IOMMU group, as writing ``create`` does."""
    sys_dir = host_root / "sys"
    parent_dir = (sys_dir / "bus" / "pci" / "devices" / parent).resolve()
    type_dir = parent_dir / "mdev_supported_types" / type_id
    mdev_dir = parent_dir / uuid
    group_dir = sys_dir / "kernel" / "iommu_groups" / str(group)
    driver_dir = sys_dir / "bus" / "mdev" / "drivers" / "vfio_mdev"
    mdev_dir.mkdir()
    (group_dir / "devices").mkdir(parents=True, exist_ok=True)
    driver_dir.mkdir(parents=True, exist_ok=True)

    def link(at: Path, target: Path) -> None:
        at.symlink_to(os.path.relpath(target, at.parent))

    link(mdev_dir / "mdev_type", type_dir)
    link(type_dir / "devices" / uuid, mdev_dir)
    link(mdev_dir / "iommu_group", group_dir)
    link(group_dir / "devices" / uuid, mdev_dir)
    link(mdev_dir / "driver", driver_dir)
    link(driver_dir / uuid, mdev_dir)
    (host_root / "dev" / "vfio" / str(group)).write_text("")
    link(sys_dir / "bus" / "mdev" / "devices" / uuid, mdev_dir)  # last: discovery sees a complete mdev


# -- the real process ------------------------------------------------------------------------------------


def serve_command(host_root: Path, kubelet_dir: Path, *extra: str) -> list[str]:
    code = "from plugin.cli import main; main()"
    return [
        sys.executable,
        "-c",
        code,
        "serve",
        "--host-root",
        str(host_root),
        "--kubelet-dir",
        str(kubelet_dir),
        *extra,
    ]


def plugin_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPU_PLUGIN_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


@contextmanager
def serve_process(
    host_root: Path, kubelet_dir: Path, *extra: str, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``gpu-device-plugin serve`` as a process (stderr to ``log``); SIGTERM and reaped when the block ends."""
    log = log or kubelet_dir.parent / "plugin.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            serve_command(host_root, kubelet_dir, "--scan-interval", "0.2", *extra),
            env=plugin_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class Refusal(NamedTuple):
    kind: str
    message: str
    device_id: str | None


def outcome(call: Callable[[], Allocation]) -> Allocation | Refusal:
    """What an Allocate answers: the allocation, or the refusal (its class, message and device)."""
    try:
        return call()
    except AllocationError as error:
        return Refusal(type(error).__name__, error.message, error.device_id)
