"""The kubelet's PodResources API for ``bench/hook_sidecar.py``: one pod whose ``compute`` container has GPUs.

``python bench/hook_kubelet_server.py --socket S --pod NS/NAME --resource R --devices A,B,…`` serves
``v1.PodResourcesLister`` ``Get`` and ``List`` on the unix socket ``S`` until SIGTERM, in its own process (as the
kubelet is, beside the hook it answers).
"""

from __future__ import annotations

import argparse
import sys
from concurrent import futures
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.hook_floor_server import serve_until_sigterm
from schemas.generated.kubelet.podresources.v1 import api_pb2 as pr
from schemas.generated.kubelet.podresources.v1 import api_pb2_grpc as pr_grpc


class PodResources:
    def __init__(self, namespace: str, name: str, resource: str, devices: list[str]) -> None:
        compute = pr.ContainerResources(
            name="compute", devices=[pr.ContainerDevices(resource_name=resource, device_ids=devices)]
        )
        self.pod = pr.PodResources(name=name, namespace=namespace, containers=[compute])

    def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
        if (request.pod_namespace, request.pod_name) != (self.pod.namespace, self.pod.name):
            context.abort(grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} not found in {request.pod_namespace}")
        return pr.GetPodResourcesResponse(pod_resources=self.pod)

    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse(pod_resources=[self.pod])

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        return pr.AllocatableResourcesResponse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--pod", required=True, help="namespace/name")
    parser.add_argument("--resource", required=True)
    parser.add_argument("--devices", required=True)
    options = parser.parse_args()
    namespace, _, name = options.pod.partition("/")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service = PodResources(namespace, name, options.resource, options.devices.split(","))
    pr_grpc.add_PodResourcesListerServicer_to_server(service, server)
    serve_until_sigterm(server, options.socket)


if __name__ == "__main__":
    main()
