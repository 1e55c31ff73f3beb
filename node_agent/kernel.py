"""The agent's only way to change the node: a :class:`Kernel` that writes sysfs attributes and asks about
VFIO groups. :class:`RealKernel` is what runs on a node (and in the real-kernel guest); ``simkit.kernel_sim``
implements the same protocol over a fixture tree, giving each write the effect the kernel would.

Stopping the agent never calls anything here: no write happens on SIGTERM (docs/node-agent.md).
"""

from __future__ import annotations

import errno
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from schemas.errors import InputError

MODPROBE_TIMEOUT = 60.0
"""Seconds ``modprobe`` may take (loading vfio-pci takes well under one; a hung one must not hang the agent)."""


class AgentError(InputError):
    """Something the agent refuses or cannot do; the message names the device, file or holder."""


MAX_OUTPUT_CHARS = 1024 * 1024
"""What the agent keeps of a command's stdout or stderr (nvidia-smi's answers are a few kilobytes)."""


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class Kernel(Protocol):
    """What the agent asks of the kernel. Every write is one ``write(2)`` of ``value`` to ``path``."""

    writes: int
    """How many writes were made (a re-run that finds the node ready makes none)."""

    def write(self, path: Path, value: str) -> None:
        """Write ``value`` to the sysfs attribute ``path``; :class:`AgentError` naming both on failure."""

    def group_busy(self, node: Path) -> bool:
        """Whether the VFIO group node ``node`` is held open (by a VM): opening it answers ``EBUSY``."""

    def load_module(self, module: str, root: Path) -> None:
        """Load the kernel module ``module`` of the node whose ``/`` is ``root``."""

    def run(self, argv: list[str], timeout: float) -> CommandResult:
        """Run the driver's tool ``argv`` (``nvidia-smi``, for MIG); :class:`AgentError` when it cannot start or
        does not finish in ``timeout`` seconds."""


class Opener(Protocol):
    """How :class:`RealKernel` opens what it writes: inside the host root (``node_agent.sysfs.Sysfs``)."""

    def open_write(self, path: Path) -> int:
        """``path`` (an existing regular file) open for writing; :class:`AgentError` naming it otherwise."""

    def open_node(self, path: Path, flags: int) -> int:
        """The device node ``path`` opened with ``flags``; ``OSError`` as ``open`` raises it."""


class RealKernel:
    """Writes the node's real sysfs files, each opened through ``node`` (inside its host root: a link leading
    out of it is refused before anything is written); opens ``/dev/vfio/<N>`` to see whether a VM holds it."""

    def __init__(self, node: Opener) -> None:
        self.node = node
        self.writes = 0

    def write(self, path: Path, value: str) -> None:
        try:
            fd = self.node.open_write(path)
        except AgentError as exc:
            raise AgentError(f"cannot open {path} to write {value.strip()!r}: {exc}") from None
        try:
            self.writes += 1
            written = os.write(fd, value.encode())
            if written != len(value.encode()):
                raise AgentError(f"short write of {value.strip()!r} to {path}: {written} bytes")
        except OSError as exc:
            raise AgentError(f"the kernel refused {value.strip()!r} written to {path}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def group_busy(self, node: Path) -> bool:
        # A group node can be open once: a VM (QEMU) holding it makes a second open fail with EBUSY. Opening it
        # ourselves holds it for the few microseconds until close (a VM starting in that window would fail).
        try:
            fd = self.node.open_node(node, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as exc:
            return exc.errno == errno.EBUSY
        os.close(fd)
        return False

    def load_module(self, module: str, root: Path) -> None:
        # The image's own modprobe (kmod) with the host's modules: ``-d`` makes kmod read
        # <root>/lib/modules/<release>/, which is all of the host the agent's pod mounts there (no host
        # /sbin to chroot into).
        argv = ["modprobe", module] if str(root) == "/" else ["modprobe", "-d", str(root), module]
        done = self.run(argv, MODPROBE_TIMEOUT)
        if done.returncode != 0:
            raise AgentError(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")

    def run(self, argv: list[str], timeout: float) -> CommandResult:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise AgentError(f"{' '.join(argv)} did not finish in {timeout:.0f} s") from None
        except OSError as exc:
            raise AgentError(f"cannot run {' '.join(argv)}: {exc.strerror or exc}") from None
        return CommandResult(done.returncode, done.stdout[:MAX_OUTPUT_CHARS], done.stderr[-MAX_OUTPUT_CHARS:])
