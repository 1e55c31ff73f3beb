"""The DRA prepare benchmark keeps working (a few rounds; the figures are the benchmark's job)."""

from __future__ import annotations

import pytest

from bench.dra_prepare import main


def test_bench_runs_and_prints_both_claim_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rounds", "5"]) == 0
    out = capsys.readouterr().out
    assert "claim of 1 GPU:" in out and "claim of 8 GPUs:" in out
    assert out.count("floor: empty NodePrepareResources") == 2
