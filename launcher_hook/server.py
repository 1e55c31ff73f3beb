"""The KubeVirt hook sidecar's gRPC server: ``Info`` and ``Callbacks`` v1alpha1-v1alpha3 on one unix socket.

virt-launcher finds the socket in ``/var/run/kubevirt-hooks/``, calls ``Info``, picks the newest version both
sides know and calls that version's ``OnDefineDomain`` (FACTS.md §3). The servicers here are thin adapters:
they hand the bytes to ``HookService`` and turn its ``HookFault`` into the gRPC status. ``Shutdown`` (and
SIGTERM/SIGINT, handled by the CLI) stops the server and removes the socket.

The socket is created with mode 0666 (``DEFAULT_SOCKET_MODE``): virt-launcher and the sidecar are different
containers that may run as different users, and the directory is the pod's own ``emptyDir`` shared only by
the containers of this pod, so the pod boundary is what protects it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from launcher_hook.service import HookFault, HookService, log_call
from schemas.generated.kubevirt.hooks import (
    info_pb2,
    info_pb2_grpc,
    v1alpha1_pb2,
    v1alpha1_pb2_grpc,
    v1alpha2_pb2,
    v1alpha2_pb2_grpc,
    v1alpha3_pb2,
    v1alpha3_pb2_grpc,
)
from schemas.limits import DEFAULT_MAX_INPUT_BYTES

HOOK_NAME = "kubevirt-gpu-passthrough"
VERSIONS = ("v1alpha1", "v1alpha2", "v1alpha3")
HOOK_POINTS = ("OnDefineDomain", "Shutdown")
DEFAULT_SOCKET = Path("/var/run/kubevirt-hooks/gpu-hostdev.sock")
DEFAULT_SOCKET_MODE = 0o666
MAX_MESSAGE_BYTES = 2 * DEFAULT_MAX_INPUT_BYTES + 64 * 1024
"""Largest gRPC message either way (16 MiB + 64 KiB): the builder's largest domain and VMI (8 MiB each,
``schemas.limits``) with room for the protobuf framing, so an over-cap document still reaches the builder and
is refused with its message; anything larger is refused by gRPC (``RESOURCE_EXHAUSTED``) before it is read."""
MAX_WORKERS = 8
"""Calls worked on at once (threads)."""
MAX_CONCURRENT_RPCS = 64
"""Calls accepted at once, running or waiting for a worker; more are answered ``RESOURCE_EXHAUSTED`` at once.
virt-launcher makes one call at a time."""
MEMORY_BUDGET_BYTES = DEFAULT_MAX_INPUT_BYTES
"""Domain + VMI bytes in flight at once (8 MiB), held from the start of a call until its answer has been sent
(a client that never reads keeps its share). A call larger than the budget runs alone. Working on a call takes
about 20 times its size, so this keeps the hook's working memory near 150 MB above its idle RSS."""
BUDGET_WAIT_SECONDS = 2.0
"""Longest a call waits for its share of the budget before it is answered ``RESOURCE_EXHAUSTED``."""
MAX_CONNECTION_AGE_MS = 120_000
MAX_CONNECTION_AGE_GRACE_MS = 30_000
"""Connections are closed after 2 min (+30 s for a call in flight): virt-launcher dials afresh for every call
and gives each a 1-minute deadline, so only a client that never reads its answer is cut off, and its share of
the budget returns."""
MAX_UNIX_SOCKET_PATH = 107
MAX_STATUS_MESSAGE = 512
"""Longest status message sent, in characters (as the device plugin's). gRPC sends it percent-encoded in the
trailers, and a client drops trailers over its metadata limit (16 KiB hard) with RESOURCE_EXHAUSTED instead of
the real status; 512 characters stay under 8 KiB even when every one is a 4-byte character."""


def status_message(message: str) -> str:
    """``message`` fit for a gRPC status: at most ``MAX_STATUS_MESSAGE`` characters, and encodable as UTF-8
    (a VMI's JSON may carry lone surrogates such as ``\\ud800`` into a message; they are written escaped)."""
    if len(message) > MAX_STATUS_MESSAGE:
        message = message[: MAX_STATUS_MESSAGE - 3] + "..."
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def _abort(context: grpc.ServicerContext, fault: HookFault) -> None:
    context.abort(grpc.StatusCode[fault.code], status_message(fault.message))


TRIM_AFTER_BYTES = 1024 * 1024
"""After a call this large, free heap memory is handed back to the system (see ``_release_free_memory``)."""


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def _release_free_memory() -> None:
    """Return free heap pages to the system. glibc gives each worker thread its own malloc arena and keeps what a
    big parse freed there, so without this 8 workers that each once built an 8 MiB domain hold ~8 x 150 MB."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class ByteBudget:
    """A semaphore counted in bytes: ``acquire(n)`` waits until ``n`` more bytes fit under ``limit``.

    A request larger than ``limit`` counts as ``limit`` (it then runs alone). Cheap on the usual path: one lock
    taken twice per call.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._changed = threading.Condition(threading.Lock())

    @property
    def used(self) -> int:
        with self._changed:
            return self._used

    def acquire(self, size: int, timeout: float) -> int | None:
        """Take ``size`` bytes (at most ``limit``) within ``timeout`` seconds: what was taken, or None."""
        share = min(size, self.limit)
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._used + share > self.limit:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)
            self._used += share
        return share

    def release(self, share: int) -> None:
        with self._changed:
            self._used -= share
            self._changed.notify_all()


class InfoServicer:
    """``kubevirt.hooks.info.Info``: who we are and what we hook."""

    def Info(self, request: info_pb2.InfoParams, context: grpc.ServicerContext) -> info_pb2.InfoResult:
        return info_pb2.InfoResult(
            name=HOOK_NAME,
            versions=list(VERSIONS),
            hookPoints=[info_pb2.HookPoint(name=name, priority=0) for name in HOOK_POINTS],
        )


class _Callbacks:
    """What every version shares: OnDefineDomain through the service."""

    version = ""

    def __init__(
        self,
        service: HookService,
        on_shutdown: Callable[[], None],
        budget: ByteBudget,
        budget_wait: float = BUDGET_WAIT_SECONDS,
    ) -> None:
        self._service = service
        self._on_shutdown = on_shutdown
        self._budget = budget
        self._budget_wait = budget_wait

    def _define(self, domain_xml: bytes, vmi: bytes, context: grpc.ServicerContext) -> bytes:
        size = len(domain_xml) + len(vmi)
        share = self._budget.acquire(size, self._budget_wait)
        if share is None:
            message = (
                f"the GPU hook is busy: {size} bytes of domain and VMI do not fit in its {self._budget.limit}-byte "
                f"memory budget within {self._budget_wait:g} s (other calls hold it); retry"
            )
            log_call(
                "OnDefineDomain",
                level=logging.WARNING,
                via=f"grpc {self.version}",
                status="RESOURCE_EXHAUSTED",
                error=message,
            )
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, status_message(message))
        # Held until the answer has been sent (or the call ended otherwise), not just until we return.
        if not context.add_callback(lambda: self._budget.release(share)):
            self._budget.release(share)
        try:
            return self._service.define_domain(domain_xml, vmi, via=f"grpc {self.version}").domain_xml
        except HookFault as fault:
            _abort(context, fault)
            raise  # unreachable: abort raises
        finally:
            if size >= TRIM_AFTER_BYTES:
                _release_free_memory()


class CallbacksV1alpha1(_Callbacks):
    version = "v1alpha1"

    def OnDefineDomain(
        self, request: v1alpha1_pb2.OnDefineDomainParams, context: grpc.ServicerContext
    ) -> v1alpha1_pb2.OnDefineDomainResult:
        return v1alpha1_pb2.OnDefineDomainResult(domainXML=self._define(request.domainXML, request.vmi, context))


class CallbacksV1alpha2(_Callbacks):
    version = "v1alpha2"

    def OnDefineDomain(
        self, request: v1alpha2_pb2.OnDefineDomainParams, context: grpc.ServicerContext
    ) -> v1alpha2_pb2.OnDefineDomainResult:
        return v1alpha2_pb2.OnDefineDomainResult(domainXML=self._define(request.domainXML, request.vmi, context))

    def PreCloudInitIso(
        self, request: v1alpha2_pb2.PreCloudInitIsoParams, context: grpc.ServicerContext
    ) -> v1alpha2_pb2.PreCloudInitIsoResult:
        return v1alpha2_pb2.PreCloudInitIsoResult(
            cloudInitNoCloudSource=request.cloudInitNoCloudSource, cloudInitData=request.cloudInitData
        )


class CallbacksV1alpha3(_Callbacks):
    version = "v1alpha3"

    def OnDefineDomain(
        self, request: v1alpha3_pb2.OnDefineDomainParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.OnDefineDomainResult:
        return v1alpha3_pb2.OnDefineDomainResult(domainXML=self._define(request.domainXML, request.vmi, context))

    def PreCloudInitIso(
        self, request: v1alpha3_pb2.PreCloudInitIsoParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.PreCloudInitIsoResult:
        return v1alpha3_pb2.PreCloudInitIsoResult(
            cloudInitNoCloudSource=request.cloudInitNoCloudSource, cloudInitData=request.cloudInitData
        )

    def Shutdown(
        self, request: v1alpha3_pb2.ShutdownParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.ShutdownResult:
        self._on_shutdown()
        return v1alpha3_pb2.ShutdownResult()


class SocketInUse(Exception):
    """The socket path is taken (a live server answers there, or it is not a socket) or too long for a socket."""


LIVE_PROBE_SECONDS = 1.0
"""How long ``start`` waits for an existing socket to accept a connection before calling it stale."""


def socket_is_live(path: Path, timeout: float = LIVE_PROBE_SECONDS) -> bool:
    """Whether something accepts connections on the unix socket ``path`` now (a stale socket refuses them)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(os.fspath(path))
    except (TimeoutError, PermissionError):
        return True  # a full backlog (a busy server), or a socket we may not probe: neither is ours to replace
    except OSError:
        return False  # ECONNREFUSED: nobody listens there any more
    finally:
        probe.close()
    return True


class HookServer:
    """The gRPC server on one unix socket, and its lifecycle: start, wait for a stop request, stop."""

    def __init__(
        self,
        socket_path: Path,
        service: HookService,
        *,
        socket_mode: int = DEFAULT_SOCKET_MODE,
        max_workers: int = MAX_WORKERS,
        max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
        memory_budget: int = MEMORY_BUDGET_BYTES,
        budget_wait: float = BUDGET_WAIT_SECONDS,
    ) -> None:
        self.socket_path = socket_path.absolute()
        self.socket_mode = socket_mode
        self._stop_requested = threading.Event()
        self._inode: int | None = None
        self.budget = ByteBudget(memory_budget)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="hook"),
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
                ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
            ],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        info_pb2_grpc.add_InfoServicer_to_server(InfoServicer(), self._server)
        for servicer_class, module in (
            (CallbacksV1alpha1, v1alpha1_pb2_grpc),
            (CallbacksV1alpha2, v1alpha2_pb2_grpc),
            (CallbacksV1alpha3, v1alpha3_pb2_grpc),
        ):
            module.add_CallbacksServicer_to_server(
                servicer_class(service, self.request_stop, self.budget, budget_wait), self._server
            )

    def _prepare_path(self) -> None:
        path = self.socket_path
        if len(os.fsencode(path)) > MAX_UNIX_SOCKET_PATH:
            raise SocketInUse(f"socket path {path} is longer than {MAX_UNIX_SOCKET_PATH} bytes, the unix socket limit")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
        if socket_is_live(path):
            raise SocketInUse(
                f"another server is listening on {path} (or it cannot be probed); refusing to replace its socket"
            )
        path.unlink()  # a stale socket from an earlier run: nobody answers there

    def start(self) -> None:
        """Bind (replacing a stale socket), set the socket's mode, and serve."""
        self._prepare_path()
        # The umask decides the mode bind() gives the socket, so no client ever sees it with another mode.
        previous = os.umask(0o777 & ~self.socket_mode)
        try:
            bound = self._server.add_insecure_port(f"unix:{self.socket_path}")
        finally:
            os.umask(previous)
        if not bound:
            raise SocketInUse(f"could not listen on {self.socket_path}")
        os.chmod(self.socket_path, self.socket_mode)
        self._inode = self.socket_path.lstat().st_ino
        self._server.start()

    def request_stop(self) -> None:
        """Ask ``wait`` to return (from Shutdown, a signal handler or a test); safe from any thread."""
        self._stop_requested.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    def wait(self, poll_seconds: float = 0.5) -> None:
        """Block until ``request_stop``; polls so that signal handlers run promptly in the main thread."""
        while not self._stop_requested.wait(poll_seconds):
            pass

    def stop(self, grace: float = 2.0) -> None:
        """Finish in-flight calls (up to ``grace`` seconds), stop, and remove our socket (not a newer one)."""
        self._stop_requested.set()
        self._server.stop(grace).wait()
        try:
            if self._inode is not None and self.socket_path.lstat().st_ino == self._inode:
                self.socket_path.unlink()
        except FileNotFoundError:
            pass
