"""The discovery benchmark keeps working (small sizes; the timing goal itself is the benchmark's job)."""

from __future__ import annotations

import pytest

from bench.discovery_scale import Figure, generated_node, main, report


@pytest.mark.parametrize("size", [40, 129, 300])
def test_generated_node_has_exactly_the_asked_functions(size: int) -> None:
    node = generated_node(size)
    assert len(node.functions) == size
    assert len({function.address for function in node.functions}) == size


def test_bench_runs_and_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "60,120", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "node01" in out
    assert "goal: 120 functions cost <= 100 ms more than node01" in out
    assert "linear:" in out


def test_report_flags_a_missed_goal() -> None:
    tiny = Figure(25, 1.0, 1.0, 1, 4)
    lines, ok = report(tiny, [Figure(1024, 100.0, 99.0, 1, 51), Figure(4096, 400.0, 390.0, 1, 204)])
    assert not ok
    assert any("MISSED" in line for line in lines)
