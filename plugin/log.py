"""The device plugin's event log: one line per event on the ``plugin`` logger, written to stderr.

Every notable event (serving, registration, health change, allocation, rescan trouble, stop) goes through
:func:`log_event`, the one place that decides an event's level; :func:`runtime.logs.configure_logging` picks
the line format (``--log-format json|text``, shared with the hook). Nothing here
decides behaviour; callers never need the log to succeed.
"""

from __future__ import annotations

import logging

from runtime.logs import component_logger
from schemas.logformat import log_event_on

COMPONENT = "plugin"
LOGGER = component_logger(COMPONENT)
"""Silent until ``serve`` configures it (:func:`runtime.logs.configure_logging`); xmlgen and tests stay quiet."""

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
    "dra_prepare_refused": logging.WARNING,
    "dra_unprepare_failed": logging.WARNING,
    "dra_publish_failed": logging.WARNING,
    "dra_restore_failed": logging.ERROR,
    "dra_checkpoint_damaged": logging.ERROR,
    "dra_checkpoint_unwritable": logging.ERROR,
    "dra_rebuild_failed": logging.ERROR,
    "dra_internal_error": logging.ERROR,
}
"""Events above INFO; every other event is INFO."""


def log_event(event: str, **fields: object) -> None:
    """Log ``event`` with ``fields`` (non-JSON values are written via ``str``) at the event's level.

    ``log_event_on`` makes the record and hands it to the logger's handlers directly: ``Logger.log`` would
    first walk the stack for the caller's file and line, which no line format here writes (a sixth of the
    cost on Allocate's path).
    """
    level = LEVELS.get(event, logging.INFO)
    log_event_on(LOGGER, level, event, fields)
