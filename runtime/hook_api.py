"""The KubeVirt hook API versions this project speaks, and their generated gRPC modules: the one registry.

virt-launcher calls ``Info``, then the newest ``Callbacks`` version both sides list (docs/protocols.md,
"KubeVirt hooks"). The server registers a servicer per version, ``Info`` answers the list, and the simulator
and tests call each version: all read :data:`HOOK_API_VERSIONS` so a new version is added once.
"""

from __future__ import annotations

from types import ModuleType

from schemas.generated.kubevirt.hooks import (
    v1alpha1_pb2,
    v1alpha1_pb2_grpc,
    v1alpha2_pb2,
    v1alpha2_pb2_grpc,
    v1alpha3_pb2,
    v1alpha3_pb2_grpc,
)

HOOK_API_VERSIONS: dict[str, tuple[ModuleType, ModuleType]] = {
    "v1alpha1": (v1alpha1_pb2, v1alpha1_pb2_grpc),
    "v1alpha2": (v1alpha2_pb2, v1alpha2_pb2_grpc),
    "v1alpha3": (v1alpha3_pb2, v1alpha3_pb2_grpc),
}
"""Each version, oldest first, with its messages module and its gRPC module."""
VERSIONS: tuple[str, ...] = tuple(HOOK_API_VERSIONS)
"""The version strings ``Info`` answers."""
NEWEST_VERSION = VERSIONS[-1]
