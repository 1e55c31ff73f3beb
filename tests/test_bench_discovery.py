"""The discovery benchmark keeps working (small sizes; the timing goal itself is the benchmark's job)."""

from __future__ import annotations

from pathlib import Path

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


def test_scan_ab_alternates_two_checkouts_and_prints_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    """This checkout against itself (its own .venv): both workers answer, the figures and the ratio print."""
    from bench.scan_ab import ROOT
    from bench.scan_ab import main as ab_main

    assert ab_main([str(ROOT), "--functions", "60", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "60 functions vs node01, 2 scans of each tree per checkout, alternated:" in out
    assert out.count("extra") >= 3
    assert " this (" in out
    assert "other (" in out


def test_scan_ab_names_a_checkout_without_its_venv(tmp_path: Path) -> None:
    from bench.scan_ab import main as ab_main

    with pytest.raises(SystemExit, match=rf"{tmp_path}: no \.venv/bin/python"):
        ab_main([str(tmp_path), "--functions", "60", "--rounds", "2"])
