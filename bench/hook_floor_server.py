"""The floors the hook sidecar is measured against (``bench/hook_sidecar.py`` starts this in a subprocess).

``--mode floor``: a gRPC server on a unix socket serving ``kubevirt.hooks.v1alpha3.Callbacks/OnDefineDomain``
that only parses the domain with lxml and serialises it back: the least any hook on this transport must do.
``--mode idle``: a Python gRPC server on a unix socket with no service at all, for the memory floor.
``--reads FILE`` (with ``floor``): before the parse, each call also does the reads a path of the hook must do
(:class:`Reads`, a JSON file ``bench/hook_sidecar.py`` writes): the same files, read the simplest way Python can
(no confinement, no bounds, nothing decided), and the kubelet's PodResources ``Get`` where the hook asks it.
``--answer FILE`` (with ``floor``): each call parses the call's domain as the floor does, but serialises the
document in FILE (parsed once at start: the hook's answer to the same call) instead of the call's: the least a
hook giving that answer must do on this transport, whatever it decides (an answer with companions is several
times the size of the call's domain).
Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
from lxml import etree

from schemas.generated.kubelet.podresources.v1 import api_pb2 as pr
from schemas.generated.kubelet.podresources.v1 import api_pb2_grpc as pr_grpc
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc

PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False)


@dataclass
class Reads:
    """The file work of one call of a hook path, by kind: directories listed, links read, names looked up
    (``lstat``), files read, JSON files read and parsed; and the PodResources ``Get`` (socket, namespace, name)."""

    listdir: list[str] = field(default_factory=list)
    readlink: list[str] = field(default_factory=list)
    lstat: list[str] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    json: list[str] = field(default_factory=list)
    pod_resources: list[str] = field(default_factory=list)

    def do(self, kubelet: pr_grpc.PodResourcesListerStub | None) -> None:
        for path in self.listdir:
            os.listdir(path)
        for path in self.readlink:
            os.readlink(path)
        for path in self.lstat:
            os.path.lexists(path)
        for path in self.read:
            with open(path, "rb") as file:
                file.read()
        for path in self.json:
            with open(path, "rb") as file:
                json.loads(file.read())
        if kubelet is not None:
            _, namespace, name = self.pod_resources
            kubelet.Get(pr.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace), timeout=60)


class FloorCallbacks:
    def __init__(self, reads: Reads | None = None, answer: bytes | None = None) -> None:
        self.reads = reads or Reads()
        self._answer = etree.fromstring(answer, PARSER).getroottree() if answer is not None else None
        self._kubelet = None
        if self.reads.pod_resources:
            channel = grpc.insecure_channel(f"unix:{self.reads.pod_resources[0]}")
            self._kubelet = pr_grpc.PodResourcesListerStub(channel)

    def OnDefineDomain(
        self, request: v1alpha3_pb2.OnDefineDomainParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.OnDefineDomainResult:
        self.reads.do(self._kubelet)
        tree = etree.fromstring(request.domainXML, PARSER).getroottree()
        if self._answer is not None:
            tree = self._answer
        return v1alpha3_pb2.OnDefineDomainResult(domainXML=etree.tostring(tree, encoding="UTF-8"))

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
    parser.add_argument("--reads", type=Path, help="a JSON file of Reads: the file work each call also does")
    parser.add_argument("--answer", type=Path, help="a domain to serialise as each call's answer (parsed once)")
    options = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    if options.mode == "floor":
        reads = Reads(**json.loads(options.reads.read_text())) if options.reads else None
        answer = options.answer.read_bytes() if options.answer else None
        v1alpha3_pb2_grpc.add_CallbacksServicer_to_server(FloorCallbacks(reads, answer), server)
    serve_until_sigterm(server, options.socket)


if __name__ == "__main__":
    main()
