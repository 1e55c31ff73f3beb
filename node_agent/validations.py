"""The GPU Operator sandbox validator's readiness files, for nodes that run the Operator beside this agent.

NVIDIA's validator (``cmd/nvidia-validator/main.go`` in NVIDIA/gpu-operator) keeps its status files in
``/run/nvidia/validations``; the Operator's other DaemonSets wait in init containers until a file exists (the
sandbox device plugin for ``vfio-pci-ready`` or ``vgpu-devices-ready`` after reading ``workload-type``, the
vGPU device manager for ``vgpu-manager-ready`` or ``host-vgpu-manager-ready``). The ones this agent writes,
as the validator does (docs/node-agent.md, "Validator readiness files"):

- ``workload-type``: the node's workload and a newline (the validator writes the label's value, ready or not);
- ``vfio-pci-ready`` (empty): the ``vm-passthrough`` GPUs are on their VFIO driver;
- ``host-vgpu-manager-ready`` (empty): the ``vm-vgpu`` GPUs are vGPU parents of a vGPU manager installed on
  the host (this agent never deploys one as a container, so ``vgpu-manager-ready`` is not ours);
- ``vgpu-devices-ready`` (empty): the ``vm-vgpu`` GPUs hold vGPUs.

A ``*-ready`` file exists exactly while the last workload apply succeeded and its condition holds; otherwise it
is removed. Files are written atomically (temporary file, flush, rename); no other file of the directory is
touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from node_agent.kernel import AgentError
from node_agent.state import atomic_write
from node_agent.workload import PASSTHROUGH, VGPU, WORKLOADS, Outcome

DEFAULT_DIR = Path("/run/nvidia/validations")
WORKLOAD_TYPE = "workload-type"
VFIO_PCI_READY = "vfio-pci-ready"
HOST_VGPU_MANAGER_READY = "host-vgpu-manager-ready"
VGPU_DEVICES_READY = "vgpu-devices-ready"
OWNED = (WORKLOAD_TYPE, VFIO_PCI_READY, HOST_VGPU_MANAGER_READY, VGPU_DEVICES_READY)
"""The only files of the directory this agent writes or removes."""


def validation_files(
    outcome: Outcome, workloads: Mapping[str, str], workload: str | None = None
) -> dict[str, str | None]:
    """Each owned file's content, or None where it must not exist (pure). ``workload``: the node's (default:
    the outcome's, else the one workload every GPU has)."""
    node = workload or outcome.default or None
    if node is None and len(set(workloads.values())) == 1:
        node = next(iter(workloads.values()))
    if node is not None and node not in WORKLOADS:
        raise AgentError(f"workload {node!r} is none of {', '.join(WORKLOADS)}")
    success = outcome.state == "success"
    passthrough = success and any(value == PASSTHROUGH for value in workloads.values())
    on_vgpu = [address for address, value in workloads.items() if value == VGPU]
    devices = success and any(outcome.vgpus.get(address) for address in on_vgpu)
    return {
        WORKLOAD_TYPE: None if node is None else node + "\n",
        VFIO_PCI_READY: "" if passthrough else None,
        HOST_VGPU_MANAGER_READY: "" if success and on_vgpu else None,
        VGPU_DEVICES_READY: "" if devices else None,
    }


def write_validations(
    directory: Path, outcome: Outcome, workloads: Mapping[str, str], workload: str | None = None
) -> dict[str, bool]:
    """Make the owned files of ``directory`` what :func:`validation_files` says; returns which exist now."""
    present = {}
    for name, content in validation_files(outcome, workloads, workload).items():
        path = directory / name
        if content is None:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise AgentError(f"cannot remove {path}: {exc.strerror or exc}") from None
            present[name] = False
        else:
            atomic_write(path, content)
            present[name] = True
    return present
