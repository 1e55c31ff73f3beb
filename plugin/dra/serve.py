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
from pathlib import Path

from plugin.config import PluginConfig
from plugin.dra.claims import ClaimSource, StaticClaims
from plugin.dra.options import DraOptions
from plugin.dra.prepare import PrepareCore
from plugin.dra.runner import DraRunner, InventorySink
from plugin.dra.service import DraServer
from plugin.health import UsabilityRule
from plugin.metrics import PREFIX, PluginMetrics
from runtime.pciids import PciIds
from schemas.errors import InputError


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
