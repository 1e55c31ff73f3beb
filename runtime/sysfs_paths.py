"""Resolving a path under a configurable sysfs root without ever leaving it.

The hook reads sysfs under ``--sysfs-root`` (``/sys``, a fixture tree's ``sys``, a host's sysfs mounted
elsewhere): a PCI function's BARs (:mod:`runtime.pci_bars`) and its slot's functions, IOMMU group and drivers
(:mod:`runtime.pci_companions`). ``bus/pci/devices/<address>`` is a relative link into ``devices/pci…``, and
``iommu_group`` and ``driver`` are links too; each path is resolved and must stay inside the root, so a link
that leads anywhere else is refused, naming the device and the file. (The check and the use are two steps:
the root is sysfs, which only the kernel writes, or a tree of ours.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from schemas.errors import InputError


def resolved_root(root: Path, reading: str) -> Path:
    """``root`` resolved; an ``InputError`` naming it and what was being read when it is not a directory."""
    resolved = Path(os.path.realpath(root))
    if not resolved.is_dir():
        raise InputError(f"sysfs root {str(root)!r} is not a directory ({reading})")
    return resolved


def resolve_under(root: Path, resolved: Path, relative: str, device: str) -> Path:
    """``<root>/<relative>`` with every link resolved (``resolved``: the root, resolved); it must stay under
    the root. ``device`` names the culprit in the error (``PCI device 0000:86:00.0``)."""
    path = Path(os.path.realpath(resolved / relative))
    if path != resolved and resolved not in path.parents:
        raise InputError(
            f"{device}: {relative} under {str(root)!r} leads out of that root (to {str(path)!r}); refusing to read it"
        )
    return path


class _Unusual(Exception):
    """A path :class:`Resolver` leaves to ``os.path.realpath`` (a link loop, an absolute or odd link target)."""


MAX_LINKS = 40
"""Links one resolution follows at most before it is left to ``os.path.realpath`` (Linux's own limit)."""


class Resolver:
    """:func:`resolve_under` for many paths under one root, the directories it resolved remembered while it
    lives (one read: a GPU's functions share their root, ``bus/pci/devices`` and their IOMMU group and driver
    directories; nothing is kept beyond the reader's call).

    Each path resolves as ``os.path.realpath`` resolves it: component by component, a link replaced by its
    target read relative to the link's (resolved) directory. Only what that takes one ``lstat`` (and for a link
    one ``readlink``) per new component is done here; anything else (a loop, an absolute target, ``..`` after a
    name in a target) is given to ``os.path.realpath`` itself, so the result is always the same.
    """

    def __init__(self, root: Path, reading: str) -> None:
        self.root = root
        self.resolved = resolved_root(root, reading)
        base = str(self.resolved)
        self._base = base
        self._real: dict[str, str] = {base: base}
        self._there: dict[str, bool] = {base: True}
        """Paths looked up (``lstat`` of their name in their resolved parent): whether they are there."""
        self._modes: dict[str, int] = {}
        """``st_mode`` of resolved paths that are no link."""

    def resolve(self, relative: str, device: str) -> Path:
        """``<root>/<relative>`` resolved, which must stay under the root (else ``InputError``, as
        :func:`resolve_under`)."""
        return Path(self._resolve(relative, device))

    def link(self, relative: str, device: str) -> tuple[Path, bool] | None:
        """``<root>/<relative>`` resolved (as :meth:`resolve`) and whether that is a directory, or None when
        ``<root>/<relative>`` is not there (``os.path.lexists``: a dangling link is there)."""
        found = self.link_text(relative, device)
        return (Path(found[0]), found[1]) if found is not None else None

    def link_text(self, relative: str, device: str) -> tuple[str, bool] | None:
        """:meth:`link` with the path as text."""
        full = f"{self._base}/{relative}"
        try:
            real = self._realpath(full, 0)
            there = self._there[full]
        except _Unusual:
            real, there = os.path.realpath(full), os.path.lexists(full)
        if not there:
            return None
        self._check(real, relative, device)
        mode = self._modes.get(real)
        if mode is None:
            try:
                mode = os.stat(real).st_mode
            except OSError:
                mode = 0
        return real, stat.S_ISDIR(mode)

    def _resolve(self, relative: str, device: str) -> str:
        full = f"{self._base}/{relative}"
        try:
            real = self._realpath(full, 0)
        except _Unusual:
            real = os.path.realpath(full)
        self._check(real, relative, device)
        return real

    def _check(self, real: str, relative: str, device: str) -> None:
        base = self._base
        if real != base and not real.startswith(base + "/"):
            raise InputError(
                f"{device}: {relative} under {str(self.root)!r} leads out of that root (to {real!r}); "
                "refusing to read it"
            )

    def _realpath(self, path: str, links: int) -> str:
        found = self._real.get(path)
        if found is not None:
            return found
        parent, _, name = path.rpartition("/")
        if not parent or name in ("", ".", ".."):
            raise _Unusual(path)
        base = self._realpath(parent, links)
        candidate = f"{base}/{name}"
        try:
            mode = os.lstat(candidate).st_mode
        except OSError:
            mode = None  # not there: kept as it is, as realpath keeps it
        self._there[path] = mode is not None  # what ``lstat(path)`` (``os.path.lexists``) says
        if mode is None or not stat.S_ISLNK(mode):
            result = candidate
            if mode is not None:
                self._modes[candidate] = mode
        else:
            if links >= MAX_LINKS:
                raise _Unusual(path)
            result = self._realpath(self._joined(base, os.readlink(candidate), path), links + 1)
        self._real[path] = result
        return result

    @staticmethod
    def _joined(base: str, target: str, path: str) -> str:
        """``target`` read from the resolved directory ``base``, its leading ``..`` taken off ``base``."""
        if target.startswith("/"):
            raise _Unusual(path)
        parts = [part for part in target.split("/") if part not in ("", ".")]
        while parts and parts[0] == "..":
            parts.pop(0)
            base = base.rpartition("/")[0] or "/"
        if not parts or ".." in parts or base == "/":
            raise _Unusual(path)
        return f"{base}/{'/'.join(parts)}"
