"""``gpu-node-agent`` with the simulated kernel, as a pod of the real-cluster tests runs it.

The real cluster's node has no GPU and no VFIO: its DaemonSets mount a fixture tree where ``/sys`` should be.
Plain files cannot react to the agent's writes, so a pod that must move GPUs between drivers (the node-label
protocol's scenario, ``tests/cluster/test_s8_node_protocol.py``) runs this instead of ``gpu-node-agent``: the
same command line, options and environment, with :class:`~simkit.kernel_sim.SimKernel` over the host root
(``--host-root`` / ``GPU_NODE_AGENT_HOST_ROOT``) as the kernel. Everything else is the product's code: the API
edge, the loop, the plans and the writes. Only tests start it (``python -m simkit.sim_agent operate …``).
``SIMKIT_NODE=mig``: the tree is :func:`simkit.agent_nodes.build_mig_node`'s, and the simulator is told its
GPUs' SR-IOV and MIG capabilities (which live in the simulator, not in the tree).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from node_agent.cli import ENV_PREFIX, cli
from schemas.clirun import error_exit, run_cli
from simkit.agent_nodes import mig_capable
from simkit.kernel_sim import SimKernel


def host_root(argv: list[str]) -> Path:
    """The ``--host-root`` the command line gives (``--host-root X`` or ``--host-root=X``), else the env's, else /."""
    for index, word in enumerate(argv):
        if word == "--host-root" and index + 1 < len(argv):
            return Path(argv[index + 1])
        if word.startswith("--host-root="):
            return Path(word.split("=", 1)[1])
    return Path(os.environ.get(f"{ENV_PREFIX}_HOST_ROOT", "/"))


def main(argv: list[str] | None = None) -> None:
    words = sys.argv[1:] if argv is None else argv
    root = host_root(words)
    if not (root / "sys" / "bus" / "pci" / "devices").is_dir():
        error_exit(f"{root} holds no fixture tree (no sys/bus/pci/devices): pass --host-root", 2)
    kernel = SimKernel(root)
    node = os.environ.get("SIMKIT_NODE", "")
    if node == "mig":
        mig_capable(kernel)
    elif node:
        error_exit(f"SIMKIT_NODE={node!r}: only 'mig' is known", 2)
    run_cli(cli, "gpu-node-agent", words, obj=kernel)


if __name__ == "__main__":
    main()
