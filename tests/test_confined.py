"""Reading below a root: links resolve inside it, reads and listings are bounded, absence is told apart."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path, PurePosixPath

import pytest

from runtime.confined import MAX_LINKS, ConfinedRoot, NotInRoot
from schemas.errors import InputError
from tests.kernel_paths_support import watch_kernel_paths


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


def test_a_link_to_a_double_slash_path_stays_inside_the_root(tree: tuple[ConfinedRoot, Path], resolver: str) -> None:
    """``//x`` is an absolute path like ``/x``: it starts at the root, never at the host's ``/`` (the Python walk
    once took the component ``//`` as a name and opened the host's root through it)."""
    confined, base = tree
    os.symlink(f"/{base}/secret", confined.root / "file")
    os.symlink(f"/{base}/outdir", confined.root / "dir")
    os.symlink("//a/b/f.json", confined.root / "inside")
    with pytest.raises(NotInRoot, match="does not exist"):
        confined.read_file(PurePosixPath("file"), 100, "file")
    with pytest.raises(NotInRoot, match="does not exist"):
        confined.list_dir(PurePosixPath("dir"), 10)
    with pytest.raises(NotInRoot, match="does not exist"):
        confined.read_file(PurePosixPath("dir/f.json"), 100, "file")
    assert confined.read_file(PurePosixPath("inside"), 100, "file") == b"inside"


def _damaged(tmp_path: Path) -> ConfinedRoot:
    """A tree with every kind of damage a driver's (or an attacker's) tree can have, beside ordinary entries."""
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f.json").write_bytes(b"inside")
    (root / "a" / "b" / "g.json").write_bytes(b"second")
    (root / "swapped").write_bytes(b"a file where a directory belongs")
    (root / "empty").mkdir()
    (tmp_path / "secret").write_bytes(b"outside")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "f.json").write_bytes(b"outside-dir")
    links = {
        "abs": "/a/b/f.json",  # absolute: from the root
        "absdir": "/a/b",
        "a/up": "../../../../secret",  # .. above the root stops at it
        "a/updir": "../../../a/b",
        "host": str(tmp_path / "secret"),  # a host path, looked up inside the root
        "hostdir": str(tmp_path / "outdir"),
        "slashes": f"//{tmp_path}/secret",
        "loop": "loop",
        "ping": "pong",
        "pong": "ping",
        "dangling": "nothing/here",
        "danglingabs": "/nothing",
        "throughfile": "swapped/x",
        "tofile": "swapped",
        "chain1": "chain2",
        "chain2": "/absdir/../b/./g.json",
        "a/b/self": ".",
        "a/b/parent": "..",
    }
    for name, target in links.items():
        os.symlink(target, root / name)
    return ConfinedRoot(root, "test root")


_DAMAGED_READS = [
    "a/b/f.json",
    "abs",
    "absdir/f.json",
    "a/up",
    "a/updir/g.json",
    "host",
    "hostdir/f.json",
    "slashes",
    "loop",
    "ping",
    "dangling",
    "danglingabs",
    "throughfile",
    "tofile",
    "tofile/x",
    "swapped/x",
    "chain1",
    "a/b/self/self/f.json",
    "a/b/parent/b/g.json",
    "../../a/b/f.json",
    "a/../a/b/./f.json",
    "a",
    "empty",
    ".",
    "a/b/none",
    "none/none",
    "a/b/f.json/x",
    "loop/x",
]
_DAMAGED_LISTINGS = [
    ".",
    "a/b",
    "absdir",
    "a/updir",
    "hostdir",
    "loop",
    "dangling",
    "tofile",
    "swapped",
    "empty",
    "a/b/f.json",
    "a/b/parent",
    "a/b/self",
    "throughfile",
    "none",
    "../..",
]


def _outcome(call: Callable[[], object]) -> tuple[str, object]:
    try:
        return "ok", call()
    except InputError as exc:
        return type(exc).__name__, str(exc)


def test_the_kernel_and_the_python_walk_agree_on_ordinary_and_damaged_trees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read and listing gives the same bytes, names or error (type and message) with ``openat2`` and
    with the Python walk used where the kernel lacks it (forced here as a seccomp refusal would)."""
    from runtime.hostroot import HostRoot
    from tests.libvirt_support import missing

    if HostRoot.openat2 is None:
        missing("openat2 is not available here (Linux >= 5.6 has it)", "openat2")
    confined = _damaged(tmp_path)

    def everything() -> list[tuple[str, object]]:
        outcomes = [_outcome(partial(confined.read_file, PurePosixPath(p), 100, "file")) for p in _DAMAGED_READS]
        outcomes += [_outcome(partial(confined.list_dir, PurePosixPath(p), 10)) for p in _DAMAGED_LISTINGS]
        outcomes.append(_outcome(lambda: confined.list_dir(PurePosixPath("a/b"), 1)))
        outcomes.append(_outcome(lambda: confined.list_dir(PurePosixPath("."), 100)))
        outcomes.append(_outcome(lambda: confined.read_file(PurePosixPath("a/b/f.json"), 3, "file")))
        return outcomes

    kernel = everything()
    monkeypatch.setattr(HostRoot, "openat2", None)
    python = everything()
    assert kernel == python
    # and the trees are damaged as meant: reads inside, refusals and absences where the damage is
    by_path = dict(zip(_DAMAGED_READS, python, strict=False))
    assert by_path["abs"] == ("ok", b"inside") and by_path["chain1"] == ("ok", b"second")
    assert by_path["slashes"][0] == by_path["host"][0] == by_path["a/up"][0] == "NotInRoot"
    assert by_path["loop"][0] == by_path["ping"][0] == "InputError"
    assert by_path["throughfile"][0] == "NotInRoot" and "is not a directory" in str(by_path["throughfile"][1])


def test_each_read_opens_the_root_once_and_lets_the_kernel_resolve(
    tree: tuple[ConfinedRoot, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``openat2`` is there, a read is one in-root open of the whole path (no walk in Python: no lstat, no
    readlink of each component), and a call of several reads opens the root once."""
    confined, _ = tree
    os.symlink("/a/b", confined.root / "lnk")
    seen = watch_kernel_paths(monkeypatch, confined.root)
    with confined.open() as opened_root:
        for _ in range(3):
            assert opened_root.read_file("lnk/f.json", 100, "file") == b"inside"
            with opened_root.directory("lnk", 10) as listing:
                assert listing.names == ["f.json"]
                assert listing.read("f.json", 100, "file") == b"inside"
    assert seen.root_opens == 1
    assert seen.asked == [b"lnk/f.json", b"lnk"] * 3


def test_a_listed_name_swapped_for_a_link_is_read_inside_the_root(
    tree: tuple[ConfinedRoot, Path], resolver: str
) -> None:
    """Between the listing and the read, a name the listing gave becomes a link: it is not followed from the
    listed directory but resolved again inside the root (an absolute target from the root, never the host's)."""
    confined, base = tree
    (confined.root / "a" / "b" / "g.json").write_bytes(b"second")
    with confined.open() as opened, opened.directory("a/b", 10) as listing:
        assert listing.names == ["f.json", "g.json"]
        (confined.root / "a" / "b" / "f.json").unlink()
        os.symlink(str(base / "secret"), confined.root / "a" / "b" / "f.json")
        with pytest.raises(NotInRoot, match=r"file '.*/root/a/b/f\.json' does not exist"):
            listing.read("f.json", 100, "file")
        (confined.root / "a" / "b" / "g.json").unlink()
        os.symlink("/a/b/h.json", confined.root / "a" / "b" / "g.json")
        (confined.root / "a" / "b" / "h.json").write_bytes(b"inside")
        assert listing.read("g.json", 100, "file") == b"inside"
        (confined.root / "a" / "b" / "h.json").unlink()
        os.mkfifo(confined.root / "a" / "b" / "h.json")
        with pytest.raises(InputError, match="is a FIFO, not a regular file"):
            listing.read("h.json", 100, "file")
