"""The inotify wrapper on real temp dirs: files and unix sockets appearing, going, renamed, changed."""

from __future__ import annotations

import os
import select
import shutil
import socket
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugin.inotify import (
    ENTRIES_CHANGED,
    IN_ATTRIB,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_ISDIR,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    DirectoryWatch,
    Event,
    describe_mask,
    parse_events,
)


@pytest.fixture
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kp", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def collect(watch: DirectoryWatch, until: int, timeout: float = 1.0) -> list[Event]:
    """Read until an event with a bit of ``until`` arrives (each read waits up to ``timeout``)."""
    events: list[Event] = []
    while not any(event.mask & until for event in events):
        batch = watch.read(timeout)
        assert batch, f"no {describe_mask(until)} event within {timeout} s; got {[str(e) for e in events]}"
        events.extend(batch)
    return events


def masks_for(events: list[Event], name: str) -> int:
    mask = 0
    for event in events:
        if event.name == name:
            mask |= event.mask
    return mask


def test_file_created_and_deleted(directory: Path) -> None:
    with DirectoryWatch(directory, IN_CREATE | IN_DELETE) as watch:
        assert watch.read(0) == []
        (directory / "74").write_text("")
        assert masks_for(collect(watch, IN_CREATE), "74") & IN_CREATE
        (directory / "74").unlink()
        events = collect(watch, IN_DELETE)
        assert Event("74", IN_DELETE) in events


def test_unix_socket_bound_and_removed(directory: Path) -> None:
    with DirectoryWatch(directory, ENTRIES_CHANGED) as watch:
        server = socket.socket(socket.AF_UNIX)
        try:
            server.bind(str(directory / "kubelet.sock"))
            assert masks_for(collect(watch, IN_CREATE), "kubelet.sock") & IN_CREATE
        finally:
            server.close()
        os.unlink(directory / "kubelet.sock")
        assert masks_for(collect(watch, IN_DELETE), "kubelet.sock") & IN_DELETE


def test_attribute_change(directory: Path) -> None:
    (directory / "vfio").write_text("")
    with DirectoryWatch(directory, IN_ATTRIB) as watch:
        os.chmod(directory / "vfio", 0o600)
        assert collect(watch, IN_ATTRIB) == [Event("vfio", IN_ATTRIB)]


def test_rename_pairs_moved_from_and_moved_to(directory: Path) -> None:
    (directory / "old.sock").write_text("")
    with DirectoryWatch(directory, IN_MOVED_FROM | IN_MOVED_TO) as watch:
        os.rename(directory / "old.sock", directory / "new.sock")
        events = collect(watch, IN_MOVED_TO)
        moved_from = next(event for event in events if event.mask & IN_MOVED_FROM)
        moved_to = next(event for event in events if event.mask & IN_MOVED_TO)
        assert (moved_from.name, moved_to.name) == ("old.sock", "new.sock")
        assert moved_from.cookie == moved_to.cookie != 0


def test_events_outside_the_mask_are_not_reported(directory: Path) -> None:
    with DirectoryWatch(directory, IN_DELETE) as watch:
        (directory / "a").write_text("")
        os.chmod(directory / "a", 0o600)
        assert watch.read(0) == []
        (directory / "a").unlink()
        assert collect(watch, IN_DELETE) == [Event("a", IN_DELETE)]


def test_subdirectories_carry_isdir(directory: Path) -> None:
    with DirectoryWatch(directory, IN_CREATE) as watch:
        (directory / "devices").mkdir()
        (event,) = collect(watch, IN_CREATE)
        assert event.name == "devices"
        assert event.is_dir
        assert event.mask == IN_CREATE | IN_ISDIR


def test_many_events_are_all_drained(directory: Path) -> None:
    with DirectoryWatch(directory, IN_CREATE) as watch:
        names = {f"file-with-a-long-name-{index:05d}" for index in range(3000)}  # more than one read's buffer
        for name in names:
            (directory / name).write_text("")
        seen: set[str] = set()
        while seen != names:
            batch = watch.read(1.0)
            assert batch, f"{len(names - seen)} creations never reported"
            seen.update(event.name for event in batch)


def test_the_watched_directory_removed_ends_the_watch(directory: Path) -> None:
    target = directory / "vfio"
    target.mkdir()
    with DirectoryWatch(target, ENTRIES_CHANGED) as watch:
        assert not watch.ended
        target.rmdir()
        events = collect(watch, IN_IGNORED)
        assert any(event.mask & IN_DELETE_SELF for event in events)
        assert watch.ended
        assert "ended" in repr(watch)


def test_the_watched_directory_moved_away_ends_the_watch(directory: Path) -> None:
    target = directory / "device-plugins"
    target.mkdir()
    with DirectoryWatch(target, IN_CREATE) as watch:
        target.rename(directory / "elsewhere")
        assert any(event.mask & IN_MOVE_SELF for event in collect(watch, IN_MOVE_SELF))
        assert watch.ended


def test_fileno_works_with_select(directory: Path) -> None:
    with DirectoryWatch(directory, IN_CREATE) as watch:
        assert select.select([watch], [], [], 0)[0] == []
        (directory / "x").write_text("")
        assert select.select([watch], [], [], 1.0)[0] == [watch]
        assert watch.read(0) == [Event("x", IN_CREATE)]
        assert select.select([watch.fileno()], [], [], 0)[0] == []


def test_missing_and_non_directory_paths_are_refused(directory: Path) -> None:
    with pytest.raises(FileNotFoundError):
        DirectoryWatch(directory / "absent")
    (directory / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        DirectoryWatch(directory / "file")


def test_close_releases_the_descriptor_and_is_idempotent(directory: Path) -> None:
    before = set(os.listdir("/proc/self/fd"))
    watch = DirectoryWatch(directory)
    descriptor = watch.fileno()
    assert str(descriptor) in os.listdir("/proc/self/fd")
    assert os.readlink(f"/proc/self/fd/{descriptor}") == "anon_inode:inotify"
    assert os.get_inheritable(descriptor) is False
    watch.close()
    watch.close()
    assert watch.closed
    assert set(os.listdir("/proc/self/fd")) == before
    with pytest.raises(ValueError, match="closed"):
        watch.read(0)
    with pytest.raises(ValueError, match="closed"):
        watch.fileno()


def test_parse_events_decodes_padded_names() -> None:
    record = struct.pack("iIII", 1, IN_CREATE, 0, 16) + b"kubelet.sock\0\0\0\0"
    record += struct.pack("iIII", 1, IN_DELETE_SELF, 0, 0)
    assert parse_events(record) == [Event("kubelet.sock", IN_CREATE), Event("", IN_DELETE_SELF)]
    assert describe_mask(IN_CREATE | IN_ISDIR) == "CREATE|ISDIR"
    assert describe_mask(0) == "0"
    assert str(Event("", IN_DELETE_SELF)) == ".: DELETE_SELF"
