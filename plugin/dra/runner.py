"""``gpu-device-plugin serve --dra``'s loop: the same discovery as the device plugin, served through DRA.

One thread, blocking on file descriptors like :class:`~plugin.manager.PluginManager` (inotify on
``/dev/vfio`` and the plugin registry, the kernel's uevents, a wake-up pipe; :class:`~plugin.watching.NodeWatcher`):

- at start: reconcile the checkpoint (:meth:`PrepareCore.start`), scan, serve the DRAPlugin and registration
  sockets (:class:`~plugin.dra.service.DraServer`);
- on a VFIO change, a uevent, or every ``scan_interval``: rescan (:func:`plugin.sysfs.scan`); the core
  prepares against the newest inventory, and each :class:`InventorySink` gets an inventory that differs from
  the last one it took (or the same one again after it failed, or after :data:`SINK_RESYNC_INTERVAL`): the
  seam where the ResourceSlice publisher (plugin/dra/kube.py) plugs in. Each sink publishes on its own thread
  (:class:`_SinkWorker`, the newest inventory waiting wins), so an API server that answers slowly or not at all
  never holds the scans, the health stream or ``/healthz``; after each scan the kubelet's health
  streams get the devices' health (:mod:`plugin.dra.health_stream`: sent when it changed, and again every
  ``KEEPALIVE`` seconds; a scan that fails sends nothing, so the kubelet turns the devices UNKNOWN after the
  timeout rather than hear a stale "healthy");
- a socket removed under us (a wiped registry directory) is served again, which makes the kubelet register
  us anew; a kubelet restart re-reads the registry directory and registers us again by itself, but it also
  deletes every ResourceSlice of the node when it starts (and a driver's slices when no plugin of it has been
  connected for a while), so each registration the kubelet confirms offers the sinks the current inventory
  again at once and once more :data:`REGISTRATION_RESYNC_DELAY` later; after a refusal
  (``NotifyRegistrationStatus`` with ``plugin_registered`` false, which the kubelet never retries) the
  registration socket is offered again every :data:`REREGISTER_AFTER` seconds;
- :meth:`request_stop` (SIGTERM) ends the loop: the registration socket goes first, so the kubelet
  deregisters before the endpoint disappears. Prepared claims stay prepared (their files and the checkpoint
  stay): a restarted plugin answers for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from plugin.config import PluginConfig
from plugin.dra.health_stream import device_states, health_timeout
from plugin.dra.options import DEFAULT_SCAN_INTERVAL
from plugin.dra.prepare import PrepareCore
from plugin.dra.service import DraServeError, DraServer
from plugin.inventory import Inventory
from plugin.log import log_event
from plugin.sysfs import scan
from plugin.watching import NodeWatcher
from runtime.pciids import PciIds
from schemas.errors import InputError

REREGISTER_AFTER = 30.0
"""Seconds after the kubelet refused us before the registration socket is offered again: a refusal may be
transient (the kubelet had not yet seen the previous instance's socket go), and it never retries by itself."""
LIVENESS_SLACK = 10.0
"""Seconds a loop turn may take beyond the scan interval before ``/healthz`` calls the loop stuck."""


SINK_RESYNC_INTERVAL = 300.0
"""Seconds after which a sink is offered an unchanged inventory again: the ResourceSlice publisher then lists
its slices (one call) and repairs any deleted under it (by hand, or by the garbage collector after the Node
object was re-created)."""


REGISTRATION_RESYNC_DELAY = 30.0
"""Seconds after a registration the kubelet confirmed when the sinks are offered the inventory a second time:
the kubelet's start-up deletion of the node's ResourceSlices runs in the background and may land after the
registration (Kubernetes ``pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go``, ``wipeResourceSlices``)."""


class InventorySink(Protocol):
    """Takes each new inventory of the node (e.g. publishes it as ResourceSlices). May raise: the error is
    logged and the same inventory is offered again at the next scan."""

    def publish(self, inventory: Inventory) -> None: ...


class _SinkWorker:
    """One sink's own thread: the loop hands it inventories (:meth:`hand`; the newest waiting one wins) and never
    waits for a publish, which may wait on the API server (20 s a call, several calls a sync). So a slow or dead
    API server never holds the scans, the prepares' inventory, the kubelet's health stream or ``/healthz``."""

    def __init__(self, sink: InventorySink, index: int) -> None:
        self.sink = sink
        self._changed = threading.Condition()
        self._pending: Inventory | None = None
        self._busy: Inventory | None = None
        self._stopped = False
        self.last: tuple[Inventory, float] | None = None
        """The inventory the sink last took without an error, and ``time.monotonic()`` then."""
        self._thread = threading.Thread(target=self._run, name=f"dra-sink-{index}", daemon=True)
        self._thread.start()

    def due(self, inventory: Inventory, now: float, resync: float) -> bool:
        """Whether ``inventory`` is news for the sink: not taken yet (or failed), not already on its way, or
        :data:`SINK_RESYNC_INTERVAL` old."""
        with self._changed:
            if inventory in (self._pending, self._busy):
                return False
            return self.last is None or self.last[0] != inventory or now >= self.last[1] + resync

    def hand(self, inventory: Inventory) -> None:
        with self._changed:
            self._pending = inventory
            self._changed.notify_all()

    def stop(self) -> None:
        """No more publishes; one under way finishes on its own (its calls have deadlines); never waited for."""
        with self._changed:
            self._stopped = True
            self._pending = None
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._pending is None and not self._stopped:
                    self._changed.wait()
                if self._stopped:
                    return
                inventory, self._pending = self._pending, None
                self._busy = inventory
            assert inventory is not None
            try:
                self.sink.publish(inventory)
            except Exception as exc:  # the publisher's trouble (API server down...) never stops the node side
                log_event("dra_publish_failed", sink=type(self.sink).__name__, error=f"{type(exc).__name__}: {exc}")
                done = None
            else:
                done = (inventory, time.monotonic())
            with self._changed:
                self._busy = None
                self.last = done  # failed: None, so the next scan hands it again


class DraRunner:
    """Runs the DRA plugin: :meth:`run` blocks until :meth:`request_stop`; safe to drive from a thread."""

    def __init__(
        self,
        config: PluginConfig,
        core: PrepareCore,
        server: DraServer,
        *,
        registry_dir: Path,
        scan_interval: float = DEFAULT_SCAN_INTERVAL,
        pci_ids: PciIds | None = None,
        warnings: Iterable[str] = (),
        sinks: Sequence[InventorySink] = (),
        reregister_after: float = REREGISTER_AFTER,
        registration_resync_delay: float = REGISTRATION_RESYNC_DELAY,
    ) -> None:
        if scan_interval <= 0:
            raise ValueError("scan_interval must be positive")
        self.config = config
        self.core = core
        self.server = server
        server.health.timeout_seconds = health_timeout(scan_interval)
        self.host_root = Path(config.host_root).absolute()
        self.scan_interval = scan_interval
        self.pci_ids = pci_ids
        self.sinks = list(sinks)
        self.reregister_after = reregister_after
        self.registration_resync_delay = registration_resync_delay
        self.ready = threading.Event()
        """Set once the first scan is in the core and both sockets are served."""
        self.scans = 0
        self.inventory: Inventory | None = None
        self._warnings = tuple(warnings)
        self._stop = threading.Event()
        self._serving = False
        self.sink_resync = SINK_RESYNC_INTERVAL
        self._workers: list[_SinkWorker] = []
        self._registrations_seen = 0
        """``RegistrationStatus.calls`` of the last confirmed registration acted on."""
        self._forced_resyncs: list[float] = []
        """``time.monotonic()`` times at which the sinks get the inventory even when unchanged."""
        state = config.node_agent_state
        agent_state = self.host_root / state.lstrip("/") if state else None
        self._watcher = NodeWatcher(self.host_root / "dev" / "vfio", registry_dir.absolute(), agent_state)
        self._next_scan = 0.0
        self._last_problem: str | None = None
        self._heartbeat: float | None = None
        self._finished = False

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop; safe from any thread and from a signal handler."""
        self._stop.set()
        self._watcher.wake()

    def liveness(self) -> str | None:
        """None while the loop runs and turned within ``2 * scan_interval + 10 s`` (``/healthz``); else why not."""
        heartbeat = self._heartbeat
        if self._finished:
            return "stopped: the DRA plugin's loop has ended"
        if heartbeat is None:
            return "not started: the DRA plugin's loop has not run yet"
        age, bound = time.monotonic() - heartbeat, 2 * self.scan_interval + LIVENESS_SLACK
        if age > bound:
            return f"stuck: the DRA plugin's loop last turned {age:.1f} s ago (bound {bound:.1f} s)"
        return None

    def readiness(self) -> str | None:
        """None once scanned, served and registered by the kubelet, and no damaged checkpoint is kept aside
        (``/readyz``: :meth:`PrepareCore.quarantine`); else why not."""
        problem = self.liveness()
        if problem is not None:
            return problem
        if not self.ready.is_set():
            return f"starting: {self._last_problem or 'the first scan is not served yet'}"
        status = self.server.registration.status
        if status.registered is not True:
            why = f": {status.error}" if status.error else " yet"
            return f"not registered with the kubelet{why} ({self.server.registration_socket})"
        return self.core.quarantine()

    def run(self) -> None:
        log_event("dra_starting", host_root=str(self.host_root), scan_interval=self.scan_interval)
        self._finished = False
        self._heartbeat = time.monotonic()
        self._workers = [_SinkWorker(sink, index) for index, sink in enumerate(self.sinks)]
        try:
            self.core.start()
            self._watcher.ensure()
            self._rescan()
            self._serve()
            while not self._stop.is_set():
                self._heartbeat = time.monotonic()
                if self._serving and self.inventory is not None:
                    self.ready.set()
                rescan = self._watcher.wait(self._timeout_ms())
                if self._stop.is_set():
                    break
                self._watcher.ensure()
                if rescan or time.monotonic() >= self._next_scan:
                    self._rescan()
                self._serve()
                due = self._registered_anew() or any(at <= time.monotonic() for at in self._forced_resyncs)
                if due and self.inventory is not None:
                    self._offer(self.inventory)
        finally:
            self._finished = True
            self.ready.clear()
            for worker in self._workers:
                worker.stop()
            self.server.stop()
            self._watcher.close()

    def _timeout_ms(self) -> int:
        deadline = self._next_scan if self._serving else min(self._next_scan, time.monotonic() + 1.0)
        status = self.server.registration.status
        if status.registered is False:
            deadline = min(deadline, status.at + self.reregister_after)
        if self._forced_resyncs:
            deadline = min(deadline, *self._forced_resyncs)
        return max(0, int((deadline - time.monotonic()) * 1000) + 1)

    def _serve(self) -> None:
        try:
            if not self._serving:
                self.server.start()
                self._serving = True
            elif not self.server.ensure():
                status = self.server.registration.status
                if status.registered is False and time.monotonic() >= status.at + self.reregister_after:
                    self.server.registration.forget_refusal()
                    self.server.reregister()
        except (DraServeError, OSError) as exc:
            self._serving = False
            self._problem(f"cannot serve: {exc}")

    def _rescan(self) -> None:
        self._next_scan = time.monotonic() + self.scan_interval
        self.scans += 1
        try:
            inventory = scan(self.host_root, self.config, self.pci_ids, self._warnings)
        except InputError as exc:
            self._problem(str(exc))
            return
        except Exception as exc:  # a half-written sysfs must not end the plugin: keep the last truth
            self._problem(f"scan failed: {type(exc).__name__}: {exc}")
            return
        self._problem(None)
        if inventory != self.inventory:
            devices = {device.id: device.health for resource in inventory.resources for device in resource.devices}
            log_event("dra_inventory", devices=devices)
        self.inventory = inventory
        self.core.update_inventory(inventory)
        self.server.health.update(device_states(inventory, self.core.prepared().values(), self.core.pool))
        self._offer(inventory)

    def _registered_anew(self) -> bool:
        """Whether the kubelet confirmed a registration since the last look (its start, or ours anew); if so,
        the sinks are due now and once more after :data:`REGISTRATION_RESYNC_DELAY`."""
        status = self.server.registration.status
        if status.registered is not True or status.calls == self._registrations_seen:
            return False
        self._registrations_seen = status.calls
        now = time.monotonic()
        self._forced_resyncs = [now, now + self.registration_resync_delay]
        return True

    def _offer(self, inventory: Inventory) -> None:
        """Hand ``inventory`` to each sink's thread that has not taken it (or failed, or is due a resync); forced
        (a registration's resync), to every one, even while it publishes the same (that sync may have listed
        before the kubelet's wipe). Never waits for a publish."""
        now = time.monotonic()
        forced = any(at <= now for at in self._forced_resyncs)
        self._forced_resyncs = [at for at in self._forced_resyncs if at > now]
        for worker in self._workers:
            if forced or worker.due(inventory, now, self.sink_resync):
                worker.hand(inventory)

    def _problem(self, problem: str | None) -> None:
        if problem is not None and problem != self._last_problem:
            log_event("scan_problem", error=problem)
        self._last_problem = problem
