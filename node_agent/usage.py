"""Whether the host uses a PCI function through its driver: what ``bind`` must never take from it.

A function's host driver makes kernel objects below the function's sysfs directory, each with a ``uevent``
file (the kernel's ``Documentation/ABI/testing/sysfs-uevent``; ``udevadm info`` shows the same keys):

- ``DEVNAME=<name>``: a device node ``/dev/<name>`` (DRM ``dri/card0``, ``snd/controlC1``, ``nvme0``,
  ``nvme0n1``, ``hidraw0``…). A process holding it open (``/proc/<pid>/fd``) uses the device;
- ``DEVTYPE=disk`` / ``partition`` with ``MAJOR``/``MINOR`` (``block/<dev>`` and its partitions): in use
  when a mount of the host's (``/proc/1/mountinfo``, and ``/proc/self/mountinfo`` when that resolves) has
  that device number or names ``/dev/<name>`` as its source (btrfs mounts show an anonymous ``0:N``), when
  neither table can be read (nothing then says it is unused), when it is a device of a mounted btrfs
  (``/sys/fs/btrfs/<fsid>/devices``), when ``/proc/swaps`` names it, when its ``holders/`` is not empty
  (device-mapper, md RAID, LVM built on it), or when a loop device is backed by it
  (``/sys/block/loop<N>/loop/backing_file``);
- ``INTERFACE=<name>`` (``net/<if>``): in use when it is up (``operstate`` ``up``, or ``IFF_UP`` in
  ``flags``; flags that are missing or no number count as up) or has an address (``/proc/1/net/if_inet6``,
  ``/proc/1/net/route``: the host's network namespace, as the host's init sees it).

An NVMe controller (``nvme/nvme<N>``) under native multipath has its namespaces' disks below the virtual
``nvme-subsystem`` device instead: the walk checks the subsystems that link one of its controllers too.
The walk does not follow links (``driver``, ``subsystem``, ``physfn``…), does not enter another PCI function's
directory (below a bridge), and is bounded in depth and directories; a tree too large or too deep to check
counts as in use. Everything is read under the host root through :class:`~node_agent.sysfs.Sysfs`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.kernel import AgentError
from node_agent.sysfs import MAX_PROC_FILE, Sysfs

MAX_DEPTH = 24
"""Levels below a function the walk enters. A USB disk behind five hubs (USB's most) on a card's USB
controller has its partition 13 levels down; a deeper tree counts as in use (not half checked)."""
MAX_DIRECTORIES = 4096
"""Directories one function's walk may visit; a larger tree is refused rather than half checked."""
IFF_UP = 0x1
_NVME_CONTROLLER = re.compile(r"nvme[0-9]+")
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
    nvme_controllers: list[str] = field(default_factory=list)
    """Names of the NVMe controllers (``nvme/nvme0``) found: their namespaces may hang elsewhere (multipath)."""
    too_large: str | None = None
    """Why the tree could not be checked whole (more directories or levels than the walk goes)."""


def _uevent(fs: Sysfs, path: Path) -> dict[str, str]:
    text = fs.read(path) or ""
    pairs = (line.partition("=") for line in text.splitlines())
    return {key: value for key, sep, value in pairs if sep}


def walk(fs: Sysfs, directory: Path) -> Usage:
    """What the function at ``directory`` (resolved, see :meth:`Sysfs.inside`) has below it, and the namespaces
    of its NVMe controllers that native NVMe multipath puts below a virtual subsystem device instead."""
    found = Usage()
    _walk(fs, directory, found)
    for subsystem in nvme_subsystems(fs, found.nvme_controllers):
        if found.too_large is None:
            _walk(fs, subsystem, found)
    return found


def nvme_subsystems(fs: Sysfs, controllers: list[str]) -> list[Path]:
    """The NVMe subsystems one of ``controllers`` belongs to. With native multipath (``nvme_core.multipath``,
    on by default where the kernel has it) a namespace's disk is ``nvme-subsys<N>/nvme<N>n<M>`` below
    ``/sys/devices/virtual/nvme-subsystem``, and the subsystem links each of its controllers by name
    (``nvme-subsys0/nvme0``, kernel ``drivers/nvme/host/core.c``); controller names are unique."""
    if not controllers:
        return []
    base = fs.sys / "class" / "nvme-subsystem"
    found = []
    for name in fs.listdir(base):
        if set(controllers) & set(fs.listdir(base / name)):
            found.append(fs.inside(base / name))
    return found


def _walk(fs: Sysfs, directory: Path, found: Usage) -> None:
    pending = [(directory, 0)]
    visited = 0
    while pending:
        current, depth = pending.pop()
        visited += 1
        if visited > MAX_DIRECTORIES:
            found.too_large = f"more than {MAX_DIRECTORIES} directories below {directory} to check"
            return
        for name, is_dir in fs.entries(current):
            if name == "uevent" and not is_dir and current != directory:
                _note(found, current, _uevent(fs, current / name))
            elif is_dir and not _PCI_NAME.fullmatch(name):
                if depth >= MAX_DEPTH:
                    found.too_large = f"more than {MAX_DEPTH} levels below {directory} to check ({current / name})"
                    return
                pending.append((current / name, depth + 1))


def _note(found: Usage, directory: Path, event: dict[str, str]) -> None:
    name = event.get("DEVNAME")
    if name and ".." not in name.split("/"):
        found.nodes.append(f"/dev/{name}")
        if directory.parent.name == "nvme" and _NVME_CONTROLLER.fullmatch(name):
            found.nvme_controllers.append(name)
        if event.get("DEVTYPE") in ("disk", "partition") and event.get("MAJOR", "").isdigit():
            found.blocks.append((name, f"{event['MAJOR']}:{event.get('MINOR', '0')}", directory))
    interface = event.get("INTERFACE")
    if interface:
        found.interfaces.append((interface, directory))


_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    """A ``/proc`` table field as it is: the kernel writes space, tab, newline and backslash in mount points,
    sources and swap file names as octal escapes (``\\040``: ``fs/proc_namespace.c``, ``mangle``)."""
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


@dataclass
class Mounts:
    """The mounts of the host's tables: by device number (``major:minor``) and by source (``/dev/nvme0n1p1``)."""

    by_number: dict[str, list[str]] = field(default_factory=dict)
    by_source: dict[str, list[str]] = field(default_factory=dict)

    def points(self, number: str, node: str) -> list[str]:
        """Where the block device ``number`` (``/dev`` node ``node``) is mounted. The number alone misses a
        filesystem whose mounts show an anonymous device (btrfs: ``0:45``); its source names the device."""
        found = list(self.by_number.get(number, []))
        found += [point for point in self.by_source.get(node, []) if point not in found]
        return found


class HostUse:
    """The host's tables a usage check reads, read once per command (mounts, swaps, addresses, btrfs
    members, loop devices)."""

    def __init__(self, fs: Sysfs) -> None:
        self.fs = fs
        self._mounts: Mounts | None = None
        self._swaps: set[str] | None = None
        self._addressed: set[str] | None = None
        self._btrfs: dict[str, str] | None = None
        self._loops: dict[str, list[str]] | None = None

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

    def mounts(self) -> Mounts | None:
        """The mounts of the host's init and our own mount tables (``proc(5)``, ``/proc/<pid>/mountinfo``:
        ``ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER-OPTIONS``); None when no mount
        table can be read (then no disk can be said to be unused)."""
        if self._mounts is None:
            table = self._table("1/mountinfo", "self/mountinfo")
            if table is None:
                return None
            self._mounts = Mounts()
            for line in table:
                fields = line.split()
                if len(fields) < 5 or ":" not in fields[2]:
                    continue
                point = unescape(fields[4])
                keys = [(self._mounts.by_number, fields[2])]
                if "-" in fields[5:]:
                    after = fields[fields.index("-", 5) + 1 :]
                    if len(after) >= 2 and after[1].startswith("/dev/"):
                        keys.append((self._mounts.by_source, unescape(after[1])))
                for table_, key in keys:
                    points = table_.setdefault(key, [])
                    if point not in points:
                        points.append(point)
        return self._mounts

    def swaps(self) -> set[str]:
        if self._swaps is None:
            self._swaps = {unescape(line.split()[0]) for line in (self._table("swaps") or [])[1:] if line.split()}
        return self._swaps

    def btrfs_members(self) -> dict[str, str]:
        """Block device name → fsid of each device of a mounted btrfs filesystem: the kernel lists them in
        ``/sys/fs/btrfs/<fsid>/devices/<name>`` while it is mounted (``Documentation/ABI/testing/sysfs-fs-btrfs``);
        a multi-device filesystem's mount names only one of them as its source."""
        if self._btrfs is None:
            base = self.fs.sys / "fs" / "btrfs"
            self._btrfs = {}
            for fsid in self.fs.listdir(base):
                for name in self.fs.listdir(base / fsid / "devices"):
                    self._btrfs.setdefault(name, fsid)
        return self._btrfs

    def loops(self) -> dict[str, list[str]]:
        """Backing file → the loop devices on it (``/sys/block/loop<N>/loop/backing_file``): a loop device on a
        disk holds it from inside the kernel, with no process's descriptor and nothing in ``holders/``."""
        if self._loops is None:
            self._loops = {}
            block = self.fs.sys / "block"
            for name in self.fs.listdir(block):
                if not name.startswith("loop"):
                    continue
                backing = self.fs.read(block / name / "loop" / "backing_file")
                if backing:
                    self._loops.setdefault(backing.removesuffix(" (deleted)"), []).append(name)
        return self._loops

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
        mounts = self.mounts() if usage.blocks else Mounts()
        for name, number, directory in usage.blocks:
            node = f"/dev/{name}"
            if mounts is None:
                why.append(
                    f"block device {name} ({number}) may be mounted: no mount table is readable under {self.fs.proc} "
                    "(1/mountinfo, self/mountinfo)"
                )
            else:
                points = mounts.points(number, node)
                if points:
                    why.append(f"block device {name} ({number}) is mounted on {', '.join(points[:4])}")
            fsid = self.btrfs_members().get(name)
            if fsid is not None:
                why.append(f"block device {name} ({number}) is a device of the mounted btrfs filesystem {fsid}")
            if node in self.swaps():
                why.append(f"block device {name} is used as swap")
            holders = self.fs.listdir(directory / "holders")
            if holders:
                why.append(f"block device {name} is held by {', '.join(holders)}")
            loops = self.loops().get(node)
            if loops:
                why.append(f"block device {name} ({number}) backs the loop device {', '.join(loops)}")
        for name, directory in usage.interfaces:
            state = self.fs.read(directory / "operstate")
            flags = self.fs.read(directory / "flags")
            try:
                up: int | None = int(flags or "", 16) & IFF_UP
            except ValueError:
                up = None
            if state == "up" or up:
                why.append(f"network interface {name} is up (operstate {state or '?'}, flags {flags})")
            elif up is None:
                why.append(
                    f"network interface {name} may be up: its flags read {flags!r}, not a hex number "
                    f"(operstate {state or '?'})"
                )
            elif name in self.addressed():
                why.append(f"network interface {name} has an address or a route")
        return why
