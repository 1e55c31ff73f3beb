"""The node agent's command line on fixture trees (the trees: simkit.agent_nodes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from node_agent.cli import cli
from simkit.agent_nodes import MODULES_ALIAS, build_node, consumer_card, grace_gpu, mdev_node, passthrough_node
from simkit.kernel_sim import SimKernel

__all__ = [
    "MODULES_ALIAS",
    "agent",
    "build_node",
    "consumer_card",
    "grace_gpu",
    "mdev_node",
    "passthrough_node",
    "report",
]

_COMMANDS = {"bind", "unbind", "validate", "prepare", "vgpu", "workload", "apply"}


def agent(kernel: SimKernel, *args: str, state_dir: Path | None = None, env: dict[str, str] | None = None) -> Result:
    """``gpu-node-agent ARGS`` through click with the simulator as the kernel (``--host-root`` the tree,
    ``--state-dir`` beside it). An ``AgentError`` is in ``result.exception``, as run_cli would print it."""
    state = state_dir or kernel.root.parent / "state"
    words = 0
    while words < len(args) and args[words] in _COMMANDS:
        words += 1
    argv = [*args[:words], "--host-root", str(kernel.root), "--state-dir", str(state), *args[words:]]
    return CliRunner().invoke(cli, argv, obj=kernel, env=env)


def report(result: Result) -> dict[str, Any]:
    """The JSON report a command printed."""
    return dict(json.loads(result.stdout))
