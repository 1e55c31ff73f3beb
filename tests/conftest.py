"""Shared pytest setup: paths to fixtures, the ``--regen-golden`` switch and the timeout backstop's message."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
EXAMPLES = Path(__file__).parent.parent / "examples"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--regen-golden", action="store_true", help="rewrite the expected.xml of golden cases from the builder's output"
    )
    parser.addoption(
        "--soak",
        action="store_true",
        help="run the reliability suites (marked soak) at full length; by default they run a short version",
    )


@pytest.fixture(params=["openat2", "python"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: node files read through ``openat2`` (``RESOLVE_IN_ROOT``), then through the plugin's
    Python resolution of the same rules (as on a kernel or seccomp profile without ``openat2``)."""
    from plugin.hostroot import HostRoot
    from tests.libvirt_support import missing

    if request.param == "python":
        monkeypatch.setattr(HostRoot, "openat2", None)
    elif HostRoot.openat2 is None:
        missing("openat2 is not available here (Linux >= 5.6 has it)", "openat2")
    return str(request.param)


@pytest.fixture
def regen_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--regen-golden"))


@pytest.fixture
def soak(request: pytest.FixtureRequest) -> bool:
    """True under ``--soak`` (``make soak``): reliability tests use the issue's full counts, else a short run."""
    return bool(request.config.getoption("--soak"))


def scaled(full: int, soak: bool, short: int) -> int:
    """``full`` iterations under ``--soak``, ``short`` in the default test run."""
    return full if soak else short


# -- the pytest-timeout backstop (pyproject.toml: timeout, timeout_method = "thread") ------------------------
# pytest-timeout's own thread method prints stacks without saying which test hung; this one names it first,
# then dumps every thread's stack and ends the run (exit 1), as the plugin would.

_timers: dict[str, threading.Timer] = {}


def _expire(item: pytest.Item, timeout: float) -> None:
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    sys.stderr.flush()
    name = item.nodeid if not item.nodeid.startswith("::") else f"{item.path}{item.nodeid}"
    message = (
        f"\nerror: {name} was still running after {timeout:g} s (pytest-timeout backstop, "
        "pyproject.toml [tool.pytest.ini_options] timeout); every thread's stack follows\n"
    )
    os.write(2, message.encode())
    faulthandler.dump_traceback(file=2, all_threads=True)
    os._exit(1)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    if settings.method != "thread" or not settings.timeout or settings.timeout <= 0:
        return None  # pytest-timeout's own handling (signal method, or no timeout)
    timer = threading.Timer(settings.timeout, _expire, (item, settings.timeout))
    timer.daemon = True
    timer.name = "pytest-timeout backstop"
    _timers[item.nodeid] = timer
    timer.start()
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    timer = _timers.pop(item.nodeid, None)
    if timer is None:
        return None
    timer.cancel()
    return True


@pytest.fixture(autouse=True)
def _reap_started_servers() -> Any:
    """After each test, no server process it started is left running, whether the test passed or failed."""
    from tests.hook_support import reap_started

    yield
    reap_started()
