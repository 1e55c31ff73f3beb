"""The shared runtime plumbing: socket preparation, status messages, signals, log setup, pci.ids choice."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
from pathlib import Path

import pytest

from runtime.env import hook_env, plugin_env
from runtime.logs import component_logger, configure_logging
from runtime.pciids import locate_pci_ids
from runtime.signals import stop_on_signals
from runtime.sockets import MAX_UNIX_SOCKET_PATH, SocketInUse, prepare_socket_path, socket_is_live
from runtime.status import MAX_STATUS_MESSAGE, status_message
from tests.hook_support import short_dir


def test_prepare_replaces_a_stale_socket_and_refuses_a_live_one() -> None:
    with short_dir() as directory:
        path = directory / "s.sock"
        prepare_socket_path(path)  # nothing there: nothing to do
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(os.fspath(path))
        stale.close()  # bound, never listened: connecting is refused
        assert not socket_is_live(path)
        prepare_socket_path(path)
        assert not path.exists()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
            live.bind(os.fspath(path))
            live.listen()
            assert socket_is_live(path)
            with pytest.raises(SocketInUse, match=r"another server is listening on .* \(a hint\); refusing"):
                prepare_socket_path(path, in_use_hint="a hint")
            assert path.exists()


def test_prepare_refuses_a_file_and_a_long_path_and_creates_the_parent_on_request() -> None:
    with short_dir() as directory:
        path = directory / "file.sock"
        path.write_text("not a socket")
        with pytest.raises(SocketInUse, match="exists and is not a socket"):
            prepare_socket_path(path)
        assert path.read_text() == "not a socket"
        with pytest.raises(SocketInUse, match=f"longer than {MAX_UNIX_SOCKET_PATH} bytes"):
            prepare_socket_path(directory / ("x" * MAX_UNIX_SOCKET_PATH))
        nested = directory / "a" / "b.sock"
        prepare_socket_path(nested, create_parent=True)
        assert nested.parent.is_dir()


def test_status_message_is_bounded_and_utf8_safe() -> None:
    long = "é" * (MAX_STATUS_MESSAGE * 2)
    cut = status_message(long)
    assert len(cut) == MAX_STATUS_MESSAGE
    assert cut.endswith("...")
    assert status_message("bad \ud800 name") == "bad \\ud800 name"
    status_message("bad \ud800 name").encode("utf-8")


def test_stop_on_signals_requests_stop_and_restores_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    stops: list[bool] = []
    with stop_on_signals(lambda: stops.append(True)) as received:
        signal.raise_signal(signal.SIGTERM)
    assert received == ["SIGTERM"]
    assert stops == [True]
    assert signal.getsignal(signal.SIGTERM) is before


def test_one_log_setup_for_every_component() -> None:
    stream = io.StringIO()
    logger = component_logger("runtime_test_component")
    flush = configure_logging("runtime_test_component", "json", stream)
    logger.info("hello")
    flush()
    line = json.loads(stream.getvalue().splitlines()[-1])
    assert line["component"] == "runtime_test_component"


def test_env_names_and_the_pci_ids_warning(tmp_path: Path) -> None:
    assert plugin_env("log_format") == "GPU_PLUGIN_LOG_FORMAT"
    assert hook_env("pod-resources-socket") == "LAUNCHER_HOOK_POD_RESOURCES_SOCKET"
    choice = locate_pci_ids(None, tmp_path / "host", tmp_path / "image")
    assert choice.database is None
    [warning] = choice.warnings
    assert warning.startswith("no pci.ids found (looked at ")
    assert "named by hex device ID" in warning
