"""The virt-launcher side: turn the device plugin's allocation into ``<hostdev>`` elements in the domain.

Runs as a KubeVirt hook sidecar (or through the sidecar-shim); never imports the device plugin.
"""

from launcher_hook.builder import BuildOptions, BuildResult, build_domain

__all__ = ["BuildOptions", "BuildResult", "build_domain"]
