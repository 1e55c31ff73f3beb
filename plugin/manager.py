"""The device plugin's lifecycle: keep one registered server per resource, true to the node, until told to stop.

NVIDIA's plugin scans once, never recovers a device, gives up when the kubelet is late and leaves its sockets
behind (docs/protocols.md, "Resource names"). :class:`PluginManager` is the answer, one loop in one thread that blocks
on file descriptors (no busy polling):

- inotify on ``<host-root>/dev/vfio``: a group node removed or restored triggers a rescan at once, so the
  group's devices turn Unhealthy (or Healthy) in the kubelet well within a second;
- the kernel's uevents (``plugin/uevent.py``): a driver bound or unbound, an mdev created or removed, triggers
  a rescan at once (a real kernel keeps ``/dev/vfio/<group>`` while any function of the group is on vfio-pci);
- a full rescan every ``scan_interval`` seconds catches the rest (a lost event, no netlink in a sandbox,
  group viability, hot-added cards): a new resource gets its own server and
  registration, a resource with no devices left has its server stopped and its socket removed;
- inotify on the kubelet's device-plugin directory: our own socket deleted (a starting kubelet removes every
  socket there) makes us serve again and re-register; with no kubelet we simply wait for its socket;
- the kubelet's ``ListAndWatch`` stream ending (the kubelet disconnected us, or died) wakes the loop, which
  registers again at once: one ``Register`` per lost stream, none while the stream is open, whatever
  ``kubelet.sock`` looks like (its identity only keys the back-off after a failure);
- :meth:`PluginManager.request_stop` (SIGTERM in the CLI) ends the loop; every server stops and its socket
  is removed.

The loop records what it learns in :class:`~plugin.metrics.MetricsRecorder` (scans, devices by health,
registrations) and beats a heartbeat on every turn, which :meth:`PluginManager.liveness` (``/healthz``)
compares with :func:`liveness_bound`.

The roles are split: :class:`~plugin.watching.NodeWatcher` says when to look again (inotify, the wake-up
pipe), :class:`~plugin.registration.Registrar` registers servers and takes the kubelet's answers (they come back
through a queue and the wake-up pipe into the same loop), and this module reconciles. All decisions about
sockets and registrations are made in :meth:`PluginManager._reconcile`, which is idempotent: it compares what
is (socket files, the kubelet's stream, ``kubelet.sock`` there or not) with what we last did, so a missed or
duplicated event cannot mislead it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from plugin.config import PluginConfig
from plugin.health import UsabilityRule
from plugin.inventory import Inventory, Resource
from plugin.log import log_event
from plugin.metrics import NO_METRICS, MetricsRecorder
from plugin.registration import Identity, Registrar, Registration, socket_identity
from plugin.server import KUBELET_SOCKET, SOCKET_PROBE_TIMEOUT, KubeletLink, ResourceServer, ServeError
from plugin.sysfs import scan
from plugin.watching import NodeWatcher
from runtime.pciids import PciIds, locate_pci_ids
from runtime.sockets import socket_is_live
from schemas.errors import InputError

DEFAULT_SCAN_INTERVAL = 5.0
STOP_GRACE = 0.5
"""Seconds in-flight unary calls get when the plugin stops (streams end at once)."""
LIVENESS_SLACK = 10.0
"""Seconds a loop turn may take beyond the scan interval's wait before ``/healthz`` calls the loop stuck."""


KUBELET_PROBE_RETRY = 0.5
"""Seconds after a ``kubelet.sock`` that did not answer before it is probed again, inotify event or not: a
kubelet's socket file appears at ``bind`` and answers only from ``listen`` on, so a probe in between finds it
silent and no later file event tells that it now listens. A connect refused at once costs microseconds."""


KUBELET_MISSING_BOUND = 60.0
"""Seconds without ``kubelet.sock`` after which ``/healthz`` fails: the node's device-plugins directory was
replaced under our bind mount (the socket never comes back there) and only a restart of the pod cures it. A
kubelet restart takes far less, and the kubelet runs no probes while it is down anyway."""


def liveness_bound(scan_interval: float) -> float:
    """How old the loop's heartbeat may get while it is alive: ``2 * scan_interval + 10 s``.

    The loop wakes at least once per scan interval (its poll timeout is the next scan's deadline) and a scan
    of a large node takes a fraction of a second, so only a loop that is stuck (a hung sysfs read, a
    deadlock) or dead misses the bound. 20 s with the default interval of 5 s.
    """
    return 2 * scan_interval + LIVENESS_SLACK


class PluginManager:
    """Runs the plugin: :meth:`run` blocks until :meth:`request_stop`; safe to drive from a thread in tests."""

    def __init__(
        self,
        config: PluginConfig,
        kubelet_dir: Path,
        *,
        scan_interval: float = DEFAULT_SCAN_INTERVAL,
        pci_ids: PciIds | None = None,
        warnings: Iterable[str] = (),
        metrics: MetricsRecorder = NO_METRICS,
        kubelet_missing_bound: float = KUBELET_MISSING_BOUND,
    ) -> None:
        if scan_interval <= 0:
            raise ValueError("scan_interval must be positive")
        self.config = config
        self.host_root = Path(config.host_root).absolute()
        self.kubelet_dir = kubelet_dir.absolute()
        self.kubelet_socket = self.kubelet_dir / KUBELET_SOCKET
        self.vfio_dir = self.host_root / "dev" / "vfio"
        self.scan_interval = scan_interval
        self.pci_ids = pci_ids
        self._base_warnings = tuple(warnings)
        self.ready = threading.Event()
        """Set once the first scan is done and every resource's server is serving."""
        self.scans = 0
        self.metrics = metrics
        self._heartbeat: float | None = None
        """``time.monotonic()`` of the loop's last turn; None before :meth:`run`."""
        self._finished = False
        self._served: dict[str, Registration] = {}
        self._stop = threading.Event()
        state = config.node_agent_state
        self.agent_state_file = self.host_root / state.lstrip("/") if state else None
        self._watcher = NodeWatcher(self.vfio_dir, self.kubelet_dir, self.agent_state_file)
        self._registrar = Registrar(self.kubelet_socket, self._watcher.wake, self.metrics)
        self._next_scan = 0.0
        self._last_problem: str | None = None
        self._last_warnings: tuple[str, ...] = ()
        self._last_ignored: dict[str, str] = {}
        self._kubelet_missing = False
        self._silent_kubelet: Identity | None = None
        """The ``kubelet.sock`` last found not answering (logged once per socket)."""
        self._probe_again_at = 0.0
        """When a silent ``kubelet.sock`` is probed again (:data:`KUBELET_PROBE_RETRY`)."""
        self._kubelet_missing_since: float | None = None
        self.kubelet_missing_bound = kubelet_missing_bound
        self._serve_failures: dict[str, tuple[str, float]] = {}
        """Resources whose socket cannot be served now: the error and since when (retried every loop turn)."""

    @classmethod
    def from_config(
        cls,
        config: PluginConfig,
        kubelet_dir: Path,
        *,
        scan_interval: float = DEFAULT_SCAN_INTERVAL,
        image_root: Path = Path("/"),
        metrics: MetricsRecorder = NO_METRICS,
    ) -> PluginManager:
        """Locate pci.ids once (``config.pci_ids``, else under the host root, else the image) and build the manager."""
        explicit = Path(config.pci_ids) if config.pci_ids else None
        choice = locate_pci_ids(explicit, Path(config.host_root), image_root)
        return cls(
            config,
            kubelet_dir,
            scan_interval=scan_interval,
            pci_ids=choice.database,
            warnings=choice.warnings,
            metrics=metrics,
        )

    # -- control from other threads ----------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop everything and return; safe from any thread and from a signal handler."""
        self._stop.set()
        self._watcher.wake()

    def served(self) -> tuple[str, ...]:
        """Names of the resources being served now."""
        return tuple(sorted(self._served))

    def registered(self) -> tuple[str, ...]:
        """Names of the resources the kubelet has: registered, its stream open (or just on its way)."""
        now = time.monotonic()
        return tuple(sorted(name for name, served in list(self._served.items()) if served.holds(now)))

    def liveness(self) -> str | None:
        """None while the plugin is alive (``/healthz`` 200); else why not (``/healthz`` 503). Any thread.

        Alive: :meth:`run` is running, its loop turned within :func:`liveness_bound`, and ``kubelet.sock``
        has not been missing for longer than ``kubelet_missing_bound`` (the failure only a pod restart cures).
        Registration is not part of it: the loop retries that by itself (see :meth:`readiness`).
        """
        heartbeat = self._heartbeat
        if self._finished:
            return "stopped: the plugin's loop has ended"
        if heartbeat is None:
            return "not started: the plugin's loop has not run yet"
        now = time.monotonic()
        age, bound = now - heartbeat, liveness_bound(self.scan_interval)
        if age > bound:
            return f"stuck: the plugin's loop last turned {age:.1f} s ago (bound {bound:.1f} s)"
        missing_since = self._kubelet_missing_since
        if missing_since is not None and now - missing_since > self.kubelet_missing_bound:
            return (
                f"no kubelet: {self.kubelet_socket} missing for {now - missing_since:.0f} s "
                f"(bound {self.kubelet_missing_bound:.0f} s); was the device-plugins directory replaced?"
            )
        for name, (error, since) in sorted(dict(self._serve_failures).items()):
            if now - since > self.kubelet_missing_bound:
                return f"cannot serve {name} for {now - since:.0f} s: {error}"
        faults = self._faults()
        if faults:
            return faults
        return None

    def _faults(self) -> str | None:
        """Resources whose ``ListAndWatch`` message cannot be built: the kubelet is not told the truth."""
        faults = [
            f"{name}: {served.server.state.fault}"
            for name, served in sorted(dict(self._served).items())
            if served.server.state.fault is not None
        ]
        return "; ".join(faults) if faults else None

    def readiness(self) -> str | None:
        """None once the first scan is served and every resource is registered with the current kubelet."""
        problem = self.liveness()
        if problem is not None:
            return problem
        if not self.ready.is_set():
            return "starting: the first scan is not served yet"
        failures = dict(self._serve_failures)
        if failures:
            return "; ".join(f"cannot serve {name}: {error}" for name, (error, _) in sorted(failures.items()))
        # Registered with a kubelet that is there now: a socket (lstat: not a file, directory or symlink) that
        # answers, and the stream the registration granted open.
        waiting_for = f"not registered with the kubelet: {', '.join(sorted(self._served)) or 'no resources'}"
        kubelet = socket_identity(self.kubelet_socket)
        if kubelet is None:
            return f"{waiting_for} (no kubelet: {self.kubelet_socket} is missing or not a socket)"
        if not socket_is_live(self.kubelet_socket, SOCKET_PROBE_TIMEOUT):
            return f"{waiting_for} (no kubelet: nobody answers on {self.kubelet_socket})"
        now = time.monotonic()
        waiting = [(name, served) for name, served in sorted(dict(self._served).items()) if not served.holds(now)]
        if waiting:
            return "not registered with the kubelet: " + ", ".join(
                name
                if served.hold_until <= now
                else f"{name} (its stream keeps ending: registering again in {served.hold_until - now:.1f} s)"
                for name, served in waiting
            )
        return None

    def _serve_failed(self, name: str, socket: Path, error: BaseException) -> None:
        """Log a resource's socket that cannot be served (once per distinct error); health turns red."""
        text = f"{type(error).__name__}: {error}" if not isinstance(error, ServeError | OSError) else str(error)
        previous = self._serve_failures.get(name)
        if previous is None or previous[0] != text:
            log_event("serve_failed", resource=name, socket=str(socket), error=text, retry="at the next scan")
        self._serve_failures[name] = (text, previous[1] if previous is not None else time.monotonic())

    def _serve_ok(self, name: str) -> None:
        if self._serve_failures.pop(name, None) is not None:
            log_event("serve_recovered", resource=name)

    # -- the loop ----------------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve, register and keep the truth until :meth:`request_stop`; then stop servers and remove sockets."""
        log_event(
            "starting",
            host_root=str(self.host_root),
            kubelet_dir=str(self.kubelet_dir),
            scan_interval=self.scan_interval,
            pci_ids=self.pci_ids.path if self.pci_ids else None,
            pid=os.getpid(),
        )
        self._finished = False
        self._heartbeat = time.monotonic()
        try:
            try:
                self.kubelet_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # served once it exists (retried at every scan)
                log_event("kubelet_dir_unusable", directory=str(self.kubelet_dir), error=str(exc))
            self._watcher.ensure()
            self._rescan()
            self._reconcile()
            self.ready.set()
            while not self._stop.is_set():
                self._heartbeat = time.monotonic()
                rescan = self._watcher.wait(self._timeout_ms())
                self._take_answers()
                if self._stop.is_set():
                    break
                if rescan or time.monotonic() >= self._next_scan:
                    self._watcher.ensure()
                    self._rescan()
                self._reconcile()
        finally:
            self._finished = True
            self._shutdown()

    def _timeout_ms(self) -> int:
        now = time.monotonic()
        deadline = self._next_scan
        for served in self._served.values():
            if not served.pending and served.failed is not None and served.retry_at > now:
                deadline = min(deadline, served.retry_at)
            if served.registered is not None and served.link() == KubeletLink.WAITING:
                deadline = min(deadline, served.stream_deadline())
            if served.registered is None and served.hold_until > now:
                deadline = min(deadline, served.hold_until)
        if self._silent_kubelet is not None:
            deadline = min(deadline, self._probe_again_at)
        return max(0, int((deadline - now) * 1000) + 1)

    # -- discovery ---------------------------------------------------------------------------------------

    def _rescan(self) -> None:
        self._next_scan = time.monotonic() + self.scan_interval
        self.scans += 1
        started = time.perf_counter()
        try:
            inventory = scan(self.host_root, self.config, self.pci_ids, self._base_warnings)
        except InputError as exc:
            self.metrics.record_scan(time.perf_counter() - started, ok=False)
            self._problem(str(exc))
            return
        except Exception as exc:  # a half-written sysfs must not end the plugin: keep the last truth
            self.metrics.record_scan(time.perf_counter() - started, ok=False)
            self._problem(f"scan failed: {type(exc).__name__}: {exc}")
            return
        self.metrics.record_scan(time.perf_counter() - started, ok=True)
        self._problem(None)
        self._note_inventory(inventory)
        current = {resource.name: resource for resource in inventory.resources}
        for name in [name for name in self._serve_failures if name not in current]:
            del self._serve_failures[name]  # no longer offered: nothing to serve
        for name in [name for name in self._served if name not in current]:
            served = self._served.pop(name)
            self._log_changes(served.server.state.resource, None, inventory)
            self._retire(served)
            log_event("resource_withdrawn", resource=name, socket=str(served.server.socket_path))
        for name, resource in current.items():
            existing = self._served.get(name)
            if existing is not None:
                old = existing.server.state.resource
                if existing.server.update(resource):
                    self._log_changes(old, resource, inventory)
                continue
            server = ResourceServer(
                resource,
                self.kubelet_dir,
                self.host_root,
                rule=UsabilityRule.from_config(self.config),
                metrics=self.metrics,
                notify=self._watcher.wake,  # the kubelet's stream ended: register again now
            )
            try:
                server.start()
            except Exception as exc:  # the directory gone, the path taken...: logged, health red, retried
                self._serve_failed(name, server.socket_path, exc)
                server.stop(grace=0)
                continue
            self._serve_ok(name)
            self._served[name] = Registration(server)
            log_event(
                "resource_added",
                resource=name,
                kind=resource.kind.value,
                env=resource.env,
                devices={device.id: device.health for device in resource.devices},
            )
        self.metrics.observe_devices(served.server.state.resource for served in self._served.values())

    def _problem(self, problem: str | None) -> None:
        if problem != self._last_problem and problem is not None:
            log_event("scan_problem", error=problem)
        self._last_problem = problem

    def _note_inventory(self, inventory: Inventory) -> None:
        """Log warnings and not-offered functions when they change (not on every scan)."""
        if inventory.warnings != self._last_warnings:
            for warning in inventory.warnings:
                if warning not in self._last_warnings:
                    log_event("warning", message=warning)
            self._last_warnings = inventory.warnings
        ignored = {item.id: item.reason for item in inventory.ignored}
        for device_id, reason in ignored.items():
            if self._last_ignored.get(device_id) != reason:
                log_event("not_offered", device=device_id, reason=reason)
        self._last_ignored = ignored

    def _log_changes(self, old: Resource, new: Resource | None, inventory: Inventory) -> None:
        before = {device.id: device for device in old.devices}
        after = {} if new is None else {device.id: device for device in new.devices}
        for device_id, device in after.items():
            previous = before.get(device_id)
            if previous is None:
                log_event("device_added", resource=old.name, device=device_id, health=device.health)
            elif previous.healthy != device.healthy:
                log_event(
                    "health_changed", resource=old.name, device=device_id, health=device.health, reason=device.reason
                )
        ignored = {item.id: item.reason for item in inventory.ignored}
        for device_id in before.keys() - after.keys():
            log_event("device_removed", resource=old.name, device=device_id, reason=ignored.get(device_id, "gone"))

    # -- reconciling: sockets and registrations -----------------------------------------------------------

    def _reconcile(self) -> None:
        """Make what is match what should be: our sockets in place, each server registered with this kubelet."""
        now = time.monotonic()
        kubelet = socket_identity(self.kubelet_socket)
        if (kubelet is None) != self._kubelet_missing:
            self._kubelet_missing = kubelet is None
            self._kubelet_missing_since = now if kubelet is None else None
            if kubelet is None:
                log_event("waiting_for_kubelet", socket=str(self.kubelet_socket))
        answers: list[bool] = []
        for served in self._served.values():
            server = served.server
            if not server.socket_intact():
                if server.serving:
                    log_event("socket_gone", resource=server.name, socket=str(server.socket_path))
                try:
                    server.restart()
                except Exception as exc:  # the directory gone, the path taken...: logged, health red, retried
                    self._serve_failed(server.name, server.socket_path, exc)
                    server.stop(grace=0)
                    served.registered = None
                    served.restarted()
                    continue
                self._serve_ok(server.name)
                served.restarted()
            if served.registered is not None and not served.holds(now):
                # The kubelet's stream ended (it disconnected us, died, or our server restarted) or never came:
                # the kubelet no longer has us, whatever kubelet.sock looks like. Register again.
                stream = served.link()
                delay = served.lost(now, self.scan_interval)
                log_event(
                    "kubelet_stream_lost",
                    resource=server.name,
                    stream=stream,
                    action="registering again" if kubelet is not None else "waiting for the kubelet",
                    retry_in=round(delay, 3),
                )
            if kubelet is not None and served.due(kubelet, now) and self._kubelet_answers(kubelet, answers):
                self._registrar.register(served, kubelet)

    def _kubelet_answers(self, kubelet: Identity, answers: list[bool]) -> bool:
        """Whether somebody accepts connections on ``kubelet.sock`` (probed once per reconcile, in ``answers``).

        A dead kubelet leaves its socket behind, and its streams end as it dies: registering then could only
        fail. Instead the plugin waits for the new ``kubelet.sock`` (inotify wakes the loop; every scan looks
        again), so a kubelet restart costs no failed ``Register`` and no back-off; and it probes a silent
        socket again every :data:`KUBELET_PROBE_RETRY`, since one bound but not yet listening starts answering
        without any file event.
        """
        if not answers:
            answers.append(socket_is_live(self.kubelet_socket, SOCKET_PROBE_TIMEOUT))
            if not answers[0] and self._silent_kubelet != kubelet:
                log_event("kubelet_not_answering", socket=str(self.kubelet_socket), retry="when it changes")
            self._silent_kubelet = None if answers[0] else kubelet
            self._probe_again_at = time.monotonic() + KUBELET_PROBE_RETRY
        return answers[0]

    # -- stopping ----------------------------------------------------------------------------------------

    def _take_answers(self) -> None:
        self._registrar.take_answers(self._served, self.scan_interval)

    def _retire(self, served: Registration) -> None:
        served.server.stop(grace=STOP_GRACE)

    def _shutdown(self) -> None:
        for served in self._served.values():
            self._retire(served)
        names = sorted(self._served)
        pending = [served for served in self._served.values() if served.pending]
        self._served.clear()
        # Registrations in flight end fast once our servers are gone; collect them to close their channels.
        deadline = time.monotonic() + STOP_GRACE
        while any(served.pending for served in pending) and time.monotonic() < deadline:
            self._watcher.wait(max(1, int((deadline - time.monotonic()) * 1000)))
            self._take_answers()
        self._take_answers()
        self._watcher.close()
        log_event("stopped", resources=names)
