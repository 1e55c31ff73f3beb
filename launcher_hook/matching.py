"""Which allocated device becomes which of the VM's devices, with what alias and display flags.

Follows virt-launcher (docs/kubevirt-hostdevs.md): each ``gpus[]`` entry takes the next unused ID of its
``deviceName``, the PCI variable first and then the mdev one, an ID being used once across all variables;
``hostDevices[]`` entries the same way. When virt-launcher has already rendered an entry (its alias
``ua-gpu-<name>`` / ``ua-hostdevice-<name>`` is in the domain) and that device is in the allocation, the entry
keeps virt-launcher's device, so both agree even when the hook reads the IDs in another order.

The hook acts only on entries whose allocation arrives in ``PCI_RESOURCE_*`` / ``MDEV_PCI_RESOURCE_*``. An
entry without such a variable is left to virt-launcher, with a warning, when virt-launcher has rendered it
(or, for ``hostDevices[]``, when it is a USB device: ``USB_RESOURCE_*``); otherwise virt-launcher itself
would have refused the VMI (its device count check), and so does the hook, naming the entry.

Aliases of hostdevs the hook creates are ``ua-gpuN`` / ``ua-hostdevN`` with N the entry's index in its list,
so they never depend on user-chosen names (which may hold characters libvirt silently drops from aliases).

Entries with ``claimName``/``requestName`` (DRA, docs/dra.md "Hook side") get the device their claim's metadata
file names (:mod:`launcher_hook.dra` reads it before the match); the same rules apply: virt-launcher's rendering
(``ua-dra-gpu-<name>`` / ``ua-dra-hostdevice-<name>``) is kept; an entry whose file the hook cannot find (a hook
sidecar does not see the compute container's CDI mounts) takes the device of virt-launcher's rendering when
there is one (a warning: virt-launcher read the file; for ``gpus[N]`` also the hook's own ``ua-gpuN``, which
``--force-gpu-aliases`` made of it, so a rebuild gives the same bytes) and is refused otherwise;
display and ramfb as for any vGPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from launcher_hook.allocation import EnvAllocation, Pool, usb_env_var_for
from launcher_hook.claims import ClaimOutcome, EntryKey
from launcher_hook.hostdev import HostdevSpec
from schemas import VM_KINDS, DeviceId, InputError, ResourceKind, kind_info
from schemas.vmi import GPU, HostDevice, VGPUOptions, VirtualMachineInstance

SourceKey = tuple[str, str]
"""What a hostdev passes through: ``("pci", "0000:86:00.0")`` or ``("mdev", "<uuid>")``."""

KUBEVIRT_ALIAS_PREFIX = {"gpus": "ua-gpu-", "hostDevices": "ua-hostdevice-"}
"""virt-launcher's alias for an entry: this prefix and the entry's name."""
KUBEVIRT_USB_ALIAS_PREFIX = "ua-usb-host-"
KUBEVIRT_DRA_ALIAS_PREFIX = {"gpus": "ua-dra-gpu-", "hostDevices": "ua-dra-hostdevice-"}
"""virt-launcher's alias for a DRA entry (``dra-gpu-<name>``/``dra-hostdevice-<name>`` as a user alias)."""
DRA_VARIABLE_PREFIX = "dra:"
"""A DRA hostdev's ``variable`` (for messages and logs): ``dra:<claimName>/<requestName>``."""


@dataclass(frozen=True)
class HostdevOptions:
    """Rendering choices that are not in the VMI."""

    managed: bool = False
    driver: str | None = None
    graphics: bool = True
    """Whether the domain has a ``<graphics>`` device: libvirt's QEMU driver refuses ``display='on'`` on an
    mdev hostdev without one, so the default display is only turned on with it."""
    force_gpu_aliases: bool = False
    """Rename GPUs virt-launcher already rendered to ``ua-gpuN`` too."""


@dataclass(frozen=True)
class DomainHostdevs:
    """What the matcher needs to know of the hostdevs already in the domain (``domain.read_hostdevs``)."""

    alias_sources: Mapping[str, SourceKey | None] = field(default_factory=dict)
    """Each hostdev alias → what that hostdev passes (None: a source the hook does not read, e.g. USB)."""
    ramfb_on: Mapping[SourceKey, str] = field(default_factory=dict)
    """mdev hostdevs with ``ramfb='on'``: source → how to name the hostdev in a message."""


NO_HOSTDEVS = DomainHostdevs()


class _Fixed(NamedTuple):
    """A DRA entry's device, read from ``file``."""

    kind: ResourceKind
    source: DeviceId
    file: str


class _Request(NamedTuple):
    """One VMI entry that asks for a device: where it sits and which resource it names."""

    list_name: str  # "gpus" or "hostDevices"
    position: int
    name: str
    device_name: str
    gpu: GPU | None
    claim: _Fixed | None = None
    """A DRA entry's device (and ``device_name`` is ``dra:<claimName>/<requestName>``)."""

    @property
    def alias(self) -> str:
        return f"ua-gpu{self.position}" if self.list_name == "gpus" else f"ua-hostdev{self.position}"

    @property
    def kubevirt_alias(self) -> str:
        return KUBEVIRT_ALIAS_PREFIX[self.list_name] + self.name

    @property
    def label(self) -> str:
        if self.claim is not None:
            return _dra_label(self.list_name, self.position, self.name, self.device_name)
        return f"{self.list_name}[{self.position}] {self.name!r} (deviceName {self.device_name})"


def _dra_label(list_name: str, position: int, name: str, variable: str) -> str:
    claim, _, request = variable.removeprefix(DRA_VARIABLE_PREFIX).partition("/")
    return f"{list_name}[{position}] {name!r} (claimName {claim}, requestName {request})"


def _dra_requests(
    vmi: VirtualMachineInstance,
    claims: Mapping[EntryKey, ClaimOutcome] | None,
    existing: DomainHostdevs,
    warnings: list[str],
) -> list[_Request]:
    """The VMI's DRA entries with the device each gets; an entry virt-launcher rendered and the hook cannot
    confirm is left as virt-launcher wrote it (a warning); an entry nobody can give a device is an error."""
    devices = vmi.spec.domain.devices
    entries: list[tuple[str, int, GPU | HostDevice]] = [("gpus", i, gpu) for i, gpu in enumerate(devices.gpus)]
    entries += [("hostDevices", i, host) for i, host in enumerate(devices.host_devices)]
    requests: list[_Request] = []
    for list_name, position, entry in entries:
        if not entry.is_dra:
            continue
        variable = f"{DRA_VARIABLE_PREFIX}{entry.claim_name or ''}/{entry.request_name or ''}"
        label = _dra_label(list_name, position, entry.name, variable)
        if not entry.claim_name or not entry.request_name:
            raise InputError(f"{label}: a DRA entry needs both claimName and requestName")
        if claims is None:
            warnings.append(f"{label}: no DRA metadata root is configured for the hook; left to virt-launcher")
            continue
        if vmi.spec.resource_claim(entry.claim_name) is None:
            names = ", ".join(repr(claim.name) for claim in vmi.spec.resource_claims) or "none"
            raise InputError(f"{label}: claimName {entry.claim_name!r} is not in spec.resourceClaims (names: {names})")
        outcome = claims.get((list_name, position))
        rendered = KUBEVIRT_DRA_ALIAS_PREFIX[list_name] + entry.name
        if outcome is None or outcome.kind is None or outcome.source is None:
            why = outcome.missing if outcome is not None else "the hook's DRA metadata reader gave nothing for it"
            holder = _rendered_alias(list_name, position, rendered, existing)
            if holder is not None:
                whose = "virt-launcher's" if holder == rendered else "the hook's own"
                taken = _rendered_device(existing.alias_sources[holder])
                if taken is None:
                    warnings.append(f"{label}: {why}; {whose} <hostdev> {holder!r} is left as it is")
                    continue
                # virt-launcher read the file itself (a hook sidecar does not see the compute container's CDI
                # mounts): its device is the entry's, so the GPU still gets its companions and BAR window.
                warnings.append(
                    f"{label}: {why}; {whose} <hostdev> {holder!r} is kept with the device it passes, {taken[1]}"
                )
                gpu = entry if isinstance(entry, GPU) else None
                fixed = _Fixed(taken[0], taken[1], f"{whose} <hostdev> {holder!r}")
                requests.append(_Request(list_name, position, entry.name, variable, gpu, fixed))
                continue
            raise InputError(
                f"{label}: {why} (is the DRA driver's metadata file visible to the hook? see --dra-metadata-root)"
            )
        key = (str(outcome.kind), str(outcome.source))
        if rendered in existing.alias_sources and existing.alias_sources[rendered] != key:
            passes = existing.alias_sources[rendered]
            warnings.append(
                f"{label}: virt-launcher's <hostdev> {rendered!r} passes "
                f"{passes[1] if passes is not None else 'a device the hook does not read'}, but {outcome.file} "
                f"names {outcome.source}; virt-launcher's is left as it is"
            )
            continue
        gpu = entry if isinstance(entry, GPU) else None
        fixed = _Fixed(outcome.kind, outcome.source, outcome.file)
        requests.append(_Request(list_name, position, entry.name, variable, gpu, fixed))
    return requests


def _requests(vmi: VirtualMachineInstance) -> list[_Request]:
    devices = vmi.spec.domain.devices
    requests = [
        _Request("gpus", index, gpu.name, gpu.device_name, gpu)
        for index, gpu in enumerate(devices.gpus)
        if gpu.device_name
    ]
    requests += [
        _Request("hostDevices", index, host.name, host.device_name, None)
        for index, host in enumerate(devices.host_devices)
        if host.device_name
    ]
    return requests


def _pools_for(device_name: str, allocation: EnvAllocation) -> list[Pool]:
    """The pools of ``device_name`` in the kinds table's order (PCI, then mdev, as virt-launcher; any may be absent)."""
    return [pool for kind in VM_KINDS.values() if (pool := allocation.pool(kind.env_var(device_name))) is not None]


class _Resource(NamedTuple):
    """What the matcher needs of one resource's pools, computed once per allocation (``allocation.derived``)."""

    pools: list[Pool]
    distinct: int
    """How many different IDs its pools list."""
    offered: dict[SourceKey, tuple[Pool, DeviceId]]
    """Each ID by the source key a hostdev passing it has (a later pool's ID wins)."""


def _resource(device_name: str, allocation: EnvAllocation) -> _Resource:
    cache = allocation.derived
    found: _Resource | None = cache.get(device_name)
    if found is None:
        pools = _pools_for(device_name, allocation)
        offered = {(str(pool.kind), str(device_id)): (pool, device_id) for pool in pools for device_id in pool.ids}
        distinct = len({device_id for pool in pools for device_id in pool.ids})
        found = cache[device_name] = _Resource(pools, distinct, offered)
    return found


def _left_to_virt_launcher(request: _Request, allocation: EnvAllocation, existing: DomainHostdevs) -> str | None:
    """Why an entry without a PCI/mdev variable is virt-launcher's alone (a warning), or None if it is not."""
    variables = ", ".join(kind.env_var(request.device_name) for kind in VM_KINDS.values())
    aliases = [request.kubevirt_alias]
    if request.list_name == "hostDevices":
        aliases.append(KUBEVIRT_USB_ALIAS_PREFIX + request.name)
    for alias in aliases:
        if alias in existing.alias_sources:
            return (
                f"{request.label}: not in the hook's allocation ({variables}); virt-launcher's <hostdev> "
                f"{alias!r} is left as it is"
            )
    if request.list_name == "hostDevices" and usb_env_var_for(request.device_name) in allocation.usb_variables:
        return f"{request.label}: a USB device ({usb_env_var_for(request.device_name)}); left to virt-launcher"
    return None


def _check_supply(requests: Sequence[_Request], resources: dict[str, _Resource]) -> None:
    """Every served resource has enough IDs; otherwise say exactly what is missing."""
    for device_name, count in Counter(request.device_name for request in requests).items():
        pools, found, _ = resources[device_name]
        if found < count:
            raise InputError(
                f"too few devices for {device_name}: {' + '.join(pool.variable for pool in pools)} lists {found}, "
                f"the VMI needs {count}"
            )


def _no_variable(request: _Request) -> InputError:
    variables = " and ".join(kind.env_var(request.device_name) for kind in VM_KINDS.values())
    return InputError(
        f"{request.label}: no allocation variable found; looked for {variables} "
        "(is the device plugin serving this resource, and is this the compute container's env?)"
    )


class _Display(NamedTuple):
    display: bool
    ramfb: str | None  # None, "default" (KubeVirt's default) or "explicit" (ramFB.enabled: true)


def _display_request(options: VGPUOptions | None, default_display: bool) -> _Display:
    """KubeVirt's display/ramfb rules for one mdev GPU, before the one-ramfb rule is applied."""
    display = options.display if options else None
    if display is None:
        return _Display(True, "default") if default_display else _Display(False, None)
    if display.enabled is False:
        return _Display(False, None)
    ram_fb = display.ram_fb.enabled if display.ram_fb is not None else None
    return _Display(True, None if ram_fb is False else "explicit" if ram_fb is True else "default")


def _one_ramfb(
    wants: Mapping[int, _Display], labels: Mapping[int, str], taken_by: str | None
) -> tuple[set[int], list[str]]:
    """Who gets ``ramfb='on'`` (libvirt allows it on one vGPU only), and warnings for those who lose it.

    An explicit request wins over KubeVirt's default; two explicit requests, or one while another hostdev of
    the domain already has ramfb (``taken_by``), are an error naming both.
    """
    explicit = [index for index, want in wants.items() if want.ramfb == "explicit"]
    default = [index for index, want in wants.items() if want.ramfb == "default"]
    if len(explicit) > 1:
        raise InputError(
            f"{labels[explicit[0]]} and {labels[explicit[1]]} both ask for ramfb (virtualGPUOptions.display.ramFB."
            "enabled: true), but libvirt allows ramfb='on' on one vGPU only"
        )
    if explicit and taken_by is not None:
        raise InputError(
            f"{labels[explicit[0]]} asks for ramfb, but {taken_by} in the domain already has ramfb='on' and libvirt "
            "allows it on one vGPU only"
        )
    winner = explicit[0] if explicit else default[0] if default and taken_by is None else None
    holder = labels[winner] if winner is not None else taken_by
    warnings = [
        f"{labels[index]}: no ramfb='on' ({holder} has it; libvirt allows it on one vGPU only)"
        for index in default
        if index != winner
    ]
    return ({winner} if winner is not None else set()), warnings


def _rendered_alias(list_name: str, position: int, rendered: str, existing: DomainHostdevs) -> str | None:
    """The alias of the hostdev that holds a DRA entry's device when the hook cannot read its file: virt-launcher's
    ``rendered``, or for ``gpus[N]`` the hook's own ``ua-gpuN`` (``--force-gpu-aliases`` renamed virt-launcher's on
    an earlier build; the hook's output fed back must give the same bytes); None when neither is there."""
    aliases = (rendered, f"ua-gpu{position}") if list_name == "gpus" else (rendered,)
    return next((alias for alias in aliases if alias in existing.alias_sources), None)


def _rendered_device(key: SourceKey | None) -> tuple[ResourceKind, DeviceId] | None:
    """The device a hostdev virt-launcher rendered passes, as a DRA entry's device; None for a source the hook
    does not write (USB) or cannot read."""
    if key is None:
        return None
    kind = next((kind for kind in VM_KINDS if kind_info(kind).hostdev_type == key[0]), None)
    if kind is None:
        return None
    try:
        return kind, kind_info(kind).parse_id(key[1])
    except InputError:
        return None


def _claim_rendered(
    served: Sequence[_Request],
    resources: Mapping[str, _Resource],
    existing: DomainHostdevs,
    used: set[DeviceId],
    warnings: list[str],
) -> tuple[dict[int, tuple[Pool, DeviceId]], set[int]]:
    """Entries virt-launcher already rendered keep its device: index → (pool, ID); and the indexes of entries
    whose rendered device is not in the hook's allocation (left as virt-launcher wrote them)."""
    claimed: dict[int, tuple[Pool, DeviceId]] = {}
    kept: set[int] = set()
    if not existing.alias_sources:
        return claimed, kept
    alias_sources = existing.alias_sources
    for index, request in enumerate(served):
        alias = KUBEVIRT_ALIAS_PREFIX[request.list_name] + request.name
        if alias not in alias_sources:
            continue
        key = alias_sources[alias]
        pools, _, offered = resources[request.device_name]
        match = offered.get(key) if key is not None else None
        if match is not None and match[1] in used:
            match = None
        if match is None:
            kept.add(index)
            passes = key[1] if key is not None else "a device the hook does not read"
            warnings.append(
                f"{request.label}: virt-launcher's <hostdev> {alias!r} passes {passes}, which "
                f"{' / '.join(pool.variable for pool in pools)} does not offer; it is left as it is"
            )
            continue
        claimed[index] = match
        used.add(match[1])
    return claimed, kept


MATCHES_KEPT = 64
"""Most results :func:`match_vmi` keeps per allocation (a pod's hook sees one VMI shape, a test a few)."""
_MATCHES = object()
"""Where in ``allocation.derived`` those results are (no resource name equals it)."""


def match_vmi(
    vmi: VirtualMachineInstance,
    allocation: EnvAllocation,
    options: HostdevOptions,
    existing: DomainHostdevs = NO_HOSTDEVS,
    claims: Mapping[EntryKey, ClaimOutcome] | None = None,
) -> tuple[list[HostdevSpec], list[str]]:
    """Hostdev specs for the VMI's GPUs and host devices, in VMI order, and warnings for the user.

    A pure function of what it reads: the VMI's ``gpus`` and ``hostDevices`` (every field of each entry)
    and ``resourceClaims``, the allocation, the options, the domain's hostdevs and the DRA entries' devices
    (``claims``, read by :mod:`launcher_hook.dra`; None: no metadata root configured). The hook's allocation
    is the same on every call and virt-launcher sends the same VMI each time, so a result is kept with the
    allocation (``allocation.derived``), keyed by all of those, and handed out as fresh lists; a call that
    raises keeps nothing.
    """
    devices = vmi.spec.domain.devices
    key = (
        tuple(devices.gpus),
        tuple(devices.host_devices),
        options,
        tuple(existing.alias_sources.items()),
        tuple(existing.ramfb_on.items()),
        vmi.spec.resource_claims,
        tuple(claims.items()) if claims is not None else None,
    )
    kept: dict[object, tuple[list[HostdevSpec], list[str]]] | None = allocation.derived.get(_MATCHES)
    if kept is None:
        kept = allocation.derived[_MATCHES] = {}
    found = kept.get(key)
    if found is None:
        found = _match_vmi(vmi, allocation, options, existing, claims)
        if len(kept) >= MATCHES_KEPT:
            kept.clear()
        kept[key] = found
    return list(found[0]), list(found[1])


def _match_vmi(
    vmi: VirtualMachineInstance,
    allocation: EnvAllocation,
    options: HostdevOptions,
    existing: DomainHostdevs,
    claims: Mapping[EntryKey, ClaimOutcome] | None,
) -> tuple[list[HostdevSpec], list[str]]:
    warnings: list[str] = []
    dra = _dra_requests(vmi, claims, existing, warnings) if _has_dra(vmi) else []
    served, resources = _served(vmi, allocation, existing, warnings)
    _check_supply(served, resources)
    used: set[DeviceId] = set()
    _reserve(dra, used)
    claimed, kept = _claim_rendered(served, resources, existing, used, warnings)
    # One cursor per resource over its IDs, PCI pool first: each request takes the next one not yet used.
    cursors: dict[str, Iterator[tuple[Pool, DeviceId]]] = {
        name: ((pool, device_id) for pool in resource.pools for device_id in pool.ids)
        for name, resource in resources.items()
    }
    any_display = any(
        gpu.virtual_gpu_options and gpu.virtual_gpu_options.display for gpu in vmi.spec.domain.devices.gpus
    )
    specs: list[HostdevSpec] = []
    wants: dict[int, _Display] = {}
    labels: dict[int, str] = {}
    first_mdev_seen = False
    for index, request in _in_vmi_order(served, dra):
        if index in kept:
            continue
        if request.claim is not None:
            pool, device_id = Pool(request.device_name, request.claim.kind, ()), request.claim.source
        elif index in claimed:
            pool, device_id = claimed[index]
        else:
            for pool, device_id in cursors[request.device_name]:  # noqa: B007 - pool is used after the break
                if device_id not in used:
                    break
            else:
                raise InputError(
                    f"{request.label}: every device of {request.device_name} is already taken by another entry"
                )
            used.add(device_id)
        gpu_options = request.gpu.virtual_gpu_options if request.gpu is not None else None
        is_gpu = request.list_name == "gpus"
        info = kind_info(pool.kind)
        spec = HostdevSpec(  # positional: one is built per device on the OnDefineDomain path
            pool.kind,
            device_id,
            f"ua-gpu{request.position}" if is_gpu else f"ua-hostdev{request.position}",
            pool.variable,
            options.managed,
            options.driver if info.takes_driver_element else None,
            False,
            False,
            request.label,
            options.force_gpu_aliases and is_gpu,
        )
        if info.default_display and is_gpu:
            is_first_mdev = not first_mdev_seen
            first_mdev_seen = True
            want = _display_request(gpu_options, is_first_mdev and options.graphics and not any_display)
            if want.display and not options.graphics:
                raise InputError(
                    f"{request.label} asks for a vGPU display, but the domain has no <graphics> device and "
                    "libvirt refuses display='on' without one (keep autoattachGraphicsDevice on, or set "
                    "virtualGPUOptions.display.enabled: false)"
                )
            wants[len(specs)] = want
            labels[len(specs)] = request.label
        elif gpu_options is not None and gpu_options.display is not None and gpu_options.display.enabled is True:
            warnings.append(
                f"{request.label}: display/ramfb are not written on PCI passthrough hostdevs "
                "(libvirt's schema allows them on mdev hostdevs only and its parser drops them)"
            )
        specs.append(spec)
    return _with_display(specs, wants, labels, existing, warnings), warnings


def _served(
    vmi: VirtualMachineInstance, allocation: EnvAllocation, existing: DomainHostdevs, warnings: list[str]
) -> tuple[list[_Request], dict[str, _Resource]]:
    """The device-plugin entries the hook serves (their resource has a variable) and those resources; the
    others are left to virt-launcher (a warning) or refused."""
    resources: dict[str, _Resource] = {}
    served: list[_Request] = []
    for request in _requests(vmi):
        resource = resources.get(request.device_name)
        if resource is None:
            resource = resources[request.device_name] = _resource(request.device_name, allocation)
        if resource.pools:
            served.append(request)
            continue
        reason = _left_to_virt_launcher(request, allocation, existing)
        if reason is None:
            raise _no_variable(request)
        warnings.append(reason)
    return served, resources


def _in_vmi_order(served: Sequence[_Request], dra: Sequence[_Request]) -> list[tuple[int, _Request]]:
    """The served entries (with their index in ``served``) and the DRA ones (index -1) in VMI order: gpus, then
    hostDevices, each by position."""
    ordered: list[tuple[int, _Request]] = list(enumerate(served))
    if dra:
        ordered += [(-1, request) for request in dra]
        ordered.sort(key=lambda item: (item[1].list_name != "gpus", item[1].position))
    return ordered


def _reserve(dra: Sequence[_Request], used: set[DeviceId]) -> None:
    """A DRA entry's device is fixed: no other entry may take it (two DRA entries naming one is an error)."""
    given_to: dict[DeviceId, str] = {}
    for request in dra:
        if request.claim is None:
            continue
        other = given_to.setdefault(request.claim.source, request.label)
        if other != request.label:
            raise InputError(f"{request.label}: {request.claim.source} is named by {other} too")
        used.add(request.claim.source)


def _has_dra(vmi: VirtualMachineInstance) -> bool:
    devices = vmi.spec.domain.devices
    return any(gpu.is_dra for gpu in devices.gpus) or any(host.is_dra for host in devices.host_devices)


def _with_display(
    specs: list[HostdevSpec],
    wants: Mapping[int, _Display],
    labels: Mapping[int, str],
    existing: DomainHostdevs,
    warnings: list[str],
) -> list[HostdevSpec]:
    """``specs`` with their display flags set, ramfb on at most one (warnings appended)."""
    if not wants:
        return specs
    ours = {(str(spec.kind), spec.source_text) for spec in specs}
    others = [label for key, label in existing.ramfb_on.items() if key not in ours]
    ramfb, lost = _one_ramfb(wants, labels, others[0] if others else None)
    warnings += lost
    for index, want in wants.items():
        specs[index] = specs[index]._replace(display=want.display, ramfb=index in ramfb)
    return specs


def match_all(
    allocation: EnvAllocation, options: HostdevOptions, existing: DomainHostdevs = NO_HOSTDEVS
) -> tuple[list[HostdevSpec], list[str]]:
    """Without a VMI: every variable in name order, IDs in listed order, aliases ``ua-gpu0``, ``ua-gpu1``…;
    the first vGPU gets the default display (with a ``<graphics>`` device)."""
    specs: list[HostdevSpec] = []
    seen: set[DeviceId] = set()
    wants: dict[int, _Display] = {}
    labels: dict[int, str] = {}
    for variable in sorted(allocation.pools):
        pool = allocation.pools[variable]
        for device_id in pool.ids:
            if device_id in seen:
                continue
            seen.add(device_id)
            label = f"{variable} {device_id}"
            if kind_info(pool.kind).default_display:
                wants[len(specs)] = _display_request(None, not wants and options.graphics)
                labels[len(specs)] = label
            specs.append(_spec(pool, device_id, f"ua-gpu{len(specs)}", options, label))
    warnings: list[str] = []
    return _with_display(specs, wants, labels, existing, warnings), warnings


def _spec(pool: Pool, device_id: DeviceId, alias: str, options: HostdevOptions, label: str) -> HostdevSpec:
    return HostdevSpec(
        kind=pool.kind,
        source=device_id,
        alias=alias,
        variable=pool.variable,
        managed=options.managed,
        driver=options.driver if kind_info(pool.kind).takes_driver_element else None,
        label=label,
        force_alias=options.force_gpu_aliases,
    )
