"""The domain builder: allocation env + VMI + domain XML in, the domain with its GPUs out.

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
from launcher_hook.claims import ClaimOutcome, ClaimResolver, EntryKey, dra_entries
from launcher_hook.companions import (
    CompanionReader,
    Placement,
    place_companions,
    wanted_companions,
    with_read_companions,
)
from launcher_hook.domain import devices_document, merge_hostdevs, parse_domain, read_hostdevs
from launcher_hook.hostdev import HostdevSpec
from launcher_hook.matching import NO_HOSTDEVS, DomainHostdevs, HostdevOptions, match_all, match_vmi
from launcher_hook.mmio_window import BarSource, WindowOutcome, add_window
from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from schemas.pci import PciAddress
from schemas.vmi import VirtualMachineInstance, parse_vmi

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

    @property
    def aliases(self) -> dict[str, str]:
        """alias → source, for logs."""
        return {spec.alias: spec.source_text for spec in self.hostdevs}


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
    return options.claims.resolve(vmi) if dra_entries(vmi) else {}


def build_domain(
    domain_xml: bytes | None,
    vmi_json: bytes | None,
    env: Mapping[str, str],
    options: BuildOptions | None = None,
) -> BuildResult:
    """Render the allocated GPUs into ``domain_xml`` (or a bare ``<devices>`` when it is None)."""
    options = options or BuildOptions()
    vmi = parse_vmi(vmi_json, max_bytes=options.max_input_bytes) if vmi_json is not None else None
    parsed = parse_domain(domain_xml, options.max_input_bytes) if domain_xml is not None else None
    companions = vmi is None or vmi.metadata.companions  # on unless the VMI's annotation turns it off
    allocation = allocation_from_env(env)
    claims = _read_claims(vmi, options)
    if parsed is None:
        specs, warnings = plan_hostdevs(vmi, env, options, allocation=allocation, claims=claims)
        if companions and options.companion_reader is not None:
            allocation = with_read_companions(
                specs, allocation, options.companion_reader, warnings, dra_only=options.allocation_carries_companions
            )
        if companions and wanted_companions(specs, allocation, warnings):
            warnings.append("companion functions are not placed: there is no domain to place them in")
        return BuildResult(devices_document(specs), specs, warnings, vmi)
    # libvirt reads the devices of every <devices> element; so does the hook (graphics and hostdevs).
    graphics = parsed.root.find("devices/graphics") is not None
    existing = read_hostdevs(parsed)
    specs, warnings = plan_hostdevs(
        vmi, env, options, graphics=graphics, existing=existing.view, allocation=allocation, claims=claims
    )
    spliced = merge_hostdevs(parsed, specs, existing)
    domain, hostdevs, warnings = spliced.domain_xml, spliced.hostdevs, warnings + spliced.warnings
    placements: list[Placement] = []
    # The passes below re-read the hook's own output, which may outgrow the input cap by the hostdevs added:
    # a domain within the cap must not be refused for them.
    own_cap = max(options.max_input_bytes, len(domain))
    if companions and options.companion_reader is not None:
        allocation = with_read_companions(
            hostdevs, allocation, options.companion_reader, warnings, dra_only=options.allocation_carries_companions
        )
    if companions and allocation.companions:
        placed = place_companions(domain, hostdevs, allocation, own_cap)
        domain, hostdevs, placements = placed.domain_xml, hostdevs + placed.hostdevs, placed.placements
        warnings += placed.warnings
    mmio = None
    if options.bars is not None:
        # Every PCI function the hook passes counts: GPUs, SR-IOV VFs, companions. Companions change only
        # <devices>, so the window's text insertion (outside <devices>) still reads ``parsed``'s layout.
        pci = [spec.source for spec in hostdevs if isinstance(spec.source, PciAddress)]
        domain, mmio = add_window(parsed, domain, pci, options.bars, max(own_cap, len(domain)))
        warnings += mmio.warnings
    return BuildResult(domain, hostdevs, warnings, vmi, placements, mmio)
