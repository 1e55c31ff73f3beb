"""The kernel's device events (``NETLINK_KOBJECT_UEVENT``): driver binds and unbinds, mdevs created and removed.

sysfs cannot be watched with inotify, and ``/dev/vfio`` changes only when the *first* function of an IOMMU
group binds to a VFIO driver or the *last* one leaves it. A real kernel showed what that misses
(tests/realnode): a GPU unbound from vfio-pci while its audio function keeps the group node, a companion
rebound, an mdev created or removed. The kernel announces each of those as a uevent (``bind``/``unbind`` on
the ``pci`` subsystem, ``add``/``remove`` on ``mdev``); this socket lets the plugin rescan at once.

Receiving uevents needs no privilege or capability; the kernel sends device uevents to every network
namespace of the initial user namespace, so the DaemonSet's pod (no ``hostNetwork``) gets them too. Only
the fact that something changed matters (the rescan reads everything), so messages are drained, not parsed
beyond their subsystem, and a lost message costs at most a scan interval.
"""

from __future__ import annotations

import socket

SUBSYSTEMS = frozenset({b"pci", b"mdev", b"vfio", b"mdev_bus"})
KERNEL_GROUP = 1
NETLINK_KOBJECT_UEVENT = 15  # linux/netlink.h


class UeventSocket:
    """A non-blocking uevent listener; :meth:`drain` says whether a relevant event came."""

    def __init__(self) -> None:
        self._socket = socket.socket(
            socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
            NETLINK_KOBJECT_UEVENT,
        )  # fmt: skip
        try:
            self._socket.bind((0, KERNEL_GROUP))
        except OSError:
            self._socket.close()
            raise

    def fileno(self) -> int:
        return self._socket.fileno()

    def drain(self) -> bool:
        """Read every queued event; True if one concerns PCI functions, mdevs or VFIO (or events were lost)."""
        relevant = False
        while True:
            try:
                message = self._socket.recv(65536)
            except BlockingIOError:
                return relevant
            except OSError:  # ENOBUFS: the queue overflowed, events were lost: rescan to be safe
                relevant = True
                continue
            for field in message.split(b"\0"):
                if field.startswith(b"SUBSYSTEM=") and field[10:] in SUBSYSTEMS:
                    relevant = True

    def close(self) -> None:
        self._socket.close()


def open_uevents() -> UeventSocket | None:
    """The listener, or None where the kernel or a sandbox refuses netlink (the periodic rescan remains)."""
    try:
        return UeventSocket()
    except OSError:
        return None
