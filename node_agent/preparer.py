"""The node-local core behind ``gpu-node-agent operate``: :class:`WorkloadPreparer`, the one adapter between the
label-following loop (:mod:`node_agent.operate`) and the modules that change and describe the node.

The loop knows labels, pauses and states; this module knows the node. For each pass it turns what the Node's
labels ask for (:class:`~node_agent.operate.Wanted`) into a :class:`~node_agent.workload.Desired`: the workload,
the per-GPU overrides of ``--workload-config`` and, when any GPU is to serve vGPUs, the config named by
``nvidia.com/vgpu.config`` from ``--vgpu-config``. Both files are read again on every pass (a ConfigMap volume
changes under a running pod), and a file that cannot be read or a config that is not in it makes the plan a
refusal naming it, never a half-applied node. After each pass it reports to the node what the pass settled:
the agent's readiness file (``<state dir>/ready``, what the plugin's init container and the pod's readiness
probe look for) exists exactly while the node serves its labels' workload, and the GPU Operator's sandbox
validator files (:mod:`node_agent.validations`) say the same for Operator users.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from node_agent import vgpu as vgpus
from node_agent.kernel import AgentError, Kernel, RealKernel
from node_agent.mig import NvidiaSmi
from node_agent.node_labels import COUNT, PRODUCT, VGPU_TYPE_PREFIX, node_labels
from node_agent.operate import Plan, PreparerConfig, Wanted
from node_agent.state import read_state, set_ready
from node_agent.sysfs import Sysfs
from node_agent.validations import write_validations
from node_agent.vgpu_config import VgpuSpec, load_specs
from node_agent.workload import VGPU, Desired, Outcome, Transition, apply_transition, plan_transition
from node_agent.workload_config import load_workload_config
from runtime.logs import component_logger
from runtime.pciids import PciIds, locate_pci_ids
from schemas import node_agent_state as state_schema
from schemas.errors import InputError

log = component_logger("node_agent")

FEATURE_LABELS = (PRODUCT, COUNT, VGPU_TYPE_PREFIX)
"""What :meth:`WorkloadPreparer.labels` can return: two keys and one prefix (:mod:`node_agent.node_labels`)."""


@dataclass(frozen=True)
class RefusedPlan:
    """A pass that cannot be planned (a file or config the labels name is missing or broken): refused whole."""

    refusals: list[str]
    changes: bool = False
    workloads: dict[str, str] = field(default_factory=dict)


class WorkloadPreparer:
    """:class:`~node_agent.operate.Preparer` over :mod:`node_agent.workload` on the host root of ``config``."""

    def __init__(self, config: PreparerConfig) -> None:
        self.config = config
        self.fs = Sysfs(config.host_root)
        given = config.kernel
        self.kernel: Kernel = given if given is not None else RealKernel(self.fs)  # type: ignore[assignment]
        self.mig = NvidiaSmi(self.kernel, config.nvidia_smi)
        self._pciids: PciIds | None = None
        self._pciids_read = False

    @property
    def label_prefixes(self) -> tuple[str, ...]:
        return FEATURE_LABELS

    # -- the loop's steps ----------------------------------------------------------------------------------

    def desired(self, wanted: Wanted) -> Desired:
        """What the labels and the two files ask for now; an error names the file or the config."""
        overrides = () if self.config.workload_config is None else load_workload_config(self.config.workload_config)
        workloads = {wanted.workload, *(override.workload for override in overrides)}
        specs: tuple[VgpuSpec, ...] = ()
        if VGPU in workloads:
            specs = self._vgpu_specs(wanted.vgpu_config)
        return Desired(wanted.workload, overrides, specs)

    def plan(self, wanted: Wanted, allocated: frozenset[str]) -> Plan:
        try:
            desired = self.desired(wanted)
            return plan_transition(
                self.fs,
                self.kernel,
                desired,
                allocated,
                remembered=self._remembered(),
                nvidia_smi=self.config.nvidia_smi,
                mig=self.mig,
            )
        except InputError as exc:  # AgentError is one: a file, a config, or the node unreadable
            return RefusedPlan([str(exc)])

    def apply(self, plan: Plan) -> Outcome:
        if not isinstance(plan, Transition):
            raise AgentError("a refused plan cannot be applied")
        return apply_transition(self.fs, self.kernel, plan, state_dir=self.config.state_dir)

    def labels(self, workloads: Mapping[str, str]) -> dict[str, str]:
        return node_labels(self.fs, workloads, self.pciids(), self._remembered())

    def withdrawn_resources(self, plan: Plan) -> frozenset[str] | None:
        """None: every resource of the plugin. A paused plugin withdraws all it serves (its pod leaves the node),
        so the kubelet offers none of them once it has noticed."""
        return None

    def settled(self, state: str, message: str, workloads: Mapping[str, str], workload: str) -> None:
        """After a pass: the readiness file and the validator's files for what the node now serves. ``refused``
        and ``pending`` leave them as they were (the node still serves what it served)."""
        if state not in ("success", "failed"):
            return
        on_vgpu = {address for address, serving in workloads.items() if serving == VGPU}
        held = {p.name: p.vgpus() for p in vgpus.read_parents(self.fs, required=False) if p.name in on_vgpu}
        outcome = Outcome(state, message, dict(workloads), vgpus=held, default=workload)  # type: ignore[arg-type]
        set_ready(self.config.state_dir, state == "success", {"workload": workload, "gpus": dict(workloads)})
        if self.config.validations_dir is not None:
            write_validations(self.config.validations_dir, outcome, workloads, workload)

    # -- what the steps read ---------------------------------------------------------------------------------

    def pciids(self) -> PciIds | None:
        """The image's (or host's) pci.ids, read once: product labels by name (None: no product label)."""
        if not self._pciids_read:
            self._pciids_read = True
            try:
                choice = locate_pci_ids(None, self.config.host_root)
            except (InputError, OSError) as exc:
                log.warning("no pci.ids for the product label: %s", exc)
            else:
                self._pciids = choice.database
                for warning in choice.warnings:
                    log.warning("%s", warning)
        return self._pciids

    def _remembered(self) -> dict[str, dict[int, str]]:
        return state_schema.type_names(read_state(self.config.state_dir))

    def _vgpu_specs(self, name: str | None) -> tuple[VgpuSpec, ...]:
        path = self.config.vgpu_config
        if path is None or not name:
            raise AgentError(
                "a GPU is to serve vGPUs but no vGPU config is named (nvidia.com/vgpu.config, or "
                "--default-vgpu-config, and --vgpu-config)"
            )
        return load_specs(path, name)


def workload_preparer(config: PreparerConfig) -> WorkloadPreparer:
    return WorkloadPreparer(config)
