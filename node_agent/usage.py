"""Whether the host uses a PCI function through its driver: what ``bind`` must never take from it.

A function's host driver makes kernel objects below the function's sysfs directory, each with a ``uevent``
file (the kernel's ``Documentation/ABI/testing/sysfs-uevent``; ``udevadm info`` shows the same keys):

- ``DEVNAME=<name>``: a device node ``/dev/<name>`` (DRM ``dri/card0``, ``snd/controlC1``, ``nvme0``,
  ``nvme0n1``, ``hidraw0``…). A process holding it open (``/proc/<pid>/fd``) uses the device;
- ``DEVTYPE=disk`` / ``partition`` with ``MAJOR``/``MINOR`` (``block/<dev>`` and its partitions): in use
  when a mount of the host's (``/proc/1/mountinfo``, and ``/proc/self/mountinfo`` when that resolves) has
  that device number (and when neither table can be read: nothing then says it is unused), when
  ``/proc/swaps`` names it, or when its ``holders/`` is not empty (device-mapper, md RAID, LVM built on it);
- ``INTERFACE=<name>`` (``net/<if>``): in use when it is up (``operstate`` ``up``, or ``IFF_UP`` in
  ``flags``) or has an address (``/proc/1/net/if_inet6``, ``/proc/1/net/route``: the host's network
  namespace, as the host's init sees it).

The walk does not follow links (``driver``, ``subsystem``, ``physfn``…), does not enter another PCI function's
directory (below a bridge), and is bounded in depth and directories; a tree too large to check counts as in
use. Everything is read under the host root through :class:`~node_agent.sysfs.Sysfs`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.kernel import AgentError
from node_agent.sysfs import MAX_PROC_FILE, Sysfs

MAX_DEPTH = 12
"""Directories below a function the walk enters (a USB disk on a card's USB controller sits ~10 deep)."""
MAX_DIRECTORIES = 4096
"""Directories one function's walk may visit; a larger tree is refused rather than half checked."""
IFF_UP = 0x1
_PCI_NAME = re.compile(r"[0-9a-fA-F]{4,5}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


@dataclass
class Usage:
    """The kernel objects a function's driver made, as found below its sysfs directory."""

    nodes: list[str] = field(default_factory=list)
    """``/dev/<DEVNAME>`` of each."""
    blocks: list[tuple[str, str, Path]] = field(default_factory=list)
    """(name, ``major:minor``, directory) of each disk and partition."""
    interfaces: list[tuple[str, Path]] = field(default_factory=list)
    """(name, directory) of each network interface."""
    too_large: str | None = None


def _uevent(fs: Sysfs, path: Path) -> dict[str, str]:
    text = fs.read(path) or ""
    pairs = (line.partition("=") for line in text.splitlines())
    return {key: value for key, sep, value in pairs if sep}


def walk(fs: Sysfs, directory: Path) -> Usage:
    """What the function at ``directory`` (resolved, see :meth:`Sysfs.inside`) has below it."""
    found = Usage()
    pending = [(directory, 0)]
    visited = 0
    while pending:
        current, depth = pending.pop()
        visited += 1
        if visited > MAX_DIRECTORIES:
            found.too_large = f"more than {MAX_DIRECTORIES} directories below {directory} to check"
            return found
        for name, is_dir in fs.entries(current):
            if name == "uevent" and not is_dir and current != directory:
                _note(found, current, _uevent(fs, current / name))
            elif is_dir and depth < MAX_DEPTH and not _PCI_NAME.fullmatch(name):
                pending.append((current / name, depth + 1))
    return found


def _note(found: Usage, directory: Path, event: dict[str, str]) -> None:
    name = event.get("DEVNAME")
    if name and ".." not in name.split("/"):
        found.nodes.append(f"/dev/{name}")
        if event.get("DEVTYPE") in ("disk", "partition") and event.get("MAJOR", "").isdigit():
            found.blocks.append((name, f"{event['MAJOR']}:{event.get('MINOR', '0')}", directory))
    interface = event.get("INTERFACE")
    if interface:
        found.interfaces.append((interface, directory))


class HostUse:
    """The host's tables a usage check reads, read once per command (mounts, swaps, addresses)."""

    def __init__(self, fs: Sysfs) -> None:
        self.fs = fs
        self._mounts: dict[str, list[str]] | None = None
        self._swaps: set[str] | None = None
        self._addressed: set[str] | None = None

    def _table(self, *names: str) -> list[str] | None:
        """The lines of the first ``/proc`` tables ``names`` that can be read, together; None when none can."""
        lines: list[str] | None = None
        for name in names:
            try:
                text = self.fs.read_table(self.fs.proc / name, MAX_PROC_FILE)
            except AgentError:
                continue  # a table we cannot read (a proc without it): the others still tell
            if text is not None:
                lines = (lines or []) + text.splitlines()
        return lines

    def mounts(self) -> dict[str, list[str]] | None:
        """``major:minor`` → where it is mounted (from the host's init and our own mount tables); None when no
        mount table can be read (then no disk can be said to be unused)."""
        if self._mounts is None:
            table = self._table("1/mountinfo", "self/mountinfo")
            if table is None:
                return None
            self._mounts = {}
            for line in table:
                fields = line.split()
                if len(fields) >= 5 and ":" in fields[2]:
                    points = self._mounts.setdefault(fields[2], [])
                    if fields[4] not in points:
                        points.append(fields[4])
        return self._mounts

    def swaps(self) -> set[str]:
        if self._swaps is None:
            self._swaps = {line.split()[0] for line in (self._table("swaps") or [])[1:] if line.split()}
        return self._swaps

    def addressed(self) -> set[str]:
        """Interfaces with an IPv6 address or an IPv4 route in the host's network namespace."""
        if self._addressed is None:
            names = {line.split()[-1] for line in self._table("1/net/if_inet6") or [] if len(line.split()) >= 6}
            names |= {line.split()[0] for line in (self._table("1/net/route") or [])[1:] if line.split()}
            self._addressed = names
        return self._addressed

    def reasons(self, usage: Usage) -> list[str]:
        """Why the host uses what ``usage`` lists (empty: nothing but open device nodes, checked apart)."""
        why: list[str] = []
        if usage.too_large:
            why.append(usage.too_large)
        mounts = self.mounts() if usage.blocks else {}
        for name, number, directory in usage.blocks:
            if mounts is None:
                why.append(
                    f"block device {name} ({number}) may be mounted: no mount table is readable under {self.fs.proc} "
                    "(1/mountinfo, self/mountinfo)"
                )
                continue
            points = mounts.get(number, [])
            if points:
                why.append(f"block device {name} ({number}) is mounted on {', '.join(points[:4])}")
            if f"/dev/{name}" in self.swaps():
                why.append(f"block device {name} is used as swap")
            holders = self.fs.listdir(directory / "holders")
            if holders:
                why.append(f"block device {name} is held by {', '.join(holders)}")
        for name, directory in usage.interfaces:
            state = self.fs.read(directory / "operstate")
            flags = self.fs.read(directory / "flags") or "0"
            try:
                up = int(flags, 16) & IFF_UP
            except ValueError:
                up = 0
            if state == "up" or up:
                why.append(f"network interface {name} is up (operstate {state or '?'}, flags {flags})")
            elif name in self.addressed():
                why.append(f"network interface {name} has an address or a route")
        return why
