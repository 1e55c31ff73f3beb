"""What the node agent costs over the writes it makes: ``bind`` of 8 GPUs with their companions and
``vgpu apply`` of 32 vGPUs, on fixture trees driven through :mod:`simkit.kernel_sim`.

    python -m bench.node_agent [--repeat 5]

For each operation, same run, fresh trees (building them is not timed), medians of ``--repeat``:

- **agent**: the agent's core (read sysfs, choose drivers, check holders, plan, write, read back);
- **floor**: the same writes (taken from the agent's own run) replayed directly in a loop through the
  same simulated kernel: what the kernel's side costs here, with no reading or planning;
- **re-run**: the agent again on the prepared node (every check, no write: the idempotent path);
- **plain writes**: the same number of open+write+close of small regular files (the syscall floor of a
  sysfs write; the real kernel's own work on bind/probe or mdev create cannot be measured without the device).

A measurement, not a test: it prints figures and exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from node_agent.bind import bind, driver_chooser, select
from node_agent.drivers import parse_vfio_aliases
from node_agent.sysfs import Sysfs
from node_agent.vgpu import apply
from node_agent.vgpu_config import parse_config
from simkit.agent_nodes import MODULES_ALIAS, build_node, consumer_card
from simkit.fixture_nodes import CLASS_3D, NVIDIA
from simkit.kernel_sim import SimKernel
from simkit.sysfs_fixture import Function, MdevType, Node

ROOT_BUSES = (0x17, 0x3A, 0x5D, 0x85, 0xAE, 0xD7)


def eight_gpu_node() -> Node:
    """Eight RTX 2060 cards (VGA + audio + USB + UCSI each, one group per card) on their host drivers."""
    functions: list[Function] = []
    for index in range(8):
        card = consumer_card(ROOT_BUSES[index % len(ROOT_BUSES)])
        if index >= len(ROOT_BUSES):  # two more cards: same shape, their own buses and groups
            card = tuple(
                Function(
                    f.address.replace(f.address[5:7], f"{int(f.address[5:7], 16) + 0x10:02x}", 1),
                    f.vendor,
                    f.device,
                    f.pci_class,
                    f.driver,
                    (f.iommu_group or 0) + 1000,
                    f.numa_node,
                    parent=None
                    if f.parent is None
                    else f.parent.replace(f.parent[5:7], f"{int(f.parent[5:7], 16) + 0x10:02x}", 1),
                )
                for f in card
            )
        functions.extend(card)
    return Node("eight-gpus", tuple(functions))


def vgpu_node() -> Node:
    """Four T4s on nvidia, each able to take 16 T4-1Q vGPUs (the config asks 8 each: 32 in all)."""
    addresses = [f"0000:{bus:02x}:00.0" for bus in (0x3B, 0x5E, 0xAF, 0xD8)]
    functions = tuple(Function(a, NVIDIA, 0x1EB8, CLASS_3D, "nvidia", 30 + i, 0) for i, a in enumerate(addresses))
    types = tuple(MdevType(a, "nvidia-222", "GRID T4-1Q", 16) for a in addresses)
    return Node("vgpu-32", functions, mdev_types=types)


CONFIG = "version: v1\nvgpu-configs:\n  t4:\n    - devices: all\n      vgpu-devices: {T4-1Q: 8}\n"


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(name: str, node: Node, run: Callable[[Sysfs, SimKernel], object], repeat: int, scratch: Path) -> None:
    agent, floor, rerun, plain = [], [], [], []
    writes = 0
    for round_ in range(repeat):
        sim = build_node(node, scratch / f"{name}-{round_}-a" / "root")
        fs = Sysfs(sim.root)
        agent.append(timed(lambda fs=fs, sim=sim: run(fs, sim)))  # type: ignore[misc]
        writes = len(sim.log)
        rerun.append(timed(lambda fs=fs, sim=sim: run(fs, sim)))  # type: ignore[misc]
        assert len(sim.log) == writes, "a re-run wrote"
        replay = build_node(node, scratch / f"{name}-{round_}-b" / "root")
        log = [(replay.root / path, value) for path, value in sim.log]
        for module in sim.loaded:  # loading a module is not a write: done before timing, as the agent's was
            replay.load_module(module, replay.root)

        def replay_writes(kernel: SimKernel = replay, log: list[tuple[Path, str]] = log) -> None:
            for path, value in log:
                kernel.write(path, value)

        floor.append(timed(replay_writes))
        files = [scratch / f"{name}-{round_}-plain-{i}" for i in range(writes)]
        for path in files:
            path.write_text("")

        def plain_writes(files: list[Path] = files) -> None:
            for path in files:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                os.write(fd, b"0000:86:00.0")
                os.close(fd)

        plain.append(timed(plain_writes))
    a, f, r, p = (statistics.median(x) * 1000 for x in (agent, floor, rerun, plain))
    print(f"{name}: {writes} writes")
    print(f"  agent {a:8.2f} ms   floor (same writes, simulated kernel) {f:7.2f} ms   ratio {a / f:5.1f}x")
    print(f"  re-run on the prepared node (no write) {r:7.2f} ms   plain open+write+close x{writes} {p:6.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    aliases = parse_vfio_aliases(MODULES_ALIAS)
    specs = parse_config(CONFIG, "bench")["t4"]

    def run_bind(fs: Sysfs, sim: SimKernel) -> object:
        return bind(fs, sim, select(fs, (), (), True), driver_chooser(fs, aliases))

    counter = iter(range(1 << 30))

    def run_apply(fs: Sysfs, sim: SimKernel) -> object:
        return apply(fs, sim, specs, new_uuid=lambda: f"00000000-0000-4000-8000-{next(counter):012x}")

    with tempfile.TemporaryDirectory(prefix="bench-node-agent-") as scratch:
        measure("bind --all: 8 GPUs, 32 functions", eight_gpu_node(), run_bind, args.repeat, Path(scratch))
        measure("vgpu apply: 32 mdevs on 4 GPUs", vgpu_node(), run_apply, args.repeat, Path(scratch))


if __name__ == "__main__":
    main()
