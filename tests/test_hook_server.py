"""The hook server driven as virt-launcher drives it: real gRPC clients over a unix socket in a temp dir."""

from __future__ import annotations

import json
import logging
import stat
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from lxml import etree

from launcher_hook.server import HOOK_NAME, HookServer
from launcher_hook.service import HookService
from launcher_hook.sources import EnvironFileSource, Loaded, ProcessEnvSource
from runtime.hook_api import HOOK_API_VERSIONS
from runtime.sockets import SocketInUse
from schemas.generated.kubevirt.hooks import (
    info_pb2,
    info_pb2_grpc,
)
from tests.hook_support import RTX_VAR, SEED_PCI, running_hook, seed_case, short_dir, unix_channel
from tests.libvirt_support import libvirt_verdict


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory / "hooks" / "gpu-hostdev.sock"


@pytest.fixture
def hook(socket_path: Path) -> Iterator[HookServer]:
    _, _, env = seed_case()
    with running_hook(HookService(ProcessEnvSource(env)), socket_path) as server:
        yield server


def define(socket_path: Path, domain: bytes, vmi: bytes, version: str = "v1alpha3") -> bytes:
    pb2, pb2_grpc = HOOK_API_VERSIONS[version]
    with unix_channel(socket_path) as channel:
        result = pb2_grpc.CallbacksStub(channel).OnDefineDomain(
            pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60
        )
    assert isinstance(result.domainXML, bytes)
    return result.domainXML


def status_of(socket_path: Path, domain: bytes, vmi: bytes, version: str = "v1alpha3") -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        define(socket_path, domain, vmi, version)
    error = caught.value
    assert isinstance(error, grpc.Call)
    return error.code(), error.details() or ""


def hostdevs(domain_xml: bytes) -> dict[str, str]:
    """alias → PCI address as ``DDDD:BB:SS.F`` of every PCI hostdev in the domain."""
    found = {}
    for hostdev in etree.fromstring(domain_xml).iterfind("devices/hostdev"):
        address = hostdev.find("source/address")
        alias = hostdev.find("alias")
        assert address is not None
        assert alias is not None
        numbers = [int(address.get(part, ""), 16) for part in ("domain", "bus", "slot", "function")]
        found[alias.get("name", "")] = "{:04x}:{:02x}:{:02x}.{:x}".format(*numbers)
    return found


def test_info_names_the_hook_points_and_all_three_versions(hook: HookServer, socket_path: Path) -> None:
    with unix_channel(socket_path) as channel:
        info = info_pb2_grpc.InfoStub(channel).Info(info_pb2.InfoParams(), timeout=10)
    assert info.name == HOOK_NAME
    assert list(info.versions) == ["v1alpha1", "v1alpha2", "v1alpha3"]
    assert [point.name for point in info.hookPoints] == ["OnDefineDomain", "Shutdown"]


@pytest.mark.parametrize("version", sorted(HOOK_API_VERSIONS))
def test_on_define_domain_adds_the_gpus_for_every_version(hook: HookServer, socket_path: Path, version: str) -> None:
    domain, vmi, _ = seed_case()
    result = define(socket_path, domain, vmi, version)
    assert hostdevs(result) == SEED_PCI
    original, new = etree.fromstring(domain), etree.fromstring(result)
    assert len(new.find("devices")) == len(original.find("devices")) + 2  # type: ignore[arg-type]
    report = libvirt_verdict(result, SEED_PCI)
    assert set(report.hostdevs) == set(SEED_PCI)


def test_socket_is_world_connectable_and_in_a_created_directory(hook: HookServer, socket_path: Path) -> None:
    mode = socket_path.lstat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o666


@pytest.mark.parametrize("version", ["v1alpha2", "v1alpha3"])
def test_pre_cloud_init_iso_returns_its_input(hook: HookServer, socket_path: Path, version: str) -> None:
    pb2, pb2_grpc = HOOK_API_VERSIONS[version]
    with unix_channel(socket_path) as channel:
        result = pb2_grpc.CallbacksStub(channel).PreCloudInitIso(
            pb2.PreCloudInitIsoParams(cloudInitNoCloudSource=b'{"userData":"x"}', vmi=b"{}", cloudInitData=b"\x00\x01"),
            timeout=10,
        )
    assert result.cloudInitNoCloudSource == b'{"userData":"x"}'
    assert result.cloudInitData == b"\x00\x01"


BILLION_LAUGHS = b"""<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]>
<domain type="kvm"><name>&lol2;</name><devices/></domain>"""
XXE = b"""<?xml version="1.0"?>
<!DOCTYPE domain [<!ENTITY x SYSTEM "file:///etc/passwd">]>
<domain type="kvm"><name>&x;</name><devices/></domain>"""


@pytest.mark.parametrize(
    ("domain", "vmi", "message"),
    [
        (b"this is not xml", None, "not well-formed XML"),
        (None, b"{not json", "VMI JSON is not valid JSON"),
        (BILLION_LAUGHS, None, "DOCTYPE"),
        (XXE, None, "DOCTYPE"),
        (b"<network/>", None, "expected <domain>"),
        (b"", None, "domain XML"),
    ],
)
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(
    hook: HookServer, socket_path: Path, domain: bytes | None, vmi: bytes | None, message: str
) -> None:
    good_domain, good_vmi, _ = seed_case()
    code, details = status_of(socket_path, domain if domain is not None else good_domain, vmi or good_vmi)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert message in details
    assert hostdevs(define(socket_path, good_domain, good_vmi)) == SEED_PCI


def test_missing_allocation_variable_is_invalid_argument_naming_it(socket_path: Path) -> None:
    domain, vmi, _ = seed_case()
    with running_hook(HookService(ProcessEnvSource({"PATH": "/bin"})), socket_path):
        code, details = status_of(socket_path, domain, vmi, "v1alpha1")
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert RTX_VAR in details
    assert "gpus[0]" in details


class FlakySource:
    """Fails with a bug-like exception on the first call, then works."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.calls = 0
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "flaky"

    def load(self, vmi_json: bytes | None, domain_xml: bytes | None = None) -> Loaded:
        with self._lock:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("boom")
        return Loaded(self.env, "flaky")

    def close(self) -> None:
        return None


def test_an_unexpected_fault_is_internal_and_the_server_keeps_serving(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    domain, vmi, env = seed_case()
    caplog.set_level(logging.INFO, logger="launcher_hook")
    with running_hook(HookService(FlakySource(env)), socket_path):
        code, details = status_of(socket_path, domain, vmi)
        assert code is grpc.StatusCode.INTERNAL
        assert "RuntimeError: boom" in details
        assert hostdevs(define(socket_path, domain, vmi)) == SEED_PCI
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "launcher_hook"]
    assert lines[0]["status"] == "INTERNAL"
    assert "RuntimeError: boom" in lines[0]["traceback"]
    assert lines[1]["status"] == "OK"


def test_an_unreadable_environ_file_is_failed_precondition(socket_path: Path) -> None:
    domain, vmi, _ = seed_case()
    missing = socket_path.parent.parent / "no-such-environ"
    with running_hook(HookService(EnvironFileSource(missing)), socket_path):
        code, details = status_of(socket_path, domain, vmi)
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert str(missing) in details


def test_one_structured_log_line_per_call(
    hook: HookServer, socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    domain, vmi, _ = seed_case()
    caplog.set_level(logging.INFO, logger="launcher_hook")
    define(socket_path, domain, vmi, "v1alpha2")
    status_of(socket_path, b"nope", vmi)
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "launcher_hook"]
    assert len(lines) == 2
    ok, bad = lines
    assert ok["event"] == "OnDefineDomain"
    assert ok["via"] == "grpc v1alpha2"
    assert ok["vmi"] == "cxl/vm-with-gpu"
    assert ok["gpus"] == SEED_PCI
    assert ok["source"] == "process env"
    assert ok["status"] == "OK"
    assert ok["duration_ms"] >= 0
    assert bad["status"] == "INVALID_ARGUMENT"
    assert bad["vmi"] == "cxl/vm-with-gpu"
    assert bad["gpus"] == {}
    assert "not well-formed" in bad["error"]


def test_48_concurrent_calls_are_all_correct(hook: HookServer, socket_path: Path) -> None:
    domain, vmi, _ = seed_case()
    versions = sorted(HOOK_API_VERSIONS)

    def call(index: int) -> tuple[int, bytes]:
        named = domain.replace(b"<name>cxl_vm-with-gpu</name>", f"<name>vm-{index}</name>".encode())
        return index, define(socket_path, named, vmi, versions[index % 3])

    with futures.ThreadPoolExecutor(max_workers=48) as pool:
        results = list(pool.map(call, range(48)))
    assert len(results) == 48
    for index, result in results:
        root = etree.fromstring(result)
        assert root.findtext("name") == f"vm-{index}"
        assert hostdevs(result) == SEED_PCI


def test_shutdown_requests_stop_and_stopping_removes_the_socket(socket_path: Path) -> None:
    _, _, env = seed_case()
    server = HookServer(socket_path, HookService(ProcessEnvSource(env)))
    server.start()
    try:
        with unix_channel(socket_path) as channel:
            pb2, pb2_grpc = HOOK_API_VERSIONS["v1alpha3"]
            pb2_grpc.CallbacksStub(channel).Shutdown(pb2.ShutdownParams(), timeout=10)
        assert server.stop_requested
        server.wait()  # returns at once
    finally:
        server.stop(grace=0.5)
    assert not socket_path.exists()


def test_a_stale_socket_is_replaced(socket_path: Path) -> None:
    import socket

    socket_path.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(socket_path))
    stale.close()  # the file stays, nobody listens
    domain, vmi, env = seed_case()
    with running_hook(HookService(ProcessEnvSource(env)), socket_path):
        assert hostdevs(define(socket_path, domain, vmi)) == SEED_PCI
    assert not socket_path.exists()


def test_a_non_socket_in_the_way_is_refused(socket_path: Path) -> None:
    socket_path.parent.mkdir(parents=True)
    socket_path.write_text("keep me")
    server = HookServer(socket_path, HookService(ProcessEnvSource({})))
    with pytest.raises(SocketInUse, match="not a socket"):
        server.start()
    assert socket_path.read_text() == "keep me"


def test_a_too_long_socket_path_is_refused_clearly(socket_path: Path) -> None:
    server = HookServer(socket_path.parent / ("x" * 120) / "s.sock", HookService(ProcessEnvSource({})))
    with pytest.raises(SocketInUse, match="longer than 107 bytes"):
        server.start()


def test_a_huge_error_is_cut_in_the_log_line(caplog: pytest.LogCaptureFixture) -> None:
    from launcher_hook.service import MAX_LOGGED_ERROR, HookFault, HookService
    from launcher_hook.sources import ProcessEnvSource

    gpus = [{"name": "g" * 100_000, "deviceName": "example.com/r"}]  # its name goes into the message
    vmi = json.dumps({"spec": {"domain": {"devices": {"gpus": gpus}}}}).encode()
    service = HookService(ProcessEnvSource({}))
    with caplog.at_level("INFO", logger="launcher_hook"), pytest.raises(HookFault) as fault:
        service.define_domain(b"<domain/>", vmi, via="test")
    assert len(fault.value.message) > MAX_LOGGED_ERROR
    logged = json.loads(caplog.records[-1].getMessage())
    assert logged["error"].endswith(f"... ({len(fault.value.message)} characters)")
    assert len(logged["error"]) < MAX_LOGGED_ERROR + 40


def test_serve_asks_glibc_for_at_most_two_malloc_arenas(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve`` asks glibc (``mallopt(M_ARENA_MAX, 2)``) before its worker threads start: eight threads would
    each get an arena keeping what it freed."""
    import ctypes

    from launcher_hook import server

    asked: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, parameter: int, value: int) -> int:
            asked.append((parameter, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    assert server.limit_malloc_arenas() is True
    assert asked == [(-8, 2)]  # glibc's M_ARENA_MAX
