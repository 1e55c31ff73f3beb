"""The installed programs as KubeVirt runs them: ``launcher-hook serve`` in its own process (Shutdown, SIGTERM
and SIGINT end it with exit 0 and no socket left) and ``onDefineDomain`` as the sidecar-shim calls it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from lxml import etree

from schemas.generated.kubevirt.hooks import info_pb2, info_pb2_grpc, v1alpha3_pb2, v1alpha3_pb2_grpc
from tests.hook_support import RTX_VAR, SEED_PCI, STARTED, seed_case, short_dir, unix_channel, wait_for_socket
from tests.libvirt_support import libvirt_verdict
from tests.test_hook_server import hostdevs

BIN = Path(sys.executable).parent


def program(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{name} is not installed next to {sys.executable}: run scripts/bootstrap.sh dev"
    return str(path)


def clean_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("LAUNCHER_HOOK_", "PCI_", "MDEV_"))}
    env.update(extra)
    return env


@pytest.fixture
def directory() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def start_serve(socket_path: Path, *args: str, **env: str) -> subprocess.Popen[bytes]:
    _, _, seed_env = seed_case()
    process = subprocess.Popen(
        [program("launcher-hook"), "serve", "--socket", str(socket_path), *args],
        env=clean_env(**{RTX_VAR: seed_env[RTX_VAR], **env}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    STARTED.append(process)
    try:
        wait_for_socket(socket_path)
    except AssertionError:
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"launcher-hook serve did not start: {err.decode()}") from None
    return process


def finish(process: subprocess.Popen[bytes]) -> tuple[int, list[dict[str, object]]]:
    _, err = process.communicate(timeout=20)
    lines = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    for line in lines:  # the envelope every line carries; the tests below look at the event and its fields
        assert line.pop("component") == "launcher_hook" and line.pop("level") and line.pop("time"), line
    return process.returncode, lines


def test_serve_answers_and_exits_0_on_shutdown(directory: Path) -> None:
    socket_path = directory / "kubevirt-hooks" / "gpu-hostdev.sock"
    process = start_serve(socket_path)
    domain, vmi, _ = seed_case()
    with unix_channel(socket_path) as channel:
        info = info_pb2_grpc.InfoStub(channel).Info(info_pb2.InfoParams(), timeout=10)
        assert "v1alpha3" in info.versions
        stub = v1alpha3_pb2_grpc.CallbacksStub(channel)
        result = stub.OnDefineDomain(v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60)
        stub.Shutdown(v1alpha3_pb2.ShutdownParams(), timeout=10)
    code, lines = finish(process)
    assert code == 0
    assert not socket_path.exists()
    assert hostdevs(result.domainXML) == SEED_PCI
    events = [line["event"] for line in lines]
    assert events == ["serving", "OnDefineDomain", "stopped"]
    assert lines[0]["mode"] == "0666"
    assert lines[1]["gpus"] == SEED_PCI


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_serve_exits_0_on_signal_and_removes_the_socket(directory: Path, signal_number: int) -> None:
    socket_path = directory / "hook.sock"
    process = start_serve(socket_path)
    process.send_signal(signal_number)
    code, lines = finish(process)
    assert code == 0
    assert not socket_path.exists()
    assert {"event": "signal", "signal": signal.Signals(signal_number).name} in lines


def test_serve_refuses_a_non_socket_in_the_way(directory: Path) -> None:
    socket_path = directory / "hook.sock"
    socket_path.write_text("not a socket")
    done = subprocess.run(
        [program("launcher-hook"), "serve", "--socket", str(socket_path)],
        env=clean_env(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert b"exists and is not a socket" in done.stderr
    assert socket_path.read_text() == "not a socket"


def test_serve_reads_the_environ_file_given_by_env_variable(directory: Path) -> None:
    environ = directory / "environ"
    environ.write_bytes(f"{RTX_VAR}=0000:af:00.0\0".encode())
    socket_path = directory / "hook.sock"
    process = start_serve(socket_path, **{"LAUNCHER_HOOK_ENVIRON_FILE": str(environ), RTX_VAR: "0000:01:00.0"})
    domain, vmi, _ = seed_case()
    one_gpu = json.loads(vmi)
    one_gpu["spec"]["domain"]["devices"]["gpus"] = one_gpu["spec"]["domain"]["devices"]["gpus"][:1]
    with unix_channel(socket_path) as channel:
        result = v1alpha3_pb2_grpc.CallbacksStub(channel).OnDefineDomain(
            v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=json.dumps(one_gpu).encode()), timeout=60
        )
    process.send_signal(signal.SIGTERM)
    code, lines = finish(process)
    assert code == 0
    assert hostdevs(result.domainXML) == {"ua-gpu0": "0000:af:00.0"}  # the file wins over the process env
    assert lines[1]["source"] == f"environ file {environ}"


def shim(*args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [program("onDefineDomain"), *args], env=clean_env(**env), capture_output=True, timeout=60, check=False
    )


def test_shim_prints_the_new_domain_on_stdout_only() -> None:
    domain, vmi, env = seed_case()
    done = shim("--vmi", vmi.decode(), "--domain", domain.decode(), **env)
    assert done.returncode == 0, done.stderr.decode()
    assert hostdevs(done.stdout) == SEED_PCI
    assert etree.fromstring(done.stdout).findtext("name") == "cxl_vm-with-gpu"
    libvirt_verdict(done.stdout, SEED_PCI)
    (line,) = [json.loads(text) for text in done.stderr.decode().splitlines()]
    assert line["via"] == "onDefineDomain"
    assert line["status"] == "OK"


def test_shim_takes_the_source_from_env_variables(directory: Path) -> None:
    domain, vmi, env = seed_case()
    environ = directory / "environ"
    environ.write_text(f"{RTX_VAR}={env[RTX_VAR]}\n")
    done = shim("--vmi", vmi.decode(), "--domain", domain.decode(), LAUNCHER_HOOK_ENVIRON_FILE=str(environ))
    assert done.returncode == 0, done.stderr.decode()
    assert hostdevs(done.stdout) == SEED_PCI


@pytest.mark.parametrize(
    ("domain", "vmi", "env", "message"),
    [
        ("<domain", None, True, "INVALID_ARGUMENT: domain XML is not well-formed"),
        (None, "[1, 2", True, "INVALID_ARGUMENT: VMI JSON is not valid JSON"),
        (
            None,
            None,
            False,
            # no allocation variable in the env: the allocation is read from the domain, which lacks the GPUs
            "INVALID_ARGUMENT: domain XML: gpus[0] 'gpu0' (deviceName nvidia.com/TU106_GEFORCE_RTX_2060_REV__A) "
            "has no <hostdev> aliased 'ua-gpu-gpu0' or 'ua-gpu0'",
        ),
    ],
)
def test_shim_errors_go_to_stderr_with_exit_1_and_nothing_on_stdout(
    domain: str | None, vmi: str | None, env: bool, message: str
) -> None:
    good_domain, good_vmi, seed_env = seed_case()
    done = shim(
        "--vmi", vmi if vmi is not None else good_vmi.decode(),
        "--domain", domain if domain is not None else good_domain.decode(),
        **(seed_env if env else {}),
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stdout == b""
    assert message in done.stderr.decode()


def test_shim_unreachable_pod_resources_is_failed_precondition(directory: Path) -> None:
    domain, vmi, _ = seed_case()
    done = shim(
        "--vmi", vmi.decode(), "--domain", domain.decode(),
        LAUNCHER_HOOK_POD_RESOURCES_SOCKET=str(directory / "kubelet.sock"),
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stdout == b""
    assert "FAILED_PRECONDITION" in done.stderr.decode()
    assert str(directory / "kubelet.sock") in done.stderr.decode()


def test_shim_usage_error_exits_2_with_nothing_on_stdout() -> None:
    done = shim("--vmi", "{}")
    assert done.returncode == 2
    assert done.stdout == b""
    assert b"--domain" in done.stderr


def test_serve_socket_mode_option(directory: Path) -> None:
    socket_path = directory / "hook.sock"
    process = start_serve(socket_path, "--socket-mode", "0660")
    try:
        assert stat.S_IMODE(socket_path.lstat().st_mode) == 0o660
    finally:
        process.send_signal(signal.SIGTERM)
    code, _ = finish(process)
    assert code == 0
    bad = subprocess.run(
        [program("launcher-hook"), "serve", "--socket", str(socket_path), "--socket-mode", "rw"],
        env=clean_env(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert bad.returncode == 2
    assert b"not an octal mode" in bad.stderr
