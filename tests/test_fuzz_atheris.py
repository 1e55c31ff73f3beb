"""The atheris harness (``tests/fuzz_atheris.py``, ``make fuzz``) runs, finds nothing, and can find something.

A short coverage-guided run in the default test command; a longer one under ``--soak``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import scaled

ROOT = Path(__file__).resolve().parent.parent


def fuzz(*flags: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.fuzz_atheris", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.soak
def test_atheris_finds_no_crash_in_the_parsers_and_the_builder(tmp_path: Path, soak: bool) -> None:
    runs = scaled(2_000_000, soak, 50_000)
    seconds = scaled(300, soak, 20)
    done = fuzz(f"-runs={runs}", f"-max_total_time={seconds}", f"-artifact_prefix={tmp_path}/", timeout=seconds + 120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert list(tmp_path.iterdir()) == [], "libFuzzer wrote a crash or timeout input"
    summary = re.search(r"Done (\d+) runs in (\d+) second", done.stderr)
    assert summary is not None, done.stderr[-2000:]
    coverage = re.findall(r"cov: (\d+) ft: (\d+)", done.stderr)
    print(
        f"\natheris: {summary.group(1)} runs in {summary.group(2)} s, no crash; "
        f"final coverage {coverage[-1][0] if coverage else '?'} edges, {coverage[-1][1] if coverage else '?'} features"
    )
    assert int(summary.group(1)) > 0


def test_a_crash_is_reported_with_its_input(tmp_path: Path) -> None:
    """The harness is not blind: an input file is replayed (how a saved crash is reproduced), and an exception
    other than InputError in a target fails the run, naming it."""
    crash = tmp_path / "input"
    crash.write_bytes(b"\x000000:86:00.0")  # target 0 (PCI parser) with a good address
    ok = fuzz(str(crash), timeout=60)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "Executed" in ok.stderr
    # The same input against a target that raises something else (planted): a crash, with the traceback.
    broken = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, tests.fuzz_atheris as f\n"
            "def boom(text):\n    raise RuntimeError('planted')\n"
            "f._pci = boom\nf.main(sys.argv)",
            str(crash),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert broken.returncode != 0
    assert "RuntimeError: planted" in broken.stdout + broken.stderr
