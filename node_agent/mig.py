"""MIG (Multi-Instance GPU) for MIG-backed vGPUs: the GPUs' GPU instance profiles, what a MIG-backed vGPU type
name asks for, where GPU instances fit, and the one way the agent changes MIG state: NVIDIA's ``nvidia-smi``
(docs/node-agent.md, "MIG-backed vGPU", has the facts and their sources).

- **Type names.** NVIDIA's vgpu-device-manager reads a MIG-backed vGPU type name as
  ``<GPU>-<G>-<GB><series>[ME|NOME|MEALL|GFX]`` (``A100-1-5C``, ``H100-2-20C``, ``DC-1-24CGFX``) and turns it
  into the GPU instance profile ``<G>g.<GB>gb`` with ``+me``, ``-me``, ``+me.all`` or ``+gfx`` for the suffix:
  each vGPU of such a type needs one GPU instance of that profile. :func:`mig_backed` does the same.
- **Profiles.** :data:`MIG_GPUS` holds the GPU instance profiles of the A100 40GB/80GB and H100 80GB as NVIDIA's
  MIG user guide lists them: profile ID, memory slices, the placements (first memory slice) each may take, and
  how many a GPU holds. A GPU whose PCI ID is not there is not MIG-capable to the agent.
- **nvidia-smi.** :class:`NvidiaSmi` runs the configured executable through the kernel's ``run`` (tests: the
  simulator in ``simkit.kernel_sim``): ``--query-gpu=mig.mode.current,mig.mode.pending``, ``--query-compute-apps``,
  ``mig -lgi``, ``-mig 0|1``, ``-r`` (GPU reset, when a mode change is pending), ``mig -cgi <id>:<start> -C``
  and ``mig -dci``/``-dgi``. Every command names the GPU by its PCI address (``-i 0000:3b:00.0``).

Pure except :class:`NvidiaSmi`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from node_agent.kernel import AgentError, CommandResult

NVIDIA_SMI = "nvidia-smi"
MAX_COMMAND_CHARS = 4096
"""A bound on the configured nvidia-smi command line."""
MEMORY_SLICES = 8
"""A100 and H100 have 8 memory slices; a placement is a run of slices (MIG user guide, "Supported MIG Profiles")."""

_MIG_BACKED = re.compile(
    r"^(?P<gpu>[A-Z0-9]+)-(?P<g>[1-9])-(?P<gb>0|[1-9][0-9]*)(?P<series>[ABCQ])(?P<attr>MEALL|NOME|ME|GFX)?$"
)
_ATTRIBUTE = {"ME": "+me", "NOME": "-me", "MEALL": "+me.all", "GFX": "+gfx"}


@dataclass(frozen=True, slots=True)
class MigBacked:
    """What a MIG-backed vGPU type name says: one GPU instance of :attr:`profile` per vGPU."""

    name: str
    profile: str


def mig_backed(name: str) -> MigBacked | None:
    """The profile a MIG-backed type name (``A100-1-5C``, ``NVIDIA H100-2-20C``) needs; None for any other name
    (time-sliced ``A100-40C``, an mdev directory, a numeric type ID)."""
    bare = name.removeprefix("NVIDIA ").removeprefix("GRID ")
    found = _MIG_BACKED.match(bare)
    if found is None:
        return None
    profile = f"{found['g']}g.{found['gb']}gb" + _ATTRIBUTE.get(found["attr"] or "", "")
    return MigBacked(bare, profile)


@dataclass(frozen=True, slots=True)
class GiProfile:
    profile_id: int
    name: str
    size: int
    """Memory slices it takes."""
    starts: tuple[int, ...]
    """The memory slices it may start at."""
    most: int
    """How many one GPU holds."""


@dataclass(frozen=True, slots=True)
class MigGpu:
    model: str
    profiles: tuple[GiProfile, ...]

    def profile(self, name: str) -> GiProfile | None:
        return next((profile for profile in self.profiles if profile.name == name), None)

    def by_id(self, profile_id: int) -> GiProfile | None:
        return next((profile for profile in self.profiles if profile.profile_id == profile_id), None)


def _profiles(one: int, ten_gb: int) -> tuple[GiProfile, ...]:
    """The seven GPU instance profiles A100 and H100 share (IDs and placements from the MIG user guide), named by
    the memory of one slice (``one`` GB) and of two (``ten_gb``)."""
    return (
        GiProfile(19, f"1g.{one}gb", 1, tuple(range(7)), 7),
        GiProfile(20, f"1g.{one}gb+me", 1, tuple(range(7)), 1),
        GiProfile(15, f"1g.{ten_gb}gb", 2, (0, 2, 4, 6), 4),
        GiProfile(14, f"2g.{ten_gb}gb", 2, (0, 2, 4), 3),
        GiProfile(9, f"3g.{2 * ten_gb}gb", 4, (0, 4), 2),
        GiProfile(5, f"4g.{2 * ten_gb}gb", 4, (0,), 1),
        GiProfile(0, f"7g.{4 * ten_gb}gb", 8, (0,), 1),
    )


_A100_40GB = _profiles(5, 10)
_80GB = _profiles(10, 20)
MIG_GPUS: dict[int, MigGpu] = {
    0x20B0: MigGpu("A100 SXM4 40GB", _A100_40GB),
    0x20F1: MigGpu("A100 PCIe 40GB", _A100_40GB),
    0x20B2: MigGpu("A100 SXM4 80GB", _80GB),
    0x20B5: MigGpu("A100 PCIe 80GB", _80GB),
    0x2330: MigGpu("H100 SXM5 80GB", _80GB),
    0x2331: MigGpu("H100 PCIe 80GB", _80GB),
}
"""PCI device ID → MIG profiles (docs/node-agent.md, "MIG-backed vGPU")."""


@dataclass(frozen=True, slots=True)
class GpuInstance:
    gi_id: int
    profile_id: int
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class MigState:
    current: bool
    pending: bool
    instances: tuple[GpuInstance, ...]
    processes: tuple[str, ...]
    """Compute processes on the GPU (``pid (name)``): a mode change waits for none."""


def place(gpu: MigGpu, kept: Iterable[GpuInstance], wanted: list[GiProfile]) -> list[tuple[GiProfile, int]] | None:
    """Where the GPU instances ``wanted`` go beside ``kept`` (each at one of its profile's starts, no two sharing a
    memory slice, no profile above its count); None when they do not fit."""
    used = [False] * MEMORY_SLICES
    counts: dict[int, int] = {}
    for instance in kept:
        for index in range(instance.start, min(instance.start + instance.size, MEMORY_SLICES)):
            used[index] = True
        counts[instance.profile_id] = counts.get(instance.profile_id, 0) + 1
    order = sorted(wanted, key=lambda profile: (-profile.size, profile.profile_id))
    chosen: list[tuple[GiProfile, int]] = []

    def search(at: int) -> bool:
        if at == len(order):
            return True
        profile = order[at]
        if counts.get(profile.profile_id, 0) >= profile.most:
            return False
        for start in profile.starts:
            span = range(start, start + profile.size)
            if span.stop > MEMORY_SLICES or any(used[index] for index in span):
                continue
            for index in span:
                used[index] = True
            counts[profile.profile_id] = counts.get(profile.profile_id, 0) + 1
            chosen.append((profile, start))
            if search(at + 1):
                return True
            chosen.pop()
            counts[profile.profile_id] -= 1
            for index in span:
                used[index] = False
        return False

    return chosen if search(0) else None


# -- nvidia-smi -------------------------------------------------------------------------------------------


class Runner(Protocol):
    def run(self, argv: list[str], timeout: float) -> CommandResult:
        """Run ``argv``; its exit code, stdout and stderr."""


class MigTool(Protocol):
    """The MIG operations ``vgpu apply`` needs, one GPU (PCI address) at a time."""

    commands: list[str]
    """The changing commands run so far (a re-apply of a matching node runs none)."""

    def state(self, address: str) -> MigState: ...

    def set_mode(self, address: str, enabled: bool) -> None: ...

    def reset(self, address: str) -> None: ...

    def create(self, address: str, placements: list[tuple[int, int]]) -> None: ...

    def destroy(self, address: str, gi_id: int) -> None: ...


QUERY_TIMEOUT = 60.0
CHANGE_TIMEOUT = 300.0
"""Seconds a changing command (a GPU reset) may take."""
_GI_LINE = re.compile(r"^\|\s*(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+):(\d+)\s*\|$")


def command_prefix(text: str) -> list[str]:
    """The configured nvidia-smi command (``nvidia-smi``, a path, or ``chroot /host nvidia-smi``) as argv."""
    if not text.strip() or len(text) > MAX_COMMAND_CHARS or any(ord(char) < 32 for char in text):
        raise AgentError(f"the nvidia-smi command {text[:80]!r} is empty, too long or has control characters")
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise AgentError(f"the nvidia-smi command {text[:80]!r} cannot be split into words: {exc}") from None


class NvidiaSmi:
    """:class:`MigTool` through NVIDIA's ``nvidia-smi``, run by ``runner`` (the agent's kernel)."""

    def __init__(self, runner: Runner, command: str = NVIDIA_SMI) -> None:
        self.runner = runner
        self.prefix = command_prefix(command)
        self.commands: list[str] = []

    def _run(self, args: list[str], *, change: bool, allow: tuple[str, ...] = ()) -> str:
        argv = [*self.prefix, *args]
        shown = " ".join(shlex.quote(word) for word in argv)
        if change:
            self.commands.append(shown)
        done = self.runner.run(argv, CHANGE_TIMEOUT if change else QUERY_TIMEOUT)
        if done.returncode != 0 and not any(text in done.stdout + done.stderr for text in allow):
            said = (done.stderr.strip() or done.stdout.strip())[-500:]
            raise AgentError(f"{shown} failed (exit {done.returncode}): {said}")
        return done.stdout

    def state(self, address: str) -> MigState:
        mode = self._run(
            ["--query-gpu=mig.mode.current,mig.mode.pending", "--format=csv,noheader", "-i", address], change=False
        )
        words = [word.strip() for word in mode.strip().split(",")]
        if len(words) != 2 or any(word not in ("Enabled", "Disabled") for word in words):
            raise AgentError(f"nvidia-smi reports MIG mode {mode.strip()[:80]!r} for {address}, not Enabled/Disabled")
        current, pending = (word == "Enabled" for word in words)
        instances: list[GpuInstance] = []
        if current:
            listing = self._run(["mig", "-lgi", "-i", address], change=False, allow=("No GPU instances found",))
            for line in listing.splitlines():
                found = _GI_LINE.match(line.strip())
                if found:
                    instances.append(GpuInstance(int(found[4]), int(found[3]), int(found[5]), int(found[6])))
        apps = self._run(
            ["--query-compute-apps=pid,process_name", "--format=csv,noheader", "-i", address], change=False
        )
        processes = tuple(
            f"pid {pid.strip()} ({name.strip()})"
            for pid, _, name in (line.partition(",") for line in apps.splitlines() if line.strip())
        )
        return MigState(current, pending, tuple(instances), processes[:16])

    def set_mode(self, address: str, enabled: bool) -> None:
        self._run(["-i", address, "-mig", "1" if enabled else "0"], change=True)

    def reset(self, address: str) -> None:
        self._run(["-r", "-i", address], change=True)

    def create(self, address: str, placements: list[tuple[int, int]]) -> None:
        tuples = ",".join(f"{profile_id}:{start}" for profile_id, start in placements)
        self._run(["mig", "-i", address, "-cgi", tuples, "-C"], change=True)

    def destroy(self, address: str, gi_id: int) -> None:
        self._run(["mig", "-i", address, "-dci", "-gi", str(gi_id)], change=True, allow=("No compute instances found",))
        self._run(["mig", "-i", address, "-dgi", "-gi", str(gi_id)], change=True)
