"""``gpu-device-plugin serve --dra``: the DRA kubelet plugin put together from its pieces (docs/dra.md).

:func:`build_runner` wires the prepare core, the gRPC server and the loop for a configuration; the CLI
(:mod:`plugin.cli`) only parses options and owns the process edges. Two seams are parameters, so the cluster
side plugs in without touching the node side: ``claims`` (where allocations are read: :class:`StaticClaims`
from ``--claims-dir``, or the API-backed source) and ``sinks`` (who takes each new inventory: the
ResourceSlice publisher).

``--dra`` serves DRA *instead of* the device-plugin servers, never beside them: the kubelet's device manager
and the DRA scheduler plugin do not know each other's allocations, so a GPU offered both ways could go to two
pods. One node, one way (docs/dra.md, "Node side").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from plugin.config import PluginConfig
from plugin.dra.cdi import DEFAULT_CDI_DIR
from plugin.dra.claims import ClaimSource, StaticClaims
from plugin.dra.prepare import PrepareCore
from plugin.dra.runner import DEFAULT_SCAN_INTERVAL, DraRunner, InventorySink
from plugin.dra.service import DEFAULT_PLUGIN_DIR, DEFAULT_REGISTRY_DIR, DraServer
from plugin.health import UsabilityRule
from plugin.metrics import PREFIX, PluginMetrics
from runtime.pciids import PciIds
from schemas.errors import InputError


@dataclass(frozen=True)
class DraOptions:
    plugin_dir: Path = DEFAULT_PLUGIN_DIR
    """The plugin's own directory: ``dra.sock``, the checkpoint, the metadata files (the same path in the
    plugin's container and on the node: CDI mounts name node paths)."""
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    cdi_dir: Path = Path(DEFAULT_CDI_DIR)
    claims_dir: Path | None = None
    pool: str | None = None
    """The node's pool name in its ResourceSlices (the node name); None: any pool is accepted."""
    scan_interval: float = DEFAULT_SCAN_INTERVAL


def claim_source(options: DraOptions) -> ClaimSource:
    """Where allocations come from without an API server: ``--claims-dir``. InputError when there is none."""
    if options.claims_dir is None:
        raise InputError(
            "serve --dra needs a claim source: --claims-dir DIR (ResourceClaim JSON files named "
            "<namespace>_<name>.json), or the in-cluster source"
        )
    if not options.claims_dir.is_dir():
        raise InputError(f"claims dir {str(options.claims_dir)!r} is not a directory")
    return StaticClaims.from_directory(options.claims_dir)


def cluster_seams(options: DraOptions) -> tuple[ClaimSource, tuple[InventorySink, ...]]:
    """The claim source and the inventory sinks: ``--claims-dir`` alone (no API server, nothing published), else
    the API server (:func:`plugin.dra.kube.cluster_side`: ResourceClaims read, ResourceSlices published for
    ``--node-name``). The ``kubernetes`` client is imported only then."""
    if options.claims_dir is not None:
        return claim_source(options), ()
    if options.pool is None:
        raise InputError(
            "serve --dra without --claims-dir reads claims from the API server and publishes this node's "
            "ResourceSlices: it needs --node-name (GPU_PLUGIN_NODE_NAME, the pod's spec.nodeName)"
        )
    from plugin.dra.kube import cluster_side  # noqa: PLC0415 -- the client is loaded for the API server only

    claims, publisher = cluster_side(options.pool)
    return claims, (publisher,)


def claim_counter(metrics: PluginMetrics) -> Callable[[str, str], None]:
    """A ``gpu_device_plugin_dra_claims_total{operation,result}`` counter on the plugin's registry, as the
    core's ``on_outcome``."""
    from prometheus_client import Counter  # noqa: PLC0415 -- loaded with PluginMetrics only

    counter = Counter(
        PREFIX + "dra_claims",
        "DRA claims answered, by operation (prepare, unprepare) and result (ok, error: the claim's error string).",
        ["operation", "result"],
        registry=metrics.registry,
    )
    for operation in ("prepare", "unprepare"):
        for result in ("ok", "error"):
            counter.labels(operation, result)
    return lambda operation, result: counter.labels(operation, result).inc()


def build_runner(
    config: PluginConfig,
    options: DraOptions,
    claims: ClaimSource,
    *,
    sinks: Sequence[InventorySink] = (),
    pci_ids: PciIds | None = None,
    warnings: Iterable[str] = (),
    on_outcome: Callable[[str, str], None] | None = None,
) -> DraRunner:
    core = PrepareCore(
        claims,
        Path(config.host_root),
        options.plugin_dir,
        options.cdi_dir,
        rule=UsabilityRule.from_config(config),
        pool=options.pool,
        on_outcome=on_outcome,
    )
    server = DraServer(core, options.plugin_dir, options.registry_dir)
    return DraRunner(
        config,
        core,
        server,
        registry_dir=options.registry_dir,
        scan_interval=options.scan_interval,
        pci_ids=pci_ids,
        warnings=warnings,
        sinks=sinks,
    )
