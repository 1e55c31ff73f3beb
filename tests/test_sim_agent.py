"""``python -m simkit.sim_agent``: the agent's own command line with the simulated kernel, as the real-cluster
tests' pods run it. The writes must take effect (the plain files of a fixture tree would ignore them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node_agent.sysfs import Sysfs, read_function
from simkit.agent_nodes import build_node, passthrough_node
from simkit.sim_agent import host_root

REPO = Path(__file__).parents[1]
CARD = ["0000:86:00.0", "0000:86:00.1", "0000:86:00.2", "0000:86:00.3"]


def test_the_agent_binds_through_the_simulated_kernel(tmp_path: Path) -> None:
    root = build_node(passthrough_node(), tmp_path / "root").root
    argv = [sys.executable, "-m", "simkit.sim_agent", "bind", "--all", "--host-root", str(root)]
    done = subprocess.run(
        [*argv, "--state-dir", str(tmp_path / "state")],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["writes"] > 0
    assert [read_function(Sysfs(root), a).driver for a in CARD] == ["vfio-pci"] * 4


def test_the_host_root_comes_from_the_command_line_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_NODE_AGENT_HOST_ROOT", "/c")
    assert host_root(["bind", "--host-root", "/a"]) == Path("/a")
    assert host_root(["bind", "--host-root=/b"]) == Path("/b")
    assert host_root(["bind"]) == Path("/c")
    monkeypatch.delenv("GPU_NODE_AGENT_HOST_ROOT")
    assert host_root(["bind"]) == Path("/")


def test_a_root_without_a_tree_is_refused_naming_it(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "simkit.sim_agent", "bind", "--all", "--host-root", str(tmp_path)]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert done.stderr == f"error: {tmp_path} holds no fixture tree (no sys/bus/pci/devices): pass --host-root\n"


MIG_CONFIG = """\
version: v1
vgpu-configs:
  mig:
    - devices: [0]
      vgpu-devices: {A100-1-5C: 2}
"""


def test_simkit_node_mig_gives_the_agent_the_mig_gpus_of_the_tree(tmp_path: Path) -> None:
    """In its own process the simulator knows the MIG tree's SR-IOV and MIG GPUs only when told (SIMKIT_NODE)."""
    from simkit.agent_nodes import build_mig_node

    root = build_mig_node(tmp_path / "root").root
    (tmp_path / "vgpu.yaml").write_text(MIG_CONFIG)
    argv = [sys.executable, "-m", "simkit.sim_agent", "workload", "apply", "--workload", "vm-vgpu"]
    argv += ["--vgpu-config", str(tmp_path / "vgpu.yaml"), "--vgpu-select", "mig", "--host-root", str(root)]
    argv += ["--state-dir", str(tmp_path / "state"), "--validations-dir", ""]
    done = subprocess.run(
        argv,
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "SIMKIT_NODE": "mig"},
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)["outcome"]
    assert outcome["state"] == "success"
    vfs = list((root / "sys/bus/pci/devices/0000:3b:00.0").glob("virtfn*"))
    typed = [vf for vf in vfs if (vf / "nvidia/current_vgpu_type").read_text().strip() not in ("", "0")]
    assert len(typed) == 2
    unknown = subprocess.run(
        argv, check=False, capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, "SIMKIT_NODE": "x"}
    )
    assert unknown.returncode == 2 and "SIMKIT_NODE='x'" in unknown.stderr
