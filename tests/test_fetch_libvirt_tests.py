"""scripts/fetch-libvirt-tests.sh: a failure names its cause, and under CI=true a missing corpus fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.libvirt_corpus_support import FETCH_SCRIPT, unavailable


@pytest.mark.skipif(shutil.which("apt-get") is None, reason="the script fetches with Debian's apt-get")
def test_an_unreachable_mirror_is_named_and_fails(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "LIBVIRT_TESTS_MIRROR": "http://127.0.0.1:9/debian",
        "LIBVIRT_TESTS_SECURITY_MIRROR": "http://127.0.0.1:9/debian-security",
    }
    done = subprocess.run(
        ["bash", str(FETCH_SCRIPT), str(tmp_path / "cache")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(
        "fetch-libvirt-tests: no deb-src index could be fetched from http://127.0.0.1:9/debian (bookworm)"
    ), done.stderr


def test_a_missing_corpus_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="libvirt's test domains are needed under CI=true: no network"):
        unavailable("no network")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="no network"):
        unavailable("no network")
