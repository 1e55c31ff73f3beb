"""Log setup for a component, with one signature for every command (the plugin, the hook, the shim).

Each component logs on the :mod:`logging` logger named after it (``plugin``, ``launcher_hook``), one event per
line in the format :mod:`schemas.logformat` writes. Commands call :func:`configure_logging` once at start and
the returned function before exiting (it writes lines still queued when ``background`` is on).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TextIO

from schemas.logformat import DEFAULT_LOG_FORMAT, LogFormat, configure


def component_logger(component: str) -> logging.Logger:
    """The logger of ``component``; silent until configured (xmlgen and tests: no "last resort" lines)."""
    logger = logging.getLogger(component)
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


def configure_logging(
    component: str,
    log_format: LogFormat = DEFAULT_LOG_FORMAT,
    stream: TextIO | None = None,
    *,
    background: bool = False,
) -> Callable[[], None]:
    """Send ``component``'s log lines in ``log_format`` to ``stream`` (default stderr, which the kubelet or
    virt-launcher's sidecar-shim collects); ``background`` writes them from a thread, off the request paths.
    Returns the function that writes what is left (call it before exiting)."""
    return configure(
        logging.getLogger(component),
        component,
        log_format,
        sys.stderr if stream is None else stream,
        background=background,
    )
