"""Issue 11's attacks on the hook sidecar, each reproduced before its fix: a FIFO or a huge environ file, a second
``serve`` on a live socket, streams that never read, huge domains at once, a caller naming another pod, and a
stderr nobody drains. Load stays on this machine (unix sockets only) and every loop is bounded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from launcher_hook.cli import make_source
from launcher_hook.server import HookServer
from launcher_hook.service import HookService
from launcher_hook.sources import (
    MAX_ENVIRON_FILE_BYTES,
    EnvironFileSource,
    PodIdentity,
    PodResourcesSource,
    ProcessEnvSource,
    SourceUnavailable,
    could_be_launcher_pod_of_host,
    own_pod_identity,
    read_environ_file,
)
from runtime.sockets import SocketInUse, socket_is_live
from schemas.generated.kubevirt.hooks import info_pb2, info_pb2_grpc, v1alpha3_pb2, v1alpha3_pb2_grpc
from simkit.podresources_standin import FakeKubelet, fake_kubelet
from tests.hook_support import (
    RTX_VAR,
    SEED_PCI,
    launcher_pod,
    running_hook,
    seed_case,
    short_dir,
    unix_channel,
)
from tests.test_hook_cli import clean_env, program, start_serve
from tests.test_hook_server import define, hostdevs


@pytest.fixture
def directory() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def load_in_thread(source: EnvironFileSource, seconds: float) -> BaseException | None:
    """``source.load`` in a thread; its exception, or AssertionError if it is still running after ``seconds``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            source.load(None)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return AssertionError(f"load of {source.path} still blocked after {seconds} s")
    return outcome[0]


# --- finding 4: the environ file ------------------------------------------------------------------------------


def test_a_fifo_as_environ_file_is_refused_at_once(directory: Path) -> None:
    fifo = directory / "environ"
    os.mkfifo(fifo)
    try:
        error = load_in_thread(EnvironFileSource(fifo), 5)
    finally:
        with contextlib.suppress(OSError):  # unblock a reader stuck in open() (before the fix)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert isinstance(error, SourceUnavailable), error
    assert str(error) == f"environ file {fifo} is a FIFO, not a regular file; refusing to read it"


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_as_environ_file_is_refused(device: str) -> None:
    with pytest.raises(SourceUnavailable, match="is a character device, not a regular file"):
        read_environ_file(Path(device))


def test_a_directory_as_environ_file_is_refused(directory: Path) -> None:
    with pytest.raises(SourceUnavailable, match=r"is a directory|cannot be read"):
        read_environ_file(directory)


def test_an_environ_file_over_the_cap_is_refused_without_reading_it_whole(directory: Path) -> None:
    huge = directory / "environ"
    with huge.open("wb") as handle:  # sparse: 64 MiB of NULs cost no disk
        handle.truncate(64 * 1024 * 1024)
    source = EnvironFileSource(huge)
    with pytest.raises(SourceUnavailable) as caught:
        source.load(None)
    assert str(caught.value) == f"environ file {huge} is over the {MAX_ENVIRON_FILE_BYTES}-byte limit"
    exact = directory / "exact"
    exact.write_bytes(f"{RTX_VAR}=0000:86:00.0\n".encode().ljust(MAX_ENVIRON_FILE_BYTES, b"\n"))
    assert EnvironFileSource(exact).load(None).env == {RTX_VAR: "0000:86:00.0"}


def test_proc_environ_is_a_regular_file_and_still_read() -> None:
    data = read_environ_file(Path(f"/proc/{os.getpid()}/environ"))
    assert b"PATH=" in data


def test_serve_with_a_fifo_environ_file_answers_info_and_stops_on_sigterm(directory: Path) -> None:
    fifo = directory / "environ"
    os.mkfifo(fifo)
    socket_path = directory / "hook.sock"
    process = start_serve(socket_path, "--environ-file", str(fifo))
    domain, vmi, _ = seed_case()
    try:
        with unix_channel(socket_path) as channel:
            stub = v1alpha3_pb2_grpc.CallbacksStub(channel)
            for _ in range(12):  # more calls than workers: none may stay blocked on the FIFO
                with pytest.raises(grpc.RpcError) as caught:
                    stub.OnDefineDomain(v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=5)
                error = caught.value
                assert isinstance(error, grpc.Call)
                assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert "is a FIFO" in (error.details() or "")
            info = info_pb2_grpc.InfoStub(channel).Info(info_pb2.InfoParams(), timeout=5)
            assert "v1alpha3" in info.versions
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=10)
        assert process.returncode == 0
        assert time.monotonic() - started < 5
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_the_shim_with_a_fifo_environ_file_fails_at_once(directory: Path) -> None:
    fifo = directory / "environ"
    os.mkfifo(fifo)
    domain, vmi, _ = seed_case()
    try:
        done = subprocess.run(
            [program("onDefineDomain"), "--vmi", vmi.decode(), "--domain", domain.decode()],
            env=clean_env(LAUNCHER_HOOK_ENVIRON_FILE=str(fifo)),
            capture_output=True,
            timeout=20,
            check=False,
        )
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert done.returncode == 1
    assert done.stdout == b""
    assert b"is a FIFO, not a regular file" in done.stderr


# --- finding 11: a second serve on a live socket ---------------------------------------------------------------


def test_a_second_server_on_a_live_socket_is_refused_and_the_first_keeps_serving(directory: Path) -> None:
    socket_path = directory / "hook.sock"
    domain, vmi, env = seed_case()
    with running_hook(HookService(ProcessEnvSource(env)), socket_path):
        inode = socket_path.lstat().st_ino
        second = HookServer(socket_path, HookService(ProcessEnvSource({})))
        with pytest.raises(SocketInUse, match=f"another server is listening on {socket_path}"):
            second.start()
        second.stop(grace=0)
        assert socket_path.lstat().st_ino == inode
        assert hostdevs(define(socket_path, domain, vmi)) == SEED_PCI


def test_serve_refuses_a_live_socket_with_exit_1(directory: Path) -> None:
    socket_path = directory / "hook.sock"
    first = start_serve(socket_path)
    try:
        done = subprocess.run(
            [program("launcher-hook"), "serve", "--socket", str(socket_path)],
            env=clean_env(),
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 1
        assert b"another server is listening on" in done.stderr
        domain, vmi, _ = seed_case()
        assert hostdevs(define(socket_path, domain, vmi)) == SEED_PCI
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=20)
    assert first.returncode == 0


# --- finding 12: a stderr nobody drains ------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_an_undrained_stderr_neither_grows_the_hook_nor_holds_its_sigterm(directory: Path) -> None:
    socket_path = directory / "hook.sock"
    _, _, seed_env = seed_case()
    read_end, write_end = os.pipe()  # stderr: a pipe nobody reads (it fills after 64 KiB)
    process = subprocess.Popen(
        [program("launcher-hook"), "serve", "--socket", str(socket_path)],
        env=clean_env(**{RTX_VAR: seed_env[RTX_VAR]}),
        stdout=subprocess.DEVNULL,
        stderr=write_end,
    )
    os.close(write_end)
    try:
        deadline = time.monotonic() + 20
        while not (socket_path.is_socket() and socket_is_live(socket_path)):  # answering, not only bound
            assert time.monotonic() < deadline and process.poll() is None, "serve did not start"
            time.sleep(0.02)
        gpus = [{"name": "g" * 5000, "deviceName": "example.com/r"}]  # a ~4 KiB error in every log line
        vmi = json.dumps({"spec": {"domain": {"devices": {"gpus": gpus}}}}).encode()
        domain, _, _ = seed_case()
        request = v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi)
        sizes = []
        with unix_channel(socket_path) as channel:
            stub = v1alpha3_pb2_grpc.CallbacksStub(channel)
            for _ in range(2):
                for _ in range(1500):
                    with pytest.raises(grpc.RpcError):
                        stub.OnDefineDomain(request, timeout=10)
                sizes.append(rss_bytes(process.pid))
        grown = sizes[1] - sizes[0]
        print(f"RSS after 1,500 and 3,000 failing calls: {sizes}")
        assert grown < 4 * 1024 * 1024, f"RSS grew {grown} bytes over 1,500 more failing calls: {sizes}"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
        assert process.returncode == 0
        assert time.monotonic() - started < 6
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(read_end)


def test_dropped_lines_are_counted_in_a_line_once_stderr_drains() -> None:
    import logging

    from schemas.logformat import DROPPED_EVENT, LOG_QUEUE_LINES, configure, event_extra, event_message

    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    logger = logging.getLogger("kgp-drop-test")
    flush = configure(logger, "test", "json", stream, background=True)
    total = LOG_QUEUE_LINES * 3
    filler = "x" * 1000
    for number in range(total):
        fields = {"n": number, "filler": filler}
        logger.info(event_message("tick", fields), extra=event_extra("tick", fields))
    received = bytearray()

    def drain() -> None:  # reading now lets the writer catch up and report what it dropped
        while chunk := os.read(read_end, 1 << 20):
            received.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    flush()
    stream.close()
    reader.join(30)
    os.close(read_end)
    lines = [json.loads(line) for line in received.decode().splitlines()]
    ticks = [line for line in lines if line["event"] == "tick"]
    dropped = sum(line["dropped"] for line in lines if line["event"] == DROPPED_EVENT)
    assert len(ticks) + dropped == total
    assert dropped >= total - LOG_QUEUE_LINES - 200
    assert [line["n"] for line in ticks] == sorted(line["n"] for line in ticks)
    assert next(line for line in lines if line["event"] == DROPPED_EVENT)["level"] == "warning"


# --- finding 5: streams that never read, and huge domains at once ---------------------------------------------

SERVER = """
import os, sys
from pathlib import Path
from launcher_hook.server import HookServer
from launcher_hook.service import HookService
from launcher_hook.sources import ProcessEnvSource
server = HookServer(Path(sys.argv[1]), HookService(ProcessEnvSource(os.environ)))
server.start()
try:
    server.wait(0.1)
finally:
    server.stop(grace=0)
"""
METHOD = "/kubevirt.hooks.v1alpha3.Callbacks/OnDefineDomain"


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def padded_domain(size: int, *, elements: bool) -> bytes:
    """The seed domain grown to about ``size`` bytes: many small metadata elements (costly to parse) or one text."""
    domain, _, _ = seed_case()
    head, name_end, tail = domain.partition(b"</name>")
    if elements:
        element = b"<x:e a='1'>ab</x:e>"
        filler = b"<metadata><x:m xmlns:x='urn:x'>" + element * (size // len(element)) + b"</x:m></metadata>"
    else:
        filler = b"<description>" + b"x" * size + b"</description>"
    return head + name_end + filler + tail


@contextmanager
def hook_process(directory: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    socket_path = directory / "hook.sock"
    _, _, env = seed_case()
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(socket_path)],
        env=clean_env(**env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not (socket_path.is_socket() and socket_is_live(socket_path)):  # answering, not only bound
            assert time.monotonic() < deadline and process.poll() is None, "the hook did not start"
            time.sleep(0.02)
        yield process, socket_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_concurrent_huge_domains_stay_within_the_memory_budget(directory: Path) -> None:
    clients = 8
    domain = padded_domain(4 * 1024 * 1024, elements=True)  # ~120 MB of parser memory each
    _, vmi, _ = seed_case()
    with hook_process(directory) as (process, socket_path):
        idle = peak_rss_bytes(process.pid)
        barrier = threading.Barrier(clients)

        def call(_: int) -> str:
            options = [("grpc.max_receive_message_length", 2 * len(domain))]
            with grpc.insecure_channel(f"unix:{socket_path}", options=options) as channel:
                barrier.wait(30)
                try:
                    result = v1alpha3_pb2_grpc.CallbacksStub(channel).OnDefineDomain(
                        v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=120
                    )
                except grpc.RpcError as error:
                    return error.code().name if isinstance(error, grpc.Call) else "error"
                assert hostdevs(result.domainXML) == SEED_PCI
                return "OK"

        with futures.ThreadPoolExecutor(clients) as pool:
            outcomes = list(pool.map(call, range(clients)))
        peak = peak_rss_bytes(process.pid)
    print(f"{clients} concurrent {len(domain)}-byte domains: {outcomes}; idle {idle >> 20} MiB, peak {peak >> 20} MiB")
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"} and "OK" in outcomes
    assert peak - idle < 300 * 1024 * 1024


def test_clients_that_never_read_cannot_pile_up_answers(directory: Path) -> None:
    streams = 200
    domain = padded_domain(1024 * 1024, elements=False)  # cheap to build, a 1 MB answer
    _, vmi, _ = seed_case()
    request = v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi).SerializeToString()
    channels: list[grpc.Channel] = []
    calls: list[grpc.RpcContext] = []
    with hook_process(directory) as (process, socket_path):
        idle = peak_rss_bytes(process.pid)
        try:
            for _ in range(streams):
                channel = grpc.insecure_channel(
                    f"unix:{socket_path}", options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
                )
                channels.append(channel)
                # A server-streaming view of the unary method: the answer is never asked for, so never read.
                never_read: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
                    METHOD, request_serializer=None, response_deserializer=None
                )
                calls.append(never_read(request, timeout=60))
            time.sleep(15)  # every call has run, waited out its budget or been turned away
            peak = peak_rss_bytes(process.pid)
            with unix_channel(socket_path) as channel:  # and a well-behaved caller still gets its answer
                small, small_vmi, _ = seed_case()
                answer = v1alpha3_pb2_grpc.CallbacksStub(channel).OnDefineDomain(
                    v1alpha3_pb2.OnDefineDomainParams(domainXML=small, vmi=small_vmi), timeout=30
                )
                assert hostdevs(answer.domainXML) == SEED_PCI
        finally:
            for call in calls:
                call.cancel()
            for channel in channels:
                channel.close()
    print(f"{streams} never-read streams of {len(domain)} bytes: idle {idle >> 20} MiB, peak {peak >> 20} MiB")
    assert peak - idle < 240 * 1024 * 1024  # the old code: +395 MiB for 100 streams; now ~110 MiB (162 under load)


# --- finding 6: a caller naming another pod --------------------------------------------------------------------

OURS = launcher_pod(["0000:86:00.0", "0000:af:00.0"])  # cxl/virt-launcher-vm-with-gpu-x7k2p
NEIGHBOUR = launcher_pod(["0000:3b:00.0"], vmi="neighbour")  # same namespace, another VM on this node
VICTIM = launcher_pod(["0000:d8:00.0"], namespace="other", vmi="victim")
TWIN = launcher_pod(["0000:5e:00.0"], namespace="elsewhere")  # another namespace's VM of the same name
CLUSTER_DNS = "nameserver 10.96.0.10\nsearch cxl.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"


def vmi_named(namespace: str, name: str) -> bytes:
    return json.dumps({"metadata": {"namespace": namespace, "name": name}, "spec": {}}).encode()


def identity_files(directory: Path, resolv: str | None = CLUSTER_DNS) -> dict[str, Path]:
    resolv_conf = directory / "resolv.conf"
    if resolv is not None:
        resolv_conf.write_text(resolv)
    return {"service_account_namespace": directory / "no-token" / "namespace", "resolv_conf": resolv_conf}


def test_the_deployed_mode_never_returns_another_namespaces_pod(directory: Path) -> None:
    kubelet = FakeKubelet([OURS, NEIGHBOUR, VICTIM])
    with fake_kubelet(kubelet, directory / "kubelet.sock") as socket_path:
        # As deployed: the annotation sets no POD_NAME; before the fix the caller's VMI chose the pod.
        deployed = make_source(socket_path, None, "compute", {"CONTAINER_NAME": "hook-sidecar-0"})
        try:
            with pytest.raises(SourceUnavailable) as caught:
                deployed.load(vmi_named("other", "victim"))
        finally:
            deployed.close()
    assert "0000:d8:00.0" not in str(caught.value)


@pytest.mark.parametrize(
    ("namespace", "name"), [("other", "victim"), ("cxl", "neighbour"), ("elsewhere", "vm-with-gpu")]
)
def test_a_vmi_naming_another_pod_is_refused_and_ours_still_served(directory: Path, namespace: str, name: str) -> None:
    identity = own_pod_identity(
        {"CONTAINER_NAME": "hook-sidecar-0"}, hostname="vm-with-gpu", **identity_files(directory)
    )
    assert (identity.namespace, identity.namespace_from) == ("cxl", f"the {directory / 'resolv.conf'} search path")
    with fake_kubelet(FakeKubelet([OURS, NEIGHBOUR, VICTIM, TWIN]), directory / "kubelet.sock") as socket_path:
        source = PodResourcesSource(socket_path, identity=identity)
        try:
            with pytest.raises(SourceUnavailable) as caught:
                source.load(vmi_named(namespace, name))
            assert str(caught.value) == (
                f"the VMI {namespace}/{name} is not the one this hook's pod cxl/{OURS.name} runs; "
                "refusing to read another pod's devices"
            )
            assert source.load(vmi_named("cxl", "vm-with-gpu")).env == {RTX_VAR: "0000:86:00.0,0000:af:00.0"}
        finally:
            source.close()


def test_the_same_vm_name_in_two_namespaces_is_refused_when_the_namespace_is_unknown(directory: Path) -> None:
    identity = own_pod_identity({}, hostname="vm-with-gpu", **identity_files(directory, resolv=None))
    assert identity.namespace is None
    with fake_kubelet(FakeKubelet([OURS, TWIN]), directory / "kubelet.sock") as socket_path:
        source = PodResourcesSource(socket_path, identity=identity)
        try:
            with pytest.raises(SourceUnavailable, match="several pods could be this hook's own"):
                source.load(vmi_named("cxl", "vm-with-gpu"))
        finally:
            source.close()


def test_with_pod_name_the_namespace_is_never_taken_from_the_caller(directory: Path) -> None:
    with fake_kubelet(FakeKubelet([OURS, TWIN]), directory / "kubelet.sock") as socket_path:
        source = PodResourcesSource(socket_path, identity=PodIdentity(name=OURS.name))
        try:
            with pytest.raises(SourceUnavailable, match="cannot tell its namespace: set POD_NAMESPACE"):
                source.load(vmi_named("elsewhere", "vm-with-gpu"))
        finally:
            source.close()
        source = PodResourcesSource(socket_path, pod_name=OURS.name, pod_namespace="cxl")
        try:
            with pytest.raises(SourceUnavailable, match="is not the one this hook's pod"):
                source.load(vmi_named("elsewhere", "vm-with-gpu"))
        finally:
            source.close()


def test_own_pod_identity_sources(directory: Path) -> None:
    files = identity_files(directory)
    token_dir = directory / "no-token"
    assert own_pod_identity({"POD_NAMESPACE": "a", "POD_NAME": "p"}, hostname="h", **files) == PodIdentity(
        "p", "a", "h", None, "POD_NAMESPACE"
    )
    token_dir.mkdir()
    (token_dir / "namespace").write_text("from-token")
    assert own_pod_identity({}, hostname="h", **files).namespace == "from-token"
    (token_dir / "namespace").unlink()
    assert own_pod_identity({}, hostname="h", **files).namespace == "cxl"
    assert own_pod_identity({}, hostname="h", **identity_files(directory, "search example.com\n")).namespace is None


@pytest.mark.parametrize(
    ("pod", "hostname", "expected"),
    [
        ("virt-launcher-vm-with-gpu-x7k2p", "vm-with-gpu", True),
        ("virt-launcher-vm-with-gpu-2-x7k2p", "vm-with-gpu", False),
        ("virt-launcher-db.prod-x7k2p", "db", True),  # a dotted VMI name: the hostname is its first label
        ("virt-launcher-db.prod-x7k2p", "db.prod", False),
        ("virt-launcher-" + ("a" * 60)[:43] + "-bcd2f", "a" * 43, True),  # 58 characters, not cut
        ("virt-launcher-" + ("a" * 60 + "-")[:44] + "bcd2f", "a" * 60, True),  # cut: a prefix of the name
        ("virt-launcher-" + ("a" * 60 + "-")[:44] + "bcd2f", "b" * 60, False),
        ("launcher-vm-with-gpu-x7k2p", "vm-with-gpu", False),
    ],
)
def test_could_be_launcher_pod_of_host(pod: str, hostname: str, expected: bool) -> None:
    assert could_be_launcher_pod_of_host(pod, hostname) is expected
