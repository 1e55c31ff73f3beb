"""The node side: discover vfio-bound NVIDIA GPUs and vGPUs and serve them to the kubelet.

Runs as a DaemonSet on GPU nodes; never imports the launcher hook.
"""

from schemas.grpc_logging import quiet_grpc_core

quiet_grpc_core()  # before any module of this package imports grpc: keeps the C-core off stderr
