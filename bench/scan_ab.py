"""The discovery benchmark as an A/B: this checkout's scan against another checkout's, alternated scan by scan.

``bench.discovery_scale`` runs one checkout at a time, and on a shared machine the same code measures +100 ms in
one run and +170 ms in the next (other tenants, the page cache and writeback of a tree just written): two
checkouts run minutes apart cannot be compared that way. Here both scan the same trees (written and synced
before any timing) from two long-lived worker processes, one per checkout, each with its own interpreter
and virtualenv, taking turns scan by scan (ABBA order), so whatever the machine does hits both alike.

    python -m bench.scan_ab OTHER_CHECKOUT [--functions 4096] [--rounds 30]

``OTHER_CHECKOUT`` is a directory holding another commit of this repository with its own ``.venv`` (e.g.
``git worktree add /tmp/base 4539955 && (cd /tmp/base && bash scripts/bootstrap.sh dev)``); the worker code is
passed on the command line, so it needs nothing newer than ``plugin.sysfs.discover_node``. Prints, per checkout,
the median wall and CPU time of a scan of the generated tree and of node01, and the extra over node01; then the
ratio of this checkout's extra to the other's. A measurement, not a test: exits 0.
"""

from __future__ import annotations

import argparse
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.discovery_scale import generated_node
from simkit.fixture_nodes import NODE01
from simkit.sysfs_fixture import build

ROOT = Path(__file__).resolve().parent.parent
WORKER = """
import os, sys, time
sys.path.insert(0, os.getcwd())
from pathlib import Path
from plugin.config import PluginConfig
from plugin.sysfs import discover_node
configs = {"big": PluginConfig(host_root=sys.argv[1]), "tiny": PluginConfig(host_root=sys.argv[2])}
image = Path(sys.argv[1]) / "no-image"
for config in configs.values():
    discover_node(config, image_root=image)
print("ready", flush=True)
for line in sys.stdin:
    config = configs[line.strip()]
    wall, cpu = time.perf_counter(), time.process_time()
    discover_node(config, image_root=image)
    print((time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000, flush=True)
"""
"""One checkout's side: scans a tree each time it reads its name, prints wall and CPU milliseconds."""
WORKER_TIMEOUT = 120.0
"""Seconds a worker may take to start or to answer one scan before the run gives up, naming it."""


@dataclass
class Side:
    label: str
    checkout: Path
    process: subprocess.Popen[str]
    big: list[tuple[float, float]]
    tiny: list[tuple[float, float]]

    def scan(self, tree: str) -> tuple[float, float]:
        assert self.process.stdin is not None
        self.process.stdin.write(tree + "\n")
        self.process.stdin.flush()
        line = _read_line(self, f"a scan of the {tree} tree")
        wall, cpu = (float(value) for value in line.split())
        return wall, cpu


def _read_line(side: Side, what: str) -> str:
    """The worker's next line, or SystemExit naming the checkout when it dies or stays silent."""
    assert side.process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(side.process.stdout, selectors.EVENT_READ)
        if not selector.select(WORKER_TIMEOUT):
            raise SystemExit(f"{side.checkout}: no answer to {what} within {WORKER_TIMEOUT:.0f} s")
    line = side.process.stdout.readline()
    if not line:
        raise SystemExit(f"{side.checkout}: the worker ended during {what} (exit {side.process.wait()})")
    return line


def start(label: str, checkout: Path, big: Path, tiny: Path) -> Side:
    python = checkout / ".venv" / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"{checkout}: no .venv/bin/python (run `bash scripts/bootstrap.sh dev` there first)")
    process = subprocess.Popen(
        [str(python), "-c", WORKER, str(big), str(tiny)],
        cwd=checkout,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={key: value for key, value in os.environ.items() if not key.startswith("GPU_PLUGIN_")},
    )
    side = Side(label, checkout, process, [], [])
    try:
        if _read_line(side, "its start").strip() != "ready":
            raise SystemExit(f"{checkout}: the worker did not start")
    except SystemExit:
        process.kill()
        process.wait()
        raise
    return side


def summary(side: Side) -> tuple[float, str]:
    big_wall = statistics.median(wall for wall, _ in side.big)
    tiny_wall = statistics.median(wall for wall, _ in side.tiny)
    big_cpu = statistics.median(cpu for _, cpu in side.big)
    tiny_cpu = statistics.median(cpu for _, cpu in side.tiny)
    quartiles = statistics.quantiles([wall for wall, _ in side.big], n=4)
    line = (
        f"{side.label:>5} ({side.checkout}): scan median {big_wall:.1f} ms (quartiles {quartiles[0]:.1f}-"
        f"{quartiles[2]:.1f}), node01 {tiny_wall:.2f} ms, extra {big_wall - tiny_wall:.1f} ms; "
        f"CPU extra {big_cpu - tiny_cpu:.1f} ms"
    )
    return big_wall - tiny_wall, line


def run(other: Path, functions: int, rounds: int) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="bench-scan-ab-") as temp:
        big = build(generated_node(functions), Path(temp) / f"n{functions}")
        tiny = build(NODE01, Path(temp) / "node01")
        os.sync()  # the writeback of the trees just written must not land in the timed scans
        sides: list[Side] = []
        try:
            for label, checkout in (("this", ROOT), ("other", other.resolve())):
                sides.append(start(label, checkout, big, tiny))
            for index in range(rounds):
                for side in sides if index % 2 == 0 else reversed(sides):
                    side.big.append(side.scan("big"))
                    side.tiny.append(side.scan("tiny"))
        finally:
            for side in sides:
                if side.process.stdin is not None:
                    side.process.stdin.close()
                try:
                    side.process.wait(10)
                except subprocess.TimeoutExpired:
                    side.process.kill()
                    side.process.wait()
    (this_extra, this_line), (other_extra, other_line) = (summary(side) for side in sides)
    return [
        f"{functions} functions vs node01, {rounds} scans of each tree per checkout, alternated:",
        this_line,
        other_line,
        f"this checkout's extra is {this_extra / other_extra:.2f}x the other's"
        if other_extra > 0
        else "no ratio: the other checkout's extra is not above zero",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scan_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="another checkout of this repository, with its own .venv")
    parser.add_argument("--functions", type=int, default=4096, help="functions of the generated tree")
    parser.add_argument("--rounds", type=int, default=30, help="scans of each tree per checkout")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    print("\n".join(run(args.other, args.functions, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
