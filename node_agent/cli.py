"""``gpu-node-agent``: thin click commands over :mod:`node_agent.bind`, :mod:`node_agent.vgpu`,
:mod:`node_agent.state` and (``operate``, which alone loads the Kubernetes client) :mod:`node_agent.operate`.
Each prints a JSON report on stdout and fails (``error: …``, exit 1) naming every refusal. The kernel is
:class:`~node_agent.kernel.RealKernel` unless a caller passes another as click's ``obj`` (the tests pass
``simkit.kernel_sim.SimKernel``).

Every option can come from the environment (``GPU_NODE_AGENT_<OPTION>``), as a DaemonSet sets it.
Stopping the agent changes nothing: ``--stay`` only waits for SIGTERM/SIGINT and exits 0.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import click

from node_agent import protocol
from node_agent.bind import bind as bind_groups
from node_agent.bind import driver_chooser, missing_bindings, select
from node_agent.bind import load_aliases as read_aliases
from node_agent.bind import unbind as unbind_groups
from node_agent.drivers import VfioAlias
from node_agent.kernel import AgentError, Kernel, RealKernel
from node_agent.mig import NVIDIA_SMI, NvidiaSmi
from node_agent.state import DEFAULT_STATE_DIR, read_state, set_ready, write_section
from node_agent.sysfs import Sysfs
from node_agent.validations import DEFAULT_DIR as VALIDATIONS_DIR
from node_agent.validations import write_validations
from node_agent.vgpu import apply as apply_vgpus
from node_agent.vgpu import pending, plan_all
from node_agent.vgpu_config import VgpuSpec, load_specs
from node_agent.workload import WORKLOADS, Desired, apply_transition, plan_transition
from node_agent.workload_config import load_workload_config
from runtime.cli_options import log_format_option
from runtime.logs import component_logger, configure_logging
from runtime.pod_resources import DEFAULT_SOCKET as DEFAULT_POD_RESOURCES_SOCKET
from runtime.signals import stop_on_signals
from schemas import node_agent_state as state_schema
from schemas.clirun import run_cli
from schemas.logformat import LogFormat

COMPONENT = "node_agent"
ENV_PREFIX = "GPU_NODE_AGENT"
log = component_logger(COMPONENT)


def env(name: str) -> str:
    return f"{ENV_PREFIX}_{name.upper()}"


def _kernel(context: click.Context, fs: Sysfs) -> Kernel:
    obj = context.find_root().obj
    return obj if obj is not None else RealKernel(fs)


def load_aliases(fs: Sysfs, release: str | None = None) -> list[VfioAlias]:
    """The ``vfio_pci:`` aliases of the running kernel's modules.alias under the host root (none when absent:
    every device then takes vfio-pci), read through the host root's resolver."""
    aliases = read_aliases(fs, release)
    if aliases is None:
        log.info("no modules.alias under %s: every device takes vfio-pci", fs.root / "lib" / "modules")
        return []
    return aliases


def _emit(report: dict[str, Any]) -> None:
    click.echo(json.dumps(report, indent=2, sort_keys=True))


def _stay() -> None:
    """Wait for SIGTERM/SIGINT, then return: the node stays as it is (no unbind, no vGPU removal)."""
    stop = threading.Event()
    with stop_on_signals(stop.set) as received:
        stop.wait()
    log.info("stopping on %s; the node is left as it is", ",".join(received) or "request")


host_root_option = click.option(
    "--host-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    show_default=True,
    envvar=env("host_root"),
    show_envvar=True,
    help="Where the node's / is mounted (sysfs, /dev/vfio, /proc and lib/modules are used under it).",
)
state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_STATE_DIR,
    show_default=True,
    envvar=env("state_dir"),
    show_envvar=True,
    help="Where state.json and the readiness file go.",
)
selection_options = [
    click.argument("addresses", nargs=-1),
    click.option("--all", "all_gpus", is_flag=True, help="Every NVIDIA GPU (vendor 10de, VGA or 3D controller)."),
    click.option(
        "--select",
        "selectors",
        multiple=True,
        envvar=env("select"),
        show_envvar=True,
        metavar="VENDOR:DEVICE",
        help="Also every function with these IDs (e.g. 1234:1111 for QEMU's bochs-display in tests); repeatable.",
    ),
    click.option(
        "--allow-group",
        "allowed_groups",
        multiple=True,
        type=click.IntRange(min=0),
        envvar=env("allow_groups"),
        show_envvar=True,
        metavar="N",
        help="Bind IOMMU group N although it holds functions that are not the GPU's own (a NIC, a disk, another "
        "vendor's device): they leave the host with it. Repeatable; see docs/node-agent.md for the risk.",
    ),
]


def with_selection(function: Any) -> Any:
    for option in reversed(selection_options):
        function = option(function)
    return function


def _selected(fs: Sysfs, addresses: tuple[str, ...], all_gpus: bool, selectors: tuple[str, ...]) -> list[str]:
    if not (addresses or all_gpus or selectors):
        raise click.UsageError("name the GPUs: PCI addresses, --all, or --select VENDOR:DEVICE")
    if not fs.is_dir(fs.pci_devices):
        raise AgentError(f"{fs.pci_devices} does not exist: is {fs.root} the node's / (--host-root)?")
    selected = select(fs, addresses, selectors, all_gpus)
    if not selected:
        wanted = " or ".join(["NVIDIA GPU (10de, VGA or 3D)"] * all_gpus + [f"function {s}" for s in selectors])
        raise AgentError(f"no {wanted} on this node (under {fs.pci_devices})")
    return selected


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="kubevirt-gpu-passthrough")
@log_format_option(env("log_format"))
def cli(log_format: LogFormat) -> None:
    """Prepare a node for GPU VMs: GPUs onto VFIO (bind), vGPUs from a config (vgpu apply), readiness (validate)."""
    context = click.get_current_context()
    context.call_on_close(configure_logging(COMPONENT, log_format))


@cli.command()
@with_selection
@host_root_option
@state_dir_option
@click.option("--stay", is_flag=True, help="After binding, wait for SIGTERM/SIGINT (then exit, changing nothing).")
def bind(
    addresses: tuple[str, ...],
    all_gpus: bool,
    selectors: tuple[str, ...],
    allowed_groups: tuple[int, ...],
    host_root: Path,
    state_dir: Path,
    stay: bool,
) -> None:
    """Bind each selected GPU and every other function of its IOMMU group to the VFIO driver."""
    fs = Sysfs(host_root)
    kernel = _kernel(click.get_current_context(), fs)
    selected = _selected(fs, addresses, all_gpus, selectors)
    report = bind_groups(fs, kernel, selected, driver_chooser(fs, load_aliases(fs)), allowed_groups)
    write_section(state_dir, state_schema.SECTION_BIND, {"selected": selected, **report.as_dict()})
    _emit(report.as_dict())
    for address in report.changed:
        log.info("bound %s to %s", address, report.drivers.get(address))
    if report.refused:
        raise AgentError("; ".join(report.refused))
    if stay:
        _stay()


@cli.command()
@with_selection
@host_root_option
@state_dir_option
def unbind(
    addresses: tuple[str, ...],
    all_gpus: bool,
    selectors: tuple[str, ...],
    allowed_groups: tuple[int, ...],
    host_root: Path,
    state_dir: Path,
) -> None:
    """Clear driver_override and let the kernel reprobe each selected GPU's group (refused while a VM holds it)."""
    fs = Sysfs(host_root)
    kernel = _kernel(click.get_current_context(), fs)
    selected = _selected(fs, addresses, all_gpus, selectors)
    report = unbind_groups(fs, kernel, selected)
    write_section(state_dir, state_schema.SECTION_UNBIND, {"selected": selected, **report.as_dict()})
    set_ready(state_dir, False, {})
    _emit(report.as_dict())
    if report.refused:
        raise AgentError("; ".join(report.refused))


workload_options = [
    click.option(
        "--workload",
        type=click.Choice(WORKLOADS),
        default="vm-passthrough",
        show_default=True,
        envvar=env("workload"),
        show_envvar=True,
        help="What the node serves (the nvidia.com/gpu.workload.config label's value).",
    ),
    click.option(
        "--vgpu-config",
        "config_file",
        type=click.Path(dir_okay=False, path_type=Path),
        envvar=env("vgpu_config"),
        show_envvar=True,
        help="vm-vgpu: the vGPU config file.",
    ),
    click.option(
        "--vgpu-select", "config_name", envvar=env("vgpu_select"), show_envvar=True, help="vm-vgpu: the config's name."
    ),
    click.option(
        "--vgpu-parent",
        "parents",
        multiple=True,
        envvar=env("vgpu_parents"),
        show_envvar=True,
        help="vm-vgpu: manage these vGPU parents only.",
    ),
]

nvidia_smi_option = click.option(
    "--nvidia-smi",
    "nvidia_smi",
    default=NVIDIA_SMI,
    show_default=True,
    envvar=env("nvidia_smi"),
    show_envvar=True,
    help="The nvidia-smi command for MIG-backed vGPU types (a path, or words such as 'chroot /host nvidia-smi').",
)
workload_options.append(nvidia_smi_option)


def with_workload(function: Any) -> Any:
    for option in reversed(workload_options):
        function = option(function)
    return function


def _missing(
    fs: Sysfs,
    kernel: Kernel,
    state_dir: Path,
    workload: str,
    selection: tuple[tuple[str, ...], bool, tuple[str, ...], tuple[int, ...]],
    vgpu: tuple[Path | None, str | None, tuple[str, ...]],
    nvidia_smi: str = NVIDIA_SMI,
) -> list[str]:
    """What keeps the node from serving ``workload`` (empty: ready)."""
    if workload == "container":
        return []
    if workload == "vm-passthrough":
        selected = _selected(fs, *selection[:3])
        return missing_bindings(fs, selected, driver_chooser(fs, load_aliases(fs)), selection[3])
    config_file, config_name, parents = vgpu
    # Read only (the readiness probe runs this every 30 s): who holds a vGPU is asked of /proc, never by
    # opening its group node, which a VM's QEMU opening it at that instant would find busy.
    specs = _specs(config_file, config_name)
    return pending(plan_all(fs, None, specs, parents, _remembered(state_dir), NvidiaSmi(kernel, nvidia_smi)))


def _judge(state_dir: Path, workload: str, missing: list[str], done: dict[str, Any] | None = None) -> None:
    set_ready(state_dir, not missing, {"workload": workload})
    _emit({"workload": workload, "ready": not missing, "missing": missing, **({"done": done} if done else {})})
    if missing:
        raise AgentError(f"node not ready for {workload}: " + "; ".join(missing))


@cli.command()
@with_selection
@host_root_option
@state_dir_option
@with_workload
def validate(
    addresses: tuple[str, ...],
    all_gpus: bool,
    selectors: tuple[str, ...],
    allowed_groups: tuple[int, ...],
    host_root: Path,
    state_dir: Path,
    workload: str,
    config_file: Path | None,
    config_name: str | None,
    parents: tuple[str, ...],
    nvidia_smi: str,
) -> None:
    """Exit 0 when the node is ready for its workload (and write the readiness file), else 1 naming what is missing."""
    fs = Sysfs(host_root)
    kernel = _kernel(click.get_current_context(), fs)
    selection = (addresses, all_gpus, selectors, allowed_groups)
    _judge(
        state_dir,
        workload,
        _missing(fs, kernel, state_dir, workload, selection, (config_file, config_name, parents), nvidia_smi),
    )


@cli.command()
@with_selection
@host_root_option
@state_dir_option
@with_workload
@click.option("--stay", is_flag=True, help="When ready, wait for SIGTERM/SIGINT (then exit, changing nothing).")
def prepare(
    addresses: tuple[str, ...],
    all_gpus: bool,
    selectors: tuple[str, ...],
    allowed_groups: tuple[int, ...],
    host_root: Path,
    state_dir: Path,
    workload: str,
    config_file: Path | None,
    config_name: str | None,
    parents: tuple[str, ...],
    nvidia_smi: str,
    stay: bool,
) -> None:
    """What the workload needs: vm-passthrough binds, vm-vgpu applies the vGPU config, container does nothing;
    then validate (readiness file) and, with --stay, wait."""
    fs = Sysfs(host_root)
    kernel = _kernel(click.get_current_context(), fs)
    selection = (addresses, all_gpus, selectors, allowed_groups)
    done: dict[str, Any] | None = None
    if workload == "vm-passthrough":
        selected = _selected(fs, *selection[:3])
        report = bind_groups(fs, kernel, selected, driver_chooser(fs, load_aliases(fs)), allowed_groups)
        write_section(state_dir, state_schema.SECTION_BIND, {"selected": selected, **report.as_dict()})
        done = report.as_dict()
        if report.refused:
            set_ready(state_dir, False, {})
            raise AgentError("; ".join(report.refused))
    elif workload == "vm-vgpu":
        done = _apply(fs, kernel, state_dir, config_file, config_name, parents, nvidia_smi)
    missing = _missing(fs, kernel, state_dir, workload, selection, (config_file, config_name, parents), nvidia_smi)
    _judge(state_dir, workload, missing, done)
    if stay:
        _stay()


def _specs(config_file: Path | None, config_name: str | None) -> tuple[VgpuSpec, ...]:
    if config_file is None or not config_name:
        raise click.UsageError(
            f"the vGPU config file and the name of the config in it are needed ({env('vgpu_config')}, "
            f"{env('vgpu_select')})"
        )
    return load_specs(config_file, config_name)


def _remembered(state_dir: Path) -> dict[str, dict[int, str]]:
    """SR-IOV type names learnt by earlier runs (a VF with a type lists none)."""
    return state_schema.type_names(read_state(state_dir))


def _apply(
    fs: Sysfs,
    kernel: Kernel,
    state_dir: Path,
    config_file: Path | None,
    config_name: str | None,
    parents: tuple[str, ...],
    nvidia_smi: str = NVIDIA_SMI,
) -> dict[str, Any]:
    """Apply the named config; the state file's ``vgpu`` section says success (with the vGPUs) or the error."""
    specs = _specs(config_file, config_name)
    try:
        tool = NvidiaSmi(kernel, nvidia_smi)
        report = apply_vgpus(fs, kernel, specs, parents, _remembered(state_dir), mig=tool)
    except AgentError as exc:
        earlier = state_schema.section(read_state(state_dir), state_schema.SECTION_VGPU)
        failed = {**earlier, "config": config_name, "status": "failed", "error": str(exc)}
        write_section(state_dir, state_schema.SECTION_VGPU, failed)
        raise
    section = {"config": config_name, "file": str(config_file), "status": "success", **report.as_dict()}
    write_section(state_dir, state_schema.SECTION_VGPU, section)
    for change in report.changes:
        log.info("%s %s on %s", change["action"], change.get("id", ""), change["parent"])
    return report.as_dict()


@cli.group()
def vgpu() -> None:
    """vGPU devices from an NVIDIA vgpu-device-manager style config (mdev parents and SR-IOV vGPU VFs)."""


@vgpu.command("apply")
@host_root_option
@state_dir_option
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=env("vgpu_config"),
    show_envvar=True,
    help="The config file (version: v1, vgpu-configs: …).",
)
@click.option(
    "--select",
    "config_name",
    envvar=env("vgpu_select"),
    show_envvar=True,
    help="Which of its vgpu-configs to apply (e.g. from the node's nvidia.com/vgpu.config label).",
)
@click.option(
    "--parent",
    "parents",
    multiple=True,
    envvar=env("vgpu_parents"),
    show_envvar=True,
    help="Manage these vGPU parents only (mdev_bus names or PF addresses; e.g. mtty in tests). "
    "[default: every NVIDIA one]",
)
@nvidia_smi_option
@click.option("--stay", is_flag=True, help="After applying, wait for SIGTERM/SIGINT (then exit, changing nothing).")
def vgpu_apply(
    host_root: Path,
    state_dir: Path,
    config_file: Path | None,
    config_name: str | None,
    parents: tuple[str, ...],
    nvidia_smi: str,
    stay: bool,
) -> None:
    """Create and remove vGPUs (MIG-backed ones after MIG mode and GPU instances) as the selected config asks."""
    fs = Sysfs(host_root)
    kernel = _kernel(click.get_current_context(), fs)
    done = _apply(fs, kernel, state_dir, config_file, config_name, parents, nvidia_smi)
    _emit({"config": config_name, **done})
    if stay:
        _stay()


@cli.group()
def workload() -> None:
    """Move the node's GPUs between workloads (container, vm-passthrough, vm-vgpu), per GPU if configured."""


@workload.command("apply")
@host_root_option
@state_dir_option
@click.option(
    "--workload",
    "default",
    type=click.Choice(WORKLOADS),
    required=True,
    envvar=env("workload"),
    show_envvar=True,
    help="The node's workload (the nvidia.com/gpu.workload.config label's value): every GPU the config names not.",
)
@click.option(
    "--config",
    "workload_config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=env("workload_config"),
    show_envvar=True,
    help="Per-GPU workloads (version: v1, gpus: [{address|device, workload}]); docs/node-agent.md.",
)
@click.option(
    "--vgpu-config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=env("vgpu_config"),
    show_envvar=True,
    help="The vGPU config file, for the vm-vgpu GPUs.",
)
@click.option("--vgpu-select", "config_name", envvar=env("vgpu_select"), show_envvar=True, help="The config's name.")
@click.option(
    "--allow-group",
    "allowed_groups",
    multiple=True,
    type=click.IntRange(min=0),
    envvar=env("allow_groups"),
    show_envvar=True,
    metavar="N",
    help="As bind --allow-group: IOMMU group N may move with functions that are not the GPU's own.",
)
@click.option(
    "--validations-dir",
    "validations_dir",
    default=str(VALIDATIONS_DIR),
    show_default=True,
    envvar=env("validations_dir"),
    show_envvar=True,
    help="Where the GPU Operator's validator readiness files go (empty: none written).",
)
@nvidia_smi_option
@click.option("--stay", is_flag=True, help="After applying, wait for SIGTERM/SIGINT (then exit, changing nothing).")
def workload_apply(
    host_root: Path,
    state_dir: Path,
    default: str,
    workload_config: Path | None,
    config_file: Path | None,
    config_name: str | None,
    allowed_groups: tuple[int, ...],
    validations_dir: str,
    nvidia_smi: str,
    stay: bool,
) -> None:
    """Plan the move of every NVIDIA GPU to its workload and, unless it is refused, carry it out."""
    fs = Sysfs(host_root)
    kernel = _kernel(click.get_current_context(), fs)
    overrides = load_workload_config(workload_config) if workload_config is not None else ()
    specs = _specs(config_file, config_name) if config_file is not None or config_name else ()
    desired = Desired(default, overrides, specs)
    transition = plan_transition(
        fs, kernel, desired, allowed_groups=allowed_groups, remembered=_remembered(state_dir), nvidia_smi=nvidia_smi
    )
    outcome = apply_transition(fs, kernel, transition, state_dir=state_dir)
    problem = None
    if validations_dir:
        try:
            written: dict[str, bool] | None = write_validations(
                Path(validations_dir), outcome, outcome.workloads, default
            )
        except AgentError as exc:  # the outcome is still reported: the node may have changed
            written, problem = None, f"validator readiness files: {exc}"
    else:
        written = None
    _emit({"plan": transition.as_dict(), "outcome": outcome.as_dict(), "validations": written})
    for step in outcome.done:
        log.info("%s", step)
    if outcome.state != "success":
        raise AgentError(f"workload {default}: {outcome.message}" + (f"; {problem}" if problem else ""))
    if problem is not None:
        raise AgentError(problem)
    if stay:
        _stay()


@cli.command()
@host_root_option
@state_dir_option
@click.option(
    "--node-name",
    required=True,
    envvar=[env("node_name"), "NODE_NAME"],
    show_envvar=True,
    help="This node's name (the pod's spec.nodeName through the downward API): the only Node read and written.",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=env("kubeconfig"),
    show_envvar=True,
    help="A kubeconfig instead of the pod's service account (the agent run by hand).",
)
@click.option(
    "--api-server",
    envvar=env("api_server"),
    show_envvar=True,
    metavar="URL",
    help="A plain http:// API server without credentials (kubectl proxy, tests) instead of either.",
)
@click.option(
    "--default-workload",
    type=click.Choice(protocol.WORKLOADS),
    default="container",
    show_default=True,
    envvar=env("default_workload"),
    show_envvar=True,
    help=f"The workload of a node without the {protocol.WORKLOAD_LABEL} label (the GPU Operator's "
    "sandboxWorkloads.defaultWorkload).",
)
@click.option(
    "--default-vgpu-config",
    envvar=env("default_vgpu_config"),
    show_envvar=True,
    help=f"The vGPU config of a vm-vgpu node without the {protocol.VGPU_CONFIG_LABEL} label.",
)
@click.option(
    "--vgpu-config",
    "vgpu_config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=env("vgpu_config"),
    show_envvar=True,
    help="The vGPU config file (version: v1, vgpu-configs: ...).",
)
@click.option(
    "--workload-config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=env("workload_config"),
    show_envvar=True,
    help="Per-GPU workloads (docs/node-agent.md): GPUs that serve another workload than the node's.",
)
@click.option(
    "--podresources-socket",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_POD_RESOURCES_SOCKET,
    show_default=True,
    envvar=env("podresources_socket"),
    show_envvar=True,
    help="The kubelet's PodResources socket: which devices pods hold (a change to them is refused).",
)
@click.option(
    "--plugin-resource-prefix",
    default=protocol.DEFAULT_RESOURCE_PREFIX,
    show_default=True,
    envvar=env("plugin_resource_prefix"),
    show_envvar=True,
    help="The device plugin's resource names start with this (PodResources and status.allocatable are read "
    "for these only).",
)
@click.option(
    "--pause-timeout",
    type=click.FloatRange(min=0),
    default=protocol.DEFAULT_PAUSE_TIMEOUT,
    show_default=True,
    envvar=env("pause_timeout"),
    show_envvar=True,
    help="Seconds to wait, the sandbox device plugin paused, for the node to stop offering the devices that go.",
)
@click.option(
    "--retry-period",
    type=click.FloatRange(min=0.01),
    default=protocol.DEFAULT_RETRY_PERIOD,
    show_default=True,
    envvar=env("retry_period"),
    show_envvar=True,
    help="Seconds between tries of a refused change (a GPU held) or a failed API call.",
)
@click.option(
    "--validations-dir",
    "validations_dir",
    default=str(VALIDATIONS_DIR),
    show_default=True,
    envvar=env("validations_dir"),
    show_envvar=True,
    help="Where the GPU Operator's validator readiness files go (empty: none written).",
)
@nvidia_smi_option
def operate(
    host_root: Path,
    state_dir: Path,
    node_name: str,
    kubeconfig: Path | None,
    api_server: str | None,
    default_workload: str,
    default_vgpu_config: str | None,
    vgpu_config: Path | None,
    workload_config: Path | None,
    podresources_socket: Path,
    plugin_resource_prefix: str,
    pause_timeout: float,
    retry_period: float,
    validations_dir: str,
    nvidia_smi: str,
) -> None:
    """Follow this node's nvidia.com/gpu.workload.config and nvidia.com/vgpu.config labels as the GPU Operator's
    sandbox components do: plan, pause the sandbox device plugin, apply, report (docs/node-agent.md)."""
    from node_agent import operate as operate_loop  # noqa: PLC0415 (the Kubernetes client: this command only)
    from node_agent.kube import NodeApi  # noqa: PLC0415

    context = click.get_current_context()
    config = operate_loop.PreparerConfig(
        host_root,
        state_dir,
        vgpu_config,
        workload_config,
        nvidia_smi,
        context.find_root().obj,
        Path(validations_dir) if validations_dir else None,
    )
    preparer = operate_loop.PREPARER_FACTORY(config)
    api = NodeApi.for_node(node_name, host=api_server, kubeconfig=kubeconfig)
    allocations = operate_loop.PodResourcesAllocations(podresources_socket, plugin_resource_prefix)
    options = operate_loop.OperateOptions(
        default_workload, default_vgpu_config, pause_timeout, retry_period, plugin_resource_prefix
    )
    operator = operate_loop.Operator(api, preparer, allocations, options)
    try:
        with stop_on_signals(operator.stop) as received:
            operator.run()
    finally:
        allocations.close()
        api.close()
    log.info("stopping on %s; the node is left as it is", ",".join(received) or "request")


def main() -> None:
    run_cli(cli, "gpu-node-agent")
