"""``gpu-device-plugin serve`` as a real process against the kubelet stand-in, while the node and kubelet change.

The lifecycle as a DaemonSet lives it: started before the kubelet, a group node removed and restored, a
kubelet restart, its own socket deleted, SIGTERM (exit 0, sockets removed, within 5 s); configuration from
flags and from ``GPU_PLUGIN_*`` variables; a bad configuration is a clear error, not a traceback. Its stderr
is one JSON object per line.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from simkit.fixture_nodes import NODE01, VGPU_NODE
from simkit.kubelet_standin import KubeletStandIn
from tests.plugin_support import (
    ROOT,
    WAIT,
    build_tree,
    plugin_env,
    remove_group_node,
    restore_group_node,
    serve_command,
    serve_process,
    short_dir,
    sockets,
    wait_until,
)

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
TU106_SOCKET = "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
GPUS = ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0")


@pytest.fixture
def base() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory


def _events(log: Path) -> list[dict[str, object]]:
    """The JSON log's events, without the envelope every line carries (``time``, ``level``, ``component``)."""
    return [_fields(json.loads(line)) for line in log.read_text().splitlines() if line.strip()]


def _fields(line: dict[str, object]) -> dict[str, object]:
    assert line.pop("component") == "plugin" and line.pop("level") and str(line.pop("time")).endswith("Z"), line
    return line


def test_process_lifecycle_late_kubelet_health_restart_socket_sigterm(base: Path) -> None:
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    log = base / "plugin.log"
    kubelet = KubeletStandIn(kubelet_dir)
    with serve_process(root, kubelet_dir, "--scan-interval", "30", log=log) as process:
        # Started before the kubelet: it serves and waits.
        wait_until((kubelet_dir / TU106_SOCKET).is_socket, what="the plugin's socket")
        assert process.poll() is None
        kubelet.start()
        try:
            kubelet.wait_for_registration(TU106)
            kubelet.wait_for_devices(TU106, lambda devices: devices == dict.fromkeys(GPUS, "Healthy"))
            remove_group_node(root, 74)  # 0000:86:00.0's group; the 30 s scan interval cannot be what notices
            kubelet.wait_for_devices(TU106, lambda devices: devices.get("0000:86:00.0") == "Unhealthy")
            restore_group_node(root, 74)
            kubelet.wait_for_devices(TU106, lambda devices: devices == dict.fromkeys(GPUS, "Healthy"))
            kubelet.restart()
            kubelet.wait_for_registration(TU106, 2)
            kubelet.wait_for_devices(TU106, lambda devices: devices == dict.fromkeys(GPUS, "Healthy"))
            (kubelet_dir / TU106_SOCKET).unlink()
            kubelet.wait_for_registration(TU106, 3)
            wait_until(lambda: kubelet.stream_open(TU106), what="a new ListAndWatch stream")
            response = kubelet.allocate(TU106, ["0000:af:00.0", "0000:86:00.0"])
            assert dict(response.container_responses[0].envs) == {
                "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A": "0000:af:00.0,0000:86:00.0",
                "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A": "0000:af:00.0=0000:af:00.1+0000:af:00.2"
                "+0000:af:00.3,0000:86:00.0=0000:86:00.1+0000:86:00.2+0000:86:00.3",
            }
            process.send_signal(signal.SIGTERM)
            assert process.wait(5) == 0
            assert sockets(kubelet_dir) == ["kubelet.sock"]
            kubelet.wait_for_stream_end(TU106)
        finally:
            kubelet.stop()
    events = _events(log)
    names = [event["event"] for event in events]
    for expected in ("starting", "serving", "waiting_for_kubelet", "registered", "health_changed", "socket_gone"):
        assert expected in names, f"no {expected!r} event in {names}"
    assert {"event": "allocate", "resource": TU106, "ids": ["0000:af:00.0", "0000:86:00.0"]} in events
    assert names[-2:] == ["stopped", "signal"]


def test_process_configured_by_environment_and_sigint(base: Path) -> None:
    root = build_tree(VGPU_NODE, base)
    kubelet_dir = base / "kubelet"
    env = plugin_env(
        GPU_PLUGIN_HOST_ROOT=str(root),
        GPU_PLUGIN_KUBELET_DIR=str(kubelet_dir),
        GPU_PLUGIN_SCAN_INTERVAL="0.5",
        GPU_PLUGIN_PCI_IDS=str(root / "usr" / "share" / "misc" / "pci.ids"),
    )
    code = "from plugin.cli import main; main()"
    with KubeletStandIn(kubelet_dir) as kubelet:
        process = subprocess.Popen(
            [sys.executable, "-c", code, "serve"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            kubelet.wait_for_registration("nvidia.com/GRID_T4-1Q")
            kubelet.wait_for_registration("nvidia.com/GRID_T4-2Q")
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=5)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 0
        assert sockets(kubelet_dir) == ["kubelet.sock"]
    events = [json.loads(line) for line in stderr.decode().splitlines()]
    assert events[0]["event"] == "starting"
    assert events[0]["scan_interval"] == 0.5
    assert str(events[0]["pci_ids"]).endswith("pci.ids")


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        (["--config", "/nonexistent/plugin.yaml"], {}, "does not exist"),
        (["--pci-ids", "/nonexistent/pci.ids"], {}, "does not exist"),
        ([], {"GPU_PLUGIN_PCI_SELECTORS": "nope"}, "GPU_PLUGIN_PCI_SELECTORS"),
        (["--scan-interval", "0"], {}, "--scan-interval"),
    ],
)
def test_bad_configuration_is_a_clear_error(base: Path, extra: list[str], env: dict[str, str], message: str) -> None:
    root = build_tree(NODE01, base)
    result = subprocess.run(
        serve_command(root, base / "kubelet", *extra),
        env=plugin_env(**env),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr.decode()
    assert "Traceback" not in result.stderr.decode()
    assert not (base / "kubelet").exists() or sockets(base / "kubelet") == []


def test_bad_host_root_is_a_clear_error(base: Path) -> None:
    result = subprocess.run(
        serve_command(base / "missing", base / "kubelet"),
        env=plugin_env(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert "host root" in result.stderr.decode()


def test_console_script_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'gpu-device-plugin = "plugin.cli:main"' in text
    assert WAIT > 0
