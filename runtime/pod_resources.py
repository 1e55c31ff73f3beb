"""A client of the kubelet's PodResources API (``v1.PodResourcesLister``) on its unix socket: one for every reader.

The hook sidecar reads its own pod's devices from it (:mod:`launcher_hook.sources`); the node agent reads which
of the node's devices any pod holds before it changes them (:mod:`node_agent.operate`). Both use this client:
the channel with the receive limit the kubelet's own clients use (a busy node's ``List`` can exceed gRPC's
4 MiB default), every call with a timeout. Errors are the caller's to word (each says what it was reading for);
:func:`rpc_text` is the short form of a gRPC error they put in their message.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from schemas.generated.kubelet.podresources.v1 import api_pb2 as podresources
from schemas.generated.kubelet.podresources.v1 import api_pb2_grpc as podresources_grpc

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
"""Where the kubelet serves the API (``podresources.LocalEndpoint`` under its root directory)."""
TIMEOUT_SECONDS = 10.0
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""The kubelet's own PodResources clients allow 16 MiB; a busy node's ``List`` can exceed gRPC's 4 MiB default."""


def rpc_text(error: grpc.RpcError) -> str:
    """``CODE: details`` of a gRPC error (``error: <text>`` when it carries no status)."""
    code = error.code() if isinstance(error, grpc.Call) else None
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    return f"{code.name if code else 'error'}: {details}"


class PodResourcesClient:
    """``List`` and ``Get`` of the kubelet's PodResources API over ``unix:<socket_path>``; :class:`grpc.RpcError`
    as gRPC raises it."""

    def __init__(self, socket_path: Path, timeout: float = TIMEOUT_SECONDS) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            f"unix:{socket_path}", options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        )
        self.stub = podresources_grpc.PodResourcesListerStub(self._channel)

    def list(self) -> list[podresources.PodResources]:
        """Every pod of the node with the devices the kubelet assigned to its containers."""
        response: podresources.ListPodResourcesResponse = self.stub.List(
            podresources.ListPodResourcesRequest(), timeout=self.timeout
        )
        return list(response.pod_resources)

    def get(self, namespace: str, name: str) -> podresources.PodResources:
        """One pod's (kubelet 1.27+, ``KubeletPodResourcesGet``; an older or gated kubelet answers UNKNOWN)."""
        response: podresources.GetPodResourcesResponse = self.stub.Get(
            podresources.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace), timeout=self.timeout
        )
        return response.pod_resources

    def close(self) -> None:
        self._channel.close()
