"""The device plugin's event log: one line per event on the ``plugin`` logger, written to stderr.

Every notable event (serving, registration, health change, allocation, rescan trouble, stop) goes through
:func:`log_event`, the one place that decides an event's level; :func:`configure_logging` picks the line
format (``--log-format json|text``, shared with the hook through :mod:`schemas.logformat`). Nothing here
decides behaviour; callers never need the log to succeed.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TextIO

from schemas.logformat import DEFAULT_LOG_FORMAT, LogFormat, configure, event_extra, event_message

LOGGER = logging.getLogger("plugin")
LOGGER.addHandler(logging.NullHandler())  # unconfigured (xmlgen simulate, tests): no "last resort" stderr lines
COMPONENT = "plugin"

LEVELS: dict[str, int] = {
    "warning": logging.WARNING,
    "scan_problem": logging.WARNING,
    "watch_failed": logging.WARNING,
    "registration_failed": logging.WARNING,
    "allocate_refused": logging.WARNING,
    "socket_gone": logging.WARNING,
    "serve_failed": logging.ERROR,
    "stream_replaced": logging.WARNING,
    "list_and_watch_failed": logging.ERROR,
    "kubelet_dir_unusable": logging.ERROR,
    "metrics_failed": logging.ERROR,
}
"""Events above INFO; every other event is INFO."""


def log_event(event: str, **fields: object) -> None:
    """Log ``event`` with ``fields`` (non-JSON values are written via ``str``) at the event's level."""
    level = LEVELS.get(event, logging.INFO)
    if LOGGER.isEnabledFor(level):
        LOGGER.log(level, event_message(event, fields), extra=event_extra(event, fields))


def configure_logging(
    stream: TextIO | None = None, log_format: LogFormat = DEFAULT_LOG_FORMAT, *, background: bool = False
) -> Callable[[], None]:
    """Send the ``plugin`` logger's lines in ``log_format`` to ``stream`` (default stderr, where the kubelet
    collects them); ``background`` writes them from a thread, off the Allocate path. Returns the function
    that writes what is left (call it before exiting)."""
    return configure(LOGGER, COMPONENT, log_format, sys.stderr if stream is None else stream, background=background)
