"""The host root primitives Allocate uses (issue 12) keep HostRoot's rule: nothing is read outside the host root.

- :class:`~plugin.hostroot.SharedRoot` lends one root descriptor to a :class:`~plugin.hostroot.HostRoot` per
  request and closes it only once the last borrower gave it back;
- :meth:`Directory.exists <plugin.hostroot.Directory.exists>` looks one name up relative to an open handle
  (``fstatat``, no link followed): a link is resolved inside the root, so a link out of it finds nothing;
- :meth:`HostRoot.listdir_few` lists as :meth:`HostRoot.listdir` does.

Each runs with the kernel resolving (``openat2``) and with the Python resolver.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plugin.allocation import Allocator, DeviceUnavailable, allocate
from plugin.hostroot import HostRoot, SharedRoot
from simkit.fixture_nodes import NODE01
from tests.discovery_support import build_node, discover


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with ``/dev/vfio`` holding a node, links inside and out of the root, and an outside twin."""
    vfio = tmp_path / "root" / "dev" / "vfio"
    vfio.mkdir(parents=True)
    (vfio / "vfio").write_text("")
    (vfio / "74").write_text("")
    (tmp_path / "outside").write_text("not the node's\n")
    (vfio / "absolute-out").symlink_to(tmp_path / "outside")  # re-rooted: /<tmp>/outside is not in the root
    (vfio / "dot-dot-out").symlink_to("../../../outside")  # .. stops at the root: <root>/outside is absent
    (vfio / "absolute-in").symlink_to("/dev/vfio/74")  # re-rooted onto the root's own node
    (vfio / "dangling").symlink_to("nothing")
    (vfio / "directory").mkdir()
    return tmp_path / "root"


def test_a_directory_handle_says_what_exists_as_host_root_does(root: Path, resolver: str) -> None:
    names = ["vfio", "74", "75", "absolute-out", "dot-dot-out", "absolute-in", "dangling", "directory", ".", ".."]
    with HostRoot(str(root)) as fs, fs.directory("/dev/vfio") as vfio:
        found = {name: vfio.exists(name) for name in names}
        assert found == {name: fs.exists(f"/dev/vfio/{name}") for name in names}
    assert found == {
        "vfio": True,
        "74": True,
        "75": False,
        "absolute-out": False,
        "dot-dot-out": False,
        "absolute-in": True,
        "dangling": False,
        "directory": True,
        ".": True,
        "..": True,
    }


def test_a_handle_on_a_directory_linked_out_of_the_root_finds_nothing(tmp_path: Path, resolver: str) -> None:
    twin = tmp_path / "outside-vfio"
    twin.mkdir()
    (twin / "vfio").write_text("")
    (tmp_path / "root" / "dev").mkdir(parents=True)
    (tmp_path / "root" / "dev" / "vfio").symlink_to(twin)
    with HostRoot(str(tmp_path / "root")) as fs, fs.directory("/dev/vfio") as vfio:
        assert not vfio.exists("vfio")
    (tmp_path / "root" / "dev" / "vfio").unlink()
    (tmp_path / "root" / "dev" / "vfio").symlink_to("../../outside-vfio")
    with HostRoot(str(tmp_path / "root")) as fs, fs.directory("/dev/vfio") as vfio:
        assert not vfio.exists("vfio")


def test_allocate_finds_no_container_behind_a_dev_vfio_link_out_of_the_root(tmp_path: Path, resolver: str) -> None:
    host = build_node(NODE01, tmp_path)
    resource = discover(host).resource("nvidia.com/TU106_GEFORCE_RTX_2060_REV__A")
    outside = tmp_path / "outside-vfio"
    (host / "dev" / "vfio").rename(outside)  # every node still there, but outside the root
    (host / "dev" / "vfio").symlink_to(outside)
    gpu = "0000:3b:00.0"
    with (
        Allocator(host) as served,
        pytest.raises(DeviceUnavailable, match="/dev/vfio/30 is missing; /dev/vfio/vfio is missing"),
    ):
        served.allocate(resource, [gpu])
    with pytest.raises(DeviceUnavailable, match="/dev/vfio/30 is missing; /dev/vfio/vfio is missing"):
        allocate(resource, [gpu], host)


def test_listdir_few_lists_as_listdir_and_stays_in_the_root(tmp_path: Path, resolver: str) -> None:
    group = tmp_path / "root" / "sys" / "kernel" / "iommu_groups" / "7" / "devices"
    group.mkdir(parents=True)
    for name in ("0000:3b:00.0", "0000:3b:00.1", "caf\udce9"):
        (group / name).symlink_to("../../../../devices")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "0000:00:00.0").write_text("")
    (tmp_path / "root" / "sys" / "kernel" / "iommu_groups" / "8").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "root" / "file").write_text("")
    with HostRoot(str(tmp_path / "root")) as fs:
        path = "/sys/kernel/iommu_groups/7/devices"
        assert sorted(fs.listdir_few(path)) == sorted(fs.listdir(path)) == sorted(os.listdir(group))
        with pytest.raises(FileNotFoundError):
            fs.listdir_few("/sys/kernel/iommu_groups/8")  # /<tmp>/elsewhere is not in the root
        with pytest.raises(NotADirectoryError):
            fs.listdir_few("/file")


def test_a_shared_root_is_closed_once_its_last_borrower_gives_it_back(root: Path, resolver: str) -> None:
    before = open_descriptors()
    shared = SharedRoot(str(root))
    first, second = shared.borrow(), shared.borrow()
    assert first.exists("/dev/vfio/74") and second.exists("/dev/vfio/74")
    shared.close()  # the server stops while two requests still read
    assert first.read("/dev/vfio/vfio") == "" and second.listdir("/dev/vfio")
    first.close()
    assert second.exists("/dev/vfio/vfio")
    second.close()
    assert open_descriptors() == before
    with shared.borrow() as late:  # a request after the stop reads through its own descriptor
        assert late.exists("/dev/vfio/74") and not late.exists("/dev/vfio/absolute-out")
    assert open_descriptors() == before


def test_a_shared_root_that_is_missing_reads_as_missing_until_it_appears(tmp_path: Path, resolver: str) -> None:
    before = open_descriptors()
    with SharedRoot(str(tmp_path / "later")) as shared:
        with shared.borrow() as fs:
            assert not fs.exists("/dev")
            assert fs.read("/dev/x") is None
        (tmp_path / "later" / "dev").mkdir(parents=True)
        (tmp_path / "later" / "dev" / "x").write_text("here\n")
        with shared.borrow() as fs:
            assert fs.read("/dev/x") == "here\n"
    assert open_descriptors() == before


def test_a_borrowed_root_given_back_twice_gives_back_once(root: Path, resolver: str) -> None:
    before = open_descriptors()
    shared = SharedRoot(str(root))
    borrowed = shared.borrow()
    borrowed.close()
    borrowed.close()
    with shared.borrow() as again:
        assert again.exists("/dev/vfio/vfio")
        shared.close()
        assert again.exists("/dev/vfio/74")  # still lent: not closed under the request
    assert open_descriptors() == before
