"""A stand-in for the kubelet's DRA side, written from the published protos and the kubelet's documented
behaviour (docs/dra.md, "Node side"), over real unix sockets.

What it does, as a 1.34 kubelet does:

- plugin watcher: watches the plugin registry directory (inotify); at start it walks the directory, then
  reacts to sockets created or renamed into it (files whose name starts with ``.`` are skipped). For each
  socket: dial (10 s), ``Registration.GetInfo`` (1 s deadline), then checks ``type`` (only ``DRAPlugin`` has a
  handler), the name (non-empty), the supported services (the first of the plugin's list the kubelet speaks:
  ``v1.DRAPlugin`` or ``v1beta1.DRAPlugin``), takes ``endpoint`` (empty: the registration socket itself),
  refuses a second plugin of the same driver on the same endpoint, and answers ``NotifyRegistrationStatus``
  (registered, or not with the reason). A socket that goes away deregisters its plugin; a socket replaced
  under the same name registers again.
- DRA manager: ``NodePrepareResources`` / ``NodeUnprepareResources`` on the registered endpoint of the
  chosen API version with a 45 s deadline; an answer that leaves out a claim of the request is an error
  (the kubelet would call again), a claim's non-empty ``error`` is that claim's failure.
- health stream (``ResourceHealthStatus``, on by default from 1.36): :meth:`watch_health` opens
  ``v1alpha1.DRAResourceHealth/NodeWatchResources`` on the registered endpoint's channel, as the kubelet does
  for every registered DRA plugin whatever its ``supported_versions`` say (the service is not listed there),
  and hands each message over as a :class:`HealthReport` list.
- :meth:`restart`: the kubelet restarts: registrations are forgotten and the directory is walked again.

Tests and benchmarks drive the real plugin (``plugin.dra``) with it. Thread-safe; its watcher thread blocks
in ``poll`` on the inotify descriptor and a wake-up pipe (no polling loop), callers wait on one condition
variable; :meth:`stop` joins the thread and closes every channel.
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from plugin.inotify import ENTRIES_CHANGED, IN_DELETE, IN_MOVED_FROM, DirectoryWatch
from schemas.generated.kubelet.dra.v1 import api_pb2 as v1
from schemas.generated.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from schemas.generated.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from schemas.generated.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from schemas.generated.kubelet.dra_health.v1alpha1 import api_pb2 as health_pb
from schemas.generated.kubelet.dra_health.v1alpha1 import api_pb2_grpc as health_grpc
from schemas.generated.kubelet.pluginregistration.v1 import api_pb2 as reg
from schemas.generated.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc

DRA_PLUGIN_TYPE = "DRAPlugin"
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
"""What a 1.34 kubelet speaks, newest first (a 1.32/1.33 kubelet: only ``v1beta1.DRAPlugin``)."""
DIAL_TIMEOUT = 10.0
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
CALL_TIMEOUT = 45.0
_MODULES: dict[str, tuple[Any, Any]] = {
    "v1.DRAPlugin": (v1, v1_grpc),
    "v1beta1.DRAPlugin": (v1beta1, v1beta1_grpc),
}


class DraStandInError(Exception):
    """A call the kubelet would treat as failed (no plugin for the driver, a claim left out, a gRPC error)."""


@dataclass(frozen=True, slots=True)
class Registration:
    """One plugin the stand-in registered: from which socket, under which name, at which endpoint, how."""

    socket: str
    driver: str
    endpoint: str
    service: str
    time: float


@dataclass
class _Plugin:
    registration: Registration
    channel: grpc.Channel
    stub: Any
    pb: Any


@dataclass
class _State:
    plugins: dict[str, _Plugin] = field(default_factory=dict)
    """By registration socket path."""
    registrations: list[Registration] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HealthReport:
    """One device of a ``NodeWatchResources`` message, as the kubelet reads it."""

    pool: str
    device: str
    health: str
    """``HEALTHY``, ``UNHEALTHY`` or ``UNKNOWN``."""
    message: str
    last_updated_time: int
    timeout_seconds: int


class HealthWatch:
    """An open health stream: iterate for each message's devices; :meth:`cancel` ends it (the kubelet's
    context cancelled). Iteration ends when the plugin ends the stream; a gRPC error is raised as
    :class:`DraStandInError` naming the status code."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[list[HealthReport]]:
        try:
            for response in self._call:
                yield [
                    HealthReport(
                        d.device.pool_name,
                        d.device.device_name,
                        health_pb.HealthStatus.Name(d.health),
                        d.message,
                        d.last_updated_time,
                        d.health_check_timeout_seconds,
                    )
                    for d in response.devices
                ]
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise DraStandInError(f"{code.name if code else 'UNKNOWN'}: {details}") from None

    def cancel(self) -> None:
        self._call.cancel()


def container_cdi_devices(devices: list[PreparedDevice], request: str = "") -> list[str]:
    """The CDI device IDs the kubelet hands a container whose ``resources.claims[]`` entry names this claim and
    ``request`` (``""``: the whole claim), as Kubernetes' ``ClaimInfo.cdiDevicesAsList`` picks them
    (pkg/kubelet/cm/dra/claiminfo.go): a device with no ``request_names``, or one naming ``request`` exactly.
    A container can only name a top-level request, so a device answered under ``req/subrequest`` reaches no
    container that asked for ``req`` (Kubernetes' kubelet-plugin helper strips the subrequest for that)."""
    return [
        cdi_id
        for device in devices
        if not request or not device.request_names or request in device.request_names
        for cdi_id in device.cdi_ids
    ]


class KubeletDraStandIn:
    """The kubelet's plugin watcher and DRA manager for one plugin registry directory."""

    def __init__(self, registry_dir: Path, *, services: tuple[str, ...] = KUBELET_SERVICES) -> None:
        self.registry_dir = Path(registry_dir).absolute()
        self.services = services
        self.starts = 0
        self._changed = threading.Condition()
        self._state = _State()
        self._watch: DirectoryWatch | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_read = self._wake_write = -1

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Watch the directory (created if missing) and register every plugin socket already there."""
        if self._thread is not None:
            raise DraStandInError("the stand-in is already running")
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._watch = DirectoryWatch(self.registry_dir, ENTRIES_CHANGED)
        self.starts += 1
        self._thread = threading.Thread(target=self._run, name="kubelet-dra-standin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, forget every registration and close its channel (sockets stay, as a dead kubelet's)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            os.write(self._wake_write, b"x")
            thread.join()
            os.close(self._wake_read)
            os.close(self._wake_write)
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        with self._changed:
            plugins = list(self._state.plugins.values())
            self._state.plugins.clear()
            self._changed.notify_all()
        for plugin in plugins:
            plugin.channel.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> KubeletDraStandIn:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- what it saw --------------------------------------------------------------------------------------

    @property
    def registrations(self) -> list[Registration]:
        """Every registration made, in order, across restarts."""
        with self._changed:
            return list(self._state.registrations)

    @property
    def refusals(self) -> list[str]:
        with self._changed:
            return list(self._state.refusals)

    def registered(self, driver: str) -> Registration | None:
        """The driver's current registration (the newest, as the kubelet prefers)."""
        with self._changed:
            found = [p.registration for p in self._state.plugins.values() if p.registration.driver == driver]
        return max(found, key=lambda r: r.time) if found else None

    def wait_for_registration(self, driver: str, *, count: int = 1, timeout: float = 10.0) -> Registration:
        """Block until ``driver`` has been registered ``count`` times in all (and is registered now)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                made = sum(1 for r in self._state.registrations if r.driver == driver)
                current = [p.registration for p in self._state.plugins.values() if p.registration.driver == driver]
                if made >= count and current:
                    return max(current, key=lambda r: r.time)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DraStandInError(
                        f"{driver} registered {made} times, not {count}, within {timeout} s "
                        f"(refusals: {self._state.refusals})"
                    )
                self._changed.wait(left)

    def wait_for_deregistration(self, driver: str, timeout: float = 10.0) -> None:
        with self._changed:
            if not self._changed.wait_for(
                lambda: all(p.registration.driver != driver for p in self._state.plugins.values()), timeout
            ):
                raise DraStandInError(f"{driver} is still registered after {timeout} s")

    # -- the DRA manager's calls ----------------------------------------------------------------------------

    def prepare(
        self, driver: str, claims: list[tuple[str, str, str]], timeout: float = CALL_TIMEOUT
    ) -> dict[str, tuple[list[PreparedDevice], str]]:
        """``NodePrepareResources`` for ``claims`` (namespace, name, uid): by UID, (devices, error)."""
        plugin = self._plugin(driver)
        request = plugin.pb.NodePrepareResourcesRequest(
            claims=[plugin.pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = self._call(plugin.stub.NodePrepareResources, request, timeout)
        answers: dict[str, tuple[list[PreparedDevice], str]] = {}
        for _, _, uid in claims:
            if uid not in response.claims:
                raise DraStandInError(f"NodePrepareResources left out claim {uid}")
            entry = response.claims[uid]
            devices = [
                PreparedDevice(tuple(d.request_names), d.pool_name, d.device_name, tuple(d.cdi_device_ids))
                for d in entry.devices
            ]
            answers[uid] = ([] if entry.error else devices, entry.error)
        return answers

    def unprepare(
        self, driver: str, claims: list[tuple[str, str, str]], timeout: float = CALL_TIMEOUT
    ) -> dict[str, str]:
        """``NodeUnprepareResources``: by UID, the claim's error (``""``: done)."""
        plugin = self._plugin(driver)
        request = plugin.pb.NodeUnprepareResourcesRequest(
            claims=[plugin.pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = self._call(plugin.stub.NodeUnprepareResources, request, timeout)
        for _, _, uid in claims:
            if uid not in response.claims:
                raise DraStandInError(f"NodeUnprepareResources left out claim {uid}")
        return {uid: response.claims[uid].error for _, _, uid in claims}

    def watch_health(self, driver: str, timeout: float | None = None) -> HealthWatch:
        """``NodeWatchResources`` on ``driver``'s endpoint. The kubelet sets no deadline (its stream lives as long
        as the plugin's registration); ``timeout`` is one for tests that must not wait forever."""
        plugin = self._plugin(driver)
        stub = health_grpc.DRAResourceHealthStub(plugin.channel)
        return HealthWatch(stub.NodeWatchResources(health_pb.NodeWatchResourcesRequest(), timeout=timeout))

    def _plugin(self, driver: str) -> _Plugin:
        with self._changed:
            found = [p for p in self._state.plugins.values() if p.registration.driver == driver]
        if not found:
            raise DraStandInError(f"DRA driver {driver} is not registered")
        return max(found, key=lambda p: p.registration.time)

    @staticmethod
    def _call(method: Any, request: Any, timeout: float) -> Any:
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise DraStandInError(f"{code.name if code else 'UNKNOWN'}: {details}") from None

    # -- the plugin watcher ----------------------------------------------------------------------------------

    def _run(self) -> None:
        for entry in sorted(os.scandir(self.registry_dir), key=lambda e: e.name):
            self._consider(entry.name, gone=False)
        watch = self._watch
        assert watch is not None
        poller = select.poll()
        poller.register(watch.fileno(), select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        while not self._stop.is_set():
            poller.poll()  # blocks until the directory changes or stop() wakes it
            for event in watch.read(0):
                if event.name:
                    self._consider(event.name, gone=bool(event.mask & (IN_DELETE | IN_MOVED_FROM)))

    def _consider(self, name: str, *, gone: bool) -> None:
        if name.startswith("."):
            return
        path = self.registry_dir / name
        if gone:
            self._deregister(str(path))
            return
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                return
        except FileNotFoundError:
            self._deregister(str(path))
            return
        self._deregister(str(path))  # a socket replaced under the same name registers anew
        self._register(path)

    def _deregister(self, socket: str) -> None:
        with self._changed:
            plugin = self._state.plugins.pop(socket, None)
            self._changed.notify_all()
        if plugin is not None:
            plugin.channel.close()

    def _refuse(self, stub: Any, message: str) -> None:
        with self._changed:
            self._state.refusals.append(message)
            self._changed.notify_all()
        with contextlib.suppress(grpc.RpcError):
            stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=False, error=message), timeout=NOTIFY_TIMEOUT
            )

    def _register(self, path: Path) -> None:
        channel = grpc.insecure_channel(f"unix:{path}")
        try:
            grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT)
            stub = reg_grpc.RegistrationStub(channel)
            info = stub.GetInfo(reg.InfoRequest(), timeout=GET_INFO_TIMEOUT)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            channel.close()
            with self._changed:
                self._state.refusals.append(f"{path}: dial or GetInfo failed: {type(exc).__name__}")
                self._changed.notify_all()
            return
        try:
            if info.type != DRA_PLUGIN_TYPE:
                self._refuse(stub, f"no handler registered for plugin type: {info.type} at socket {path}")
                return
            if not info.name:
                self._refuse(stub, f"plugin at {path} has no name")
                return
            offered = list(info.supported_versions)
            chosen = next((service for service in offered if service in self.services), None)
            if chosen is None:
                self._refuse(
                    stub, f"none of services supported by the plugin ({offered}) are supported ({self.services})"
                )
                return
            endpoint = info.endpoint or str(path)
            with self._changed:
                clash = any(
                    p.registration.driver == info.name and p.registration.endpoint == endpoint
                    for p in self._state.plugins.values()
                )
            if clash:
                self._refuse(stub, f"endpoint {endpoint} already registered for DRA driver plugin {info.name}")
                return
            pb, pb_grpc = _MODULES[chosen]
            plugin_channel = grpc.insecure_channel(f"unix:{endpoint}")
            registration = Registration(str(path), info.name, endpoint, chosen, time.monotonic())
            plugin = _Plugin(registration, plugin_channel, pb_grpc.DRAPluginStub(plugin_channel), pb)
            try:
                stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=NOTIFY_TIMEOUT)
            except grpc.RpcError:
                plugin_channel.close()
                return
            with self._changed:
                self._state.plugins[str(path)] = plugin
                self._state.registrations.append(registration)
                self._changed.notify_all()
        finally:
            channel.close()
