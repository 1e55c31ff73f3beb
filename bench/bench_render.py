"""Rendering a 16-GPU VM into a KubeVirt-sized domain, against the floor of lxml parsing and serialising it.

Run: ``python -m bench.bench_render [--rounds N]``. Two cases: the builder adds the 16 hostdevs ("add"), and
it merges with the 16 virt-launcher already rendered ("merge"). In each, builder and floor are timed in the
same run, interleaved, on the same bytes; the ratio of medians is what matters (goal: at most 1.3x the
floor). Prints figures, exits 0; this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics

from lxml import etree

from bench.workloads import kubevirt_rendered_domain, kubevirt_sized_domain, median_seconds, sixteen_gpus
from launcher_hook import build_domain

GOAL = 1.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2000)
    rounds = parser.parse_args().rounds
    vmi, env = sixteen_gpus()
    parser_options = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False)
    for name, domain in (("add", kubevirt_sized_domain()), ("merge", kubevirt_rendered_domain())):

        def floor(domain: bytes = domain) -> bytes:
            return etree.tostring(etree.fromstring(domain, parser_options).getroottree(), encoding="UTF-8")

        def render(domain: bytes = domain) -> bytes:
            return build_domain(domain, vmi, env).domain_xml

        assert render().count(b"<hostdev ") == 16
        for _ in range(200):  # warm up both
            floor()
            render()
        floors, renders = [], []
        for _ in range(5):  # interleave so machine noise hits both alike
            floors.append(median_seconds(floor, rounds // 5))
            renders.append(median_seconds(render, rounds // 5))
        floor_s, render_s = statistics.median(floors), statistics.median(renders)
        ratio = render_s / floor_s
        print(f"{name}: domain {len(domain)} bytes, 16 GPUs, {rounds} rounds each")
        print(f"  floor  (lxml parse + serialise): {floor_s * 1e6:8.1f} us")
        print(f"  render (build_domain):           {render_s * 1e6:8.1f} us")
        print(f"  ratio: {ratio:.2f}x the floor (goal <= {GOAL}x): {'MET' if ratio <= GOAL else 'NOT MET'}")


if __name__ == "__main__":
    main()
