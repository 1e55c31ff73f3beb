"""The plugin's /metrics, /healthz and /readyz follow reality, scraped over HTTP on 127.0.0.1.

A real :class:`~plugin.manager.PluginManager` (in a thread, and as ``gpu-device-plugin serve``) runs against
the kubelet stand-in on fixture trees; the tests change the node and the kubelet and read the metrics back
through the HTTP endpoint (an ephemeral port on loopback), parsed with prometheus-client's own parser. Every
wait is for a condition with a bound.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from plugin import manager as manager_module
from plugin.manager import PluginManager
from plugin.metrics import MetricsServer, PluginMetrics, parse_address
from plugin.server import MAX_DEVICES_PER_REQUEST
from plugin.sysfs import scan as real_scan
from simkit.fixture_nodes import NODE01
from simkit.kubelet_standin import KubeletStandIn
from tests.plugin_support import (
    WAIT,
    build_tree,
    manager_for,
    plugin_env,
    rebind,
    remove_group_node,
    restore_group_node,
    running,
    serve_command,
    short_dir,
    wait_until,
)

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
NODE01_GPUS = ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0")
LOOPBACK = "127.0.0.1"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def base() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory


# -- HTTP helpers ---------------------------------------------------------------------------------------


def get(port: int, path: str) -> tuple[int, str, str]:
    """``GET path`` on 127.0.0.1:port: status, Content-Type and body."""
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=WAIT)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read().decode()
    finally:
        connection.close()


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics``, keyed by sample name and labels."""
    status, content_type, body = get(port, "/metrics")
    assert status == 200 and content_type.startswith("text/plain"), (status, content_type)
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def devices(port: int, resource: str = TU106) -> tuple[float | None, float | None]:
    samples = scrape(port)
    return (
        value(samples, "gpu_device_plugin_devices", resource=resource, health="Healthy"),
        value(samples, "gpu_device_plugin_devices", resource=resource, health="Unhealthy"),
    )


def allocations(port: int, result: str) -> float:
    return value(scrape(port), "gpu_device_plugin_allocations_total", resource=TU106, result=result) or 0.0


@contextmanager
def endpoint(manager: PluginManager) -> Iterator[MetricsServer]:
    """The manager's metrics and probes on an ephemeral loopback port, as ``serve --metrics-address`` does."""
    assert isinstance(manager.metrics, PluginMetrics)
    server = MetricsServer(LOOPBACK, 0, manager.metrics, manager.liveness, manager.readiness)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def refused(port: int) -> bool:
    try:
        get(port, "/healthz")
    except ConnectionRefusedError:
        return True
    return False


# -- in-process -----------------------------------------------------------------------------------------


def test_devices_by_health_follow_a_vfio_group_node(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    manager = manager_for(root, kubelet_dir, scan_interval=60)  # only inotify on /dev/vfio can be in time
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager), endpoint(manager) as server:
        kubelet.wait_for_devices(TU106, lambda seen: seen == dict.fromkeys(NODE01_GPUS, "Healthy"))
        assert devices(server.port) == (4, 0)
        remove_group_node(root, 30)  # 0000:3b:00.0's group
        kubelet.wait_for_devices(TU106, lambda seen: seen.get("0000:3b:00.0") == "Unhealthy")
        wait_until(lambda: devices(server.port) == (3, 1), what="3 Healthy and 1 Unhealthy in /metrics")
        restore_group_node(root, 30)
        wait_until(lambda: devices(server.port) == (4, 0), what="4 Healthy again in /metrics")

        samples = scrape(server.port)
        scans_ok = value(samples, "gpu_device_plugin_scans_total", result="ok")
        assert scans_ok is not None and scans_ok >= 3  # the first, and one per /dev/vfio change
        assert value(samples, "gpu_device_plugin_scans_total", result="failed") == 0
        assert value(samples, "gpu_device_plugin_scan_duration_seconds_count") == scans_ok
        assert (value(samples, "gpu_device_plugin_scan_duration_seconds_sum") or 0) > 0
        assert (value(samples, "gpu_device_plugin_last_successful_scan_timestamp_seconds") or 0) > 1.7e9


def test_devices_of_a_withdrawn_resource_leave_the_gauge(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    manager = manager_for(root, kubelet_dir)
    with KubeletStandIn(kubelet_dir), running(manager), endpoint(manager) as server:
        assert devices(server.port) == (4, 0)
        for address in NODE01_GPUS:  # every GPU unbound from vfio-pci: the resource is withdrawn
            rebind(root, address, None)
        wait_until(lambda: manager.served() == (), what="the resource withdrawn")
        wait_until(lambda: devices(server.port) == (None, None), what="the resource's series gone")


def test_allocations_count_ok_and_refused_calls_by_result(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    manager = manager_for(root, kubelet_dir, scan_interval=60)
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager), endpoint(manager) as server:
        kubelet.wait_for_registration(TU106)
        assert allocations(server.port, "ok") == 0
        kubelet.allocate(TU106, ["0000:86:00.0"])
        kubelet.allocate(TU106, ["0000:af:00.0", "0000:3b:00.0"])
        for bad in (["0000:d8:00.0"], ["0000:86:00.0"] * (MAX_DEVICES_PER_REQUEST + 1)):
            with pytest.raises(grpc.RpcError) as caught:
                kubelet.allocate(TU106, bad)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        remove_group_node(root, 30)
        kubelet.wait_for_devices(TU106, lambda seen: seen.get("0000:3b:00.0") == "Unhealthy")
        with pytest.raises(grpc.RpcError) as caught:
            kubelet.allocate(TU106, ["0000:3b:00.0"])
        assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        # Counted before the answer leaves the server, so no wait is needed.
        assert allocations(server.port, "ok") == 2
        assert allocations(server.port, "invalid_argument") == 2
        assert allocations(server.port, "failed_precondition") == 1


LOADED_WAIT = 60.0


def test_registrations_count_kubelet_restarts(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    manager = manager_for(root, kubelet_dir)
    with KubeletStandIn(kubelet_dir) as kubelet, running(manager), endpoint(manager) as server:

        def registrations() -> float | None:
            return value(scrape(server.port), "gpu_device_plugin_registrations_total", resource=TU106)

        def registered(count: int) -> None:
            # Bounds for a loaded machine: the plugin notices the new kubelet.sock and registers in well under a
            # second when idle; under load it can take several (the bound only ends a run that went wrong).
            kubelet.wait_for_registration(TU106, count, timeout=LOADED_WAIT)
            wait_until(lambda: registrations() == count, LOADED_WAIT, what=f"{count} registrations in /metrics")

        registered(1)
        kubelet.restart()
        registered(2)
        kubelet.restart()
        registered(3)
        failures = value(scrape(server.port), "gpu_device_plugin_registration_failures_total", resource=TU106)
        assert failures in (None, 0)


def test_healthz_200_while_running_503_after_stop_then_refused(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    manager = manager_for(root, kubelet_dir)
    with KubeletStandIn(kubelet_dir) as kubelet, endpoint(manager) as server:
        status, _, body = get(server.port, "/healthz")
        assert (status, body) == (503, "not started: the plugin's loop has not run yet\n")
        with running(manager):
            assert get(server.port, "/healthz")[::2] == (200, "ok\n")
            kubelet.wait_for_registration(TU106)
            wait_until(lambda: get(server.port, "/readyz")[0] == 200, what="/readyz 200 once registered")
            assert get(server.port, "/nothing")[0] == 404
        status, _, body = get(server.port, "/healthz")
        assert status == 503 and body.startswith("stopped"), body
        assert get(server.port, "/readyz")[0] == 503
        port = server.port
    assert refused(port)


def test_healthz_503_while_the_loop_is_stuck_in_a_scan(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    gate = threading.Event()
    gate.set()

    def scan(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(WAIT), "the test never opened the gate"
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(manager_module, "scan", scan)  # a sysfs read that hangs, on demand
    monkeypatch.setattr(manager_module, "LIVENESS_SLACK", 0.0)  # bound: 2 x 0.05 s
    manager = manager_for(root, kubelet_dir, scan_interval=0.05)
    with running(manager), endpoint(manager) as server:
        assert get(server.port, "/healthz")[0] == 200
        gate.clear()
        try:
            wait_until(lambda: get(server.port, "/healthz")[0] == 503, what="/healthz 503 while a scan hangs")
            assert get(server.port, "/healthz")[2].startswith("stuck: the plugin's loop last turned")
        finally:
            gate.set()
        wait_until(lambda: get(server.port, "/healthz")[0] == 200, what="/healthz 200 once the scan returns")


def test_readyz_waits_for_the_kubelet_and_healthz_fails_when_it_stays_away(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    manager = manager_for(root, kubelet_dir)
    with running(manager), endpoint(manager) as server:
        # No kubelet: serving, alive, not ready.
        assert get(server.port, "/healthz")[0] == 200
        status, _, body = get(server.port, "/readyz")
        assert status == 503 and TU106 in body, body
        with KubeletStandIn(kubelet_dir) as kubelet:
            kubelet.wait_for_registration(TU106)
            wait_until(lambda: get(server.port, "/readyz")[0] == 200, what="/readyz 200")
    (kubelet_dir / "kubelet.sock").unlink()  # the stopped kubelet left it, as a killed one does; not this time
    like = manager_for(root, kubelet_dir)
    impatient = PluginManager(
        like.config,
        kubelet_dir,
        scan_interval=0.2,
        pci_ids=like.pci_ids,
        kubelet_missing_bound=0,
        metrics=PluginMetrics(),
    )
    with running(impatient), endpoint(impatient) as server:
        wait_until(lambda: get(server.port, "/healthz")[0] == 503, what="/healthz 503 without kubelet.sock")
        assert "no kubelet" in get(server.port, "/healthz")[2]
        with KubeletStandIn(kubelet_dir):
            wait_until(lambda: get(server.port, "/healthz")[0] == 200, what="/healthz 200 with a kubelet")


def test_metrics_of_two_managers_do_not_collide() -> None:
    first, second = PluginMetrics(), PluginMetrics()
    first.record_allocation(TU106, grpc.StatusCode.OK)
    first.record_registration(TU106, ok=True)
    assert b'gpu_device_plugin_allocations_total{resource="nvidia.com/TU106' in first.exposition()
    assert b"gpu_device_plugin_allocations_total{" not in second.exposition()
    assert b"# HELP gpu_device_plugin_registrations_total " in second.exposition()  # HELP even without samples


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("127.0.0.1:9498", ("127.0.0.1", 9498)),
        (":9498", ("", 9498)),
        ("[::1]:0", ("::1", 0)),
        ("fd00::5:9498", ("fd00::5", 9498)),
        ("localhost:80", ("localhost", 80)),
    ],
)
def test_parse_address(text: str, parsed: tuple[str, int]) -> None:
    assert parse_address(text) == parsed


@pytest.mark.parametrize("text", ["9498", "host:", "host:port", "1.2.3.4:65536"])
def test_parse_address_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=r"HOST:PORT|out of range"):
        parse_address(text)


# -- gpu-device-plugin serve --------------------------------------------------------------------------------


def _metrics_port(log: Path) -> int:
    """The port ``serve`` announced in its ``metrics_serving`` event."""
    found: list[int] = []

    def announced() -> bool:
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "metrics_serving":
                found.append(int(event["port"]))
                return True
        return False

    wait_until(announced, what="the metrics_serving event")
    return found[0]


@contextmanager
def serve(root: Path, kubelet_dir: Path, log: Path, *args: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            serve_command(root, kubelet_dir, "--scan-interval", "0.2", *args),
            env=plugin_env(**env),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_process_metrics_and_healthz(base: Path, how: str) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    log = base / "plugin.log"
    address = f"{LOOPBACK}:0"
    args, env = (("--metrics-address", address), {}) if how == "flag" else ((), {"GPU_PLUGIN_METRICS_ADDRESS": address})
    with KubeletStandIn(kubelet_dir) as kubelet, serve(root, kubelet_dir, log, *args, **env) as process:
        port = _metrics_port(log)
        kubelet.wait_for_registration(TU106)
        assert get(port, "/healthz")[::2] == (200, "ok\n")
        wait_until(lambda: get(port, "/readyz")[0] == 200, what="/readyz 200")
        wait_until(lambda: devices(port) == (4, 0), what="4 Healthy devices in /metrics")
        kubelet.allocate(TU106, ["0000:86:00.0"])
        assert allocations(port, "ok") == 1
        remove_group_node(root, 74)  # 0000:86:00.0's group
        wait_until(lambda: devices(port) == (3, 1), what="3 Healthy and 1 Unhealthy in /metrics")
        kubelet.restart()
        kubelet.wait_for_registration(TU106, 2)
        wait_until(
            lambda: value(scrape(port), "gpu_device_plugin_registrations_total", resource=TU106) == 2,
            what="2 registrations",
        )
        samples = scrape(port)
        assert not any(name.endswith("_created") for name, _ in samples)  # the process drops *_created series
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0
    assert refused(port)


def test_serve_refuses_a_bad_or_taken_metrics_address(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    command = serve_command(root, kubelet_dir, "--metrics-address", "nonsense")
    done = subprocess.run(command, env=plugin_env(), capture_output=True, timeout=30, check=False)
    assert done.returncode == 2 and b"HOST:PORT" in done.stderr, done.stderr
    taken = MetricsServer(LOOPBACK, 0, PluginMetrics(), lambda: None)
    try:
        command = serve_command(root, kubelet_dir, "--metrics-address", f"{LOOPBACK}:{taken.port}")
        done = subprocess.run(command, env=plugin_env(), capture_output=True, timeout=30, check=False)
    finally:
        taken.stop()
    assert done.returncode == 1 and b"cannot serve metrics" in done.stderr, done.stderr
    assert not (kubelet_dir.exists() and any(kubelet_dir.iterdir()))  # failed before serving anything
