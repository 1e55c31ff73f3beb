"""A stand-in for the kubelet's device manager, behaving as docs/protocols.md, "Kubelet device plugin API" describes,
over real unix sockets.

The device plugin can only be proven against something that acts like the kubelet where it matters: the
kubelet dials the plugin back *inside* ``Register`` (so a plugin that registers before it serves fails), keeps
the options from ``GetDevicePluginOptions``, consumes ``ListAndWatch`` once and never re-calls it (a stream
that ends, even cleanly, makes every device of the resource unhealthy), treats every message as the whole
list, counts only the exact string ``Healthy`` as healthy, lets a new registration replace the old endpoint,
and on restart deletes every unix socket in its directory (keeping other files) before serving a new
``kubelet.sock``. Tests, benchmarks and ``xmlgen simulate`` run the real plugin against this.

It serves ``v1beta1.Registration`` on ``<dir>/kubelet.sock`` and is a ``v1beta1.DevicePlugin`` client for
``Allocate`` and ``GetPreferredAllocation``. Everything is thread-safe; waiting uses one condition variable
(no polling), and :meth:`KubeletStandIn.stop` joins every thread it started and closes every channel.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import grpc

from runtime.sockets import MAX_UNIX_SOCKET_PATH
from schemas.errors import InputError
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from schemas.naming import validate_resource_name

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DIAL_TIMEOUT = 10.0
"""Seconds the kubelet gives the plugin's socket to answer ``GetDevicePluginOptions`` inside ``Register``."""


class StandInError(Exception):
    """A stand-in operation that the kubelet would not make (no endpoint, preferred allocation not offered…)."""


@dataclass(frozen=True, slots=True)
class Registration:
    """One accepted ``Register`` call: what the plugin sent, and when (``time.monotonic()``)."""

    resource_name: str
    endpoint: str
    options: pb.DevicePluginOptions
    """The options sent in the ``RegisterRequest`` (the kubelet itself keeps those from the dial-back)."""
    time: float


@dataclass(eq=False)
class _Endpoint:
    """A registered plugin: its channel, the options it answered with, and its ListAndWatch stream."""

    resource: str
    endpoint: str
    channel: grpc.Channel
    stub: Any
    options: pb.DevicePluginOptions
    stream: Any = None
    thread: threading.Thread | None = None
    ended: bool = False


@dataclass
class _ResourceState:
    devices: dict[str, str] = field(default_factory=dict)
    last: tuple[pb.Device, ...] = ()
    updates: int = 0
    updated_at: float | None = None
    endpoint: _Endpoint | None = None


def _is_healthy(health: str) -> bool:
    return health == HEALTHY


class _RegistrationServicer:
    """``v1beta1.Registration``: the kubelet's side; hands each call to the stand-in."""

    def __init__(self, owner: KubeletStandIn) -> None:
        self._owner = owner

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self._owner._register(request, context)
        return pb.Empty()


class KubeletStandIn:
    """The kubelet's device manager for tests: Registration server, dial-back, ListAndWatch consumer, client.

    ``registrations`` lists every accepted registration in order, across restarts.
    """

    def __init__(self, plugin_dir: Path, *, dial_timeout: float = DIAL_TIMEOUT) -> None:
        self.plugin_dir = Path(plugin_dir).absolute()
        self.socket_path = self.plugin_dir / KUBELET_SOCKET
        if len(os.fsencode(self.socket_path)) > MAX_UNIX_SOCKET_PATH:
            raise ValueError(f"{self.socket_path} is longer than {MAX_UNIX_SOCKET_PATH} bytes, the unix socket limit")
        self.dial_timeout = dial_timeout
        self.registrations: list[Registration] = []
        self.refusals: list[str] = []
        """Why each refused ``Register`` was refused, in order."""
        self._changed = threading.Condition()
        self._resources: dict[str, _ResourceState] = {}
        self._threads: list[threading.Thread] = []
        self._dials: set[Any] = set()
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._serving = False
        self.starts = 0

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve ``v1beta1.Registration`` on ``<dir>/kubelet.sock`` (a stale socket there is replaced)."""
        with self._changed:
            if self._serving:
                raise StandInError("the kubelet stand-in is already serving")
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        try:
            if stat.S_ISSOCK(self.socket_path.lstat().st_mode):
                self.socket_path.unlink()
        except FileNotFoundError:
            pass
        executor = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet-standin")
        server = grpc.server(executor)
        pb_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
        if not server.add_insecure_port(f"unix:{self.socket_path}"):
            executor.shutdown(wait=False)
            raise StandInError(f"could not listen on {self.socket_path}")
        server.start()
        with self._changed:
            self._server, self._executor = server, executor
            self._serving = True
            self.starts += 1
            self._changed.notify_all()

    def stop(self) -> None:
        """Stop serving; cancel dial-backs and ListAndWatch streams, close channels, join every thread.

        Every resource's devices become Unhealthy (their streams ended); the socket file stays, as a dead
        kubelet leaves it.
        """
        with self._changed:
            server, executor = self._server, self._executor
            self._server = self._executor = None
            self._serving = False
            dials = list(self._dials)
            endpoints = [state.endpoint for state in self._resources.values() if state.endpoint is not None]
            for state in self._resources.values():
                state.endpoint = None
            self._changed.notify_all()
        for dial in dials:
            dial.cancel()
        if server is not None:
            server.stop(grace=None).wait()
        if executor is not None:
            executor.shutdown(wait=True)
        for endpoint in endpoints:
            self._close_endpoint(endpoint)
        with self._changed:
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
        with self._changed:
            for state in self._resources.values():
                state.devices = dict.fromkeys(state.devices, UNHEALTHY)
            self._changed.notify_all()

    def restart(self) -> None:
        """Stop; delete every unix socket in the directory (other files stay); serve a new ``kubelet.sock``."""
        self.stop()
        self.delete_sockets()
        self.start()

    def delete_sockets(self) -> list[str]:
        """Delete every unix socket directly in the directory, as a starting kubelet does; return their names."""
        deleted: list[str] = []
        try:
            entries = list(os.scandir(self.plugin_dir))
        except FileNotFoundError:
            return deleted
        for entry in entries:
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
                    deleted.append(entry.name)
            except FileNotFoundError:
                continue
        return sorted(deleted)

    @property
    def serving(self) -> bool:
        with self._changed:
            return self._serving

    def __enter__(self) -> KubeletStandIn:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    # -- Register ----------------------------------------------------------------------------------------

    def _refuse(self, context: grpc.ServicerContext, message: str) -> NoReturn:
        with self._changed:
            self.refusals.append(message)
            self._changed.notify_all()
        # The kubelet returns a plain Go error, which gRPC sends as UNKNOWN with the message.
        context.abort(grpc.StatusCode.UNKNOWN, message)

    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> None:
        if request.version != API_VERSION:
            self._refuse(context, f"Unsupported version {request.version!r}: the kubelet supports {API_VERSION!r} only")
        try:
            validate_resource_name(request.resource_name)
        except InputError as error:
            self._refuse(context, f"invalid resource name: {error}")
        endpoint_path = self.plugin_dir / request.endpoint
        channel = grpc.insecure_channel(f"unix://{endpoint_path}", options=[("grpc.default_authority", "localhost")])
        stub = pb_grpc.DevicePluginStub(channel)
        try:
            options = self._dial_back(stub)
        except grpc.FutureCancelledError:
            channel.close()
            context.abort(grpc.StatusCode.UNAVAILABLE, "the kubelet is stopping")
        except grpc.RpcError as error:
            channel.close()
            code = error.code() if isinstance(error, grpc.Call) else None
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            self._refuse(
                context,
                f"failed to dial device plugin {request.resource_name} at {endpoint_path}: "
                f"GetDevicePluginOptions: {code.name if code else 'error'}: {details}",
            )
        endpoint = _Endpoint(request.resource_name, request.endpoint, channel, stub, options)
        with self._changed:
            if not self._serving:
                channel.close()
                context.abort(grpc.StatusCode.UNAVAILABLE, "the kubelet is stopping")
            state = self._resources.setdefault(request.resource_name, _ResourceState())
            old, state.endpoint = state.endpoint, endpoint
            self.registrations.append(
                Registration(request.resource_name, request.endpoint, _copy(request.options), time.monotonic())
            )
            endpoint.stream = stub.ListAndWatch(pb.Empty())
            thread = threading.Thread(
                target=self._consume, args=(endpoint,), name=f"kubelet-standin-law-{request.resource_name}"
            )
            endpoint.thread = thread
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            thread.start()
            self._changed.notify_all()
        if old is not None:
            self._close_endpoint(old)

    def _dial_back(self, stub: Any) -> pb.DevicePluginOptions:
        call = stub.GetDevicePluginOptions.future(pb.Empty(), timeout=self.dial_timeout, wait_for_ready=True)
        with self._changed:
            if not self._serving:
                call.cancel()
            self._dials.add(call)
        try:
            result: pb.DevicePluginOptions = call.result()
            return result
        finally:
            with self._changed:
                self._dials.discard(call)

    def _close_endpoint(self, endpoint: _Endpoint) -> None:
        if endpoint.stream is not None:
            endpoint.stream.cancel()
        endpoint.channel.close()

    def _consume(self, endpoint: _Endpoint) -> None:
        """Read ListAndWatch until it ends; then, if still the resource's endpoint, every device is Unhealthy."""
        try:
            for response in endpoint.stream:
                devices = tuple(response.devices)
                with self._changed:
                    state = self._resources[endpoint.resource]
                    if state.endpoint is not endpoint:
                        break
                    state.devices = {device.ID: device.health for device in devices}
                    state.last = devices
                    state.updates += 1
                    state.updated_at = time.monotonic()
                    self._changed.notify_all()
        except grpc.RpcError:
            pass
        finally:
            with self._changed:
                endpoint.ended = True
                state = self._resources[endpoint.resource]
                if state.endpoint is endpoint:
                    state.devices = dict.fromkeys(state.devices, UNHEALTHY)
                    state.updates += 1
                    state.updated_at = time.monotonic()
                self._changed.notify_all()

    # -- what the kubelet knows --------------------------------------------------------------------------

    def _wait(self, ready: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        with self._changed:
            if not self._changed.wait_for(ready, timeout):
                raise TimeoutError(f"{what()} within {timeout} s")

    def wait_for_registration(self, resource: str, count: int = 1, timeout: float = 5) -> Registration:
        """The ``count``-th registration of ``resource`` (counting from the first), waiting for it."""

        def found() -> list[Registration]:
            return [r for r in self.registrations if r.resource_name == resource]

        self._wait(
            lambda: len(found()) >= count,
            timeout,
            lambda: f"{resource}: {len(found())} registration(s), not {count}, (refusals: {self.refusals})",
        )
        with self._changed:
            return found()[count - 1]

    def registration_count(self, resource: str) -> int:
        with self._changed:
            return sum(1 for r in self.registrations if r.resource_name == resource)

    def devices(self, resource: str) -> dict[str, str]:
        """The resource's devices as the kubelet sees them: ID → ``Healthy``/``Unhealthy`` (empty if unknown)."""
        with self._changed:
            state = self._resources.get(resource)
            return {} if state is None else dict(state.devices)

    def device_messages(self, resource: str) -> tuple[pb.Device, ...]:
        """The devices of the latest ListAndWatch message, as sent (topology included)."""
        with self._changed:
            state = self._resources.get(resource)
            return () if state is None else state.last

    def updates(self, resource: str) -> int:
        """How many times the resource's device list changed hands (messages received, plus stream ends)."""
        with self._changed:
            state = self._resources.get(resource)
            return 0 if state is None else state.updates

    def updated_at(self, resource: str) -> float | None:
        """``time.monotonic()`` when the kubelet's view of the resource last changed hands (for benchmarks)."""
        with self._changed:
            state = self._resources.get(resource)
            return None if state is None else state.updated_at

    def capacity(self, resource: str) -> int:
        """Healthy plus unhealthy devices."""
        return len(self.devices(resource))

    def allocatable(self, resource: str) -> int:
        """Healthy devices only."""
        return sum(1 for health in self.devices(resource).values() if _is_healthy(health))

    def healthy(self, resource: str) -> list[str]:
        return sorted(device for device, health in self.devices(resource).items() if _is_healthy(health))

    def stream_open(self, resource: str) -> bool:
        """Whether the resource has an endpoint whose ListAndWatch stream is still open."""
        with self._changed:
            state = self._resources.get(resource)
            return state is not None and state.endpoint is not None and not state.endpoint.ended

    def wait_for_devices(
        self, resource: str, predicate: Callable[[dict[str, str]], bool], timeout: float = 5
    ) -> dict[str, str]:
        """Wait until ``predicate(devices(resource))`` holds; return that state."""

        def current() -> dict[str, str]:
            state = self._resources.get(resource)
            return {} if state is None else dict(state.devices)

        self._wait(lambda: predicate(current()), timeout, lambda: f"{resource}: devices still {current()}")
        with self._changed:
            return current()

    def wait_for_stream_end(self, resource: str, timeout: float = 5) -> None:
        def ended() -> bool:
            state = self._resources.get(resource)
            return state is not None and (state.endpoint is None or state.endpoint.ended)

        self._wait(ended, timeout, lambda: f"{resource}: ListAndWatch still open")

    def options(self, resource: str) -> pb.DevicePluginOptions:
        """The options the plugin answered ``GetDevicePluginOptions`` with inside its latest Register."""
        return _copy(self._endpoint(resource).options)

    def _endpoint(self, resource: str) -> _Endpoint:
        with self._changed:
            state = self._resources.get(resource)
            if state is None or state.endpoint is None:
                raise StandInError(f"no registered endpoint for {resource}")
            return state.endpoint

    # -- calls to the plugin -----------------------------------------------------------------------------

    def allocate(self, resource: str, device_ids: list[str], timeout: float = 10) -> pb.AllocateResponse:
        """``Allocate`` with one container request, as the kubelet sends it; gRPC errors propagate."""
        endpoint = self._endpoint(resource)
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(device_ids))])
        response: pb.AllocateResponse = endpoint.stub.Allocate(request, timeout=timeout)
        if len(response.container_responses) != 1:
            raise StandInError(
                f"{resource}: Allocate answered {len(response.container_responses)} container responses for 1 request"
            )
        return response

    def preferred_allocation(
        self, resource: str, available: list[str], must_include: list[str], size: int, timeout: float = 10
    ) -> list[str]:
        """``GetPreferredAllocation`` for one container, if the plugin's options offer it (as the kubelet checks)."""
        endpoint = self._endpoint(resource)
        if not endpoint.options.get_preferred_allocation_available:
            raise StandInError(f"{resource}: the plugin does not offer GetPreferredAllocation")
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size
                )
            ]
        )
        response: pb.PreferredAllocationResponse = endpoint.stub.GetPreferredAllocation(request, timeout=timeout)
        if len(response.container_responses) != 1:
            raise StandInError(
                f"{resource}: GetPreferredAllocation answered {len(response.container_responses)} container responses"
            )
        return list(response.container_responses[0].deviceIDs)

    def threads(self) -> list[threading.Thread]:
        """The stand-in's live ListAndWatch consumer threads (for leak checks)."""
        with self._changed:
            return [thread for thread in self._threads if thread.is_alive()]


def _copy(options: pb.DevicePluginOptions) -> pb.DevicePluginOptions:
    copied = pb.DevicePluginOptions()
    copied.CopyFrom(options)
    return copied
