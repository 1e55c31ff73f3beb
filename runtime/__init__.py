"""Runtime plumbing shared by the device plugin, the launcher hook and ``xmlgen``: one implementation each.

Between :mod:`schemas` (contracts: what both sides must agree on) and ``plugin | launcher_hook`` (behaviour):
unix socket preparation, gRPC status messages, signal handling, log setup, the ``--log-format`` option, the
env-variable prefixes each component owns, the VFIO driver names, pci.ids lookup, the KubeVirt hook API
versions, the Kubernetes client plumbing the DRA plugin and the node agent share (:mod:`runtime.kube_api`) and
the kubelet PodResources client the hook and the node agent share (:mod:`runtime.pod_resources`). These used
to be copied on each side of the plugin/hook boundary and drifted (one status cut was UTF-8-safe, the other
not). Each module imports only what its own job needs, so the hook sidecar's start-up (its memory) stays
small: nothing here imports click, pydantic or YAML except :mod:`runtime.cli_options`.
"""
