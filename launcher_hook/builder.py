"""The domain builder: allocation env + VMI + domain XML in, the domain with its GPUs out.

One call is one flow over one parsed document:

1. read (:mod:`launcher_hook.document`): the domain and the VMI, each parsed once (:class:`CallInputs`, shared
   with the allocation source that reads the domain);
2. passes, each deciding edits on that document: the hostdev merge (:func:`launcher_hook.domain.merge_pass`:
   virt-launcher's hostdevs corrected, the hook's added, display/ramfb, DRA entries' devices, an HGX board's
   NVSwitches from :func:`launcher_hook.nvswitches.switch_specs`), the companions
   and their root ports (:func:`launcher_hook.companions.companions_pass`), the GPUDirect P2P cliques of GPUs
   that share a host PCIe switch (:func:`launcher_hook.cliques.clique_pass`), the 64-bit MMIO window
   (:func:`launcher_hook.mmio_window.window_pass`);
3. write (:mod:`launcher_hook.writer`): one writer applies every pass's edits once.

This is the one entry point the hook server, the sidecar-shim program and ``xmlgen render`` share. It is a
pure function of its inputs (no env or file access of its own: the BAR sizes that decide an EFI guest's 64-bit
PCI window come from the reader in ``BuildOptions.bars``, DRA entries' devices from ``BuildOptions.claims``,
the companions of GPUs whose allocation source carries no companion variable from the one in
``BuildOptions.companion_reader``) and either returns a whole document or raises ``InputError``; there is no
partial result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from launcher_hook.allocation import EnvAllocation, allocation_from_env
from launcher_hook.claims import ClaimOutcome, ClaimResolver, EntryKey
from launcher_hook.cliques import CliqueOutcome, TopologyReader, clique_pass
from launcher_hook.companions import (
    CompanionReader,
    Placement,
    companions_pass,
    wanted_companions,
    with_read_companions,
)
from launcher_hook.document import CallInputs
from launcher_hook.domain import devices_document, hostdevs_of, merge_pass
from launcher_hook.hostdev import HostdevSpec
from launcher_hook.hostdevs.base import device_text
from launcher_hook.matching import NO_HOSTDEVS, DomainHostdevs, HostdevOptions, match_all, match_vmi
from launcher_hook.mmio_window import BarSource, WindowOutcome, window_pass
from launcher_hook.nvswitches import switch_specs
from launcher_hook.writer import DomainWriter
from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from schemas.vmi import VirtualMachineInstance

SUPPORTED_DRIVERS = ("vfio",)


@dataclass(frozen=True)
class BuildOptions:
    managed: bool = False
    """``managed='yes'`` lets libvirt rebind the device; the default ``no`` matches KubeVirt (already on vfio-pci)."""
    driver: str | None = None
    """``vfio`` writes ``<driver name='vfio'/>`` on PCI hostdevs (needed by libvirt on hosts without IOMMU)."""
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    force_gpu_aliases: bool = False
    """Give every GPU the hook's ``ua-gpuN`` alias, also those virt-launcher rendered as ``ua-gpu-<name>``
    (KubeVirt's lookups by alias then miss them; each renamed one is a warning)."""
    bars: BarSource | None = None
    """Where PCI BAR sizes are read (sysfs); None: no 64-bit MMIO window is written (docs/large-bar.md)."""
    claims: ClaimResolver | None = None
    """Where DRA entries' devices are read (KEP 5304 metadata files, docs/dra.md); None: DRA entries are left to
    virt-launcher with a warning."""
    companion_reader: CompanionReader | None = None
    """Where passthrough GPUs' companions are read (sysfs) when the allocation has no companion variable for
    their resource: set for sources that cannot carry one (PodResources, DRA). None: the variable only
    (docs/kubevirt-hostdevs.md, "Companions")."""
    topology: TopologyReader | None = None
    """Where the GPUs' places in the host's PCIe tree are read (sysfs), for their GPUDirect cliques
    (docs/p2p.md); None: no clique is written."""
    allocation_carries_companions: bool = False
    """The allocation source carries the companion variables (env, environ file): ``companion_reader`` is then
    used only for GPUs a DRA claim gave, which no variable can describe."""


@dataclass(frozen=True)
class BuildResult:
    domain_xml: bytes
    hostdevs: list[HostdevSpec]
    """The hostdevs the hook owns in the output, with the aliases they have there."""
    warnings: list[str] = field(default_factory=list)
    vmi: VirtualMachineInstance | None = None
    placements: list[Placement] = field(default_factory=list)
    """Where each GPU with companions went (its guest slot and functions; docs/kubevirt-hostdevs.md)."""
    mmio: WindowOutcome | None = None
    """What was decided about the guest's 64-bit PCI window (None: not looked at)."""
    cliques: CliqueOutcome | None = None
    """The GPUDirect cliques written (None: not looked at)."""

    @property
    def aliases(self) -> dict[str, str]:
        """alias → source, for logs: a fresh dict, made from the one kept for the same hostdevs (the last
        :data:`ALIASES_KEPT` lists; a pod's hook logs the same GPUs on every call)."""
        key = tuple(self.hostdevs)
        found = _aliases_kept.get(key)
        if found is None:
            text = device_text
            found = {spec.alias: text(spec.source) for spec in key}
            if len(_aliases_kept) >= ALIASES_KEPT:
                _aliases_kept.clear()
            _aliases_kept[key] = found
        return dict(found)


ALIASES_KEPT = 16
"""Lists of hostdevs whose :attr:`BuildResult.aliases` are kept."""
_aliases_kept: dict[tuple[HostdevSpec, ...], dict[str, str]] = {}


def plan_hostdevs(
    vmi: VirtualMachineInstance | None,
    env: Mapping[str, str],
    options: BuildOptions,
    *,
    graphics: bool = True,
    existing: DomainHostdevs = NO_HOSTDEVS,
    allocation: EnvAllocation | None = None,
    claims: Mapping[EntryKey, ClaimOutcome] | None = None,
) -> tuple[list[HostdevSpec], list[str]]:
    """The hostdevs the VM gets and any warnings, without touching a domain (``graphics``: whether the
    domain has a ``<graphics>`` device, which a vGPU display needs; ``existing``: its hostdevs;
    ``allocation``: ``env`` already read, when the caller has it; ``claims``: the DRA entries' devices)."""
    if options.driver is not None and options.driver not in SUPPORTED_DRIVERS:
        raise ValueError(f"unsupported hostdev driver {options.driver!r}; supported: {', '.join(SUPPORTED_DRIVERS)}")
    allocation = allocation if allocation is not None else allocation_from_env(env)
    hostdev_options = HostdevOptions(options.managed, options.driver, graphics, options.force_gpu_aliases)
    if vmi is None:
        return match_all(allocation, hostdev_options, existing)
    return match_vmi(vmi, allocation, hostdev_options, existing, claims)


def _read_claims(vmi: VirtualMachineInstance | None, options: BuildOptions) -> Mapping[EntryKey, ClaimOutcome] | None:
    """The DRA entries' devices from ``options.claims``; None without a reader (or a VMI)."""
    if vmi is None or options.claims is None:
        return None
    return options.claims.resolve(vmi)


def build_domain(
    domain_xml: bytes | None,
    vmi_json: bytes | None,
    env: Mapping[str, str],
    options: BuildOptions | None = None,
    *,
    inputs: CallInputs | None = None,
) -> BuildResult:
    """Render the allocated GPUs into ``domain_xml`` (or a bare ``<devices>`` when it is None); ``inputs``: the
    call's documents when the caller has them (parsed or not yet) for the same ``domain_xml`` and ``vmi_json``."""
    options = options or BuildOptions()
    inputs = inputs if inputs is not None else CallInputs(domain_xml, vmi_json, options.max_input_bytes)
    vmi = inputs.vmi
    parsed = inputs.domain
    companions = vmi is None or vmi.metadata.companions  # on unless the VMI's annotation turns it off
    allocation = allocation_from_env(env)
    claims = _read_claims(vmi, options)
    if parsed is None:
        specs, warnings = plan_hostdevs(vmi, env, options, allocation=allocation, claims=claims)
        if allocation.switches:
            specs += switch_specs(specs, allocation, warnings)
        if companions and options.companion_reader is not None:
            allocation = with_read_companions(
                specs, allocation, options.companion_reader, warnings, dra_only=options.allocation_carries_companions
            )
        if companions and wanted_companions(specs, allocation, warnings):
            warnings.append("companion functions are not placed: there is no domain to place them in")
        return BuildResult(devices_document(specs), specs, warnings, vmi)
    writer = DomainWriter(parsed)
    # libvirt reads the devices of every <devices> element; so does the hook (graphics and hostdevs).
    graphics = parsed.root.find("devices/graphics") is not None
    existing = hostdevs_of(inputs)
    specs, warnings = plan_hostdevs(
        vmi, env, options, graphics=graphics, existing=existing.view, allocation=allocation, claims=claims
    )
    if allocation.switches:
        specs += switch_specs(specs, allocation, warnings)
    merged = merge_pass(writer, specs, existing)
    hostdevs, warnings = merged.hostdevs, warnings + merged.warnings
    placements: list[Placement] = []
    if companions and options.companion_reader is not None:
        allocation = with_read_companions(
            hostdevs, allocation, options.companion_reader, warnings, dra_only=options.allocation_carries_companions
        )
    if companions and allocation.companions:
        placed = companions_pass(writer, hostdevs, allocation, merged.placed, merged.by_source)
        hostdevs, placements = hostdevs + placed.hostdevs, placed.placements
        warnings += placed.warnings
    cliques = None
    if options.topology is not None and (vmi is None or vmi.metadata.cliques):
        # (the merge's hostdevs: the companions the last pass added are functions of a GPU's own slot, not GPUs)
        cliques = clique_pass(writer, merged.hostdevs, options.topology)
        warnings += cliques.warnings
    mmio = None
    if options.bars is not None:
        mmio = window_pass(writer, hostdevs, options.bars)
        warnings += mmio.warnings
    return BuildResult(writer.result(), hostdevs, warnings, vmi, placements, mmio, cliques)
