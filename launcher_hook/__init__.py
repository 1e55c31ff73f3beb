"""The virt-launcher side: turn the device plugin's allocation into ``<hostdev>`` elements in the domain.

Runs as a KubeVirt hook sidecar (or through the sidecar-shim); never imports the device plugin.
"""

from schemas.grpc_logging import quiet_grpc_core

quiet_grpc_core()  # before any module of this package imports grpc: keeps the C-core off stderr

from launcher_hook.builder import BuildOptions, BuildResult, build_domain  # noqa: E402

__all__ = ["BuildOptions", "BuildResult", "build_domain"]
