"""The simulator kit: a kubelet stand-in and fake sysfs trees, for tests, benchmarks and ``xmlgen simulate``.

Nothing here runs in ``gpu-device-plugin serve``: the kit exists to drive the real plugin as the kubelet and
the kernel would. It sits above :mod:`plugin` (``plugin`` never imports it) so that the plugin's process
loads only what it serves with.
"""

from schemas.grpc_logging import quiet_grpc_core

quiet_grpc_core()  # before kubelet_standin imports grpc: keeps the C-core off stderr
