"""The device plugin's event log: one JSON object per line on the ``plugin`` logger, written to stderr.

Every notable event (serving, registration, health change, allocation, rescan trouble, stop) goes through
:func:`log_event`, so a later ``--log-format`` or a metrics counter per event has exactly one place to hook
into. Nothing here decides behaviour; callers never need the log to succeed.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TextIO

LOGGER = logging.getLogger("plugin")


def log_event(event: str, **fields: object) -> None:
    """Log ``{"event": event, **fields}`` as one compact JSON line (non-JSON values via ``str``)."""
    if LOGGER.isEnabledFor(logging.INFO):
        LOGGER.info(json.dumps({"event": event, **fields}, separators=(",", ":"), default=str))


def configure_logging(stream: TextIO | None = None) -> None:
    """Send the ``plugin`` logger's lines, bare, to ``stream`` (default stderr, where the kubelet collects them)."""
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.handlers[:] = [handler]
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False
