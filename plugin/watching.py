"""The manager's eyes: what wakes its loop (inotify on ``/dev/vfio``, the kubelet's directory and the node
agent's state directory, the kernel's device uevents, a wake pipe).

One role of the plugin's lifecycle, apart from registration (:mod:`plugin.registration`) and reconciling
(:mod:`plugin.manager`): block on file descriptors (no busy polling) until something may have changed, and say
whether that something calls for a rescan. Which entry changed never matters: a rescan or a reconcile looks
at everything, so a lost event (an inotify queue overflow) costs nothing. A watched directory may appear late
or be recreated: :meth:`NodeWatcher.ensure` (re)opens the watches whose directory exists now.
"""

from __future__ import annotations

import contextlib
import os
import select
from pathlib import Path

from plugin.inotify import ENTRIES_CHANGED, IN_CLOSE_WRITE, IN_DELETE, IN_MOVED_TO, IN_Q_OVERFLOW, DirectoryWatch
from plugin.log import log_event
from plugin.uevent import open_uevents

STATE_CHANGED = IN_MOVED_TO | IN_CLOSE_WRITE | IN_DELETE
"""The node agent's state file replaced (it writes a temporary file and renames it over), written in place
or removed."""


class NodeWatcher:
    """inotify watches on the VFIO and kubelet directories (and the node agent's state directory, when a state
    file is given) and a wake-up pipe, behind one ``poll``."""

    def __init__(self, vfio_dir: Path, kubelet_dir: Path, state_file: Path | None = None) -> None:
        self.vfio_dir = vfio_dir
        self.kubelet_dir = kubelet_dir
        self.state_file = state_file
        """The node agent's state file as this process sees it; its directory is watched for the file's name.
        A write to ``current_vgpu_type`` (``vgpu apply``) has no uevent, but the agent replaces this file
        right after, so the new vGPUs are seen at once instead of at the next periodic scan."""
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller = select.poll()
        self._poller.register(self._wake_read, select.POLLIN)
        self._vfio_watch: DirectoryWatch | None = None
        self._kubelet_watch: DirectoryWatch | None = None
        self._state_watch: DirectoryWatch | None = None
        # Driver binds/unbinds and mdevs created/removed: sysfs has no inotify, and /dev/vfio changes only
        # with a group's first or last VFIO function (plugin.uevent).
        self._uevents = open_uevents()
        if self._uevents is not None:
            self._poller.register(self._uevents.fileno(), select.POLLIN)

    def wake(self) -> None:
        """End a :meth:`wait` now; safe from any thread and from a signal handler."""
        with contextlib.suppress(OSError):  # a full pipe means a wake-up is pending anyway
            os.write(self._wake_write, b"x")

    def ensure(self) -> None:
        """(Re)open the inotify watches whose directory exists now (it may appear late, or be recreated)."""
        if self._vfio_watch is None:
            self._vfio_watch = self._open_watch(self.vfio_dir)
        if self._kubelet_watch is None:
            self._kubelet_watch = self._open_watch(self.kubelet_dir)
        if self._state_watch is None and self.state_file is not None:
            # Missing until the agent first runs (deploy/ mounts it DirectoryOrCreate, so it is there): watched
            # from the rescan after it appears; the periodic rescan covers the time before.
            self._state_watch = self._open_watch(self.state_file.parent, STATE_CHANGED)

    def wait(self, timeout_ms: int) -> bool:
        """Block until woken, a watched directory changes, a device uevent comes or ``timeout_ms`` pass; True if
        ``/dev/vfio`` changed, the kernel announced a bind, unbind or mdev change, or the node agent's state file
        was replaced (device health or vGPU types: rescan now)."""
        vfio_changed = False
        for descriptor, _ in self._poller.poll(timeout_ms):
            if descriptor == self._wake_read:
                self._drain_wake()
            elif self._vfio_watch is not None and descriptor == self._vfio_watch.fileno():
                self._vfio_watch = self._drain_watch(self._vfio_watch)
                vfio_changed = True
            elif self._kubelet_watch is not None and descriptor == self._kubelet_watch.fileno():
                self._kubelet_watch = self._drain_watch(self._kubelet_watch)
            elif self._state_watch is not None and descriptor == self._state_watch.fileno():
                self._state_watch, changed = self._drain_state_watch(self._state_watch)
                vfio_changed = changed or vfio_changed
            elif self._uevents is not None and descriptor == self._uevents.fileno():
                vfio_changed = self._uevents.drain() or vfio_changed
        return vfio_changed

    def close(self) -> None:
        """Close the watches (the wake pipe stays: :meth:`wake` remains safe to call)."""
        for watch in (self._vfio_watch, self._kubelet_watch, self._state_watch):
            if watch is not None:
                self._poller.unregister(watch.fileno())
                watch.close()
        self._vfio_watch = self._kubelet_watch = self._state_watch = None
        if self._uevents is not None:
            self._poller.unregister(self._uevents.fileno())
            self._uevents.close()
            self._uevents = None

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _open_watch(self, directory: Path, mask: int = ENTRIES_CHANGED) -> DirectoryWatch | None:
        if not directory.is_dir():
            return None
        try:
            watch = DirectoryWatch(directory, mask)
        except OSError as exc:
            log_event("watch_failed", directory=str(directory), error=str(exc))
            return None
        self._poller.register(watch.fileno(), select.POLLIN)
        return watch

    def _drain_watch(self, watch: DirectoryWatch) -> DirectoryWatch | None:
        """Read the pending events (only that something changed matters); drop a watch whose directory went."""
        return self._drain_state_watch(watch)[0]

    def _drain_state_watch(self, watch: DirectoryWatch) -> tuple[DirectoryWatch | None, bool]:
        """:meth:`_drain_watch`, and whether the state file's entry was among the events (or events were lost,
        or the directory went: the file may have changed with it)."""
        name = self.state_file.name if self.state_file is not None else None
        try:
            events = watch.read(0)
            failed = False
        except OSError as exc:
            log_event("watch_failed", directory=str(watch.path), error=str(exc))
            events, failed = [], True
        touched = any(event.name == name or event.mask & IN_Q_OVERFLOW for event in events)
        if failed or watch.ended or not watch.path.is_dir():
            self._poller.unregister(watch.fileno())
            watch.close()
            return None, True
        return watch, touched
