"""``launcher-hook serve``: run the KubeVirt hook sidecar until Shutdown, SIGTERM or SIGINT.

``--api`` chooses how virt-launcher reaches it: the hook sidecar API (``hooks``, the default), KubeVirt's plugin
API (``plugins``, VEP 190) or both; each has its own socket option and default (docs/protocols.md).

The command only wires things together (options → allocation source → ``HookService`` → ``HookServer``) and
owns the process-level edges: logging to stderr, signal handlers and the exit code. The allocation options
and ``--log-format`` are shared with the ``onDefineDomain`` shim, which reads them from ``LAUNCHER_HOOK_*``
env variables.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from launcher_hook.allocation import is_allocation_variable
from launcher_hook.builder import SUPPORTED_DRIVERS, BuildOptions
from launcher_hook.dra import MetadataFiles
from launcher_hook.server import (
    DEFAULT_PLUGIN_SOCKET,
    DEFAULT_SOCKET,
    DEFAULT_SOCKET_MODE,
    HOOK_APIS,
    HookApi,
    HookServer,
    limit_malloc_arenas,
)
from launcher_hook.service import COMPONENT, HookService, log_call
from launcher_hook.sources import (
    DEFAULT_CONTAINER,
    AllocationSource,
    DomainSource,
    EnvironFileSource,
    PodResourcesSource,
    ProcessEnvSource,
    own_pod_identity,
)
from runtime.cli_options import log_format_option as _log_format_option
from runtime.env import hook_env
from runtime.logs import configure_logging
from runtime.pci_bars import SysfsBars
from runtime.pci_companions import SysfsCompanions
from runtime.pci_topology import SysfsTopology
from runtime.signals import stop_on_signals
from runtime.sockets import SocketInUse
from runtime.sysfs_paths import DEFAULT_SYSFS_ROOT
from schemas.dra_metadata import DEFAULT_ROOT as DEFAULT_DRA_METADATA_ROOT
from schemas.logformat import LogFormat

F = TypeVar("F", bound=Callable[..., Any])


def allocation_options(function: F) -> F:
    """The options that choose the allocation source and rendering, shared by ``serve`` and the shim."""
    decorators = [
        click.option(
            "--pod-resources-socket",
            type=click.Path(dir_okay=False, path_type=Path),
            envvar=hook_env("pod_resources_socket"),
            help="Kubelet PodResources socket (e.g. /var/lib/kubelet/pod-resources/kubelet.sock); root's only, so "
            "for a sidecar running as root (a root VMI); only this hook's own pod is read: POD_NAMESPACE/POD_NAME, "
            "or else the virt-launcher pod of this pod's hostname; a VMI naming another pod is refused. Takes "
            "precedence. Without it or --environ-file, the process env if it holds PCI_RESOURCE_*/"
            "MDEV_PCI_RESOURCE_*, else each call's domain XML (virt-launcher's ua-gpu-<name>/ua-hostdevice-<name> "
            "hostdevs; no privilege needed).",
        ),
        click.option(
            "--environ-file",
            type=click.Path(dir_okay=False, path_type=Path),
            envvar=hook_env("environ_file"),
            help="Read the allocation from /proc/<pid>/environ or KEY=VALUE lines (read on every call).",
        ),
        click.option(
            "--container",
            default=DEFAULT_CONTAINER,
            show_default=True,
            envvar=hook_env("container"),
            help="Whose devices to take from PodResources.",
        ),
        click.option(
            "--driver",
            type=click.Choice(SUPPORTED_DRIVERS),
            envvar=hook_env("driver"),
            help="Write <driver name='vfio'/> on PCI hostdevs.",
        ),
    ]
    for decorator in reversed(decorators):
        function = decorator(function)
    return function


def make_source(
    pod_resources_socket: Path | None, environ_file: Path | None, container: str, env: Mapping[str, str]
) -> AllocationSource:
    """The one source to use, by precedence: PodResources, then the environ file, then ``env`` itself when it
    holds an allocation variable (the hook runs in ``compute``), else the domain XML of each call (a sidecar:
    the kubelet gives it none of compute's variables, and virt-launcher has rendered them into the domain)."""
    if pod_resources_socket is not None:
        return PodResourcesSource(pod_resources_socket, container=container, identity=own_pod_identity(env))
    if environ_file is not None:
        return EnvironFileSource(environ_file)
    if any(is_allocation_variable(name) for name in env):
        return ProcessEnvSource(env)
    return DomainSource()


def force_gpu_aliases_option(function: F) -> F:
    """``--force-gpu-aliases`` (``LAUNCHER_HOOK_FORCE_GPU_ALIASES``), for ``serve`` and the onDefineDomain shim."""
    return click.option(
        "--force-gpu-aliases",
        is_flag=True,
        envvar="LAUNCHER_HOOK_FORCE_GPU_ALIASES",
        help="Alias every GPU ua-gpuN, also those virt-launcher rendered as ua-gpu-<name> (KubeVirt's lookups by "
        "alias then miss them; each rename is a warning in the call's log line).",
    )(function)


PCI_MMIO64_CHOICES = ("auto", "off")


def dra_metadata_option(function: F) -> F:
    """``--dra-metadata-root`` (``LAUNCHER_HOOK_DRA_METADATA_ROOT``), for ``serve``, the shim and ``xmlgen
    render``: where DRA entries' KEP 5304 metadata files are read (docs/dra.md, "Hook side")."""
    return click.option(
        "--dra-metadata-root",
        type=click.Path(file_okay=False, path_type=Path),
        default=DEFAULT_DRA_METADATA_ROOT,
        show_default=True,
        envvar=hook_env("dra_metadata_root"),
        help="Where the devices of gpus[]/hostDevices[] entries with claimName/requestName are read: "
        "<root>/resourceclaims/<claim>/<request>/<driver>-metadata.json (resourceclaimtemplates/<pod claim>/… "
        "for a template), as virt-launcher reads them. In a sidecar, a path that shows the compute "
        "container's files, e.g. /proc/<pid>/root/var/run/kubernetes.io/dra-device-attributes.",
    )(function)


def claim_reader(dra_metadata_root: Path) -> MetadataFiles:
    """The DRA metadata reader the builder gets."""
    return MetadataFiles(dra_metadata_root)


def mmio_window_options(function: F) -> F:
    """``--pci-mmio64`` and ``--sysfs-root`` (``LAUNCHER_HOOK_PCI_MMIO64``, ``LAUNCHER_HOOK_SYSFS_ROOT``), for
    ``serve`` and the onDefineDomain shim: the 64-bit PCI window of EFI guests (docs/large-bar.md)."""
    function = click.option(
        "--sysfs-root",
        type=click.Path(file_okay=False, path_type=Path),
        default=DEFAULT_SYSFS_ROOT,
        show_default=True,
        envvar=hook_env("sysfs_root"),
        help="Where the passed-through devices' BAR sizes are read (<root>/bus/pci/devices/<address>/resource), "
        "and, when the allocation is read from PodResources or the domain (which carry no companion variable), "
        "each passthrough GPU's companion functions (the other VFIO-bound functions of its slot and IOMMU group), "
        "and the GPUs' places in the PCIe tree (GPUs below one PCIe switch share a GPUDirect clique, docs/p2p.md).",
    )(function)
    return click.option(
        "--pci-mmio64",
        type=click.Choice(PCI_MMIO64_CHOICES),
        default="auto",
        show_default=True,
        envvar=hook_env("pci_mmio64"),
        help="auto: give an OVMF (EFI) guest whose devices' 64-bit BARs need more than OVMF's default 32 GiB "
        "window the size they need, as -fw_cfg name=opt/ovmf/X-PciMmio64Mb in <qemu:commandline> (a value the "
        "domain already sets is kept); off: never.",
    )(function)


def bar_source(pci_mmio64: str, sysfs_root: Path) -> SysfsBars | None:
    """The BAR reader the builder gets (None: ``--pci-mmio64 off``)."""
    return SysfsBars(sysfs_root) if pci_mmio64 == "auto" else None


def companion_reader(sysfs_root: Path) -> SysfsCompanions:
    """The companion reader the builder gets; the service uses it only with a source that carries no companion
    variable (PodResources, the domain)."""
    return SysfsCompanions(sysfs_root)


log_format_option = _log_format_option(hook_env("log_format"))
"""``--log-format json|text`` (env ``LAUNCHER_HOOK_LOG_FORMAT``), shared by ``serve`` and the shim."""


def _octal(context: click.Context, parameter: click.Parameter, value: str) -> int:
    try:
        mode = int(value, 8)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an octal mode such as 0666") from None
    if not 0 <= mode <= 0o777:
        raise click.BadParameter(f"{value!r} is out of range 0000..0777")
    return mode


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="kubevirt-gpu-passthrough")
def cli() -> None:
    """The virt-launcher side of kubevirt-gpu-passthrough: a KubeVirt hook sidecar that adds the GPUs."""


@cli.command()
@click.option(
    "--api",
    type=click.Choice(HOOK_APIS),
    default="hooks",
    show_default=True,
    envvar=hook_env("api"),
    help="How virt-launcher calls: hooks = hook sidecar API (Info, OnDefineDomain v1alpha1-3, on --socket); "
    "plugins = KubeVirt plugin API (DomainHookService.MutateDomain, Plugins feature gate, on --plugin-socket); "
    "both = all of them on both sockets. Services not chosen answer UNIMPLEMENTED.",
)
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_SOCKET,
    show_default=True,
    help="Hook sidecar socket (--api hooks/both); its directory is created, a stale socket replaced, a live one "
    "refused.",
)
@click.option(
    "--plugin-socket",
    "plugin_socket_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_PLUGIN_SOCKET,
    show_default=True,
    help="Plugin API socket (--api plugins/both): the Plugin CR's domainHooks[].sidecar.socketPath, under "
    "/var/run/kubevirt-plugin/<plugin name>/.",
)
@click.option(
    "--socket-mode",
    default=f"{DEFAULT_SOCKET_MODE:04o}",
    show_default=True,
    callback=_octal,
    help="Octal mode of the socket (virt-launcher may run as another user than this sidecar).",
)
@force_gpu_aliases_option
@allocation_options
@mmio_window_options
@dra_metadata_option
@log_format_option
def serve(
    api: HookApi,
    socket_path: Path,
    plugin_socket_path: Path,
    socket_mode: int,
    pod_resources_socket: Path | None,
    environ_file: Path | None,
    container: str,
    driver: str | None,
    log_format: LogFormat,
    force_gpu_aliases: bool,
    pci_mmio64: str,
    sysfs_root: Path,
    dra_metadata_root: Path,
) -> None:
    """Serve OnDefineDomain (hooks v1alpha1-v1alpha3) and/or MutateDomain (plugins v1alpha1) until Shutdown,
    SIGTERM or SIGINT."""
    flush_logs = configure_logging(COMPONENT, log_format, background=True)
    try:
        options = BuildOptions(
            driver=driver,
            force_gpu_aliases=force_gpu_aliases,
            bars=bar_source(pci_mmio64, sysfs_root),
            claims=claim_reader(dra_metadata_root),
            companion_reader=companion_reader(sysfs_root),
            topology=SysfsTopology(sysfs_root),
        )
        sockets = {"hooks": (socket_path,), "plugins": (plugin_socket_path,), "both": (socket_path, plugin_socket_path)}
        _serve(api, sockets[api], socket_mode, pod_resources_socket, environ_file, container, options)
    finally:
        flush_logs()


def _serve(
    api: HookApi,
    socket_paths: tuple[Path, ...],
    socket_mode: int,
    pod_resources_socket: Path | None,
    environ_file: Path | None,
    container: str,
    options: BuildOptions,
) -> None:
    mode = socket_mode
    limit_malloc_arenas()
    source = make_source(pod_resources_socket, environ_file, container, os.environ)
    server = HookServer(
        socket_paths[0], HookService(source, options), api=api, also_listen=socket_paths[1:], socket_mode=mode
    )

    # Handlers first: a signal that arrives as soon as the socket appears must still end us cleanly.
    with stop_on_signals(server.request_stop) as received:
        _run(server, source, mode, received)


def _run(server: HookServer, source: AllocationSource, mode: int, received: list[str]) -> None:
    try:
        try:
            server.start()
        except (SocketInUse, OSError) as exc:
            raise click.ClickException(str(exc)) from None
        sockets = ",".join(str(path) for path in server.socket_paths)
        log_call(
            "serving", api=server.api, socket=sockets, mode=f"{mode:04o}", source=source.describe(), pid=os.getpid()
        )
        server.wait()
        if received:
            log_call("signal", signal=received[0])
        server.stop()
        log_call("stopped", socket=sockets)
    finally:
        server.stop(grace=0)  # idempotent; removes the socket if anything above failed
        source.close()


def main() -> None:
    cli(prog_name="launcher-hook")
