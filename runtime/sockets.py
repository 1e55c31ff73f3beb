"""Preparing a unix socket path to serve on: the one rule both servers follow.

The plugin's sockets (in the kubelet's ``device-plugins`` directory) and the hook's (in the pod's
``/var/run/kubevirt-hooks``) may find an earlier socket at their path. The rule: connect first; a socket
something answers on (or that cannot be probed) is live and refused, a socket nobody answers on is stale and
replaced, anything that is not a socket is refused, never replaced. A path longer than ``sun_path`` is refused
with its length instead of gRPC's vague bind error.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

MAX_UNIX_SOCKET_PATH = 107
"""Longest unix socket path in bytes: Linux's ``sun_path`` is 108 bytes with its terminating NUL."""
LIVE_PROBE_SECONDS = 1.0
"""How long to wait for an existing socket to accept a connection before calling it stale."""


class SocketInUse(Exception):
    """The socket path is taken (a live server answers there, or it is not a socket) or too long for a socket."""


def check_socket_path_length(path: Path) -> None:
    """Refuse a path the kernel cannot bind (``SocketInUse`` naming its length limit)."""
    if len(os.fsencode(path)) > MAX_UNIX_SOCKET_PATH:
        raise SocketInUse(f"socket path {path} is longer than {MAX_UNIX_SOCKET_PATH} bytes, the unix socket limit")


def socket_is_live(path: Path, timeout: float = LIVE_PROBE_SECONDS) -> bool:
    """Whether something accepts connections on the unix socket ``path`` now.

    A refused connection or a missing file means nobody listens (a stale socket of a process that is gone);
    a full backlog, a timeout or a permission error counts as live: something is there we must not take over.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(os.fspath(path))
        except (BlockingIOError, TimeoutError, PermissionError):
            return True
        except OSError:
            return False  # ECONNREFUSED, ENOENT, ENOTDIR...: nobody listens there any more
        return True


def prepare_socket_path(
    path: Path, *, in_use_hint: str = "", create_parent: bool = False, probe_timeout: float = LIVE_PROBE_SECONDS
) -> None:
    """Make ``path`` free to bind: refuse a too-long path, a non-socket or a live socket; remove a stale socket.

    ``in_use_hint`` is added to the live-socket refusal (e.g. "another gpu-device-plugin on this node?");
    ``create_parent`` creates the directory first (the hook's), else it must exist (the kubelet's).
    """
    check_socket_path_length(path)
    if create_parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    if socket_is_live(path, probe_timeout):
        hint = f" ({in_use_hint})" if in_use_hint else ""
        raise SocketInUse(
            f"another server is listening on {path} (or it cannot be probed){hint}; refusing to replace its socket"
        )
    path.unlink()  # stale: nobody answers on it (an earlier run that died)
