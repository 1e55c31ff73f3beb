"""The instruction-count benchmark of the hook keeps working: its options, its arithmetic, and one tiny real case.

The figures are the benchmark's job (``python -m bench.hook_instructions``); here only that it takes the
paths and sizes of ``bench/hook_sidecar.py``, reads callgrind's dumps right, subtracts the floor before the
marginal cost of a GPU, and runs one case end to end under valgrind (scripts/ensure-system.sh installs it; without
it the case skips, and fails under CI=true).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.hook_instructions import (
    CALLS,
    Figure,
    dump_summary,
    main,
    marginal,
    parse_options,
    per_call,
    report,
)
from bench.hook_sidecar import PATHS, SIZES
from tests.libvirt_support import missing


def test_every_path_and_size_by_default() -> None:
    options = parse_options([])
    assert options.paths == list(PATHS)
    assert options.sizes == list(SIZES)
    assert options.calls == CALLS


def test_paths_sizes_and_calls_as_given() -> None:
    options = parse_options(["--paths", "dra,add,dra", "--sizes", "32,1", "--calls", "7"])
    assert options.paths == ["dra", "add"]
    assert options.sizes == [32, 1]
    assert options.calls == 7


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--paths", "add,nope"], "unknown paths: nope"),
        (["--paths", ","], "no path given"),
        (["--sizes", "1,x"], "not a list of numbers"),
        (["--sizes", "0"], "each from 1 to 200"),
        (["--sizes", "201"], "each from 1 to 200"),
        (["--calls", "0"], "at least 1"),
    ],
)
def test_bad_options_are_refused(argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_options(argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_a_dump_is_read_once_complete(tmp_path: Path) -> None:
    dump = tmp_path / "out.2"
    assert dump_summary(dump) is None
    dump.write_text("# callgrind format\nversion: 1\nevents: Ir\nsummary: 100611038\n\nfn=(1) main\n3 15\n")
    assert dump_summary(dump) is None  # totals: not written yet
    dump.write_text(dump.read_text() + "totals: 100611346\n")
    assert dump_summary(dump) == 100611038


def test_per_call() -> None:
    assert per_call(100_000_000, 40) == 2_500_000
    with pytest.raises(ValueError, match="at least 1"):
        per_call(1, 0)


def test_marginal_per_gpu_subtracts_the_floor_at_both_sizes() -> None:
    figures = [
        Figure("add", 16, hook=3_000_000, floor=2_400_000),
        Figure("add", 32, hook=3_600_000, floor=2_600_000),
        Figure("merge", 16, hook=4_000_000, floor=3_000_000),  # no 32: no marginal
        Figure("dra", 1, hook=2_000_000, floor=1_000_000),
    ]
    # ((3.6 - 2.6) - (3.0 - 2.4)) M / 16 = 25 k
    assert marginal(figures) == {"add": 25_000}
    assert figures[0].ratio == 1.25
    lines = report(figures, 7)
    assert "then 7 counted" in lines[0]
    assert any(line.startswith("add               x32  hook   3.60 M, floor   2.60 M: 1.38x") for line in lines)
    assert "marginal per GPU, add: 25.0 k instructions ((hook - floor) at 32 - at 16) / 16" in lines
    assert lines[-1] == '{"add x16": 1.25, "add x32": 1.385, "merge x16": 1.333, "dra x1": 2.0}'


def test_one_case_under_callgrind(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        missing("valgrind is not installed (scripts/ensure-system.sh installs it)", "valgrind missing")
    assert main(["--paths", "add", "--sizes", "1", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("add               x1 "))
    hook, floor = (float(part.split()[-2]) for part in row.split(":")[0].split(","))
    assert 0.5 < floor < 20 and 0.5 < hook < 20, row  # millions of instructions per call
    assert '{"add x1": ' in out
