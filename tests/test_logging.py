"""Both components' log lines, ``--log-format json|text``, as the programs write them on stderr.

``gpu-device-plugin serve`` (against the kubelet stand-in), ``launcher-hook serve`` (called over its socket)
and the ``onDefineDomain`` shim run as processes; JSON lines must each parse with ``time`` (RFC 3339 UTC),
``level``, ``component`` and ``event``; text lines must read back (timestamp, level, component, event,
``key=value`` fields) to the same fields. The formatter's edge cases are checked on records directly.
"""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from launcher_hook import service
from plugin import log as plugin_log
from runtime.logs import configure_logging
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc
from schemas.logformat import EventFormatter, LogFormat, configure, event_extra, event_message, log_event_on, text_value
from simkit.fixture_nodes import NODE01
from simkit.kubelet_standin import KubeletStandIn
from tests.hook_support import seed_case, short_dir, unix_channel
from tests.plugin_support import WAIT, build_tree, plugin_env, serve_command
from tests.test_hook_cli import shim, start_serve

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
TEXT_HEAD = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (INFO|WARNING|ERROR) (\S+) (\w+)")
Line = dict[str, object]


@pytest.fixture
def base() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory


def utc(stamp: object) -> datetime:
    """``stamp`` parsed as RFC 3339; it must be UTC with a ``Z``."""
    assert isinstance(stamp, str) and stamp.endswith("Z"), stamp
    parsed = datetime.fromisoformat(stamp)
    assert parsed.utcoffset() is not None and parsed.utcoffset() == UTC.utcoffset(None), stamp
    return parsed


def json_lines(stderr: str, component: str) -> list[Line]:
    """Every stderr line as a JSON object with the envelope checked."""
    lines: list[Line] = []
    for text in stderr.splitlines():
        line = json.loads(text)
        assert isinstance(line, dict), text
        assert list(line)[:4] == ["time", "level", "component", "event"], text
        utc(line["time"])
        assert line["level"] in ("info", "warning", "error") and line["component"] == component, text
        lines.append(line)
    return lines


def text_line(text: str) -> Line:
    """A text line read back: ``{"time", "level", "component", "event", **fields}``."""
    head = TEXT_HEAD.match(text)
    assert head is not None, text
    stamp, level, component, event = head.groups()
    utc(stamp)
    line: Line = {"time": stamp, "level": level.lower(), "component": component, "event": event}
    rest, decoder = text[head.end() :], json.JSONDecoder()
    while rest:
        match = re.match(r" ([A-Za-z_]\w*)=", rest)
        assert match is not None, f"not a ' key=value' field at {rest!r} in {text!r}"
        rest = rest[match.end() :]
        if rest[:1] in ('"', "[", "{"):
            value, end = decoder.raw_decode(rest)
        else:  # a bare word: a literal or a number if it reads as one, else the string itself
            end = len(rest.split(" ", 1)[0])
            try:
                value = json.loads(rest[:end])
            except ValueError:
                value = rest[:end]
        line[match.group(1)] = value
        rest = rest[end:]
    return line


def text_lines(stderr: str, component: str) -> list[Line]:
    lines = [text_line(text) for text in stderr.splitlines()]
    assert all(line["component"] == component for line in lines)
    return lines


def fields(line: Line) -> Line:
    return {key: value for key, value in line.items() if key not in ("time", "level", "component")}


def by_event(lines: list[Line], event: str) -> Line:
    found = [line for line in lines if line["event"] == event]
    assert found, f"no {event!r} in {[line['event'] for line in lines]}"
    return found[0]


# -- gpu-device-plugin serve --------------------------------------------------------------------------------


def run_plugin(base: Path, *args: str, **env: str) -> str:
    """Serve node01 until registered, then SIGTERM; the process's stderr."""
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    log = base / "plugin.log"
    with KubeletStandIn(kubelet_dir) as kubelet, log.open("wb") as stderr:
        process = subprocess.Popen(
            serve_command(root, kubelet_dir, "--scan-interval", "0.2", *args),
            env=plugin_env(**env),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            kubelet.wait_for_registration(TU106)
            kubelet.allocate(TU106, ["0000:86:00.0"])
            # The stand-in counts a registration when Register arrives; the plugin logs it once Register has
            # returned. A SIGTERM in between (a loaded machine) would stop it first: wait for the line.
            deadline = time.monotonic() + WAIT
            while "registered" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            assert process.wait(WAIT) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return log.read_text()


def test_plugin_logs_json_lines_by_default(base: Path) -> None:
    lines = json_lines(run_plugin(base), "plugin")
    events = [line["event"] for line in lines]
    for expected in ("starting", "serving", "registered", "allocate", "stopped", "signal"):
        assert expected in events, events
    assert fields(by_event(lines, "registered")) == {
        "event": "registered",
        "resource": TU106,
        "endpoint": "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock",
    }
    assert fields(by_event(lines, "allocate")) == {"event": "allocate", "resource": TU106, "ids": ["0000:86:00.0"]}
    assert all(line["level"] == "info" for line in lines)
    stamps = [utc(line["time"]) for line in lines]
    assert stamps == sorted(stamps)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_plugin_logs_text_lines(base: Path, how: str) -> None:
    args, env = (("--log-format", "text"), {}) if how == "flag" else ((), {"GPU_PLUGIN_LOG_FORMAT": "text"})
    stderr = run_plugin(base, *args, **env)
    assert not stderr.lstrip().startswith("{")
    lines = text_lines(stderr, "plugin")
    registered = next(text for text in stderr.splitlines() if " registered " in text)
    assert registered.split(" ", 1)[1] == (
        f"INFO plugin registered resource={TU106} endpoint=kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
    )
    assert fields(by_event(lines, "allocate")) == {"event": "allocate", "resource": TU106, "ids": ["0000:86:00.0"]}
    starting = by_event(lines, "starting")
    assert starting["scan_interval"] == 0.2 and isinstance(starting["pid"], int)


def test_plugin_refuses_an_unknown_log_format(base: Path) -> None:
    command = serve_command(base, base / "kubelet", "--log-format", "xml")
    done = subprocess.run(command, env=plugin_env(), capture_output=True, timeout=30, check=False)
    assert done.returncode == 2 and b"'xml' is not one of" in done.stderr, done.stderr


@pytest.fixture
def plugin_logger() -> Iterator[io.StringIO]:
    """The plugin logger configured onto a buffer; its earlier state restored after (caplog tests need it)."""
    logger = plugin_log.LOGGER
    saved = (logger.handlers[:], logger.level, logger.propagate)
    stream = io.StringIO()
    try:
        yield stream
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved


def test_plugin_event_levels(plugin_logger: io.StringIO) -> None:
    configure_logging(plugin_log.COMPONENT, "json", plugin_logger)
    plugin_log.log_event("scan_problem", error="sysfs went away")
    plugin_log.log_event("serve_failed", resource=TU106, error="bind")
    plugin_log.log_event("health_changed", resource=TU106, device="0000:86:00.0", health="Unhealthy")
    levels = [(line["event"], line["level"]) for line in json_lines(plugin_logger.getvalue(), "plugin")]
    assert levels == [("scan_problem", "warning"), ("serve_failed", "error"), ("health_changed", "info")]


# -- launcher-hook serve and the shim -----------------------------------------------------------------------


def run_hook(socket_path: Path, *args: str, **env: str) -> str:
    """``launcher-hook serve``: one good and one refused OnDefineDomain, then Shutdown; its stderr."""
    domain, vmi, _ = seed_case()
    process = start_serve(socket_path, *args, **env)
    try:
        with unix_channel(socket_path) as channel:
            stub = v1alpha3_pb2_grpc.CallbacksStub(channel)
            stub.OnDefineDomain(v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60)
            with pytest.raises(grpc.RpcError) as caught:
                stub.OnDefineDomain(v1alpha3_pb2.OnDefineDomainParams(domainXML=b"<domain", vmi=vmi), timeout=60)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            stub.Shutdown(v1alpha3_pb2.ShutdownParams(), timeout=10)
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0
    return err.decode()


def test_hook_serve_logs_json_lines_by_default(base: Path) -> None:
    lines = json_lines(run_hook(base / "hook.sock"), "launcher_hook")
    assert [(line["event"], line["level"]) for line in lines] == [
        ("serving", "info"),
        ("OnDefineDomain", "info"),
        ("OnDefineDomain", "warning"),
        ("stopped", "info"),
    ]
    ok, refused = lines[1], lines[2]
    assert ok["status"] == "OK" and ok["gpus"] == {"ua-gpu0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0"}
    assert refused["status"] == "INVALID_ARGUMENT" and "not well-formed" in str(refused["error"])


@pytest.mark.parametrize("how", ["flag", "env"])
def test_hook_serve_logs_text_lines(base: Path, how: str) -> None:
    args, env = (("--log-format", "text"), {}) if how == "flag" else ((), {"LAUNCHER_HOOK_LOG_FORMAT": "text"})
    stderr = run_hook(base / "hook.sock", *args, **env)
    lines = text_lines(stderr, "launcher_hook")
    assert [(line["event"], line["level"]) for line in lines] == [
        ("serving", "info"),
        ("OnDefineDomain", "info"),
        ("OnDefineDomain", "warning"),
        ("stopped", "info"),
    ]
    assert lines[1]["gpus"] == {"ua-gpu0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0"}
    assert lines[1]["vmi"] == "cxl/vm-with-gpu" and lines[1]["via"] == "grpc v1alpha3"
    assert lines[2]["status"] == "INVALID_ARGUMENT" and "not well-formed" in str(lines[2]["error"])
    assert lines[0]["mode"] == "0666"


@pytest.mark.parametrize("log_format", [None, "json", "text"])
def test_shim_logs_in_the_format_of_its_env_variable(log_format: str | None) -> None:
    domain, vmi, env = seed_case()
    if log_format is not None:
        env = {**env, "LAUNCHER_HOOK_LOG_FORMAT": log_format}
    done = shim("--vmi", vmi.decode(), "--domain", domain.decode(), **env)
    assert done.returncode == 0, done.stderr.decode()
    stderr = done.stderr.decode()
    parse = text_lines if log_format == "text" else json_lines
    (line,) = parse(stderr, "launcher_hook")
    assert (line["event"], line["level"], line["via"], line["status"]) == (
        "OnDefineDomain",
        "info",
        "onDefineDomain",
        "OK",
    )
    refused = shim("--vmi", vmi.decode(), "--domain", "<domain", **env)
    assert refused.returncode == 1 and refused.stdout == b""
    log_text, error = refused.stderr.decode().splitlines()
    (line,) = parse(log_text, "launcher_hook")
    assert (line["level"], line["status"]) == ("warning", "INVALID_ARGUMENT")
    assert error.startswith("error: INVALID_ARGUMENT: ")


def test_shim_refuses_an_unknown_log_format() -> None:
    domain, vmi, env = seed_case()
    done = shim("--vmi", vmi.decode(), "--domain", domain.decode(), LAUNCHER_HOOK_LOG_FORMAT="yaml", **env)
    assert done.returncode == 2 and done.stdout == b""
    assert "'yaml' is not one of" in done.stderr.decode()


@pytest.fixture
def hook_logger() -> Iterator[io.StringIO]:
    logger = service.LOGGER
    saved = (logger.handlers[:], logger.level, logger.propagate)
    try:
        yield io.StringIO()
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved


def test_hook_internal_error_is_logged_at_error_with_its_traceback(hook_logger: io.StringIO) -> None:
    class Broken:
        def describe(self) -> str:
            return "broken source"

        def load(self, vmi_json: bytes, domain_xml: bytes | None = None) -> object:
            raise RuntimeError("boom")

        def close(self) -> None:
            pass

    configure_logging(service.COMPONENT, "text", hook_logger)
    domain, vmi, _ = seed_case()
    with pytest.raises(service.HookFault):
        service.HookService(Broken()).define_domain(domain, vmi, via="test")  # type: ignore[arg-type]
    (line,) = text_lines(hook_logger.getvalue(), "launcher_hook")
    assert (line["level"], line["status"]) == ("error", "INTERNAL")
    assert "RuntimeError: boom" in str(line["traceback"])


# -- the formatter ------------------------------------------------------------------------------------------


def record(event: str | None, values: Mapping[str, object], level: int = logging.INFO) -> logging.LogRecord:
    extra = event_extra(event, values) if event is not None else {}
    made = logging.makeLogRecord({"name": "x", "levelno": level, "levelname": logging.getLevelName(level)})
    made.msg = "stray %s"
    made.args = ("message",)
    made.created = 1796019601.5
    made.__dict__.update(extra)
    return made


def test_formatter_json_and_text_for_the_same_record() -> None:
    values: dict[str, object] = {
        "resource": TU106,
        "error": 'a "quoted"\nsecond line',
        "ids": ["0000:86:00.0"],
        "count": 2,
        "ok": True,
        "none": None,
        "path": Path("/dev/vfio/30"),
        "empty": "",
    }
    made = record("registered", values)
    as_json = json.loads(EventFormatter("plugin", "json").format(made))
    assert as_json == {
        "time": "2026-11-30T06:20:01.500Z",
        "level": "info",
        "component": "plugin",
        "event": "registered",
        **values,
        "path": "/dev/vfio/30",
    }
    as_text = EventFormatter("plugin", "text").format(made)
    assert "\n" not in as_text
    assert as_text.startswith("2026-11-30T06:20:01.500Z INFO plugin registered resource=nvidia.com/TU106")
    assert text_line(as_text) == {**as_json, "level": "info"}


def test_formatter_keeps_reserved_names_and_stray_records_on_one_line() -> None:
    clash = json.loads(EventFormatter("plugin", "json").format(record("x", {"time": 1, "level": "l", "event": "e"})))
    assert clash["time"] == "2026-11-30T06:20:01.500Z" and clash["event"] == "x"
    assert (clash["time_"], clash["level_"], clash["event_"]) == (1, "l", "e")
    stray = json.loads(EventFormatter("launcher_hook", "json").format(record(None, {}, logging.WARNING)))
    assert (stray["event"], stray["message"], stray["level"]) == ("message", "stray message", "warning")
    try:
        raise ValueError("bad")
    except ValueError:
        failed = record("scan_problem", {}, logging.ERROR)
        failed.exc_info = sys.exc_info()
    text = EventFormatter("plugin", "text").format(failed)
    assert "\n" not in text and "ValueError: bad" in str(text_line(text)["exception"])
    with pytest.raises(ValueError, match="log format"):
        EventFormatter("plugin", "xml")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "written"),
    [
        ("nvidia.com/X", "nvidia.com/X"),
        ("0000:86:00.0", "0000:86:00.0"),
        ("two words", '"two words"'),
        ("a=b", '"a=b"'),
        ("", '""'),
        (["a"], '["a"]'),
        ({"k": 1}, '{"k":1}'),
        (None, "null"),
        (1.5, "1.5"),
    ],
)
def test_text_values(given: object, written: str) -> None:
    assert text_value(given) == written


def test_background_logging_formats_off_the_callers_thread_and_loses_nothing_at_flush() -> None:
    import threading

    from schemas.logformat import configure, event_extra, event_message

    formatted_on: list[str] = []

    class Where:
        """A field value that notes which thread turns it into text (the formatter does, via str())."""

        def __str__(self) -> str:
            formatted_on.append(threading.current_thread().name)
            return "here"

    logger = logging.getLogger("kgp-background-test")
    stream = io.StringIO()
    flush = configure(logger, "test", "json", stream, background=True)
    for number in range(500):
        fields = {"n": number, "where": Where()}
        logger.info(event_message("tick", fields), extra=event_extra("tick", fields))
    flush()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["n"] for line in lines] == list(range(500))
    assert {line["where"] for line in lines} == {"here"}
    assert len(formatted_on) == 500
    assert threading.current_thread().name not in formatted_on
    logger.info(event_message("after", {}), extra=event_extra("after", {}))  # after flush: written at once
    assert json.loads(stream.getvalue().splitlines()[-1])["event"] == "after"


def test_background_writer_writes_a_burst_of_lines_together() -> None:
    """A burst is written in few writes (the writer lingers, then takes what waits), all lines in order."""
    from schemas.logformat import configure, event_extra, event_message

    class Counting(io.StringIO):
        writes = 0

        def write(self, text: str) -> int:
            Counting.writes += 1
            return super().write(text)

    logger = logging.getLogger("kgp-burst-test")
    stream = Counting()
    flush = configure(logger, "test", "json", stream, background=True)
    for number in range(50):
        logger.info(event_message("tick", {"n": number}), extra=event_extra("tick", {"n": number}))
    flush()
    assert [json.loads(line)["n"] for line in stream.getvalue().splitlines()] == list(range(50))
    assert Counting.writes <= 10


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_background_event_without_a_record_writes_the_records_line(log_format: LogFormat) -> None:
    """``log_event_on`` hands a bare tuple to the background writer (no LogRecord on the request thread); the
    line is the one a record with the same time, level, event and fields formats to, off the caller's thread."""
    import threading

    formatted_on: list[str] = []

    class Where:
        def __str__(self) -> str:
            formatted_on.append(threading.current_thread().name)
            return "with space"

    logger = logging.getLogger(f"kgp-bare-event-{log_format}")
    stream = io.StringIO()
    flush = configure(logger, "test", log_format, stream, background=True)
    fields: dict[str, object] = {"vmi": "ml/big", "gpus": {"ua-gpu0": "0000:10:00.0"}, "time": 1, "w": Where()}
    log_event_on(logger, logging.WARNING, "OnDefineDomain", fields)
    flush()
    line = stream.getvalue().splitlines()[0]
    assert formatted_on and threading.current_thread().name not in formatted_on
    stamp = line[9:33] if log_format == "json" else line[:24]
    created = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    record = logging.LogRecord(logger.name, logging.WARNING, "x", 0, event_message("OnDefineDomain", fields), (), None)
    record.__dict__.update(event_extra("OnDefineDomain", fields))
    record.created = created + 0.0004  # the millisecond the line shows, away from a rounding edge
    assert line == EventFormatter("test", log_format).format(record)
    assert (json.loads(line)["level"] if log_format == "json" else line.split(" ")[1]) in ("warning", "WARNING")
