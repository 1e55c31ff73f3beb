"""One resource's device plugin endpoint: the ``v1beta1.DevicePlugin`` gRPC server on its own unix socket.

The kubelet talks to a device plugin per resource (docs/protocols.md, "Kubelet device plugin API"): it dials the
plugin's socket inside ``Register``, so the server here must serve before :meth:`ResourceServer.register` is called;
it keeps one ``ListAndWatch`` stream open per registration and treats the end of *any* of the resource's streams
as "disconnect the current client, every device unhealthy". This module is protocol only:

- :class:`ResourceState` holds the resource as last discovered and a version; each ``ListAndWatch`` stream
  blocks on its condition variable (no polling) and sends the whole list whenever what the kubelet sees
  (IDs, health, NUMA) changes;
- :class:`KubeletLink` tells the kubelet's stream from the others: each ``Register`` we send grants one stream,
  the first ``ListAndWatch`` opened after it. The plugin never ends a stream itself (only stopping the server
  does): the granted one has its own slot, the others share :data:`MAX_OTHER_STREAMS` slots and a stream beyond
  them is refused with ``RESOURCE_EXHAUSTED``. The grant's state (waiting, open, ended) is what tells the
  manager whether the kubelet still has us;
- :class:`DevicePluginServicer` is a thin adapter: ``Allocate`` and ``GetPreferredAllocation`` hand the
  request to :mod:`plugin.allocation` and :mod:`plugin.preferred` (policy) and turn their answers into
  messages; bad input becomes a gRPC status, never a crash; each ``Allocate`` outcome is one counter
  increment in :mod:`plugin.metrics`;
- :class:`ResourceServer` owns the gRPC server, its socket file (removed on stop only if it is still ours)
  and the ``Register`` call.

Deciding *what* to serve (discovery, rescans, kubelet restarts) is :mod:`plugin.manager`'s job.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from plugin import allocation, preferred
from plugin.health import UsabilityRule
from plugin.inventory import Device, Resource
from plugin.log import log_event
from plugin.metrics import MetricsRecorder
from runtime import sockets
from runtime.sockets import prepare_socket_path
from runtime.status import status_message
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")
REGISTER_TIMEOUT = 15.0
"""Seconds a ``Register`` call may take: the kubelet gives its dial-back to us 10 s inside it."""
MAX_DEVICES_PER_REQUEST = 4096
"""More IDs than any node has; a longer request is refused rather than processed."""
MAX_KUBELET_STREAMS = 1
"""Open ``ListAndWatch`` streams granted to the kubelet (the one that follows each of our ``Register`` calls);
a granted stream beyond this (a grant replaced while the old stream is still open) counts as another stream."""
MAX_OTHER_STREAMS = 2
"""Open ``ListAndWatch`` streams without a grant (a duplicate kubelet client, a debugging tool, an attacker). A
stream beyond this is refused with ``RESOURCE_EXHAUSTED``; no open stream is ever ended to make room, since the
kubelet disconnects its current client when any of the resource's streams ends (docs/protocols.md)."""
UNARY_WORKERS = 4
"""gRPC workers left for unary calls, which answer in milliseconds."""
MAX_WORKERS = MAX_KUBELET_STREAMS + MAX_OTHER_STREAMS + 1 + UNARY_WORKERS
"""Every admitted stream holds a worker; one more for a refused stream's handler (it returns at once), so the
unary calls (``Allocate``, ``GetPreferredAllocation``) always find one."""
MAX_CONCURRENT_RPCS = 64
"""Calls in progress or queued for a worker; gRPC answers ``RESOURCE_EXHAUSTED`` beyond (nothing queues forever)."""
SOCKET_PROBE_TIMEOUT = 0.5
"""Seconds to wait for a unix socket to accept a connection before calling it live (a full backlog)."""


def status_for_refusal(error: allocation.AllocationError) -> grpc.StatusCode:
    """The gRPC status for an allocation refusal: the caller's mistake or a device not usable now."""
    if isinstance(error, allocation.InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.FAILED_PRECONDITION


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    context.abort(code, status_message(message))


def _shown(ids: Sequence[str], limit: int = 16) -> list[str]:
    """The IDs for a log line: at most ``limit``, each cut to 63 characters (a kubelet device ID's maximum)."""
    return [device_id[:63] for device_id in ids[:limit]]


def plugin_options() -> pb.DevicePluginOptions:
    """What this plugin offers: preferred allocation yes, ``PreStartContainer`` not needed."""
    return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def device_message(device: Device) -> pb.Device:
    """The kubelet's view of one device: its ID, exactly ``Healthy``/``Unhealthy``, and its NUMA node if known."""
    message = pb.Device(ID=device.id, health=device.health)
    if device.numa_node is not None:
        message.topology.nodes.append(pb.NUMANode(ID=device.numa_node))
    return message


def list_response(resource: Resource) -> pb.ListAndWatchResponse:
    """The whole device list, as every ``ListAndWatch`` message must carry it."""
    return pb.ListAndWatchResponse(devices=[device_message(device) for device in resource.devices])


def kubelet_view(resource: Resource) -> tuple[tuple[str, bool, int | None], ...]:
    """What the kubelet can see of a resource; a new ``ListAndWatch`` message is sent only when this changes."""
    return tuple((device.id, device.healthy, device.numa_node) for device in resource.devices)


class ResourceState:
    """The resource as last discovered, a version bumped on every kubelet-visible change, and the waiters."""

    def __init__(self, resource: Resource) -> None:
        self.changed = threading.Condition()
        self._resource = resource
        self._version = 0
        self.fault: str | None = None
        """Why the last ``ListAndWatch`` message could not be built (the kubelet is not told the truth); None
        once one is built again. Read by the manager's health checks from any thread."""

    @property
    def resource(self) -> Resource:
        with self.changed:
            return self._resource

    def snapshot(self) -> tuple[Resource, int]:
        with self.changed:
            return self._resource, self._version

    def update(self, resource: Resource) -> bool:
        """Take the newly discovered ``resource``; wake the streams and return True if the kubelet's view changed."""
        with self.changed:
            visible = kubelet_view(resource) != kubelet_view(self._resource)
            self._resource = resource
            if visible:
                self._version += 1
                self.changed.notify_all()
            return visible


class KubeletLink:
    """Which ``ListAndWatch`` stream is the kubelet's: each ``Register`` we send grants the next one opened.

    The grant outlives a server restart (a kubelet that dials back while we restart reaches the new server), and
    only the latest grant counts. Its state: ``waiting`` (not claimed yet), ``open`` (a stream holds it),
    ``ended`` (that stream ended: the kubelet dropped its client, or we stopped the server), ``revoked`` (the
    ``Register`` failed). The lock is the resource state's condition; ``notify`` (the manager's wake-up) runs
    whenever the granted stream ends, from gRPC's threads.
    """

    WAITING, OPEN, ENDED, REVOKED = "waiting", "open", "ended", "revoked"

    def __init__(self, lock: threading.Condition, notify: Callable[[], None] | None = None) -> None:
        self._lock = lock
        self._notify = notify
        self._token = 0
        self._status = self.REVOKED

    def grant(self) -> int:
        """A ``Register`` is about to be sent: the next stream opened is the kubelet's. Returns the grant."""
        with self._lock:
            self._token += 1
            self._status = self.WAITING
            return self._token

    def revoke(self, token: int) -> None:
        """The ``Register`` of ``token`` failed: no stream is coming for it."""
        with self._lock:
            if token == self._token and self._status == self.WAITING:
                self._status = self.REVOKED

    def status(self, token: int | None) -> str:
        """The state of grant ``token``; ``revoked`` for an older grant or none."""
        with self._lock:
            return self._status if token == self._token else self.REVOKED

    def _claim(self) -> int | None:
        """A new stream takes the waiting grant, if any (the lock is held)."""
        if self._status != self.WAITING:
            return None
        self._status = self.OPEN
        return self._token

    def _ended(self, token: int) -> None:
        """The stream holding ``token`` ended (the lock is held)."""
        if token == self._token and self._status == self.OPEN:
            self._status = self.ENDED
            if self._notify is not None:
                self._notify()

    def server_stopped(self) -> None:
        """Our server stopped: a granted stream it held is over, whether or not gRPC has said so yet."""
        with self._lock:
            self._ended(self._token)


class _Stream:
    """One open ``ListAndWatch`` call: its context, whether it must end, and its grant (None: not the kubelet's)."""

    __slots__ = ("context", "ended", "token")

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.ended = False
        self.token: int | None = None


class DevicePluginServicer:
    """``v1beta1.DevicePlugin`` for one resource (one instance per gRPC server generation)."""

    def __init__(
        self,
        state: ResourceState,
        host_root: Path,
        rule: UsabilityRule,
        metrics: MetricsRecorder | None = None,
        link: KubeletLink | None = None,
    ) -> None:
        self._state = state
        self._link = link if link is not None else KubeletLink(state.changed)
        self._allocator = allocation.Allocator(host_root, rule)
        """The host root's descriptor and the resource's plan, kept for this generation (closed by :meth:`stop`)."""
        self._metrics = metrics
        self._stopped = False
        self._kubelet_streams: list[_Stream] = []
        """Open granted ``ListAndWatch`` streams (guarded by the state's condition)."""
        self._streams: list[_Stream] = []
        """Other open ``ListAndWatch`` streams, oldest first (guarded by the state's condition)."""
        self._refusing = False
        """A stream was refused since the last one ended (logged once per full spell)."""

    def _count(self, resource: str, code: grpc.StatusCode) -> None:
        if self._metrics is not None:
            self._metrics.record_allocation(resource, code)

    def stop(self) -> None:
        """End every open ``ListAndWatch`` stream of this generation (they return; the handlers finish)."""
        with self._state.changed:
            self._stopped = True
            self._state.changed.notify_all()
        self._allocator.close()  # a request still under way gives the root back first; later ones open their own

    # -- the five methods ------------------------------------------------------------------------------

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return plugin_options()

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        state = self._state
        stream = _Stream(context)

        def on_done() -> None:  # the client went away, or the server is stopping
            with state.changed:
                stream.ended = True
                for streams in (self._kubelet_streams, self._streams):
                    if stream in streams:
                        streams.remove(stream)
                        self._refusing = False
                if stream.token is not None:
                    self._link._ended(stream.token)
                state.changed.notify_all()

        if not context.add_callback(on_done):
            return  # the call already ended
        if not self._admit(stream):
            _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{state.resource.name}: {MAX_OTHER_STREAMS} ListAndWatch streams besides the kubelet's are open "
                "already; close one first",
            )
        sent: int | None = None
        while True:
            with state.changed:
                while True:
                    if stream.ended or self._stopped:
                        return
                    resource, version = state.snapshot()
                    if version != sent:
                        break
                    state.changed.wait()
            try:
                response = list_response(resource)
            except Exception as exc:  # a device the kubelet cannot be told about: say so, keep the stream
                problem = status_message(f"cannot build the ListAndWatch message: {type(exc).__name__}: {exc}")
                if state.fault != problem:
                    log_event("list_and_watch_failed", resource=resource.name, error=problem)
                state.fault = problem
                sent = version  # retried when the resource changes again
                continue
            if state.fault is not None:
                state.fault = None
                log_event("list_and_watch_recovered", resource=resource.name)
            if sent is None:
                log_event("list_and_watch", resource=resource.name, devices=len(resource.devices))
            yield response
            sent = version

    def _admit(self, stream: _Stream) -> bool:
        """Count ``stream`` in: the kubelet's if it claims the waiting grant, else another if there is room.

        False when it must be refused. No open stream is ever ended here: the kubelet disconnects its current
        client when any stream of the resource ends, so ending one to make room would drop the kubelet.
        """
        with self._state.changed:
            if stream.ended or self._stopped:
                return True  # ends at once by itself
            if len(self._kubelet_streams) < MAX_KUBELET_STREAMS:
                stream.token = self._link._claim()
            if stream.token is not None:
                self._kubelet_streams.append(stream)
            elif len(self._streams) < MAX_OTHER_STREAMS:
                # A grant made while the older granted stream is still open (the kubelet keeps a replaced
                # client's stream): the new one is the kubelet's all the same, counted among the others.
                stream.token = self._link._claim()
                self._streams.append(stream)
            else:
                first, self._refusing = not self._refusing, True
                if first:
                    log_event("stream_refused", resource=self._state.resource.name, limit=MAX_OTHER_STREAMS)
                return False
        log_event("stream_opened", resource=self._state.resource.name, kubelet=stream.token is not None)
        return True

    @property
    def open_streams(self) -> int:
        """Open ``ListAndWatch`` streams, the kubelet's included."""
        with self._state.changed:
            return len(self._kubelet_streams) + len(self._streams)

    @property
    def kubelet_streams(self) -> int:
        """Open granted (the kubelet's) ``ListAndWatch`` streams."""
        with self._state.changed:
            return len(self._kubelet_streams)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        resource = self._state.resource
        responses = []
        for container in request.container_requests:
            if (
                len(container.available_deviceIDs) > MAX_DEVICES_PER_REQUEST
                or len(container.must_include_deviceIDs) > MAX_DEVICES_PER_REQUEST
            ):
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{resource.name}: too many device IDs")
            try:
                chosen = preferred.preferred_allocation(
                    resource.devices,
                    list(container.available_deviceIDs),
                    list(container.must_include_deviceIDs),
                    container.allocation_size,
                )
            except ValueError as exc:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{resource.name}: {exc}")
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        resource = self._state.resource
        responses = []
        for container in request.container_requests:
            ids = list(container.devices_ids)
            if len(ids) > MAX_DEVICES_PER_REQUEST:
                self._count(resource.name, grpc.StatusCode.INVALID_ARGUMENT)
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{resource.name}: too many device IDs")
            try:
                responses.append(response_message(self._allocator.allocate(resource, ids)))
            except allocation.AllocationError as exc:
                code = status_for_refusal(exc)
                log_event(
                    "allocate_refused",
                    resource=resource.name,
                    ids=_shown(ids),
                    code=code.name,
                    error=status_message(exc.message),
                )
                self._count(resource.name, code)
                _abort(context, code, exc.message)
            except Exception:
                self._count(resource.name, grpc.StatusCode.UNKNOWN)  # gRPC answers UNKNOWN for what escapes
                raise
            log_event("allocate", resource=resource.name, ids=ids)
        self._count(resource.name, grpc.StatusCode.OK)
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def response_message(result: allocation.Allocation) -> pb.ContainerAllocateResponse:
    """An allocation as the kubelet's ``ContainerAllocateResponse``."""
    response = pb.ContainerAllocateResponse(envs=result.envs)
    add = response.devices.add  # built in place: no message made and then copied into the list
    for spec in result.device_specs:
        add(container_path=spec.container_path, host_path=spec.host_path, permissions=spec.permissions)
    return response


class ServeError(Exception):
    """The resource's socket cannot be served now (its directory is gone, the path is taken...); retried later."""


class SocketInUse(ServeError):
    """The socket path is taken (by something that is not a socket, or by a live server), or is too long: the
    plumbing's :class:`runtime.sockets.SocketInUse` as a :class:`ServeError` the manager retries."""


class ResourceServer:
    """One resource's gRPC server on ``<kubelet_dir>/<resource.socket>``: start, restart, register, stop.

    Not thread-safe by itself: :mod:`plugin.manager` drives it from one thread. :meth:`update` may be called
    from any thread.
    """

    def __init__(
        self,
        resource: Resource,
        kubelet_dir: Path,
        host_root: Path,
        *,
        rule: UsabilityRule = allocation.DEFAULT_RULE,
        max_workers: int = MAX_WORKERS,
        metrics: MetricsRecorder | None = None,
        notify: Callable[[], None] | None = None,
    ) -> None:
        self.name = resource.name
        self.metrics = metrics
        self.rule = rule
        self.kubelet_dir = kubelet_dir.absolute()
        self.socket_path = self.kubelet_dir / resource.socket
        self.host_root = host_root
        self.state = ResourceState(resource)
        self.link = KubeletLink(self.state.changed, notify)
        """Which stream is the kubelet's, across restarts; ``notify`` runs when that stream ends."""
        self.generation = 0
        """Bumped by every (re)start; a registration answer for an older generation is stale."""
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._servicer: DevicePluginServicer | None = None
        self._inode: tuple[int, int] | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    def update(self, resource: Resource) -> bool:
        """Serve ``resource``'s devices from now on; True if the kubelet's view changed (streams were woken)."""
        return self.state.update(resource)

    def _prepare_path(self) -> None:
        try:
            prepare_socket_path(
                self.socket_path,
                in_use_hint="another gpu-device-plugin on this node?",
                probe_timeout=SOCKET_PROBE_TIMEOUT,
            )
        except sockets.SocketInUse as exc:
            raise SocketInUse(str(exc)) from None

    def start(self) -> None:
        """Serve on the socket (replacing a stale one); the old server, if any, must be stopped first.

        gRPC binds a temporary name in the same directory and the socket is renamed into place once the
        server listens: the kubelet never sees a socket nobody answers on, and since gRPC unlinks the path
        it bound when it stops, binding elsewhere keeps a stopping server from deleting a newer socket.
        """
        if not self.kubelet_dir.is_dir():
            raise ServeError(f"cannot serve {self.socket_path}: the directory {self.kubelet_dir} does not exist")
        self._prepare_path()
        servicer = DevicePluginServicer(self.state, self.host_root, self.rule, self.metrics, self.link)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix=f"dp-{self.socket_path.stem}"),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        pb_grpc.add_DevicePluginServicer_to_server(servicer, server)
        temporary = self.kubelet_dir / f".kp-{os.getpid()}-{id(self):x}-{self.generation + 1}.sock"
        try:
            bound = server.add_insecure_port(f"unix:{temporary}")
        except RuntimeError as exc:  # gRPC raises this when the directory is gone or not writable
            server.stop(0)
            raise ServeError(f"cannot listen on {temporary}: {exc}") from None
        if not bound:
            server.stop(0)
            raise ServeError(f"cannot listen on {temporary}")
        server.start()
        try:
            os.rename(temporary, self.socket_path)
        except OSError:
            server.stop(0).wait()
            raise
        self._server, self._servicer = server, servicer
        self._inode = _identity(self.socket_path)
        self.generation += 1
        log_event("serving", resource=self.name, socket=str(self.socket_path), generation=self.generation)

    def socket_intact(self) -> bool:
        """True while the socket file we bound is still in place (the kubelet deletes it when it restarts)."""
        return self._inode is not None and _identity(self.socket_path) == self._inode

    def stop(self, grace: float | None = 1.0) -> None:
        """End the streams, stop the server (in-flight unary calls get ``grace`` s) and remove our socket."""
        server, servicer = self._server, self._servicer
        self._server = self._servicer = None
        if servicer is not None:
            servicer.stop()
            self.link.server_stopped()
        if server is not None:
            server.stop(grace).wait()
        if self._inode is not None and _identity(self.socket_path) == self._inode:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self._inode = None

    def restart(self) -> None:
        """Serve anew on a fresh socket (ours was deleted): the old streams end, the kubelet must re-dial."""
        self.stop(grace=0)
        self.start()

    def register(
        self,
        kubelet_socket: Path,
        done: Callable[[BaseException | None, grpc.Channel], None],
        token: int | None = None,
    ) -> int:
        """Call ``Register`` on ``kubelet_socket`` without blocking; return the stream grant it carries.

        The next ``ListAndWatch`` opened is granted to the kubelet (:class:`KubeletLink`) from before the call
        (``token``, from :meth:`KubeletLink.grant`; granted here if None), since the kubelet may open it before
        its answer reaches us. ``done(error or None, channel)`` runs on a gRPC thread when the call ends (or at
        once, here, if it already has); the receiver closes the channel from its own thread (closing it inside
        the callback could deadlock) and revokes the grant if the call failed.
        """
        if token is None:
            token = self.link.grant()
        request = pb.RegisterRequest(
            version=API_VERSION, endpoint=self.socket_path.name, resource_name=self.name, options=plugin_options()
        )
        channel = grpc.insecure_channel(f"unix:{kubelet_socket}")
        call: Any = pb_grpc.RegistrationStub(channel).Register.future(request, timeout=REGISTER_TIMEOUT)

        def finished(future: Any) -> None:
            error: BaseException | None = None
            try:
                future.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as exc:
                error = exc
            done(error, channel)

        call.add_done_callback(finished)
        return token


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file is at ``path`` (inode and modification time), or None: tells a recreated socket apart."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns


def describe_rpc_error(error: BaseException) -> str:
    """A short text for a failed call: ``CODE: details`` for gRPC errors."""
    if isinstance(error, grpc.Call):
        code = error.code()
        return f"{code.name if code is not None else 'UNKNOWN'}: {error.details()}"
    return f"{type(error).__name__}: {error}"
