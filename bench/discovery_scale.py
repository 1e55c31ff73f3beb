"""How discovery's cost grows with the node: a generated 4096-function tree against node01, same run.

The device plugin rescans sysfs for health, so a scan must stay cheap on big nodes (hundreds of SR-IOV
virtual functions, many GPUs). Goal (issue 12): the 4096-function tree costs at most 100 ms more than the tiny
node01 tree, and the cost grows linearly (checked on 1024, 2048 and 4096 functions).

    python -m bench.discovery_scale [--sizes 1024,2048,4096] [--repeat 7] [--check]

Trees are written with :mod:`simkit.sysfs_fixture` into a temporary directory, all of them and synced before
any timing; each figure is the median of ``--repeat`` full discoveries (pci.ids lookup included). ``--check``
exits 1 when a goal is missed. On a shared machine one run apart the same code measures +100 ms and +170 ms:
to compare two commits use :mod:`bench.scan_ab`, which alternates them scan by scan.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from plugin.config import PluginConfig
from plugin.sysfs import discover_node
from simkit.fixture_nodes import (
    CLASS_AUDIO,
    CLASS_ETHERNET,
    CLASS_PCI_BRIDGE,
    CLASS_SERIAL_BUS,
    CLASS_USB_XHCI,
    CLASS_VGA,
    INTEL,
    NODE01,
    NVIDIA,
    PCI_IDS_EXCERPT,
)
from simkit.sysfs_fixture import Function, Node, build

GOAL_EXTRA_MS = 100.0
MELLANOX = 0x15B3
CX6_PF, CX6_VF = 0x101D, 0x101E
VFS_PER_PF = 126


def _buses() -> Iterator[tuple[int, int]]:
    """(domain, bus) pairs for a root port at ``bus`` and its device on ``bus + 1``."""
    domain = 0
    while True:
        for bus in range(0x02, 0xFE, 2):
            yield domain, bus
        domain += 1


def generated_node(functions: int) -> Node:
    """A node with exactly ``functions`` PCI functions: a quarter of them in TU106 cards on vfio-pci (each
    below its own root port), the rest ConnectX-6 Dx PFs with SR-IOV VFs (each VF its own IOMMU group)."""
    out: list[Function] = []
    buses = _buses()
    group = 0

    def next_group() -> int:
        nonlocal group
        group += 1
        return group

    def port(domain: int, bus: int, numa: int) -> str:
        address = f"{domain:04x}:{bus:02x}:00.0"
        out.append(Function(address, INTEL, 0x2030, CLASS_PCI_BRIDGE, "pcieport", next_group(), numa))
        return address

    card_functions = (
        (0x1F08, CLASS_VGA),
        (0x10F9, CLASS_AUDIO),
        (0x1ADA, CLASS_USB_XHCI),
        (0x1ADB, CLASS_SERIAL_BUS),
    )
    for card in range(functions // 20):
        domain, bus = next(buses)
        numa = card % 2
        parent = port(domain, bus, numa)
        card_group = next_group()
        for index, (device, pci_class) in enumerate(card_functions):
            address = f"{domain:04x}:{bus + 1:02x}:00.{index}"
            out.append(Function(address, NVIDIA, device, pci_class, "vfio-pci", card_group, numa, parent))
    while len(out) < functions:
        domain, bus = next(buses)
        numa = bus % 2
        parent = port(domain, bus, numa)
        room = min(functions - len(out), VFS_PER_PF + 1)
        for index in range(room):
            slot, function = divmod(index, 8)
            address = f"{domain:04x}:{bus + 1:02x}:{slot:02x}.{function}"
            device, driver = (CX6_PF, "mlx5_core") if index == 0 else (CX6_VF, "mlx5_core")
            out.append(Function(address, MELLANOX, device, CLASS_ETHERNET, driver, next_group(), numa, parent))
    return Node(f"generated-{functions}", tuple(out[:functions]), pci_ids=PCI_IDS_EXCERPT)


@dataclass(frozen=True)
class Figure:
    functions: int
    median_ms: float
    best_ms: float
    resources: int
    devices: int


def time_discovery(root: Path, repeat: int) -> Figure:
    config = PluginConfig(host_root=str(root))
    image = root / "no-image"
    timings = []
    inventory = None
    for _ in range(repeat):
        start = time.perf_counter()
        inventory = discover_node(config, image_root=image)
        timings.append((time.perf_counter() - start) * 1000)
    assert inventory is not None
    functions = len(list((root / "sys/bus/pci/devices").iterdir()))
    devices = sum(len(resource.devices) for resource in inventory.resources)
    return Figure(functions, statistics.median(timings), min(timings), len(inventory.resources), devices)


def run(sizes: Sequence[int], repeat: int) -> tuple[Figure, list[Figure]]:
    with tempfile.TemporaryDirectory(prefix="bench-discovery-") as temp:
        base = Path(temp)
        trees = [build(generated_node(size), base / f"n{size}") for size in sizes]
        node01 = build(NODE01, base / "node01")
        os.sync()  # every tree written before any timing: their writeback must not land in the timed scans
        tiny = time_discovery(node01, repeat)
        figures = [time_discovery(tree, repeat) for tree in trees]
    return tiny, figures


def report(tiny: Figure, figures: Sequence[Figure]) -> tuple[list[str], bool]:
    lines = [f"{'tree':>16}  {'functions':>9}  {'GPUs':>5}  {'median ms':>9}  {'best ms':>8}  {'extra ms':>8}"]
    rows = [("node01", tiny), *(("generated", figure) for figure in figures)]
    for label, figure in rows:
        extra = figure.median_ms - tiny.median_ms
        lines.append(
            f"{label:>16}  {figure.functions:>9}  {figure.devices:>5}  {figure.median_ms:>9.1f}  "
            f"{figure.best_ms:>8.1f}  {extra:>8.1f}"
        )
    ok = True
    largest = figures[-1]
    extra = largest.median_ms - tiny.median_ms
    verdict = "ok" if extra <= GOAL_EXTRA_MS else "MISSED"
    ok &= extra <= GOAL_EXTRA_MS
    lines.append(
        f"goal: {largest.functions} functions cost <= {GOAL_EXTRA_MS:.0f} ms more than node01: "
        f"{extra:.1f} ms ({verdict})"
    )
    if len(figures) >= 2:
        per_function = [
            (figure.median_ms - tiny.median_ms) * 1000 / (figure.functions - tiny.functions) for figure in figures
        ]
        spread = max(per_function) / min(per_function)
        linear = spread <= 1.5
        ok &= linear
        cost = ", ".join(
            f"{figure.functions}: {value:.1f}" for figure, value in zip(figures, per_function, strict=True)
        )
        lines.append(
            f"linear: extra µs per function {cost}; max/min {spread:.2f} (<= 1.5: {'ok' if linear else 'MISSED'})"
        )
    return lines, ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.discovery_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024,2048,4096", help="function counts of the generated trees")
    parser.add_argument("--repeat", type=int, default=7, help="discoveries per tree (the median is reported)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)
    sizes = sorted(int(size) for size in args.sizes.split(","))
    tiny, figures = run(sizes, args.repeat)
    lines, ok = report(tiny, figures)
    print("\n".join(lines))
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    raise SystemExit(main())
