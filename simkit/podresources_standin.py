"""A stand-in for the kubelet's PodResources API (``v1.PodResourcesLister``) over a real unix socket.

The hook sidecar reads its own pod's devices from it, the node agent which devices any pod holds; both are
tested against this server, not a mock of the client. It answers ``List`` with the pods it is given (a test
changes them at any time with :meth:`FakeKubelet.set_pods`), ``Get`` by namespace and name (or as a kubelet
with the method gated off answers: ``UNKNOWN`` "... Get method disabled", or ``UNIMPLEMENTED``), and
``GetAllocatableResources`` empty. Every call is recorded by name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from schemas.generated.kubelet.podresources.v1 import api_pb2 as pr
from schemas.generated.kubelet.podresources.v1 import api_pb2_grpc as pr_grpc


@dataclass
class Container:
    name: str
    devices: Sequence[tuple[str, Sequence[str]]] = ()


@dataclass
class Pod:
    namespace: str
    name: str
    containers: Sequence[Container] = ()

    def message(self) -> pr.PodResources:
        return pr.PodResources(
            name=self.name,
            namespace=self.namespace,
            containers=[
                pr.ContainerResources(
                    name=container.name,
                    devices=[
                        pr.ContainerDevices(resource_name=r, device_ids=list(ids)) for r, ids in container.devices
                    ],
                )
                for container in self.containers
            ],
        )


@dataclass
class FakeKubelet:
    """The kubelet's ``v1.PodResourcesLister`` with the pods given; ``get`` is ``ok``, ``disabled`` (UNKNOWN,
    as kubelets before 1.34 answer) or ``unimplemented``."""

    pods: list[Pod]
    get: str = "ok"
    calls: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _record(self, name: str) -> None:
        with self._lock:
            self.calls.append(name)

    def set_pods(self, pods: Sequence[Pod]) -> None:
        """What the next ``List`` and ``Get`` answer (a pod started, an allocation ended)."""
        with self._lock:
            self.pods = list(pods)

    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        self._record("List")
        with self._lock:
            pods = list(self.pods)
        return pr.ListPodResourcesResponse(pod_resources=[pod.message() for pod in pods])

    def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
        self._record("Get")
        if self.get == "disabled":
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        if self.get == "unimplemented":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        with self._lock:
            pods = list(self.pods)
        for pod in pods:
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=pod.message())
        context.abort(grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} not found in {request.pod_namespace}")
        raise AssertionError("unreachable")

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        self._record("GetAllocatableResources")
        return pr.AllocatableResourcesResponse()


@contextmanager
def fake_kubelet(kubelet: FakeKubelet, socket_path: Path) -> Iterator[Path]:
    """``kubelet`` served on ``socket_path`` within the block."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pr_grpc.add_PodResourcesListerServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    try:
        yield socket_path
    finally:
        server.stop(0).wait()
