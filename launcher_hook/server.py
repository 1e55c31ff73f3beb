"""The KubeVirt hook sidecar's gRPC server: the hook sidecar API, KubeVirt's plugin API, or both.

Two ways in, one builder (docs/protocols.md, "KubeVirt hooks" and "KubeVirt plugin API"):

- ``hooks``: ``Info`` and ``Callbacks`` v1alpha1-v1alpha3. virt-launcher finds the socket in
  ``/var/run/kubevirt-hooks/``, calls ``Info``, picks the newest version both sides know and calls that
  version's ``OnDefineDomain``.
- ``plugins``: ``kubevirt.hooks.plugins.v1alpha1.DomainHookService/MutateDomain`` (VEP 190), which
  virt-launcher calls on the socket a ``Plugin`` CR names; there is no ``Info`` and no ``Shutdown``.

The servicers here are thin adapters: both hand the bytes to the same ``HookService`` under the same memory
budget and turn its ``HookFault`` into the same gRPC status, so a domain gets the same answer either way.
Services that were not selected are not registered (a call to them is ``UNIMPLEMENTED``). ``Shutdown`` (and
SIGTERM/SIGINT, handled by the CLI) stops the server and removes its sockets.

The socket is created with mode 0666 (``DEFAULT_SOCKET_MODE``): virt-launcher and the sidecar are different
containers that may run as different users, and the directory is the pod's own ``emptyDir`` shared only by
the containers of this pod, so the pod boundary is what protects it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, Literal, get_args

import grpc

from launcher_hook.service import HookFault, HookService, log_call
from runtime.hook_api import HOOK_API_VERSIONS, VERSIONS
from runtime.sockets import SocketInUse, prepare_socket_path
from runtime.status import status_message
from schemas.generated.kubevirt.hooks import info_pb2, info_pb2_grpc
from schemas.generated.kubevirt.hooks.plugins.v1alpha1 import api_pb2 as plugins_pb2
from schemas.generated.kubevirt.hooks.plugins.v1alpha1 import api_pb2_grpc as plugins_pb2_grpc
from schemas.limits import DEFAULT_MAX_INPUT_BYTES

HOOK_NAME = "kubevirt-gpu-passthrough"
HOOK_POINTS = ("OnDefineDomain", "Shutdown")
DEFAULT_SOCKET = Path("/var/run/kubevirt-hooks/gpu-hostdev.sock")
HookApi = Literal["hooks", "plugins", "both"]
HOOK_APIS: tuple[HookApi, ...] = get_args(HookApi)
"""``hooks``: Info + Callbacks v1alpha1-3 (hook sidecars); ``plugins``: DomainHookService (KubeVirt's Plugin CR)."""
PLUGIN_NAME = "kubevirt-gpu-passthrough"
"""The ``Plugin`` CR's name in deploy/plugin-api: KubeVirt only accepts a socket under its directory."""
PLUGIN_SOCKET_DIR = Path("/var/run/kubevirt-plugin")
"""virt-launcher's plugin socket directory (KubeVirt's ``pluginSocketBaseDir``), one sub-directory per plugin."""
DEFAULT_PLUGIN_SOCKET = PLUGIN_SOCKET_DIR / PLUGIN_NAME / "hook.sock"
PLUGINS_VERSION = "plugins.v1alpha1"
PLUGIN_DOMAIN_TYPES = ("libvirt",)
"""``MutateDomainRequest.domain_type`` values we can answer (an empty one counts as ``libvirt``)."""
MAX_INVOCATION_CONTEXT = 64
"""Longest ``invocation_context`` a log line repeats (KubeVirt's values are ``Boot``, ``MigrationTarget`` ...)."""
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
M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter: the most malloc arenas the process makes."""
MALLOC_ARENAS = 2
"""Arenas the hook's process keeps at most: glibc would give each of the :data:`MAX_WORKERS` threads its own
(up to 8 per core), each keeping what it once freed; Python runs one thread at a time, so more arenas only hold
more memory (a few MiB after a run of 32-GPU calls), never speed a call up."""


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Ask glibc to make at most ``arenas`` malloc arenas from now on (before the worker threads start); False
    where that cannot be asked (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))


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


class _Definer:
    """One domain through ``HookService`` under the shared memory budget: what every servicer's call does."""

    def __init__(self, service: HookService, budget: ByteBudget, budget_wait: float) -> None:
        self._service = service
        self._budget = budget
        self._budget_wait = budget_wait

    def define(self, domain_xml: bytes, vmi: bytes, context: grpc.ServicerContext, *, event: str, via: str) -> bytes:
        size = len(domain_xml) + len(vmi)
        share = self._budget.acquire(size, self._budget_wait)
        if share is None:
            message = (
                f"the GPU hook is busy: {size} bytes of domain and VMI do not fit in its {self._budget.limit}-byte "
                f"memory budget within {self._budget_wait:g} s (other calls hold it); retry"
            )
            log_call(event, level=logging.WARNING, via=via, status="RESOURCE_EXHAUSTED", error=message)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, status_message(message))
        # Held until the answer has been sent (or the call ended otherwise), not just until we return.
        if not context.add_callback(lambda: self._budget.release(share)):
            self._budget.release(share)
        try:
            return self._service.define_domain(domain_xml, vmi, via=via, event=event).domain_xml
        except HookFault as fault:
            _abort(context, fault)
            raise  # unreachable: abort raises
        finally:
            if size >= TRIM_AFTER_BYTES:
                _release_free_memory()


class InfoServicer:
    """``kubevirt.hooks.info.Info``: who we are and what we hook."""

    def Info(self, request: info_pb2.InfoParams, context: grpc.ServicerContext) -> info_pb2.InfoResult:
        return info_pb2.InfoResult(
            name=HOOK_NAME,
            versions=list(VERSIONS),
            hookPoints=[info_pb2.HookPoint(name=name, priority=0) for name in HOOK_POINTS],
        )


class Callbacks:
    """``kubevirt.hooks.<version>.Callbacks``: OnDefineDomain through the service, for one hook API version.

    One class for every version: the versions differ only in their message modules (from
    :data:`runtime.hook_api.HOOK_API_VERSIONS`) and in which methods their service lists; gRPC registers only
    those (``PreCloudInitIso`` from v1alpha2, ``Shutdown`` from v1alpha3).
    """

    def __init__(
        self,
        version: str,
        service: HookService,
        on_shutdown: Callable[[], None],
        budget: ByteBudget,
        budget_wait: float = BUDGET_WAIT_SECONDS,
    ) -> None:
        self.version = version
        self._messages: Any = HOOK_API_VERSIONS[version][0]
        self._definer = _Definer(service, budget, budget_wait)
        self._on_shutdown = on_shutdown

    def OnDefineDomain(self, request: Any, context: grpc.ServicerContext) -> Any:
        domain = self._definer.define(
            request.domainXML, request.vmi, context, event="OnDefineDomain", via=f"grpc {self.version}"
        )
        return self._messages.OnDefineDomainResult(domainXML=domain)

    def PreCloudInitIso(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._messages.PreCloudInitIsoResult(
            cloudInitNoCloudSource=request.cloudInitNoCloudSource, cloudInitData=request.cloudInitData
        )

    def Shutdown(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._on_shutdown()
        return self._messages.ShutdownResult()


class DomainHooks:
    """``kubevirt.hooks.plugins.v1alpha1.DomainHookService``: MutateDomain is OnDefineDomain by another name.

    virt-launcher sends ``domain_type`` ``libvirt``, the domain XML, the VMI JSON and why it calls
    (``sidecar_context.invocation_context``: ``Boot``, or ``MigrationTarget`` when a migration target is
    prepared); the answer is the whole new domain. Another ``domain_type`` is refused: the builder writes libvirt
    XML only.
    """

    def __init__(self, service: HookService, budget: ByteBudget, budget_wait: float = BUDGET_WAIT_SECONDS) -> None:
        self._definer = _Definer(service, budget, budget_wait)

    def MutateDomain(
        self, request: plugins_pb2.MutateDomainRequest, context: grpc.ServicerContext
    ) -> plugins_pb2.MutateDomainResponse:
        invoked = request.sidecar_context.invocation_context[:MAX_INVOCATION_CONTEXT] or "-"
        via = f"grpc {PLUGINS_VERSION} {invoked}"
        if request.domain_type not in ("", *PLUGIN_DOMAIN_TYPES):
            message = (
                f"MutateDomain domain_type {request.domain_type[:MAX_INVOCATION_CONTEXT]!r} is not supported: the GPU "
                f"hook writes libvirt domains only ({', '.join(PLUGIN_DOMAIN_TYPES)})"
            )
            log_call("MutateDomain", level=logging.WARNING, via=via, status="INVALID_ARGUMENT", error=message)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_message(message))
        domain = self._definer.define(request.domain, request.vmi, context, event="MutateDomain", via=via)
        return plugins_pb2.MutateDomainResponse(domain=domain)


class HookServer:
    """The gRPC server on its unix socket(s), and its lifecycle: start, wait for a stop request, stop.

    ``api`` chooses the services registered (every socket serves all of them); ``also_listen`` adds sockets,
    for ``both`` in one pod (the hooks socket and the plugin socket are in different directories).
    """

    def __init__(
        self,
        socket_path: Path,
        service: HookService,
        *,
        api: HookApi = "hooks",
        also_listen: tuple[Path, ...] = (),
        socket_mode: int = DEFAULT_SOCKET_MODE,
        max_workers: int = MAX_WORKERS,
        max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
        memory_budget: int = MEMORY_BUDGET_BYTES,
        budget_wait: float = BUDGET_WAIT_SECONDS,
    ) -> None:
        if api not in HOOK_APIS:
            raise ValueError(f"api {api!r} is not one of {', '.join(HOOK_APIS)}")
        self.api = api
        self.socket_path = socket_path.absolute()
        self.socket_paths = tuple(dict.fromkeys([self.socket_path, *(path.absolute() for path in also_listen)]))
        self.socket_mode = socket_mode
        self._stop_requested = threading.Event()
        self._inodes: dict[Path, int] = {}
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
        if api in ("hooks", "both"):
            info_pb2_grpc.add_InfoServicer_to_server(InfoServicer(), self._server)
            for version, (_, grpc_module) in HOOK_API_VERSIONS.items():
                grpc_module.add_CallbacksServicer_to_server(
                    Callbacks(version, service, self.request_stop, self.budget, budget_wait), self._server
                )
        if api in ("plugins", "both"):
            plugins_pb2_grpc.add_DomainHookServiceServicer_to_server(
                DomainHooks(service, self.budget, budget_wait), self._server
            )

    def start(self) -> None:
        """Bind every socket (replacing a stale one), set their mode, and serve."""
        for path in self.socket_paths:
            prepare_socket_path(path, create_parent=True)
            # The umask decides the mode bind() gives the socket, so no client ever sees it with another mode.
            previous = os.umask(0o777 & ~self.socket_mode)
            try:
                bound = self._server.add_insecure_port(f"unix:{path}")
            finally:
                os.umask(previous)
            if not bound:
                raise SocketInUse(f"could not listen on {path}")
            os.chmod(path, self.socket_mode)
            self._inodes[path] = path.lstat().st_ino
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
        """Finish in-flight calls (up to ``grace`` seconds), stop, and remove our sockets (not newer ones)."""
        self._stop_requested.set()
        self._server.stop(grace).wait()
        for path, inode in self._inodes.items():
            try:
                if path.lstat().st_ino == inode:
                    path.unlink()
            except FileNotFoundError:
                pass
