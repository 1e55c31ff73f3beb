"""xmlgen: the command line to debug the whole path: render, validate, discover, simulate a node.

The one package allowed to compose the device plugin and the launcher hook.
"""

from schemas.grpc_logging import quiet_grpc_core

quiet_grpc_core()  # before any module of this package imports grpc: keeps the C-core off stderr
