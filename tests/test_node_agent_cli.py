"""gpu-node-agent as a process: hostile or odd input is one ``error: …`` line naming the culprit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from simkit.agent_nodes import build_node, mdev_node, passthrough_node
from tests.test_cli_errors import assert_error, run


def agent(tmp_path: Path, *args: str) -> tuple[str, int]:
    done = run("node_agent.cli", *args, "--state-dir", str(tmp_path / "state"), env=dict(os.environ))
    return assert_error(done, code=done.returncode), done.returncode


@pytest.fixture
def root(tmp_path: Path) -> Path:
    build_node(mdev_node(), tmp_path / "root")
    return tmp_path / "root"


def test_a_fifo_as_config_is_refused_without_blocking(tmp_path: Path, root: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    line, code = agent(tmp_path, "vgpu", "apply", "--host-root", str(root), "--config", str(fifo), "--select", "a")
    assert code == 1 and "is a FIFO, not a regular file" in line


def test_a_config_nested_past_the_recursion_limit_is_named(tmp_path: Path, root: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5_000 + "]" * 5_000)
    line, code = agent(tmp_path, "vgpu", "apply", "--host-root", str(root), "--config", str(deep), "--select", "a")
    assert code == 1 and ("nested too deeply" in line or "not valid YAML" in line)


def test_an_oversized_config_is_refused(tmp_path: Path, root: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("#" * (2 * 1024 * 1024))
    line, code = agent(tmp_path, "vgpu", "apply", "--host-root", str(root), "--config", str(big), "--select", "a")
    assert code == 1 and "over the 1048576-byte limit" in line


def test_a_missing_config_name_is_a_usage_error(tmp_path: Path, root: Path) -> None:
    (tmp_path / "c.yaml").write_text("version: v1\nvgpu-configs: {a: [{devices: all, vgpu-devices: {}}]}\n")
    line, code = agent(tmp_path, "vgpu", "apply", "--host-root", str(root), "--config", str(tmp_path / "c.yaml"))
    assert code == 2 and "GPU_NODE_AGENT_VGPU_SELECT" in line


def test_the_real_writer_on_plain_files_is_caught_by_the_read_back(tmp_path: Path) -> None:
    """Plain files do not react to writes: the agent's read-back says the function did not move, by name."""
    root = tmp_path / "root"
    build_node(passthrough_node(), root)
    (root / "sys/bus/pci/drivers/vfio-pci").mkdir()
    (root / "sys/bus/pci/devices/0000:86:00.0/driver_override").write_text("")
    for name in ("bind", "unbind"):
        for driver in ("vfio-pci", "nouveau"):
            (root / "sys/bus/pci/drivers" / driver / name).write_text("")
    line, code = agent(tmp_path, "bind", "--host-root", str(root), "0000:86:00.0")
    assert code == 1
    assert "0000:86:00.0 (10de:1f08) is on nouveau after binding it to vfio-pci" in line
