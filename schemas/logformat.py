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

import contextlib
import json
import logging
import math
import os
import queue
import re
import select
import threading
import time
from collections.abc import Callable, Mapping
from typing import Literal, TextIO, get_args

LogFormat = Literal["json", "text"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
DEFAULT_LOG_FORMAT: LogFormat = "json"
RESERVED = ("time", "level", "component", "event")
"""Keys every JSON line starts with; a field of the same name is written as ``<name>_``."""
_RESERVED_SET = frozenset(RESERVED)

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
        return _compact({"event": self.event, **self.fields})


def event_message(event: str, fields: Mapping[str, object]) -> EventMessage:
    """The record's message for ``event`` (see :class:`EventMessage`)."""
    return EventMessage(event, fields)


def log_event_on(logger: logging.Logger, level: int, event: str, fields: Mapping[str, object]) -> None:
    """Log ``event`` with ``fields`` on ``logger`` at ``level``: what ``logger.log(level, event_message(...),
    extra=event_extra(...))`` does, without ``logging``'s walk up the stack for the caller's file and line
    (no format here prints them; it was a good part of a log call's cost on the request paths).

    When the logger's one handler is the background hand-over (:func:`configure` with ``background``) and
    nothing else would see a record (no filter, no propagation), no ``LogRecord`` is built: the time, level,
    event and ``fields`` go on the queue as a tuple and the writer thread formats the same line from them.
    ``fields`` is then kept as it is (the callers pass a fresh ``**fields`` dict)."""
    if logger.isEnabledFor(level):
        handlers = logger.handlers
        if len(handlers) == 1 and not logger.propagate and not logger.filters:
            handler = handlers[0]
            if type(handler) is _BoundedHandOver and not handler.filters and level >= handler.level:
                handler.hand_over((time.time(), level, event, fields))
                return
        message, extra = EventMessage(event, fields), event_extra(event, fields)
        record = logger.makeRecord(logger.name, level, _EVENT_SOURCE, 0, message, (), None, None, extra)
        logger.handle(record)


_EVENT_SOURCE = "(event)"
"""The ``pathname`` of records logged by :func:`log_event_on` (they carry no caller's file and line)."""
_stamps = threading.local()


def rfc3339(created: float) -> str:
    """``created`` (seconds since the epoch) as RFC 3339 UTC with milliseconds."""
    seconds = int(created)
    millis = min(int((created - seconds) * 1000), 999)
    last: tuple[int, str] | None = getattr(_stamps, "last", None)  # one strftime per second and thread
    if last is None or last[0] != seconds:
        last = _stamps.last = (seconds, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)))
    return f"{last[1]}.{millis:03d}Z"


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)
"""One encoder for every line (``json.dumps`` with these options builds a new one per call)."""


def _compact(value: object) -> str:
    return _ENCODER.encode(value)


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
        self._component = _compact(component)

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, _EVENT, None)
        fields: dict[str, object]
        if isinstance(event, str):
            fields = dict(getattr(record, _FIELDS, {}))
        else:
            event, fields = "message", {"message": record.getMessage()}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return self.format_event(record.created, record.levelname, event, fields)

    def format_event(self, created: float, level_name: str, event: str, fields: Mapping[str, object]) -> str:
        """The line for ``event`` with ``fields`` logged at ``created`` (seconds since the epoch), level
        ``level_name`` (``INFO``): what :meth:`format` writes for a record carrying them."""
        stamp = rfc3339(created)
        if self.log_format == "text":
            words = [stamp, level_name, self.component, event]
            words.extend(f"{key}={text_value(value)}" for key, value in fields.items())
            return " ".join(words)
        if type(fields) is dict and not _RESERVED_SET.intersection(fields):
            # The same text as the dict below, without building it: the four keys, then the fields' object.
            head = f'{{"time":"{stamp}","level":{_compact(level_name.lower())},"component":{self._component},"event":'
            body = _compact(fields)
            return f"{head}{_compact(event)}{',' if len(body) > 2 else ''}{body[1:]}"
        line: dict[str, object] = {
            "time": stamp,
            "level": level_name.lower(),
            "component": self.component,
            "event": event,
        }
        for key, value in fields.items():
            line[f"{key}_" if key in RESERVED else key] = value
        return _compact(line)


LOG_QUEUE_LINES = 1_000
"""Most log records waiting for the background writer; more are dropped and counted (a stderr nobody drains
must not grow the process: it took the hook ~60 MB per 5,000 failing calls)."""
LOG_FLUSH_SECONDS = 2.0
"""Longest the flush at exit waits for the writer, so SIGTERM ends the process even if stderr is a full pipe."""
LOG_LINGER_SECONDS = 0.05
"""Least time between two writes of the background writer: a line that comes within it of the last write
waits for the rest of it, and the lines that gathered meanwhile are written in one go; a line after a quiet
spell is written at once. In a burst of calls (Allocates back to back) the writer so takes the interpreter lock
once per slice rather than once per line, and does not hold up the calls (it cost the plugin's Allocate ~0.2 ms
of its ~1.3 ms round trip on two busy cores). Each line keeps the time it was logged at; the flush at exit does
not wait."""
LOG_BATCH_LINES = 64
"""Most lines the writer takes off the queue for one write: beyond the queue's bound, at most this many more
lines wait in memory for a full stderr."""
_POLL_SECONDS = 0.1
_PIPE_BUF = 4096  # writes of at most this many bytes to a pipe that poll() calls writable never block
DROPPED_EVENT = "log_lines_dropped"


class _LineSink:
    """Writes whole lines to ``stream`` without ever blocking for longer than the caller allows.

    A stream with a file descriptor (stderr) is written with ``os.write`` in pieces of at most ``PIPE_BUF``
    bytes, each after ``poll`` says the descriptor is writable: a full pipe makes a write wait in slices of
    100 ms that give up at the caller's deadline, instead of blocking the thread (and the exit that waits for
    it). Other streams (``io.StringIO``, pytest's capture) are written as they are.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._fd: int | None = None
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            return
        with contextlib.suppress(OSError, ValueError):
            stream.flush()  # whatever the process wrote before goes first
        self._fd = fd
        self._poller = select.poll()
        self._poller.register(fd, select.POLLOUT)

    def write(self, line: str, deadline: float | None) -> bool:
        """Write ``line`` and a newline; False if ``deadline`` (``time.monotonic``) passed first or it failed."""
        if self._fd is None:
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                return False
            return True
        data = memoryview((line + "\n").encode("utf-8", "backslashreplace"))
        while data:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            try:
                if not self._poller.poll(_POLL_SECONDS * 1000):
                    continue
                written = os.write(self._fd, data[:_PIPE_BUF])
            except InterruptedError:
                continue
            except OSError:
                return False  # stderr closed (EPIPE) or gone: nothing more can be written
            data = data[written:]
        return True


_Event = tuple[float, int, str, Mapping[str, object]]
"""An event handed to the writer thread without a ``LogRecord``: (time.time(), level, event, fields)."""
_Queued = logging.LogRecord | _Event


class _BoundedHandOver(logging.Handler):
    """Puts the record (or a bare :data:`_Event`) on a bounded queue as it is (formatting happens on the writer
    thread); counts what a full queue drops."""

    def __init__(self, records: queue.SimpleQueue[_Queued], limit: int) -> None:
        super().__init__()
        self._records = records
        self.limit = limit
        self._lock = threading.Lock()
        self._dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.hand_over(record)

    def hand_over(self, item: _Queued) -> None:
        # A SimpleQueue (its put and get are C, where Queue's are Python with a Condition) bounded under one
        # lock, so the bound is exact.
        with self._lock:
            if self._records.qsize() < self.limit:
                self._records.put(item)
            else:
                self._dropped += 1

    def take_dropped(self) -> int:
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        return dropped


class _SinkHandler(logging.Handler):
    """Formats and writes a record at once through a :class:`_LineSink`, waiting at most ``seconds`` per line."""

    def __init__(self, sink: _LineSink, formatter: logging.Formatter, seconds: float | None) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.sink = sink
        self._seconds = seconds

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.sink.write(line, None if self._seconds is None else time.monotonic() + self._seconds)


class _Writer:
    """The background thread: takes records off the queue, formats and writes them, and reports drops."""

    def __init__(
        self,
        logger: logging.Logger,
        handover: _BoundedHandOver,
        records: queue.SimpleQueue[_Queued],
        out: _SinkHandler,
        formatter: EventFormatter,
    ) -> None:
        self._logger = logger
        self._handover = handover
        self._records = records
        self._out = out
        self._formatter = formatter
        self._stop = threading.Event()
        self._deadline: float | None = None
        self._last_write = -math.inf
        self._thread = threading.Thread(target=self._run, name=f"log-writer-{logger.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _write(self, item: _Queued) -> None:
        self._write_all([item])

    def _line(self, item: _Queued) -> str | None:
        """The line of a queued item (an event tuple from the fast path, or a record); None when it cannot be
        formatted (logging's handler reports it, as it would the record's)."""
        try:
            if isinstance(item, tuple):
                created, level, event, fields = item
                return self._formatter.format_event(created, logging.getLevelName(level), event, fields)
            return self._out.format(item)
        except Exception:
            if isinstance(item, tuple):  # the record it would have been, for logging's error report
                created, level, event, fields = item
                item = self._logger.makeRecord(
                    self._logger.name,
                    level,
                    _EVENT_SOURCE,
                    0,
                    EventMessage(event, fields),
                    (),
                    None,
                    None,
                    event_extra(event, fields),
                )
            self._out.handleError(item)
            return None

    def _write_all(self, items: list[_Queued]) -> None:
        """Format ``items`` and write their lines in one go (one that cannot be formatted is left out)."""
        lines = [line for line in map(self._line, items) if line is not None]
        if lines:
            self._out.sink.write("\n".join(lines), self._deadline)

    def _take_waiting(self, first: _Queued) -> list[_Queued]:
        """``first`` and the items queued behind it, at most :data:`LOG_BATCH_LINES` in all: what the writer
        holds while stderr is full counts against the bound on waiting lines too."""
        items = [first]
        while len(items) < LOG_BATCH_LINES:
            try:
                items.append(self._records.get_nowait())
            except queue.Empty:
                break
        return items

    def _report_drops(self) -> None:
        dropped = self._handover.take_dropped()
        if dropped:
            fields = {"dropped": dropped, "reason": f"more than {self._handover.limit} lines waiting to be written"}
            record = self._logger.makeRecord(
                self._logger.name,
                logging.WARNING,
                __file__,
                0,
                event_message(DROPPED_EVENT, fields),
                (),
                None,
                extra=event_extra(DROPPED_EVENT, fields),
            )
            self._write(record)

    def _run(self) -> None:
        while True:
            try:
                item = self._records.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                self._report_drops()
                if self._stop.is_set():
                    return
                continue
            pause = self._last_write + LOG_LINGER_SECONDS - time.monotonic()
            if pause > 0 and not self._stop.is_set():
                self._stop.wait(pause)  # in a burst: let its lines gather; a flush at exit ends the wait
            self._write_all(self._take_waiting(item))
            self._last_write = time.monotonic()
            self._report_drops()
            if self._deadline is not None and time.monotonic() >= self._deadline:
                return  # out of time at exit: the rest is left unwritten

    def stop(self, seconds: float) -> None:
        """Write what is queued, for at most ``seconds``, then end the thread (abandoned if it cannot finish)."""
        self._deadline = time.monotonic() + seconds
        self._stop.set()
        self._thread.join(seconds + _POLL_SECONDS * 2)


def configure(
    logger: logging.Logger, component: str, log_format: LogFormat, stream: TextIO, *, background: bool = False
) -> Callable[[], None]:
    """Make ``logger`` write its events (INFO and up), formatted, to ``stream`` only (no propagation).

    With ``background``, a thread formats and writes the lines, so a server's request path (OnDefineDomain,
    Allocate) only hands the record over to a queue of at most ``LOG_QUEUE_LINES`` records; when it is full,
    records are dropped and a ``log_lines_dropped`` line says how many. Writes never block the thread for good
    (a full stderr pipe is waited on in slices). Call the returned function before exiting: it writes what is
    left for at most ``LOG_FLUSH_SECONDS``, then gives up, so an undrained stderr cannot hold the exit.
    Without ``background``, lines are written at once and the returned function does nothing.
    """
    formatter = EventFormatter(component, log_format)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not background:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(formatter)
        logger.handlers[:] = [handler]
        return lambda: None
    sink = _LineSink(stream)
    records: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
    handover = _BoundedHandOver(records, LOG_QUEUE_LINES)
    writer = _Writer(logger, handover, records, _SinkHandler(sink, formatter, None), formatter)
    writer.start()
    logger.handlers[:] = [handover]

    def flush_and_stop() -> None:
        writer.stop(LOG_FLUSH_SECONDS)
        # Later lines (there should be none) are written at once, each given up after LOG_FLUSH_SECONDS.
        logger.handlers[:] = [_SinkHandler(sink, formatter, LOG_FLUSH_SECONDS)]

    return flush_and_stop
