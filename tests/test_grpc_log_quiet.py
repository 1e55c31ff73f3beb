"""gRPC's C-core writes nothing to a component's stderr: its log stays pure (json or text lines only).

grpcio (1.85.3, what the lock installs) logs through abseil, which writes lines such as
``I1130 15:39:40.987142 23412 chttp2_transport.cc:1403] unix:…/kubelet.sock: Got goaway [2] …`` to fd 2
unless ``GRPC_VERBOSITY`` is set before grpc is imported. The stand-in kubelet here answers every
connection with an HTTP/2 GOAWAY (INTERNAL_ERROR), which is what makes the C-core write that line; the
plugin keeps connecting to it, and every line it writes must still parse.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.grpc_logging import GRPC_VERBOSITY_DEFAULT, quiet_grpc_core
from simkit.fixture_nodes import NODE01
from tests.plugin_support import build_tree, plugin_env, serve_command, short_dir


def _frame(kind: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, 0]) + struct.pack(">I", 0) + payload


SETTINGS = _frame(4, b"")
GOAWAY = _frame(7, struct.pack(">II", 0, 2) + b"stand-in goaway")  # last stream 0, INTERNAL_ERROR


@pytest.fixture
def goaway_kubelet() -> Iterator[Path]:
    """A kubelet directory whose kubelet.sock sends SETTINGS then GOAWAY [2] to every connection."""
    with short_dir() as directory:
        kubelet_dir = directory / "kubelet"
        kubelet_dir.mkdir()
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(kubelet_dir / "kubelet.sock"))
        server.listen(16)
        server.settimeout(0.1)
        stop = threading.Event()
        served = [0]

        def serve() -> None:
            while not stop.is_set():
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                with connection:
                    try:
                        connection.settimeout(1)
                        connection.recv(65536)
                        connection.sendall(SETTINGS + GOAWAY)
                        served[0] += 1
                        time.sleep(0.2)
                    except OSError:
                        pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield kubelet_dir
        finally:
            stop.set()
            thread.join(2)
            server.close()
        assert served[0] > 0, "the plugin never connected to the GOAWAY kubelet"


def run_against(kubelet_dir: Path, log_format: str, env: dict[str, str]) -> str:
    root = build_tree(NODE01, kubelet_dir.parent)
    process = subprocess.Popen(
        serve_command(root, kubelet_dir, "--log-format", log_format, "--scan-interval", "0.5"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        time.sleep(4)  # a few registration attempts, each answered with GOAWAY
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return stderr.decode()


def grpc_free_env() -> dict[str, str]:
    return {key: value for key, value in plugin_env().items() if not key.startswith("GRPC_")}


def test_plugin_json_log_stays_json_when_the_kubelet_sends_goaway(goaway_kubelet: Path) -> None:
    stderr = run_against(goaway_kubelet, "json", grpc_free_env())
    lines = stderr.splitlines()
    assert lines, "the plugin wrote nothing"
    for line in lines:
        assert "chttp2_transport" not in line, line
        parsed = json.loads(line)
        assert parsed["component"] == "plugin", line


def test_plugin_text_log_has_only_its_own_lines_when_the_kubelet_sends_goaway(goaway_kubelet: Path) -> None:
    stderr = run_against(goaway_kubelet, "text", grpc_free_env())
    for line in stderr.splitlines():
        assert " plugin " in line[:40] and line[:4].isdigit(), line


def test_the_grpc_core_does_write_goaway_lines_when_not_quieted(goaway_kubelet: Path) -> None:
    """The stand-in really provokes the C-core's line: with GRPC_VERBOSITY=INFO set on purpose it appears."""
    stderr = run_against(goaway_kubelet, "json", {**grpc_free_env(), "GRPC_VERBOSITY": "INFO"})
    assert "Got goaway" in stderr


def test_quiet_grpc_core_keeps_an_operators_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    quiet_grpc_core()
    assert os.environ["GRPC_VERBOSITY"] == GRPC_VERBOSITY_DEFAULT
    monkeypatch.setenv("GRPC_VERBOSITY", "DEBUG")
    quiet_grpc_core()
    assert os.environ["GRPC_VERBOSITY"] == "DEBUG"


@pytest.mark.parametrize("module", ["plugin.cli", "launcher_hook.cli", "launcher_hook.shim", "xmlgen.cli"])
def test_every_entry_point_sets_grpc_verbosity_before_grpc_is_imported(module: str) -> None:
    code = (
        "import builtins, os, sys\n"
        "real = builtins.__import__\n"
        "def spy(name, *args, **kwargs):\n"
        "    if name == 'grpc' or name.startswith('grpc.'):\n"
        "        if os.environ.get('GRPC_VERBOSITY') is None: sys.exit('grpc imported before GRPC_VERBOSITY was set')\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = spy\n"
        f"import {module}\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=grpc_free_env(), capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
