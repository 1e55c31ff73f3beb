"""A stand-in for the kubelet's device manager, behaving as docs/protocols.md, "Kubelet device plugin API" describes,
over real unix sockets.

The device plugin can only be proven against something that acts like the kubelet where it matters (each point
checked against the kubelet's code, cited in docs/protocols.md):

- starting, it removes every unix socket in its directory except its checkpoint file (other files and
  directories stay; the old ``kubelet.sock`` a dead kubelet left goes too), then listens on a new
  ``kubelet.sock``; the removal order and the moments between the steps can be chosen by a test;
- it dials the plugin back *inside* ``Register`` (so a plugin that registers before it serves fails), keeps
  the options from ``GetDevicePluginOptions`` and then reads one ``ListAndWatch`` stream per client, never
  calling it again; every message is the whole list and only the exact string ``Healthy`` is healthy;
- a new ``Register`` for a resource makes a new client the current one *without* closing the one it replaces:
  the old client's stream stays open and its messages still update the resource;
- when *any* client's stream ends (even cleanly), the current client is disconnected: its connection closed
  and every device of the resource marked unhealthy (not called again until the plugin registers again).

Tests, benchmarks and ``xmlgen simulate`` run the real plugin against this.

It serves ``v1beta1.Registration`` on ``<dir>/kubelet.sock`` and is a ``v1beta1.DevicePlugin`` client for
``Allocate`` and ``GetPreferredAllocation``. Everything is thread-safe; waiting uses one condition variable
(no polling), and :meth:`KubeletStandIn.stop` joins every thread it started and closes every channel.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
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
    """One client of a plugin: its channel, the options it answered with, and its ListAndWatch stream."""

    resource: str
    endpoint: str
    channel: grpc.Channel
    stub: Any
    options: pb.DevicePluginOptions | None = None
    stream: Any = None
    thread: threading.Thread | None = None
    ended: bool = False
    """Its ListAndWatch stream ended (or was never opened)."""
    closed: bool = False
    """Its connection was closed: the kubelet disconnected it (or is stopping)."""


@dataclass
class _ResourceState:
    devices: dict[str, str] = field(default_factory=dict)
    last: tuple[pb.Device, ...] = ()
    updates: int = 0
    updated_at: float | None = None
    current: _Endpoint | None = None
    """The registration server's client for the resource (the kubelet's ``clients[name]``): the one a stream's
    end disconnects. Set before the dial-back, removed when that fails or the client is disconnected."""
    endpoint: _Endpoint | None = None
    """The device manager's endpoint (``endpoints[name]``): set by the last successful dial-back, used for
    ``Allocate`` and ``GetPreferredAllocation``; kept after a disconnect, as the kubelet keeps it."""
    clients: list[_Endpoint] = field(default_factory=list)
    """Every client whose stream is read, the replaced ones included."""
    disconnects: int = 0


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

    ``registrations`` lists every accepted registration in order, across restarts; ``requests`` every
    ``Register`` call received (the kubelet logs "Got registration request" for each, refused or not).
    """

    def __init__(self, plugin_dir: Path, *, dial_timeout: float = DIAL_TIMEOUT) -> None:
        self.plugin_dir = Path(plugin_dir).absolute()
        self.socket_path = self.plugin_dir / KUBELET_SOCKET
        if len(os.fsencode(self.socket_path)) > MAX_UNIX_SOCKET_PATH:
            raise ValueError(f"{self.socket_path} is longer than {MAX_UNIX_SOCKET_PATH} bytes, the unix socket limit")
        self.dial_timeout = dial_timeout
        self.registrations: list[Registration] = []
        self.requests: list[tuple[str, str]] = []
        """``(resource_name, endpoint)`` of every ``Register`` call received, in order, across restarts."""
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

    def start(
        self,
        *,
        order: Sequence[str] = (),
        after_remove: Callable[[str], None] | None = None,
        before_listen: Callable[[], None] | None = None,
    ) -> None:
        """Start as the kubelet does: clean the directory up (:meth:`cleanup_plugin_directory`, with ``order``
        and ``after_remove``), call ``before_listen``, then serve ``v1beta1.Registration`` on a new
        ``kubelet.sock`` (whatever is at that path is removed first)."""
        with self._changed:
            if self._serving:
                raise StandInError("the kubelet stand-in is already serving")
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.cleanup_plugin_directory(order=order, after_remove=after_remove)
        if before_listen is not None:
            before_listen()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
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

        Every resource's devices become Unhealthy (their streams ended) and the endpoints are forgotten (a new
        kubelet process knows none). The socket file stays, the very same file (inode and mtime), as a kubelet
        that is killed or exits leaves it: gRPC unlinks the path it bound when its server stops, so a hard link
        keeps the file and is renamed back over the path.
        """
        with self._changed:
            server, executor = self._server, self._executor
            self._server = self._executor = None
            self._serving = False
            dials = list(self._dials)
            clients = [client for state in self._resources.values() for client in state.clients]
            for state in self._resources.values():
                state.current = state.endpoint = None
            self._changed.notify_all()
        for dial in dials:
            dial.cancel()
        if server is not None:
            kept: Path | None = self.plugin_dir / f".{KUBELET_SOCKET}.{os.getpid()}.left"
            try:
                os.link(self.socket_path, self.plugin_dir / f".{KUBELET_SOCKET}.{os.getpid()}.left")
            except OSError:
                kept = None
            server.stop(grace=None).wait()
            if kept is not None:
                os.replace(kept, self.socket_path)
        if executor is not None:
            executor.shutdown(wait=True)
        for client in clients:
            self._close(client)
        with self._changed:
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
        with self._changed:
            for state in self._resources.values():
                state.devices = dict.fromkeys(state.devices, UNHEALTHY)
                state.clients = []
            self._changed.notify_all()

    def restart(
        self,
        *,
        order: Sequence[str] = (),
        after_remove: Callable[[str], None] | None = None,
        before_listen: Callable[[], None] | None = None,
    ) -> None:
        """:meth:`stop` (the old ``kubelet.sock`` stays), then :meth:`start` with the same hooks."""
        self.stop()
        self.start(order=order, after_remove=after_remove, before_listen=before_listen)

    def cleanup_plugin_directory(
        self, *, order: Sequence[str] = (), after_remove: Callable[[str], None] | None = None
    ) -> list[str]:
        """Remove every unix socket in the directory but the checkpoint file, as a starting kubelet does.

        The kubelet lists the names first, then ``stat``s (following symlinks) and removes each socket in
        directory order; here the names in ``order`` go first, in that order, then the rest sorted, and
        ``after_remove(name)`` runs after each removal (a test's chance to let the plugin react in between).
        Directories, other files and names that vanished are left. Returns the names removed.
        """
        try:
            names = os.listdir(self.plugin_dir)
        except FileNotFoundError:
            return []
        first = [name for name in order if name in names]
        removed: list[str] = []
        for name in first + sorted(set(names) - set(first)):
            if name == CHECKPOINT_FILE:
                continue
            path = self.plugin_dir / name
            try:
                if not stat.S_ISSOCK(path.stat().st_mode):
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(name)
            if after_remove is not None:
                after_remove(name)
        return removed

    def delete_sockets(self) -> list[str]:
        """:meth:`cleanup_plugin_directory` in directory order (the name older callers know)."""
        return self.cleanup_plugin_directory()

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
        with self._changed:
            self.requests.append((request.resource_name, request.endpoint))
            self._changed.notify_all()
        if request.version != API_VERSION:
            self._refuse(context, f"Unsupported version {request.version!r}: the kubelet supports {API_VERSION!r} only")
        try:
            validate_resource_name(request.resource_name)
        except InputError as error:
            self._refuse(context, f"invalid resource name: {error}")
        endpoint_path = self.plugin_dir / request.endpoint
        channel = grpc.insecure_channel(f"unix://{endpoint_path}", options=[("grpc.default_authority", "localhost")])
        client = _Endpoint(request.resource_name, request.endpoint, channel, pb_grpc.DevicePluginStub(channel))
        with self._changed:
            # The registration server records the new client before dialing it: from now on a stream's end
            # disconnects this one, and the client it replaces is not closed (its stream stays open).
            self._resources.setdefault(request.resource_name, _ResourceState()).current = client
        try:
            options = self._dial_back(client.stub)
        except grpc.FutureCancelledError:
            self._forget(client)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the kubelet is stopping")
        except grpc.RpcError as error:
            self._forget(client)
            code = error.code() if isinstance(error, grpc.Call) else None
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            self._refuse(
                context,
                f"failed to dial device plugin {request.resource_name} at {endpoint_path}: "
                f"GetDevicePluginOptions: {code.name if code else 'error'}: {details}",
            )
        client.options = options
        with self._changed:
            if not self._serving:
                channel.close()
                context.abort(grpc.StatusCode.UNAVAILABLE, "the kubelet is stopping")
            state = self._resources[request.resource_name]
            state.endpoint = client
            self.registrations.append(
                Registration(request.resource_name, request.endpoint, _copy(request.options), time.monotonic())
            )
            client.stream = client.stub.ListAndWatch(pb.Empty())
            thread = threading.Thread(
                target=self._consume, args=(client,), name=f"kubelet-standin-law-{request.resource_name}"
            )
            client.thread = thread
            state.clients.append(client)
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            thread.start()
            self._changed.notify_all()

    def _forget(self, client: _Endpoint) -> None:
        """A dial-back failed: the registration server drops the resource's client (whichever it is now)."""
        client.channel.close()
        with self._changed:
            self._resources[client.resource].current = None
            self._changed.notify_all()

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

    def _close(self, client: _Endpoint) -> None:
        client.closed = True
        if client.stream is not None:
            client.stream.cancel()
        client.channel.close()

    def disconnect(self, resource: str) -> bool:
        """Disconnect the resource's current client, as the kubelet does when any of its streams ends: close its
        connection (the plugin sees its stream end) and mark every device unhealthy. False if there is none."""
        with self._changed:
            state = self._resources.get(resource)
            client = None if state is None else state.current
            if state is None or client is None:
                return False
            self._disconnected(state)
        self._close(client)
        return True

    def _disconnected(self, state: _ResourceState) -> None:
        """The device manager's part of a disconnect (``PluginDisconnected``); the lock is held."""
        state.current = None
        state.disconnects += 1
        state.devices = dict.fromkeys(state.devices, UNHEALTHY)
        state.updates += 1
        state.updated_at = time.monotonic()
        self._changed.notify_all()

    def _consume(self, client: _Endpoint) -> None:
        """Read ListAndWatch until it ends; then disconnect the resource's current client, whichever it is."""
        try:
            for response in client.stream:
                devices = tuple(response.devices)
                with self._changed:
                    # Any client's message updates the resource, the replaced ones' too (the kubelet keys the
                    # update by resource name only).
                    state = self._resources[client.resource]
                    state.devices = {device.ID: device.health for device in devices}
                    state.last = devices
                    state.updates += 1
                    state.updated_at = time.monotonic()
                    self._changed.notify_all()
        except grpc.RpcError:
            pass
        finally:
            current = None
            with self._changed:
                client.ended = True
                state = self._resources[client.resource]
                if client in state.clients:
                    state.clients.remove(client)
                current = state.current
                if current is not None and self._serving:
                    self._disconnected(state)
                else:
                    current = None
                self._changed.notify_all()
            if current is not None:
                self._close(current)

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
        """Whether the resource's current client is connected and its ListAndWatch stream still open."""
        with self._changed:
            return self._stream_open(resource)

    def open_streams(self, resource: str) -> int:
        """How many of the resource's clients (the replaced ones included) still read an open stream."""
        with self._changed:
            state = self._resources.get(resource)
            return 0 if state is None else sum(1 for client in state.clients if not client.ended)

    def wait_for_open_streams(self, resource: str, count: int, timeout: float = 5) -> None:
        """Wait until exactly ``count`` of the resource's clients read an open stream."""

        def open_now() -> int:
            state = self._resources.get(resource)
            return 0 if state is None else sum(1 for client in state.clients if not client.ended)

        self._wait(lambda: open_now() == count, timeout, lambda: f"{resource}: {open_now()} open streams, not {count},")

    def disconnects(self, resource: str) -> int:
        """How many times the resource's current client was disconnected (a stream's end, :meth:`disconnect`)."""
        with self._changed:
            state = self._resources.get(resource)
            return 0 if state is None else state.disconnects

    def request_count(self, resource: str) -> int:
        """``Register`` calls received for ``resource``, accepted or refused, across restarts."""
        with self._changed:
            return sum(1 for name, _ in self.requests if name == resource)

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
        """Wait until the resource has no connected client reading an open stream."""
        self._wait(lambda: not self._stream_open(resource), timeout, lambda: f"{resource}: ListAndWatch still open")

    def _stream_open(self, resource: str) -> bool:
        state = self._resources.get(resource)
        if state is None or state.current is None:
            return False
        return state.current is state.endpoint and not state.current.ended

    def options(self, resource: str) -> pb.DevicePluginOptions:
        """The options the plugin answered ``GetDevicePluginOptions`` with inside its latest Register."""
        options = self._endpoint(resource).options
        assert options is not None  # an endpoint is recorded only once its options are known
        return _copy(options)

    def _endpoint(self, resource: str) -> _Endpoint:
        with self._changed:
            state = self._resources.get(resource)
            if state is None or state.endpoint is None:
                raise StandInError(f"no registered endpoint for {resource}")
            if state.endpoint.closed:
                raise StandInError(f"the endpoint of {resource} was disconnected: the plugin must register again")
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
        if endpoint.options is None or not endpoint.options.get_preferred_allocation_available:
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
