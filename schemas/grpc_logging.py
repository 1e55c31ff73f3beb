"""Keep gRPC's C-core off the components' stderr, where only their own log lines belong.

grpcio logs through abseil; until ``GRPC_VERBOSITY`` says otherwise, abseil writes the C-core's INFO lines
(``I1130 15:39:40.987142 23412 chttp2_transport.cc:1403] …: Got goaway [2] …`` when a peer closes a
connection with an error) straight to fd 2, in neither of our formats. grpcio reads ``GRPC_VERBOSITY`` when
it is imported, so :func:`quiet_grpc_core` runs at the top of each package that serves or calls gRPC
(``plugin``, ``launcher_hook``, ``xmlgen``), before any module imports grpc. An operator who sets
``GRPC_VERBOSITY`` (or ``GRPC_TRACE``) to debug gRPC keeps that choice, and gets the C-core's raw lines.
What the C-core would have said about a failed call reaches the components' own logs anyway, as the
call's status (e.g. the plugin's ``registration_failed`` event).
"""

from __future__ import annotations

import os

GRPC_VERBOSITY_DEFAULT = "NONE"
"""grpcio 1.85 honours ``NONE`` and ``ERROR`` (``WARNING`` is refused with an error line of its own)."""


def quiet_grpc_core() -> None:
    """Set ``GRPC_VERBOSITY=NONE`` unless the environment already names a verbosity; call before importing
    grpc."""
    os.environ.setdefault("GRPC_VERBOSITY", GRPC_VERBOSITY_DEFAULT)
