"""The DRA kubelet plugin's gRPC side: registration on the kubelet's plugin registry, DRAPlugin on its own socket.

What a 1.34+ kubelet does (docs/dra.md, "Node side"): its plugin watcher sees a socket appear in
``/var/lib/kubelet/plugins_registry/`` (dot files are skipped), dials it, calls ``Registration.GetInfo``
(1 s deadline), checks ``type == "DRAPlugin"`` and that one of ``supported_versions`` is a DRAPlugin service
it speaks (the plugin's order is its preference: ``v1.DRAPlugin`` first, ``v1beta1.DRAPlugin`` for 1.32/1.33
kubelets), then answers with ``NotifyRegistrationStatus``. It then calls ``NodePrepareResources`` /
``NodeUnprepareResources`` on ``endpoint`` with a 45 s deadline, and treats a claim missing from the answer
or with a non-empty ``error`` as not done (it retries later). Removing the registration socket deregisters.

This module is protocol only: the servicers translate messages to and from :class:`~plugin.dra.prepare.
PrepareCore` (one core behind both API versions, whose messages are the same); a request over the bounds
is ``INVALID_ARGUMENT``; anything unexpected is ``INTERNAL`` with a short message, never a traceback.
:class:`DraServer` owns both gRPC servers and their sockets: each socket is bound under a dot name and
renamed into place once served (the kubelet never dials a socket nobody answers), and removed on stop
only while it is still ours. The DRAPlugin socket also serves the kubelet's health stream
(``v1alpha1.DRAResourceHealth``, :mod:`plugin.dra.health_stream`): the kubelet calls it on the endpoint it
registered, without looking for it in ``supported_versions``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from plugin.dra.claims import ClaimRef
from plugin.dra.health_stream import MAX_STREAMS, HealthBoard, HealthServicer
from plugin.dra.prepare import MAX_CLAIMS_PER_CALL, PREPARE_BUDGET, PrepareCore
from plugin.log import log_event
from runtime import sockets
from schemas.dra import DRIVER_NAME
from schemas.errors import InputError
from schemas.generated.kubelet.dra.v1 import api_pb2 as v1
from schemas.generated.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from schemas.generated.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from schemas.generated.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from schemas.generated.kubelet.dra_health.v1alpha1 import api_pb2_grpc as health_grpc
from schemas.generated.kubelet.pluginregistration.v1 import api_pb2 as reg
from schemas.generated.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc

PLUGIN_TYPE = "DRAPlugin"
"""``PluginInfo.type`` of a DRA kubelet plugin (Kubernetes' pluginregistration ``DRAPlugin`` constant)."""
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
"""``supported_versions``: the DRAPlugin services served, preferred first (the kubelet takes the first it knows)."""
SOCKET_NAME = "dra.sock"
REGISTRATION_SOCKET = f"{DRIVER_NAME}-reg.sock"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Largest request accepted: 256 claims of three names each are ~200 KiB; gRPC refuses more before we parse."""
PREPARE_CALLS = 6
"""NodePrepareResources calls served at once. A prepare may wait on the API server (reading its claims, up to
``plugin.dra.prepare.PREPARE_BUDGET``); the other workers are never taken by prepares, so an unprepare (which
reads nothing: it works from the checkpoint) is answered at once however slow the API server is. A prepare
beyond this is answered ``RESOURCE_EXHAUSTED`` at once (the kubelet retries it), never queued on a worker."""
WORKERS = PREPARE_CALLS + 2 + MAX_STREAMS
"""Threads serving a socket: the prepares', two for everything else, and one per health stream (a stream holds
its thread while it is open)."""
MAX_CONCURRENT_RPCS = 16 + MAX_STREAMS
"""Calls in progress or queued, open streams included; beyond, gRPC answers ``RESOURCE_EXHAUSTED``."""
ANSWER_MARGIN = 5.0
"""Seconds kept, of the caller's deadline for a prepare, for writing files and answering after the reads (a
quarter of it when that is less)."""
SOCKET_PROBE_TIMEOUT = 0.5


def _refs(claims: Any, context: grpc.ServicerContext) -> list[ClaimRef]:
    if len(claims) > MAX_CLAIMS_PER_CALL:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{len(claims)} claims in one call, over the limit of {MAX_CLAIMS_PER_CALL}",
        )
    return [ClaimRef(claim.namespace, claim.name, claim.uid) for claim in claims]


class DraServicer:
    """``DRAPlugin`` of one API version (``pb`` is the v1 or v1beta1 module: the same messages). ``prepare_slots``
    bounds the prepares served at once (shared by both versions' servicers: :data:`PREPARE_CALLS`)."""

    def __init__(self, core: PrepareCore, pb: Any, prepare_slots: threading.Semaphore | None = None) -> None:
        self.core = core
        self.pb = pb
        self.prepare_slots = prepare_slots or threading.BoundedSemaphore(PREPARE_CALLS)

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        refs = _refs(request.claims, context)
        if not self.prepare_slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{PREPARE_CALLS} NodePrepareResources calls are in progress (the API server is slow to answer "
                "their claims?); try again",
            )
        try:
            return self._prepare(refs, context)
        finally:
            self.prepare_slots.release()

    def _prepare(self, refs: list[ClaimRef], context: grpc.ServicerContext) -> Any:
        until = time.monotonic() + PREPARE_BUDGET
        remaining = context.time_remaining()
        if remaining is not None:  # the kubelet's own deadline (45 s), less the time to write and answer
            until = min(until, time.monotonic() + remaining - min(ANSWER_MARGIN, remaining / 4))
        try:
            outcomes = self.core.prepare(refs, until)
        except InputError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # a bug must not end the server: the kubelet retries
            log_event("dra_internal_error", call="NodePrepareResources", error=f"{type(exc).__name__}: {exc}")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        response = self.pb.NodePrepareResourcesResponse()
        for uid, outcome in outcomes.items():
            entry = response.claims[uid]
            if outcome.error:
                entry.error = outcome.error
                continue
            for device in outcome.devices:
                entry.devices.add(
                    request_names=list(device.requests),
                    pool_name=device.pool,
                    device_name=device.device,
                    cdi_device_ids=list(device.cdi_ids),
                )
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        refs = _refs(request.claims, context)
        try:
            errors = self.core.unprepare(refs)
        except InputError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            log_event("dra_internal_error", call="NodeUnprepareResources", error=f"{type(exc).__name__}: {exc}")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        response = self.pb.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error
        return response


@dataclass
class RegistrationStatus:
    """What the kubelet last said about our registration (None: nothing yet)."""

    registered: bool | None = None
    error: str = ""
    calls: int = 0
    at: float = 0.0
    """``time.monotonic()`` of the kubelet's last word."""


class RegistrationServicer:
    """``pluginregistration.Registration``: who we are, and the kubelet's verdict."""

    def __init__(self, endpoint: Path, services: tuple[str, ...] = SERVICES) -> None:
        self.endpoint = endpoint
        self.services = services
        self.status = RegistrationStatus()
        self.changed = threading.Condition()

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE, name=DRIVER_NAME, endpoint=str(self.endpoint), supported_versions=list(self.services)
        )

    def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        with self.changed:
            self.status = RegistrationStatus(
                request.plugin_registered, request.error[:1000], self.status.calls + 1, time.monotonic()
            )
            self.changed.notify_all()
        if request.plugin_registered:
            log_event("dra_registered", driver=DRIVER_NAME, endpoint=str(self.endpoint))
        else:
            log_event("registration_failed", driver=DRIVER_NAME, error=request.error[:1000])
        return reg.RegistrationStatusResponse()

    def forget_refusal(self) -> None:
        """Back to "no word yet" after a refusal (before offering the socket again)."""
        with self.changed:
            if self.status.registered is False:
                self.status = dataclasses.replace(self.status, registered=None)
            self.changed.notify_all()

    def wait_registered(self, timeout: float) -> bool:
        """Block until the kubelet said we are registered (tests, readiness)."""
        with self.changed:
            return self.changed.wait_for(lambda: self.status.registered is True, timeout)


class DraServeError(Exception):
    """A socket cannot be served (its directory is missing, another plugin holds it, the path is too long)."""


class _Socket:
    """One gRPC server on one unix socket, bound under a dot name and renamed into place."""

    def __init__(self, path: Path, adders: tuple[Any, ...], servicers: tuple[Any, ...]) -> None:
        self.path = path
        self._adders = adders
        self._servicers = servicers
        self._server: grpc.Server | None = None
        self._identity: tuple[int, int] | None = None
        self.generation = 0

    def start(self) -> None:
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
            sockets.prepare_socket_path(
                self.path, in_use_hint="another DRA plugin for this driver?", probe_timeout=SOCKET_PROBE_TIMEOUT
            )
        except (OSError, sockets.SocketInUse) as exc:
            raise DraServeError(f"cannot serve {self.path}: {exc}") from None
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix=f"dra-{self.path.stem}"),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES * 4),
            ],
        )
        for add, servicer in zip(self._adders, self._servicers, strict=True):
            add(servicer, server)
        self.generation += 1
        temporary = directory / f".{self.path.name}.{os.getpid()}.{self.generation}"
        try:
            bound = server.add_insecure_port(f"unix:{temporary}")
        except RuntimeError as exc:
            server.stop(0)
            raise DraServeError(f"cannot listen on {temporary}: {exc}") from None
        if not bound:
            server.stop(0)
            raise DraServeError(f"cannot listen on {temporary}")
        server.start()
        try:
            os.rename(temporary, self.path)
        except OSError as exc:
            server.stop(0).wait()
            raise DraServeError(f"cannot put the socket in place at {self.path}: {exc}") from None
        self._server = server
        self._identity = _identity(self.path)

    def intact(self) -> bool:
        return self._identity is not None and _identity(self.path) == self._identity

    def stop(self, grace: float | None) -> None:
        server, self._server = self._server, None
        if self._identity is not None and _identity(self.path) == self._identity:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._identity = None
        if server is not None:
            server.stop(grace).wait()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns


class DraServer:
    """The DRAPlugin socket (``<plugin dir>/dra.sock``) and the registration socket (``<registry>/<driver>-reg.sock``).

    :meth:`start` serves DRAPlugin first, then registration (the kubelet dials the endpoint as soon as it
    registers us); :meth:`stop` removes the registration socket first (the kubelet deregisters), then the
    plugin's. :meth:`ensure` puts back a socket someone removed (a wiped registry directory).
    """

    def __init__(self, core: PrepareCore, plugin_dir: Path, registry_dir: Path) -> None:
        self.core = core
        self.plugin_socket = plugin_dir.absolute() / SOCKET_NAME
        self.registration_socket = registry_dir.absolute() / REGISTRATION_SOCKET
        self.registration = RegistrationServicer(self.plugin_socket)
        self.health = HealthBoard()
        """The kubelet's health streams; the serve loop sets its state after each scan."""
        slots = threading.BoundedSemaphore(PREPARE_CALLS)
        self._plugin = _Socket(
            self.plugin_socket,
            (
                v1_grpc.add_DRAPluginServicer_to_server,
                v1beta1_grpc.add_DRAPluginServicer_to_server,
                health_grpc.add_DRAResourceHealthServicer_to_server,
            ),
            (DraServicer(core, v1, slots), DraServicer(core, v1beta1, slots), HealthServicer(self.health)),
        )
        self._registrar = _Socket(
            self.registration_socket, (reg_grpc.add_RegistrationServicer_to_server,), (self.registration,)
        )

    def start(self) -> None:
        for socket in (self.plugin_socket, self.registration_socket):
            try:
                sockets.check_socket_path_length(socket)
            except sockets.SocketInUse as exc:
                raise DraServeError(str(exc)) from None
        self.health.open()
        self._plugin.start()
        try:
            self._registrar.start()
        except DraServeError:
            self._plugin.stop(0)
            raise
        log_event(
            "dra_serving", plugin_socket=str(self.plugin_socket), registration_socket=str(self.registration_socket)
        )

    def ensure(self) -> bool:
        """Serve again a socket that was removed or replaced under us; True if one was."""
        again = False
        if not self._plugin.intact():
            log_event("socket_gone", socket=str(self.plugin_socket))
            self._plugin.stop(0)
            self._plugin.start()
            again = True
        if again or not self._registrar.intact():
            if not again:
                log_event("socket_gone", socket=str(self.registration_socket))
            self._registrar.stop(0)
            self._registrar.start()
            again = True
        return again

    def reregister(self) -> None:
        """Offer the registration socket anew (a fresh socket: the kubelet's watcher registers it again)."""
        log_event("dra_reregistering", socket=str(self.registration_socket))
        self._registrar.stop(0)
        self._registrar.start()

    def stop(self, grace: float | None = 1.0) -> None:
        self._registrar.stop(0)
        self.health.close()  # the streams end now: the grace below never waits on a kubelet's stream
        self._plugin.stop(grace)
        log_event("dra_stopped", plugin_socket=str(self.plugin_socket))
