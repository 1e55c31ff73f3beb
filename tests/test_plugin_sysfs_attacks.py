"""Issue 11, findings 8 and 9: discovery reads a node's sysfs it must not trust blindly.

- a FIFO where an attribute should be must not hang the scan (nor SIGTERM behind it);
- a huge attribute file must not be read whole (1 GiB took 5.2 GB);
- links resolve inside the host root, as a chroot would: an absolute target is re-rooted, ``..`` stops at
  the root, so no resource is ever named from a file outside it;
- a ``numa_node`` past int64 (or past the kernel's largest node) means no topology and a warning, and the
  ``ListAndWatch`` message can still be built.

Each runs twice: with the kernel resolving (``openat2`` ``RESOLVE_IN_ROOT``) and with the Python resolver
used where ``openat2`` is missing.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from plugin.inventory import Inventory
from plugin.server import list_response
from plugin.sysfs import MAX_ATTRIBUTE_BYTES, HostRoot, ReadError
from simkit.fixture_nodes import NODE01, VGPU_NODE
from simkit.sysfs_fixture import build
from tests.discovery_support import discover
from tests.libvirt_support import missing

SCAN_BOUND = 5.0
"""Seconds a scan of a small tree may take here; the attacks made it hang or take much longer."""
TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
T4_1Q = "nvidia.com/GRID_T4-1Q"
MDEV = "4b20d080-1b54-4048-85b3-a6a62d165c01"


def _discover_bounded(root: Path) -> Inventory:
    """Discover in a thread; fail (instead of hanging the suite) if it takes longer than the bound."""
    found: list[Inventory] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            found.append(discover(root))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(SCAN_BOUND)
    if thread.is_alive():
        raise AssertionError(f"discovery still running after {SCAN_BOUND} s")
    if errors:
        raise errors[0]
    return found[0]


@pytest.fixture
def node01(tmp_path: Path) -> Path:
    return build(NODE01, tmp_path / "node01")


def _gpu_dir(root: Path, address: str = "0000:3b:00.0") -> Path:
    return (root / "sys" / "bus" / "pci" / "devices" / address).resolve()


@pytest.mark.parametrize("name", ["uevent", "vendor"])
def test_a_fifo_attribute_does_not_hang_discovery(node01: Path, resolver: str, name: str) -> None:
    """A FIFO ``uevent`` is refused and the files read instead; a FIFO ``vendor`` is refused and the function
    left out."""
    vendor = _gpu_dir(node01) / name
    vendor.unlink()
    os.mkfifo(vendor)
    try:
        inventory = _discover_bounded(node01)
    finally:
        # a scan stuck in open() (before the fix) is released by a writer
        try:
            descriptor = os.open(vendor, os.O_WRONLY | os.O_NONBLOCK)
            os.close(descriptor)
        except OSError:
            pass
    assert any(f"0000:3b:00.0/{name}: not a regular file (a FIFO)" in warning for warning in inventory.warnings)
    offered = [device.id for device in inventory.resource(TU106).devices]
    if name == "uevent":
        assert inventory.resources == discover(build(NODE01, node01.parent / "intact")).resources
    else:
        assert "0000:3b:00.0" not in offered and len(offered) == 3


def test_a_huge_attribute_is_not_read_whole(node01: Path, resolver: str) -> None:
    numa = _gpu_dir(node01) / "numa_node"
    with numa.open("wb") as handle:
        handle.truncate(1 << 30)  # 1 GiB, sparse: costs no disk
    started = time.monotonic()
    inventory = _discover_bounded(node01)
    assert time.monotonic() - started < SCAN_BOUND
    device = inventory.resource(TU106).device("0000:3b:00.0")
    assert device.numa_node is None and device.healthy
    assert any(f"numa_node: larger than {MAX_ATTRIBUTE_BYTES} bytes" in warning for warning in inventory.warnings)


def test_a_huge_uevent_is_refused_and_the_files_read(node01: Path, resolver: str) -> None:
    with (_gpu_dir(node01) / "uevent").open("wb") as handle:
        handle.truncate(1 << 30)
    inventory = _discover_bounded(node01)
    assert any(
        f"0000:3b:00.0/uevent: larger than {MAX_ATTRIBUTE_BYTES} bytes" in warning for warning in inventory.warnings
    )
    assert inventory.resources == discover(build(NODE01, node01.parent / "intact")).resources


def test_other_file_kinds_are_refused_with_a_reason(node01: Path, resolver: str) -> None:
    gpu = _gpu_dir(node01)
    (gpu / "uevent").unlink()  # else class is not read at all
    (gpu / "class").unlink()
    (gpu / "class").mkdir()
    inventory = _discover_bounded(node01)
    assert len(inventory.resource(TU106).devices) == 3
    assert any("class: not a regular file (a directory)" in warning for warning in inventory.warnings)


def _vgpu(tmp_path: Path) -> tuple[Path, Path]:
    """The vGPU node and, next to it (outside its root), a directory posing as an mdev type named EVIL."""
    root = build(VGPU_NODE, tmp_path / "vgpu")
    outside = tmp_path / "outside" / "type"
    outside.mkdir(parents=True)
    (outside / "name").write_text("EVIL TYPE\n")
    return root, outside


def _mdev_type_link(root: Path) -> Path:
    return (root / "sys" / "bus" / "mdev" / "devices" / MDEV).resolve() / "mdev_type"


def test_an_absolute_link_out_of_the_root_does_not_name_a_resource(tmp_path: Path, resolver: str) -> None:
    root, outside = _vgpu(tmp_path)
    link = _mdev_type_link(root)
    link.unlink()
    link.symlink_to(outside)  # absolute: the host's own filesystem, not the node's
    inventory = _discover_bounded(root)
    assert not [name for name in inventory.resource_names if "EVIL" in name]
    assert any(f"skipping mdev {MDEV}" in warning for warning in inventory.warnings)


def test_dot_dot_stops_at_the_root(tmp_path: Path, resolver: str) -> None:
    root, _ = _vgpu(tmp_path)
    link = _mdev_type_link(root)
    link.unlink()
    link.symlink_to("../" * 40 + "outside/type")  # far more .. than the depth: would reach tmp_path/outside
    inventory = _discover_bounded(root)
    assert not [name for name in inventory.resource_names if "EVIL" in name]


def test_an_absolute_link_is_rerooted_like_a_chroot(tmp_path: Path, resolver: str) -> None:
    root, _ = _vgpu(tmp_path)
    link = _mdev_type_link(root)
    real = link.resolve()
    link.unlink()
    link.symlink_to("/" + str(real.relative_to(root)))  # /sys/devices/…/mdev_supported_types/nvidia-230
    inventory = _discover_bounded(root)
    assert MDEV in [device.id for device in inventory.resource(T4_1Q).devices]


def test_a_link_loop_is_a_missing_file(tmp_path: Path, resolver: str) -> None:
    root, _ = _vgpu(tmp_path)
    link = _mdev_type_link(root)
    link.unlink()
    link.symlink_to("mdev_type")  # itself
    inventory = _discover_bounded(root)
    assert MDEV not in [device.id for resource in inventory.resources for device in resource.devices]


def test_host_root_reads_refuse_escapes_directly(tmp_path: Path, resolver: str) -> None:
    root = tmp_path / "root"
    (root / "sys").mkdir(parents=True)
    (tmp_path / "secret").write_text("outside\n")
    (root / "sys" / "abs").symlink_to(tmp_path / "secret")
    (root / "sys" / "rel").symlink_to("../../secret")
    (root / "secret").write_text("inside\n")
    fs = HostRoot(str(root))
    try:
        assert fs.read("/sys/rel") == "inside\n"  # .. stopped at the root, found the root's own /secret
        assert fs.read("/sys/abs") is None  # /<tmp>/secret does not exist under the root
        os.mkfifo(root / "fifo")
        with pytest.raises(ReadError, match="a FIFO"):
            fs.read("/fifo")
    finally:
        fs.close()


@pytest.mark.parametrize("value", [str(2**63), "1024", "99999999999999999999999999"])
def test_numa_node_out_of_range_means_no_topology_and_a_warning(node01: Path, value: str, resolver: str) -> None:
    (_gpu_dir(node01) / "numa_node").write_text(value + "\n")
    inventory = _discover_bounded(node01)
    resource = inventory.resource(TU106)
    assert resource.device("0000:3b:00.0").numa_node is None
    assert resource.device("0000:3b:00.0").healthy
    assert any("past the kernel's largest NUMA node" in warning for warning in inventory.warnings)
    message = list_response(resource)  # raised ValueError before: the kubelet saw 0 devices
    assert len(message.devices) == 4


def test_a_directory_handle_reads_as_host_root_does(tmp_path: Path) -> None:
    """Reads through :meth:`HostRoot.directory` (one resolution per device) keep HostRoot's rules."""
    root = tmp_path / "root"
    device = root / "sys" / "devices" / "dev0"
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x10de\n")
    (root / "etc").mkdir()
    (root / "etc" / "secret").write_text("inside the root\n")
    (tmp_path / "secret").write_text("outside the root\n")
    (device / "escape").symlink_to("/etc/secret")  # absolute: must start again at the host root
    os.mkfifo(device / "fifo")
    (device / "driver").symlink_to("../../bus/pci/drivers/vfio-pci")
    fs = HostRoot(str(root))
    with fs, fs.directory("/sys/devices/dev0") as handle:
        assert handle.read("vendor") == "0x10de\n"
        assert handle.read("escape") == fs.read("/sys/devices/dev0/escape") == "inside the root\n"
        assert handle.read("missing") is None
        with pytest.raises(ReadError, match="not a regular file"):
            handle.read("fifo")
        assert handle.readlink_name("driver") == "vfio-pci"
        assert handle.readlink_name("vendor") is None
    with fs.directory("/sys/devices/nowhere") as gone:
        assert gone.read("vendor") is None


@pytest.mark.parametrize("lister", ["getdents64", "os.listdir"])
def test_listing_a_directory_gives_every_entry_once(
    tmp_path: Path, resolver: str, lister: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HostRoot.listdir as os.listdir gives it, also past one getdents64 buffer (and without getdents64)."""
    if lister == "os.listdir":
        monkeypatch.setattr(HostRoot, "list_entries", None)
    elif HostRoot.list_entries is None:
        # glibc has had it since 2.30 (Debian 12: 2.36): on the platform the project runs on, a missing one is
        # a broken binding, so it fails under CI like every other missing piece.
        missing("getdents64 is not available here (libc without it?)", "getdents64 missing")
    big = tmp_path / "root" / "sys" / "kernel" / "iommu_groups"
    big.mkdir(parents=True)
    names = {f"{number}-{'x' * (number % 200)}" for number in range(3000)}  # ~330 KB of records: many calls
    for name in names:
        (big / name).mkdir()
    (big / "link").symlink_to("/etc")
    (big / "caf\udce9").mkdir()  # not UTF-8: kept as os.listdir keeps it (surrogateescape)
    with HostRoot(str(tmp_path / "root")) as fs:
        listed = fs.listdir("/sys/kernel/iommu_groups")
        assert sorted(listed) == sorted(os.listdir(big))
        assert len(listed) == len(names) + 2
        assert fs.listdir("/sys/kernel/iommu_groups/7-xxxxxxx") == []
        small = big / "7-xxxxxxx"  # a few entries, read in one getdents64 call and parsed here
        for name in ("0000:3b:00.0", "caf\udce9", "y" * 255):
            (small / name).mkdir()
        assert sorted(fs.listdir("/sys/kernel/iommu_groups/7-xxxxxxx")) == sorted(os.listdir(small))
        with pytest.raises(FileNotFoundError):
            fs.listdir("/sys/kernel/iommu_groups/missing")
        (big / "file").write_text("")
        with pytest.raises(NotADirectoryError):
            fs.listdir("/sys/kernel/iommu_groups/file")
