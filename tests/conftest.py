"""Shared pytest setup: paths to fixtures and the ``--regen-golden`` switch."""

from __future__ import annotations

from pathlib import Path

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
