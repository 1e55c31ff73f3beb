"""KubeVirt's plugin API (VEP 190) against the hook sidecar API: one builder, the same answers.

A ``DomainHookService`` client built from the published proto (``schemas/proto/kubevirt/hooks/plugins``,
checked against KubeVirt's field names and numbers in test_protos_generated.py) calls ``MutateDomain`` over a
real unix socket as virt-launcher does (``domain_type`` ``libvirt``, an invocation context); its domain must be
byte-identical to ``OnDefineDomain`` v1alpha3's for the same domain, VMI and allocation, and every refusal must
carry the same status code and message. ``--api`` decides what is registered: the others answer UNIMPLEMENTED.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import grpc
import pytest

from launcher_hook.allocation import parse_environ
from launcher_hook.builder import BuildOptions
from launcher_hook.cli import serve
from launcher_hook.server import (
    DEFAULT_PLUGIN_SOCKET,
    DEFAULT_SOCKET,
    MAX_MESSAGE_BYTES,
    PLUGIN_NAME,
    PLUGIN_SOCKET_DIR,
    HookApi,
    HookServer,
)
from launcher_hook.service import HookService
from launcher_hook.sources import ProcessEnvSource
from runtime.sockets import MAX_UNIX_SOCKET_PATH
from schemas.generated.kubevirt.hooks import info_pb2, info_pb2_grpc, v1alpha3_pb2, v1alpha3_pb2_grpc
from schemas.generated.kubevirt.hooks.plugins.v1alpha1 import api_pb2 as plugins_pb2
from schemas.generated.kubevirt.hooks.plugins.v1alpha1 import api_pb2_grpc as plugins_pb2_grpc
from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from tests.hook_support import SEED_PCI, seed_case, short_dir, unix_channel, wait_for_socket
from tests.test_hook_cli import finish, start_serve
from tests.test_hook_server import BILLION_LAUGHS, XXE, hostdevs

Call = Callable[[Path, bytes, bytes], bytes]


@contextmanager
def hook_server(api: HookApi, **kwargs: object) -> Iterator[tuple[HookServer, Path]]:
    _, _, env = seed_case()
    with short_dir() as directory:
        socket_path = directory / "hook.sock"
        server = HookServer(socket_path, HookService(ProcessEnvSource(env)), api=api, **kwargs)  # type: ignore[arg-type]
        server.start()
        try:
            yield server, socket_path
        finally:
            server.stop(grace=0.5)


@pytest.fixture(scope="module")
def both() -> Iterator[Path]:
    with hook_server("both") as (_, socket_path):
        yield socket_path


def mutate(
    socket_path: Path, domain: bytes, vmi: bytes, invocation: str = "Boot", domain_type: str = "libvirt"
) -> bytes:
    """As virt-launcher's sidecar hook applier calls: a new connection (its dial blocks until the connection is
    ready: ``wait_for_ready``; the socket file exists from bind, a moment before the server listens), one
    MutateDomain, a deadline."""
    request = plugins_pb2.MutateDomainRequest(
        domain_type=domain_type,
        domain=domain,
        vmi=vmi,
        sidecar_context=plugins_pb2.SidecarContext(invocation_context=invocation),
    )
    with unix_channel(socket_path) as channel:
        response = plugins_pb2_grpc.DomainHookServiceStub(channel).MutateDomain(
            request, timeout=30, wait_for_ready=True
        )
    assert isinstance(response.domain, bytes)
    return response.domain


def define(socket_path: Path, domain: bytes, vmi: bytes) -> bytes:
    with unix_channel(socket_path) as channel:
        result = v1alpha3_pb2_grpc.CallbacksStub(channel).OnDefineDomain(
            v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60, wait_for_ready=True
        )
    assert isinstance(result.domainXML, bytes)
    return result.domainXML


def status(call: Call, socket_path: Path, domain: bytes, vmi: bytes) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(socket_path, domain, vmi)
    error = caught.value
    assert isinstance(error, grpc.Call)
    return error.code(), error.details() or ""


def test_mutate_domain_gives_the_same_bytes_as_on_define_domain(both: Path) -> None:
    domain, vmi, _ = seed_case()
    mutated = mutate(both, domain, vmi)
    assert mutated == define(both, domain, vmi)
    assert hostdevs(mutated) == SEED_PCI
    assert mutated != domain


@pytest.mark.parametrize("invocation", ["Boot", "MigrationTarget", "MigrationSource", ""])
def test_every_invocation_context_and_an_unset_domain_type_get_the_same_domain(both: Path, invocation: str) -> None:
    domain, vmi, _ = seed_case()
    expected = define(both, domain, vmi)
    assert mutate(both, domain, vmi, invocation) == expected
    assert mutate(both, domain, vmi, invocation, domain_type="") == expected  # proto3's default: libvirt


OVER_CAP = b"<domain type='kvm'><name>x</name><devices/>" + b" " * DEFAULT_MAX_INPUT_BYTES + b"</domain>"


@pytest.mark.parametrize(
    ("domain", "vmi", "code"),
    [
        (b"this is not xml", None, grpc.StatusCode.INVALID_ARGUMENT),
        (None, b"{not json", grpc.StatusCode.INVALID_ARGUMENT),
        (None, b'{"spec": {"domain": {"devices": {"gpus": [{"name": "g"}]}}}}', None),
        (None, b"[]", grpc.StatusCode.INVALID_ARGUMENT),
        (BILLION_LAUGHS, None, grpc.StatusCode.INVALID_ARGUMENT),
        (XXE, None, grpc.StatusCode.INVALID_ARGUMENT),
        (b"", None, grpc.StatusCode.INVALID_ARGUMENT),
        (OVER_CAP, None, grpc.StatusCode.INVALID_ARGUMENT),
        (b"<domain>" + b" " * MAX_MESSAGE_BYTES + b"</domain>", None, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
    ids=["not-xml", "not-json", "gpu-without-device", "vmi-not-object", "laughs", "xxe", "empty", "over-cap", "huge"],
)
def test_refusals_are_the_same_both_ways(
    both: Path, domain: bytes | None, vmi: bytes | None, code: grpc.StatusCode | None
) -> None:
    good_domain, good_vmi, _ = seed_case()
    domain, vmi = domain if domain is not None else good_domain, vmi if vmi is not None else good_vmi
    if code is None:  # not an error for the builder: then both answers must agree byte for byte
        assert mutate(both, domain, vmi) == define(both, domain, vmi)
        return
    by_hooks = status(define, both, domain, vmi)
    by_plugins = status(mutate, both, domain, vmi)
    assert by_plugins[0] is by_hooks[0] is code
    if code is not grpc.StatusCode.RESOURCE_EXHAUSTED:  # gRPC's own message names the sizes, not our text
        assert by_plugins[1] == by_hooks[1]
        assert by_plugins[1]
    assert hostdevs(mutate(both, good_domain, good_vmi)) == SEED_PCI  # and it keeps serving


def test_a_missing_allocation_is_the_same_invalid_argument_both_ways() -> None:
    domain, vmi, _ = seed_case()
    with short_dir() as directory:
        socket_path = directory / "hook.sock"
        server = HookServer(socket_path, HookService(ProcessEnvSource({"PATH": "/bin"})), api="both")
        server.start()
        try:
            by_hooks = status(define, socket_path, domain, vmi)
            by_plugins = status(mutate, socket_path, domain, vmi)
        finally:
            server.stop(grace=0.5)
    assert by_plugins == by_hooks
    assert by_plugins[0] is grpc.StatusCode.INVALID_ARGUMENT


def test_a_busy_budget_is_resource_exhausted_both_ways() -> None:
    domain, vmi, _ = seed_case()
    with hook_server("both", memory_budget=1024, budget_wait=0.05) as (server, socket_path):
        held = server.budget.acquire(1024, 0)
        assert held == 1024
        try:
            by_hooks = status(define, socket_path, domain, vmi)
            by_plugins = status(mutate, socket_path, domain, vmi)
        finally:
            server.budget.release(held)
        assert by_plugins == by_hooks
        assert by_plugins[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert hostdevs(mutate(socket_path, domain, vmi)) == SEED_PCI
        deadline = time.monotonic() + 10  # the share is given back once the answer has been sent
        while server.budget.used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.budget.used == 0


def test_another_domain_type_is_refused_by_name(both: Path) -> None:
    domain, vmi, _ = seed_case()
    code, details = status(lambda path, d, v: mutate(path, d, v, domain_type="cloud-hypervisor"), both, domain, vmi)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "'cloud-hypervisor'" in details and "libvirt" in details


def unimplemented(call: Callable[[], object]) -> bool:
    try:
        call()
    except grpc.RpcError as error:
        return isinstance(error, grpc.Call) and error.code() is grpc.StatusCode.UNIMPLEMENTED
    return False


@pytest.mark.parametrize(
    ("api", "hooks_served", "plugins_served"),
    [("hooks", True, False), ("plugins", False, True), ("both", True, True)],
)
def test_the_api_flag_selects_the_registered_services(api: HookApi, hooks_served: bool, plugins_served: bool) -> None:
    domain, vmi, _ = seed_case()
    with hook_server(api) as (_, socket_path), unix_channel(socket_path) as channel:
        info = info_pb2_grpc.InfoStub(channel)
        callbacks = v1alpha3_pb2_grpc.CallbacksStub(channel)
        calls: dict[str, Callable[[], object]] = {
            "Info": lambda: info.Info(info_pb2.InfoParams(), timeout=10),
            "OnDefineDomain": lambda: callbacks.OnDefineDomain(
                v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=30
            ),
            "Shutdown": lambda: callbacks.Shutdown(v1alpha3_pb2.ShutdownParams(), timeout=10),
        }
        mutate_call: Callable[[], object] = lambda: mutate(socket_path, domain, vmi)  # noqa: E731
        assert unimplemented(mutate_call) is not plugins_served
        for name, call in calls.items():
            assert unimplemented(call) is not hooks_served, name


def test_both_listens_on_two_sockets_and_removes_both() -> None:
    domain, vmi, _ = seed_case()
    with short_dir() as directory:
        hooks_socket = directory / "kubevirt-hooks" / "gpu-hostdev.sock"
        plugin_socket = directory / "kubevirt-plugin" / PLUGIN_NAME / "hook.sock"
        _, _, env = seed_case()
        server = HookServer(hooks_socket, HookService(ProcessEnvSource(env)), api="both", also_listen=(plugin_socket,))
        server.start()
        try:
            assert server.socket_paths == (hooks_socket, plugin_socket)
            assert mutate(plugin_socket, domain, vmi) == define(hooks_socket, domain, vmi)
        finally:
            server.stop(grace=0.5)
        assert not hooks_socket.exists() and not plugin_socket.exists()


def test_an_unknown_api_is_refused() -> None:
    with pytest.raises(ValueError, match="'sidecar' is not one of hooks, plugins, both"):
        HookServer(Path("/tmp/x.sock"), HookService(ProcessEnvSource({})), api="sidecar")  # type: ignore[arg-type]


def test_mutate_domain_logs_one_line_naming_the_api_and_the_invocation(
    both: Path, caplog: pytest.LogCaptureFixture
) -> None:
    domain, vmi, _ = seed_case()
    caplog.set_level(logging.INFO, logger="launcher_hook")
    mutate(both, domain, vmi, "MigrationTarget")
    status(lambda path, d, v: mutate(path, d, v, "x" * 10_000), both, b"nope", vmi)
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "launcher_hook"]
    ok, bad = lines[-2:]
    assert ok["event"] == bad["event"] == "MutateDomain"
    assert ok["via"] == "grpc plugins.v1alpha1 MigrationTarget"
    assert ok["vmi"] == "cxl/vm-with-gpu"
    assert ok["gpus"] == SEED_PCI
    assert ok["status"] == "OK"
    assert bad["status"] == "INVALID_ARGUMENT"
    assert bad["via"] == "grpc plugins.v1alpha1 " + "x" * 64  # a client's string is cut


def test_the_default_plugin_socket_is_where_kubevirt_accepts_it() -> None:
    """KubeVirt admits a Plugin's socketPath only under /var/run/kubevirt-plugin/<plugin name>/, ending in
    .sock, at most 108 characters (its admission policy); the sidecar-API default stays where it was."""
    sub = serve.make_context("serve", [])
    assert sub.params["api"] == "hooks"
    assert sub.params["socket_path"] == DEFAULT_SOCKET
    assert sub.params["plugin_socket_path"] == DEFAULT_PLUGIN_SOCKET
    assert str(PLUGIN_SOCKET_DIR) == "/var/run/kubevirt-plugin"
    assert DEFAULT_PLUGIN_SOCKET.parent == PLUGIN_SOCKET_DIR / PLUGIN_NAME
    assert DEFAULT_PLUGIN_SOCKET.suffix == ".sock"
    assert len(str(DEFAULT_PLUGIN_SOCKET)) <= MAX_UNIX_SOCKET_PATH
    with pytest.raises(click.BadParameter):
        serve.make_context("serve", ["--api", "sidecar"])


@pytest.fixture
def directory() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def test_serve_api_plugins_answers_mutate_domain_only_and_stops_on_sigterm(directory: Path) -> None:
    plugin_socket = directory / PLUGIN_NAME / "hook.sock"
    unused = directory / "kubevirt-hooks" / "gpu-hostdev.sock"
    process = start_serve(plugin_socket, "--api", "plugins", "--plugin-socket", str(plugin_socket))
    # start_serve passes --socket <plugin_socket> first; with --api plugins that option is not used.
    domain, vmi, _ = seed_case()
    try:
        mutated = mutate(plugin_socket, domain, vmi)
        with unix_channel(plugin_socket) as channel:
            assert unimplemented(lambda: info_pb2_grpc.InfoStub(channel).Info(info_pb2.InfoParams(), timeout=10))
    finally:
        process.send_signal(signal.SIGTERM)
    code, lines = finish(process)
    assert code == 0
    assert not plugin_socket.exists() and not unused.exists()
    assert hostdevs(mutated) == SEED_PCI
    assert [line["event"] for line in lines] == ["serving", "MutateDomain", "signal", "stopped"]
    assert lines[0]["api"] == "plugins"
    assert lines[0]["socket"] == str(plugin_socket)


def test_simulate_with_the_plugin_api_tells_it_and_writes_the_same_domain() -> None:
    from tests.test_xmlgen_simulate import simulate

    by_hooks, by_plugins = simulate(), simulate("--hook-api", "plugins")
    assert by_hooks.returncode == by_plugins.returncode == 0, by_plugins.stderr
    assert by_plugins.stdout == by_hooks.stdout
    # node01's two TU106 cards, each with its audio, USB and UCSI functions as companions in its guest slot.
    companions = {f"ua-gpu{gpu}-fn{function}" for gpu in (0, 1) for function in (1, 2, 3)}
    assert set(hostdevs(by_plugins.stdout.encode())) == {"ua-gpu0", "ua-gpu1", *companions}
    assert "4. hook sidecar: MutateDomain as virt-launcher calls a Plugin's sidecar" in by_plugins.stderr
    assert "invocation context Boot" in by_plugins.stderr and "Info:" not in by_plugins.stderr
    assert "hostdevs written (plugins.v1alpha1)" in by_plugins.stderr
    assert "4. hook sidecar: OnDefineDomain" in by_hooks.stderr and "MutateDomain" not in by_hooks.stderr


def test_a_domain_in_libvirtxmls_shape_merges_with_kubevirts_hostdevs_as_before() -> None:
    """virt-launcher hands a plugin its domain re-marshalled by libvirtxml, which writes a hostdev's source
    address without KubeVirt's ``type='pci'``: the hook still recognises KubeVirt's own hostdevs and adds
    only what is missing (the golden merge case), the same both ways."""
    case = Path(__file__).resolve().parent / "fixtures" / "golden" / "kubevirt-merge-numa"
    domain = (case / "domain.xml").read_bytes()
    reshaped = re.sub(rb'(<source><address) type="pci"', rb"\1", domain)
    assert reshaped.count(b"<source><address domain=") == 2 and reshaped != domain
    vmi = (case / "vmi.json").read_bytes()
    env = parse_environ((case / "env").read_bytes())
    options = BuildOptions(**json.loads((case / "options.json").read_text()))
    with short_dir() as directory:
        socket_path = directory / "hook.sock"
        server = HookServer(socket_path, HookService(ProcessEnvSource(env), options), api="both")
        server.start()
        try:
            mutated = mutate(socket_path, reshaped, vmi)
            assert mutated == define(socket_path, reshaped, vmi)
        finally:
            server.stop(grace=0.5)
    assert hostdevs(mutated) == hostdevs((case / "expected.xml").read_bytes())


def test_serve_api_both_listens_on_both_sockets_and_shutdown_removes_both(directory: Path) -> None:
    hooks_socket = directory / "kubevirt-hooks" / "gpu-hostdev.sock"
    plugin_socket = directory / "kubevirt-plugin" / PLUGIN_NAME / "hook.sock"
    process = start_serve(hooks_socket, "--api", "both", "--plugin-socket", str(plugin_socket))
    domain, vmi, _ = seed_case()
    try:
        wait_for_socket(plugin_socket)
        assert mutate(plugin_socket, domain, vmi) == define(hooks_socket, domain, vmi)
        with unix_channel(hooks_socket) as channel:
            v1alpha3_pb2_grpc.CallbacksStub(channel).Shutdown(v1alpha3_pb2.ShutdownParams(), timeout=10)
    except BaseException:
        process.kill()
        raise
    code, lines = finish(process)
    assert code == 0
    assert not hooks_socket.exists() and not plugin_socket.exists()
    assert lines[0]["api"] == "both"
    assert lines[0]["socket"] == f"{hooks_socket},{plugin_socket}"
