"""The device plugin benchmark keeps working (a short run; its goals are the benchmark's business, not a test's)."""

from __future__ import annotations

import pytest

from bench.plugin_device import main


def test_bench_runs_and_prints_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--rounds", "50", "--idle", "0.5", "--starts", "1", "--losses", "2"])
    out = capsys.readouterr().out
    for figure in ("start to registered:", "Allocate round trip:", "health loss to kubelet:", "idle CPU:", "RSS:"):
        assert figure in out
    assert out.count("MET") == 5  # one verdict per figure, MET or NOT MET
