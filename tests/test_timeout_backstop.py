"""The test command never waits silently: pytest-timeout (pinned in the dev lock) ends a hung test, naming it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_backstop_is_configured() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["timeout_method"] == "thread"
    assert 0 < options["timeout"] <= 900


def test_a_hung_test_is_ended_with_its_name_and_stacks(tmp_path: Path) -> None:
    test = "import threading\n\n\ndef test_waits_forever():\n    threading.Event().wait()\n"
    (tmp_path / "test_hangs.py").write_text(test)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "--timeout", "1",
         "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), str(tmp_path / "test_hangs.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "test_hangs.py::test_waits_forever was still running after 1 s (pytest-timeout backstop" in output
    assert "in test_waits_forever" in output  # the hung test's frame in the stack dump
