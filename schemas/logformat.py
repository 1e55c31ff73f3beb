"""The log line both components write: one event per line, as JSON (the default) or as readable text.

The device plugin and the hook sidecar are separate programs that must never import each other, yet a log
pipeline (or a person running ``kubectl logs``) should read their lines the same way. So the line's shape is
a shared contract and lives here, with the rest of what both sides share:

- ``json``: one compact object per line, ``{"time", "level", "component", "event", **fields}``; ``time`` is
  RFC 3339 UTC with milliseconds (``2026-11-30T06:20:01.123Z``), ``level`` lower case (``info``,
  ``warning``, ``error``);
- ``text``: ``2026-11-30T06:20:01.123Z INFO plugin registered resource=nvidia.com/X endpoint=kubevirt-X.sock``;
  a value is written bare when it is a plain word, JSON-quoted otherwise (spaces, quotes, ``=``, newlines),
  and lists, mappings, numbers, booleans and ``null`` as compact JSON.

Each component's logging module (``plugin.log``, ``launcher_hook.service``) attaches the event name and its
fields to the ``logging.LogRecord`` (:func:`event_extra`) and installs :class:`EventFormatter` on its logger;
the record's message stays the old compact ``{"event", **fields}`` JSON, so code that reads records directly
(pytest's ``caplog``) sees what it always saw.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import re
import time
from collections.abc import Callable, Mapping
from typing import Literal, TextIO, get_args

LogFormat = Literal["json", "text"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
DEFAULT_LOG_FORMAT: LogFormat = "json"
RESERVED = ("time", "level", "component", "event")
"""Keys every JSON line starts with; a field of the same name is written as ``<name>_``."""

_EVENT = "kgp_event"
_FIELDS = "kgp_fields"
_BARE = re.compile(r"[A-Za-z0-9_.:/@+,\-\[\]()]+")


def event_extra(event: str, fields: Mapping[str, object]) -> dict[str, object]:
    """The ``extra=`` for a ``logging`` call that records ``event`` with ``fields``."""
    return {_EVENT: event, _FIELDS: dict(fields)}


class EventMessage:
    """The record's message: ``{"event": event, **fields}`` as compact JSON (what the logs held before formats).

    Rendered only when something asks (``LogRecord.getMessage()``: pytest's caplog, a plain formatter): the
    :class:`EventFormatter` writes from the fields, and a disabled level renders nothing.
    """

    __slots__ = ("event", "fields")

    def __init__(self, event: str, fields: Mapping[str, object]) -> None:
        self.event = event
        self.fields = fields

    def __str__(self) -> str:
        return json.dumps({"event": self.event, **self.fields}, separators=(",", ":"), default=str)


def event_message(event: str, fields: Mapping[str, object]) -> EventMessage:
    """The record's message for ``event`` (see :class:`EventMessage`)."""
    return EventMessage(event, fields)


def rfc3339(created: float) -> str:
    """``created`` (seconds since the epoch) as RFC 3339 UTC with milliseconds."""
    seconds = int(created)
    millis = min(int((created - seconds) * 1000), 999)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


def text_value(value: object) -> str:
    """One field's value in a text line: a plain word bare, anything else JSON-quoted or compact JSON."""
    if isinstance(value, str):
        return value if _BARE.fullmatch(value) else _compact(value)
    if value is None or isinstance(value, bool | int | float | list | tuple | dict):
        return _compact(value)
    return text_value(str(value))


class EventFormatter(logging.Formatter):
    """Formats a record as one ``json`` or ``text`` line for ``component``.

    Records logged without :func:`event_extra` (a stray ``logger.warning("...")``) become the event
    ``message`` with a ``message`` field, so nothing on the logger ever breaks the one-object-per-line rule.
    """

    def __init__(self, component: str, log_format: LogFormat = DEFAULT_LOG_FORMAT) -> None:
        super().__init__()
        if log_format not in LOG_FORMATS:
            raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
        self.component = component
        self.log_format: LogFormat = log_format

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, _EVENT, None)
        fields: dict[str, object]
        if isinstance(event, str):
            fields = dict(getattr(record, _FIELDS, {}))
        else:
            event, fields = "message", {"message": record.getMessage()}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        stamp = rfc3339(record.created)
        if self.log_format == "text":
            words = [stamp, record.levelname, self.component, event]
            words.extend(f"{key}={text_value(value)}" for key, value in fields.items())
            return " ".join(words)
        line: dict[str, object] = {
            "time": stamp,
            "level": record.levelname.lower(),
            "component": self.component,
            "event": event,
        }
        for key, value in fields.items():
            line[f"{key}_" if key in RESERVED else key] = value
        return _compact(line)


class _HandOver(logging.handlers.QueueHandler):
    """Puts the record on the queue as it is: formatting happens on the writer thread, not the caller's."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


def configure(
    logger: logging.Logger, component: str, log_format: LogFormat, stream: TextIO, *, background: bool = False
) -> Callable[[], None]:
    """Make ``logger`` write its events (INFO and up), formatted, to ``stream`` only (no propagation).

    With ``background``, a thread formats and writes the lines, so a server's request path (OnDefineDomain,
    Allocate) only hands the record over; call the returned function before exiting to write what is left.
    Without it, lines are written at once and the returned function does nothing.
    """
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EventFormatter(component, log_format))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not background:
        logger.handlers[:] = [handler]
        return lambda: None
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    writer = logging.handlers.QueueListener(records, handler)
    writer.start()
    logger.handlers[:] = [_HandOver(records)]

    def flush_and_stop() -> None:
        writer.stop()  # writes every record already queued, then ends the thread
        logger.handlers[:] = [handler]

    return flush_and_stop
