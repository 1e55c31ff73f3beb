"""Reading below a root: links resolve inside it, reads and listings are bounded, absence is told apart."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from runtime.confined import MAX_LINKS, ConfinedRoot, NotInRoot
from schemas.errors import InputError


@pytest.fixture
def tree(tmp_path: Path) -> tuple[ConfinedRoot, Path]:
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f.json").write_bytes(b"inside")
    (tmp_path / "secret").write_bytes(b"outside")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "f.json").write_bytes(b"outside-dir")
    return ConfinedRoot(root, "test root"), tmp_path


def test_a_file_and_a_listing_are_read(tree: tuple[ConfinedRoot, Path]) -> None:
    confined, _ = tree
    assert confined.read_file(PurePosixPath("a/b/f.json"), 100, "file") == b"inside"
    assert confined.list_dir(PurePosixPath("a/b"), 10) == ["f.json"]
    assert confined.list_dir(PurePosixPath("."), 10) == ["a"]


def test_links_resolve_inside_the_root_never_outside(tree: tuple[ConfinedRoot, Path]) -> None:
    confined, base = tree
    root = confined.root
    os.symlink("/a/b/f.json", root / "abs")  # absolute: from the root, not from /
    os.symlink("../../../../secret", root / "a" / "up")  # .. stops at the root
    os.symlink(str(base / "secret"), root / "host")  # a host path: looked up inside the root
    os.symlink(str(base / "outdir"), root / "a" / "dirlink")
    assert confined.read_file(PurePosixPath("abs"), 100, "file") == b"inside"
    with pytest.raises(NotInRoot, match="does not exist"):
        confined.read_file(PurePosixPath("a/up"), 100, "file")
    with pytest.raises(NotInRoot):
        confined.read_file(PurePosixPath("host"), 100, "file")
    with pytest.raises(NotInRoot):
        confined.read_file(PurePosixPath("a/dirlink/f.json"), 100, "file")
    with pytest.raises(NotInRoot):
        confined.list_dir(PurePosixPath("a/dirlink"), 10)
    assert confined.read_file(PurePosixPath("a/../a/b/./f.json"), 100, "file") == b"inside"
    assert confined.read_file(PurePosixPath("../../a/b/f.json"), 100, "file") == b"inside"


def test_a_link_loop_is_refused(tree: tuple[ConfinedRoot, Path]) -> None:
    confined, _ = tree
    os.symlink("loop", confined.root / "loop")
    with pytest.raises(InputError, match=f"more than {MAX_LINKS} symbolic links"):
        confined.read_file(PurePosixPath("loop"), 100, "file")


def test_missing_special_and_oversized_files_are_named(tree: tuple[ConfinedRoot, Path]) -> None:
    confined, _ = tree
    with pytest.raises(NotInRoot, match=r"file '.*/root/a/b/none' does not exist"):
        confined.read_file(PurePosixPath("a/b/none"), 100, "file")
    with pytest.raises(NotInRoot, match="does not exist"):
        confined.list_dir(PurePosixPath("a/nothing"), 10)
    with pytest.raises(NotInRoot, match="is not a directory"):
        confined.read_file(PurePosixPath("a/b/f.json/x"), 100, "file")
    with pytest.raises(InputError, match="over the 3-byte limit"):
        confined.read_file(PurePosixPath("a/b/f.json"), 3, "file")
    os.mkfifo(confined.root / "fifo")
    with pytest.raises(InputError, match="is a FIFO, not a regular file"):
        confined.read_file(PurePosixPath("fifo"), 100, "file")
    with pytest.raises(InputError, match="not a regular file"):
        confined.read_file(PurePosixPath("a"), 100, "file")
    with pytest.raises(NotInRoot, match=r"test root .* does not exist"):
        ConfinedRoot(confined.root / "gone", "test root").list_dir(PurePosixPath("."), 1)


def test_listings_are_bounded(tree: tuple[ConfinedRoot, Path]) -> None:
    confined, _ = tree
    for index in range(5):
        (confined.root / f"n{index}").write_bytes(b"")
    with pytest.raises(InputError, match="more than 3 entries"):
        confined.list_dir(PurePosixPath("."), 3)


def test_no_descriptor_is_left_open(tree: tuple[ConfinedRoot, Path]) -> None:
    confined, _ = tree
    os.symlink("/a/b", confined.root / "lnk")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        confined.read_file(PurePosixPath("lnk/f.json"), 100, "file")
        confined.list_dir(PurePosixPath("lnk"), 10)
        with pytest.raises(InputError):
            confined.read_file(PurePosixPath("a/b/none"), 100, "file")
        with pytest.raises(InputError):
            confined.read_file(PurePosixPath("a/b/f.json/x"), 100, "file")
    assert len(os.listdir("/proc/self/fd")) == before
