"""Watching how a confined read resolves its paths: every ``openat2`` path asked of the kernel, any walk in
Python (``lstat``/``readlink``, refused), and how often a root directory is opened (tests/test_confined.py,
tests/test_dra_files.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class KernelPaths:
    asked: list[bytes] = field(default_factory=list)
    """The paths given to ``openat2``, in order."""
    root_opens: int = 0
    """How often the root was opened with ``os.open``."""


def watch_kernel_paths(monkeypatch: pytest.MonkeyPatch, root: Path) -> KernelPaths:
    """Record what the confined reads under ``root`` ask of the kernel, and fail any component walked in Python;
    a skip (a failure under CI=true) where the kernel has no ``openat2``."""
    from runtime.hostroot import HostRoot
    from tests.libvirt_support import missing

    kernel = HostRoot.openat2
    if kernel is None:
        missing("openat2 is not available here (Linux >= 5.6 has it)", "openat2")
        raise AssertionError("unreachable")
    seen = KernelPaths()
    real_open = os.open

    def recording(dirfd: int, path: bytes, flags: int) -> int:
        seen.asked.append(path)
        return kernel(dirfd, path, flags)

    def no_walk(*args: object, **kwargs: object) -> object:
        raise AssertionError(f"walked in Python: {args}")

    def counting_open(path: object, *args: object, **kwargs: object) -> int:
        if path == root or path == str(root):
            seen.root_opens += 1
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(HostRoot, "openat2", recording)
    monkeypatch.setattr(os, "lstat", no_walk)
    monkeypatch.setattr(os, "readlink", no_walk)
    monkeypatch.setattr(os, "open", counting_open)
    return seen
