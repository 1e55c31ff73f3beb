"""scripts/ensure-system.sh's decisions, run against stand-ins for virsh, pgrep, pkill, libvirtd and dpkg-query.

The real script runs (as root here, so its /dev/kvm step is real and idempotent); only the commands that
would touch the shared libvirtd are replaced by scripts on PATH that log their calls (``ps`` also lists a
zombie libvirtd, which must not count as running). A virsh that never
answers must make the script give up within its bounds, naming the cause; a libvirtd that is not running
is started; one that answers is left alone.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.libvirt_support import missing

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ensure-system.sh"


def stand_ins(directory: Path, *, running: bool, version: str, probe: str) -> Path:
    """``version``/``probe``: 'ok', 'hang' or 'fail' for ``virsh version`` and ``virsh domxml-to-native``."""
    log = directory / "calls.log"
    behave = {"ok": "exit 0", "hang": "exec sleep 1000", "fail": "echo 'error: refused' >&2; exit 1"}
    scripts = {
        "dpkg-query": "echo 'install ok installed'",
        "pgrep": f'echo pgrep "$@" >> {log}; [ -e {directory}/running ]',
        "ps": f'echo ps "$@" >> {log}; [ -e {directory}/running ] && echo Ssl; echo Z',  # and a zombie
        "pkill": f'echo pkill "$@" >> {log}; rm -f {directory}/running',
        "libvirtd": f'echo libvirtd "$@" >> {log}; touch {directory}/running',
        "virtlogd": f'echo virtlogd "$@" >> {log}',
        "virsh": f'echo virsh "$@" >> {log}\n'
        f'case "$*" in *domxml-to-native*) {behave[probe]} ;; esac\n{behave[version]}',
    }
    for name, body in scripts.items():
        path = directory / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    if running:
        (directory / "running").touch()
    return log


def run(directory: Path, ci: bool = True) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {
        **os.environ,
        "PATH": f"{directory}:{os.environ['PATH']}",
        "CI": "true" if ci else "",
        "ENSURE_SYSTEM_VIRSH_TIMEOUT": "1",
        "ENSURE_SYSTEM_PROBE_TIMEOUT": "2",
    }
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False)
    return done, time.monotonic() - started


pytestmark = pytest.mark.libvirt


@pytest.fixture(autouse=True)
def needs_root() -> None:
    if os.geteuid() != 0:
        missing("ensure-system.sh's libvirtd steps run as root only (the test command runs as root in CI)")


@pytest.fixture(autouse=True)
def socket_present() -> None:
    if not Path("/var/run/libvirt/libvirt-sock").is_socket():
        missing("no libvirtd socket on this machine (scripts/ensure-system.sh as root starts libvirtd)")


def test_a_libvirtd_that_answers_is_left_alone(tmp_path: Path) -> None:
    log = stand_ins(tmp_path, running=True, version="ok", probe="ok")
    done, elapsed = run(tmp_path)
    assert done.returncode == 0, done.stderr
    calls = log.read_text()
    assert "pkill" not in calls and "libvirtd -d" not in calls
    assert "domxml-to-native qemu-argv" in calls  # the probe the tests rely on was made
    assert elapsed < 20


def test_a_stopped_libvirtd_is_started(tmp_path: Path) -> None:
    log = stand_ins(tmp_path, running=False, version="ok", probe="ok")
    done, _ = run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "starting libvirtd" in done.stderr
    assert "libvirtd -d" in log.read_text()


def test_a_libvirtd_that_never_answers_is_restarted_then_given_up_on_naming_the_socket(tmp_path: Path) -> None:
    log = stand_ins(tmp_path, running=True, version="hang", probe="hang")
    done, elapsed = run(tmp_path)
    assert done.returncode == 1
    assert "error: libvirtd did not answer on /var/run/libvirt/libvirt-sock after 3 starts" in done.stderr
    assert log.read_text().count("pkill -x libvirtd") >= 3
    assert elapsed < 110


def test_a_hung_qemu_probe_fails_naming_dev_kvm(tmp_path: Path) -> None:
    stand_ins(tmp_path, running=True, version="ok", probe="hang")
    done, elapsed = run(tmp_path)
    assert done.returncode == 1
    assert "error: libvirtd answers, but not domxml-to-native (no answer within 2 s)" in done.stderr
    assert "is /dev/kvm usable by libvirt-qemu?" in done.stderr
    assert elapsed < 30


def test_outside_ci_a_broken_libvirtd_is_a_note_and_exit_0(tmp_path: Path) -> None:
    stand_ins(tmp_path, running=True, version="ok", probe="fail")
    done, _ = run(tmp_path, ci=False)
    assert done.returncode == 0
    assert "error: refused" in done.stderr and "the libvirt checks will be skipped" in done.stderr
