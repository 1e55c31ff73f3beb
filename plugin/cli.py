"""``gpu-device-plugin serve``: the DaemonSet's entry point; run the device plugin until SIGTERM or SIGINT.

The command only wires things together (options and ``GPU_PLUGIN_*`` env → :class:`~plugin.config.PluginConfig`
→ :class:`~plugin.manager.PluginManager`) and owns the process-level edges: logging to stderr, signal
handlers and the exit code (0 after a clean stop; 1 with a message for bad options or configuration).

Every flag can also come from the environment, as a DaemonSet sets it: ``GPU_PLUGIN_HOST_ROOT``,
``GPU_PLUGIN_PCI_IDS`` and ``GPU_PLUGIN_CONFIG`` are :mod:`plugin.config`'s own variables (read there, with
its precedence: defaults < file < env < flags); ``GPU_PLUGIN_KUBELET_DIR``, ``GPU_PLUGIN_SCAN_INTERVAL``,
``GPU_PLUGIN_METRICS_ADDRESS`` and ``GPU_PLUGIN_LOG_FORMAT`` belong to the process, not the node's
configuration, so they are read here and hidden from the config loader.

``--metrics-address`` is off by default: a command run by hand (or in tests) opens no TCP port unasked; the
DaemonSet sets it, and its probes use the ``/healthz`` and ``/readyz`` served there (:mod:`plugin.metrics`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from plugin.config import load_config
from plugin.dra.options import DraOptions
from plugin.log import COMPONENT, log_event
from plugin.manager import DEFAULT_SCAN_INTERVAL, PluginManager, liveness_bound
from plugin.metrics import NO_METRICS, MetricsRecorder, MetricsServer, PluginMetrics, parse_address
from plugin.server import DEFAULT_KUBELET_DIR
from plugin.sysfs import scan
from runtime.cli_options import log_format_option
from runtime.env import plugin_env
from runtime.logs import configure_logging
from runtime.pciids import locate_pci_ids
from runtime.signals import stop_on_signals
from schemas.clirun import run_cli
from schemas.errors import InputError
from schemas.logformat import LogFormat

if TYPE_CHECKING:
    from plugin.dra.runner import DraRunner

DRA_FLAGS = ("dra", "dra_plugin_dir", "plugins_registry", "cdi_dir", "claims_dir", "node_name")
PROCESS_ENV = tuple(
    plugin_env(flag) for flag in ("kubelet_dir", "scan_interval", "metrics_address", "log_format", *DRA_FLAGS)
)
"""Variables for the process that :func:`plugin.config.load_config` must not see (it refuses unknown ones)."""


def _finite_interval(context: click.Context, parameter: click.Parameter, value: float) -> float:
    """FloatRange lets nan through (every comparison with it is false): refuse it, and inf, by name."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of seconds")
    return value


def _address(context: click.Context, parameter: click.Parameter, value: str | None) -> tuple[str, int] | None:
    if value is None or value == "":
        return None
    try:
        return parse_address(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="kubevirt-gpu-passthrough")
def cli() -> None:
    """The node side of kubevirt-gpu-passthrough: a kubelet device plugin offering GPUs and vGPUs to KubeVirt VMs."""


@cli.command()
@click.option(
    "--host-root",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the node's / is mounted (sysfs and /dev/vfio are read under it). [env GPU_PLUGIN_HOST_ROOT; default /]",
)
@click.option(
    "--kubelet-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_KUBELET_DIR,
    show_default=True,
    envvar=plugin_env("KUBELET_DIR"),
    show_envvar=True,
    help="The kubelet's device-plugin directory (kubelet.sock and our sockets).",
)
@click.option(
    "--pci-ids",
    type=click.Path(dir_okay=False, path_type=Path),
    help="pci.ids to name devices by. [env GPU_PLUGIN_PCI_IDS; default: the host's, then the image's]",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="YAML/JSON configuration file (see schemas/plugin-config.schema.json). [env GPU_PLUGIN_CONFIG]",
)
@click.option(
    "--scan-interval",
    type=click.FloatRange(min=0.05, max=3600),
    default=DEFAULT_SCAN_INTERVAL,
    show_default=True,
    envvar=plugin_env("SCAN_INTERVAL"),
    show_envvar=True,
    callback=_finite_interval,
    help="Seconds between full sysfs rescans (driver changes, hot-plug, new mdevs); /dev/vfio changes are "
    "seen at once.",
)
@click.option(
    "--metrics-address",
    metavar="HOST:PORT",
    envvar=plugin_env("METRICS_ADDRESS"),
    show_envvar=True,
    callback=_address,
    help="Serve Prometheus /metrics, /healthz and /readyz over HTTP here (':9498' = every interface, port 0 = "
    "any free port). [default: off]",
)
@log_format_option(plugin_env("LOG_FORMAT"))
@click.option(
    "--dra",
    is_flag=True,
    envvar=plugin_env("DRA"),
    show_envvar=True,
    help="Serve the devices through Dynamic Resource Allocation (a DRA kubelet plugin) instead of device-plugin "
    "servers (docs/dra.md).",
)
@click.option(
    "--dra-plugin-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DraOptions.plugin_dir,
    show_default=True,
    envvar=plugin_env("DRA_PLUGIN_DIR"),
    show_envvar=True,
    help="With --dra: dra.sock, the prepared-claims checkpoint and metadata files (same path as on the node).",
)
@click.option(
    "--plugins-registry",
    type=click.Path(file_okay=False, path_type=Path),
    default=DraOptions.registry_dir,
    show_default=True,
    envvar=plugin_env("PLUGINS_REGISTRY"),
    show_envvar=True,
    help="With --dra: the kubelet's plugin registry directory (the registration socket goes there).",
)
@click.option(
    "--cdi-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DraOptions.cdi_dir,
    show_default=True,
    envvar=plugin_env("CDI_DIR"),
    show_envvar=True,
    help="With --dra: where CDI spec files for prepared claims are written.",
)
@click.option(
    "--claims-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar=plugin_env("CLAIMS_DIR"),
    show_envvar=True,
    help="With --dra: read allocated ResourceClaims from <namespace>_<name>.json files here (no API server).",
)
@click.option(
    "--node-name",
    envvar=plugin_env("NODE_NAME"),
    show_envvar=True,
    help="With --dra: the node's name, the pool its devices are published in; claims from another pool are refused.",
)
@click.option(
    "--print-slices",
    is_flag=True,
    help="Scan once, print the resource.k8s.io/v1 ResourceSlices --dra would publish for --node-name (a JSON "
    "List, for review or kubectl create -f) and exit; serves nothing.",
)
def serve(
    host_root: Path | None,
    kubelet_dir: Path,
    pci_ids: Path | None,
    config_file: Path | None,
    scan_interval: float,
    metrics_address: tuple[str, int] | None,
    log_format: LogFormat,
    dra: bool,
    dra_plugin_dir: Path,
    plugins_registry: Path,
    cdi_dir: Path,
    claims_dir: Path | None,
    node_name: str | None,
    print_slices: bool,
) -> None:
    """Serve one device plugin per GPU/vGPU resource (or, with --dra, a DRA kubelet plugin) until SIGTERM or SIGINT."""
    if print_slices:
        _print_slices(host_root, pci_ids, config_file, node_name)
        return
    flush_logs = configure_logging(COMPONENT, log_format, background=True)
    dra_options = (
        DraOptions(dra_plugin_dir, plugins_registry, cdi_dir, claims_dir, node_name or None, scan_interval)
        if dra
        else None
    )
    try:
        _serve(host_root, kubelet_dir, pci_ids, config_file, scan_interval, metrics_address, dra_options)
    finally:
        flush_logs()


def _print_slices(
    host_root: Path | None, pci_ids: Path | None, config_file: Path | None, node_name: str | None
) -> None:
    """``serve --print-slices``: the node's ResourceSlices as ``serve --dra`` would publish them (generation 1),
    from one scan, as JSON (the plugin loads YAML only for its config file; ``xmlgen discover --dra-slices``
    prints the same objects as YAML)."""
    env = {key: value for key, value in os.environ.items() if key not in PROCESS_ENV}
    try:
        if not node_name:
            raise InputError("--print-slices needs --node-name (or GPU_PLUGIN_NODE_NAME): the pool is the node's")
        config = load_config(
            config_file,
            env,
            host_root=None if host_root is None else str(host_root),
            pci_ids=None if pci_ids is None else str(pci_ids),
        )
        choice = locate_pci_ids(Path(config.pci_ids) if config.pci_ids else None, Path(config.host_root), Path("/"))
        inventory = scan(Path(config.host_root), config, choice.database, choice.warnings)
        names = choice.database.device_name if choice.database is not None else None
        from plugin.dra.slices import build_slices  # noqa: PLC0415 (the DRA modules only when asked: see _serve)

        slices = (
            build_slices(inventory, node_name)
            if names is None
            else build_slices(inventory, node_name, product_names=names)
        )
    except InputError as exc:
        raise click.ClickException(str(exc)) from None
    for warning in inventory.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(json.dumps({"apiVersion": "v1", "kind": "List", "items": slices}, indent=2))


def _serve(
    host_root: Path | None,
    kubelet_dir: Path,
    pci_ids: Path | None,
    config_file: Path | None,
    scan_interval: float,
    metrics_address: tuple[str, int] | None,
    dra: DraOptions | None = None,
) -> None:
    env = {key: value for key, value in os.environ.items() if key not in PROCESS_ENV}
    try:
        config = load_config(
            config_file,
            env,
            host_root=None if host_root is None else str(host_root),
            pci_ids=None if pci_ids is None else str(pci_ids),
        )
        if not Path(config.host_root).is_dir():
            raise InputError(f"host root {config.host_root!r} is not a directory")
        if kubelet_dir.exists() and not kubelet_dir.is_dir():
            raise InputError(f"kubelet dir {str(kubelet_dir)!r} is not a directory")
        metrics: PluginMetrics | None = None
        if metrics_address is not None:  # prometheus_client is loaded only then
            metrics = PluginMetrics()
            metrics.disable_created_series()
        recorder: MetricsRecorder = NO_METRICS if metrics is None else metrics
        manager: PluginManager | DraRunner
        if dra is not None:
            # Imported here, not at the top: the DRA servicers, prepare core and generated kubelet stubs are a third
            # of the CLI's import time, which a device plugin's start to registered would pay for nothing.
            from plugin.dra.serve import build_runner, claim_counter, cluster_seams  # noqa: PLC0415

            choice = locate_pci_ids(Path(config.pci_ids) if config.pci_ids else None, Path(config.host_root), Path("/"))
            claims, sinks = cluster_seams(dra)
            manager = build_runner(
                config,
                dra,
                claims,
                sinks=sinks,
                pci_ids=choice.database,
                warnings=choice.warnings,
                on_outcome=None if metrics is None else claim_counter(metrics),
            )
        else:
            manager = PluginManager.from_config(config, kubelet_dir, scan_interval=scan_interval, metrics=recorder)
    except InputError as exc:
        raise click.ClickException(str(exc)) from None

    # Handlers before any socket exists: a SIGTERM as soon as we serve must still end us cleanly.
    with stop_on_signals(manager.request_stop) as received:
        http: MetricsServer | None = None
        try:
            if metrics_address is not None and metrics is not None:
                try:
                    http = MetricsServer(*metrics_address, metrics, manager.liveness, manager.readiness)
                except OSError as exc:
                    host, port = metrics_address
                    raise click.ClickException(f"cannot serve metrics on {host}:{port}: {exc}") from None
                http.start()
                host, port = http.address
                log_event(
                    "metrics_serving",
                    address=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                    port=port,
                    paths=["/metrics", "/healthz", "/readyz"],
                    liveness_bound=liveness_bound(scan_interval),
                )
            manager.run()
        finally:
            if http is not None:
                http.stop()
    if received:
        log_event("signal", signal=received[0])


def main() -> None:
    run_cli(cli, "gpu-device-plugin")  # every failure an `error: …` line (schemas/clirun.py)
