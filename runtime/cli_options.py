"""Click options every command shares; the only module of :mod:`runtime` that imports click.

``--log-format json|text`` appears on ``gpu-device-plugin serve``, ``launcher-hook serve`` and the
``onDefineDomain`` shim, each with its own component's env variable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from schemas.logformat import DEFAULT_LOG_FORMAT, LOG_FORMATS

F = TypeVar("F", bound=Callable[..., Any])


def log_format_option(envvar: str) -> Callable[[F], F]:
    """``--log-format json|text``, also read from ``envvar`` (``GPU_PLUGIN_LOG_FORMAT``, ``LAUNCHER_HOOK_…``)."""

    def decorate(function: F) -> F:
        return click.option(
            "--log-format",
            type=click.Choice(LOG_FORMATS),
            default=DEFAULT_LOG_FORMAT,
            show_default=True,
            envvar=envvar,
            show_envvar=True,
            help="Log lines on stderr: one JSON object each, or readable text.",
        )(function)

    return decorate
