"""The floors the hook sidecar is measured against (``bench/hook_sidecar.py`` starts this in a subprocess).

``--mode floor``: a gRPC server on a unix socket serving ``kubevirt.hooks.v1alpha3.Callbacks/OnDefineDomain``
that only parses the domain with lxml and serialises it back: the least any hook on this transport must do.
``--mode idle``: a Python gRPC server on a unix socket with no service at all, for the memory floor.
Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures
from types import FrameType

import grpc
from lxml import etree

from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc

PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False)


class FloorCallbacks:
    def OnDefineDomain(
        self, request: v1alpha3_pb2.OnDefineDomainParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.OnDefineDomainResult:
        root = etree.fromstring(request.domainXML, PARSER)
        return v1alpha3_pb2.OnDefineDomainResult(domainXML=etree.tostring(root.getroottree(), encoding="UTF-8"))

    def PreCloudInitIso(
        self, request: v1alpha3_pb2.PreCloudInitIsoParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.PreCloudInitIsoResult:
        return v1alpha3_pb2.PreCloudInitIsoResult()

    def Shutdown(
        self, request: v1alpha3_pb2.ShutdownParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.ShutdownResult:
        return v1alpha3_pb2.ShutdownResult()


def serve_until_sigterm(server: grpc.Server, socket_path: str) -> None:
    """Serve ``server`` on the unix socket ``socket_path`` until SIGTERM, then stop it at once."""
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    stop = threading.Event()

    def on_signal(number: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    while not stop.wait(0.5):
        pass
    server.stop(0).wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--mode", choices=["floor", "idle"], default="floor")
    options = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    if options.mode == "floor":
        v1alpha3_pb2_grpc.add_CallbacksServicer_to_server(FloorCallbacks(), server)
    serve_until_sigterm(server, options.socket)


if __name__ == "__main__":
    main()
