"""Every libvirt call has a deadline: a libvirtd that accepts and never answers fails the call, naming why.

The stand-in is a unix socket that accepts connections and never writes a byte, reached through libvirt's
own URI syntax (``qemu+unix:///system?socket=PATH``), so libvirt-python's real ``open`` blocks in C exactly
as it does against a libvirtd stuck re-probing QEMU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.libvirt_support import missing
from xmlgen import libvirt_check
from xmlgen.libvirt_check import LibvirtTimeout, LibvirtUnavailable, call_with_deadline, qemu_vfio_devices

DOMAIN = (
    "<domain type='kvm'><name>t</name><memory>1024</memory><os><type>hvm</type></os><devices>"
    "<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x0000' bus='0x3b' slot='0x00'"
    " function='0x0'/></source><alias name='ua-gpu0'/></hostdev></devices></domain>"
)


@pytest.fixture
def silent_libvirtd() -> Iterator[str]:
    """A libvirt URI whose socket accepts and never replies; yields the URI."""
    # unix socket paths are limited to ~107 bytes: keep it short, outside pytest's deep tmp_path
    path = Path(f"/tmp/lvstandin-{os.getpid()}-{time.monotonic_ns()}.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(connection)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"qemu+unix:///system?socket={path}"
    finally:
        stop.set()
        thread.join(2)
        for connection in held:
            connection.close()
        server.close()
        path.unlink(missing_ok=True)


def need_libvirt_python() -> None:
    try:
        libvirt_check._libvirt()
    except LibvirtUnavailable as exc:
        missing(str(exc))


def test_a_call_that_never_returns_fails_at_its_deadline_naming_call_uri_and_cause() -> None:
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(LibvirtTimeout) as caught:
        call_with_deadline("domainXMLToNative", "qemu+unix:///never-1", release.wait, timeout=0.3)
    elapsed = time.monotonic() - started
    release.set()
    # Not before its deadline; after it, a bound a busy machine cannot reach (without the deadline it never ends).
    assert 0.3 <= elapsed < 20
    message = str(caught.value)
    assert message.startswith("libvirtd did not answer domainXMLToNative on qemu+unix:///never-1 within 0.3 s")
    assert "/dev/kvm" in message
    assert "scripts/ensure-system.sh" in message


def test_after_one_timeout_the_same_uri_fails_at_once() -> None:
    release = threading.Event()
    with pytest.raises(LibvirtTimeout):
        call_with_deadline("open", "qemu+unix:///never-2", release.wait, timeout=0.2)
    started = time.monotonic()
    with pytest.raises(LibvirtTimeout, match="an earlier call timed out; not waiting again"):
        call_with_deadline("open", "qemu+unix:///never-2", release.wait, timeout=30)
    # Half the 30 s it would have waited: no waiting at all, on a busy machine too.
    assert time.monotonic() - started < 15
    release.set()


def test_a_calls_result_and_its_own_error_pass_through() -> None:
    assert call_with_deadline("x", "test:///default", lambda a, b: a + b, 2, 3, timeout=5) == 5

    def refuse() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        call_with_deadline("x", "test:///default", refuse, timeout=5)


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "0", "soon"])
def test_a_bad_timeout_setting_is_named(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(libvirt_check.TIMEOUT_ENV, raw)
    with pytest.raises(LibvirtUnavailable, match=f"XMLGEN_LIBVIRT_TIMEOUT must be .* not '{raw}'"):
        libvirt_check.libvirt_timeout()


@pytest.mark.libvirt
def test_libvirt_python_open_on_a_silent_libvirtd_fails_within_its_timeout(silent_libvirtd: str) -> None:
    need_libvirt_python()
    started = time.monotonic()
    with pytest.raises(LibvirtTimeout) as caught:
        qemu_vfio_devices(DOMAIN, uri=silent_libvirtd, timeout=1)
    assert time.monotonic() - started < 5
    assert str(caught.value).startswith(f"libvirtd did not answer open on {silent_libvirtd} within 1 s")


@pytest.mark.libvirt
def test_xmlgen_simulate_check_against_a_silent_libvirtd_is_an_error_line_not_a_hang(silent_libvirtd: str) -> None:
    need_libvirt_python()
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "xmlgen", "simulate", "--check"],
        capture_output=True,
        input="",
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, libvirt_check.QEMU_URI_ENV: silent_libvirtd, libvirt_check.TIMEOUT_ENV: "2"},
    )
    elapsed = time.monotonic() - started
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: libvirt check: libvirtd did not answer open on {silent_libvirtd} within 2 s")
    assert "Traceback" not in done.stderr
    assert elapsed < 30
