"""GPUDirect peer-to-peer cliques: GPUs that share a host PCIe switch get one ``x-nv-gpudirect-clique``.

NVIDIA's guest driver lets two passed-through GPUs read and write each other's memory directly only when QEMU
says they may: ``vfio-pci``'s ``x-nv-gpudirect-clique=<0-15>`` adds a vendor capability to each GPU, and GPUs
with the same number form a clique (docs/p2p.md). KubeVirt sets nothing of the kind, so P2P between a VM's GPUs
goes through system memory. This pass gives each group of the VM's GPUs that sit below one host PCIe switch
(:attr:`runtime.pci_topology.PciPlace.switch`, read from sysfs by a :class:`TopologyReader`) its own clique
number, written through libvirt's ``<qemu:override>`` on the GPU's ``ua-`` alias (libvirt 8.2+ passes the
property on the device's ``-device`` JSON):

- only NVIDIA display-class physical functions count (QEMU refuses the property on anything else); a GPU alone
  below its switch, or with no switch between it and the root complex, gets none;
- a GPU the domain already gives a clique (a ``<qemu:property name="x-nv-gpudirect-clique">`` in a
  ``<qemu:override>``) keeps it and the other GPUs below its switch join it; the numbers in use there are not
  given to another group;
- more groups than the 16 numbers: the groups beyond are left out with a warning;
- the VMI's annotation :data:`schemas.vmi.CLIQUES_ANNOTATION` ``"off"`` turns the pass off.

Step 2, the last pass but the 64-bit window's (on the call's one parsed document, after the hostdev merge and
the companions): it decides the clique of each GPU and the one writer (:mod:`launcher_hook.writer`) writes them
before ``</domain>`` (or at the end of the domain's one ``<qemu:override>``), a splice in the bytes when the
document is elements and text only and the place is unambiguous, an edit of the tree otherwise. A VM with
fewer than two GPUs reads nothing; one whose GPUs share no switch costs a kept lookup.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from xml.sax.saxutils import escape

from lxml import etree

from launcher_hook.document import append_child, child_slots, indent_unit
from launcher_hook.hostdev import HostdevSpec
from launcher_hook.mmio_window import QEMU_NS
from launcher_hook.writer import DomainWriter, Splice
from schemas import InputError, PciAddress, ResourceKind
from schemas.pci_topology import PciPlace

CLIQUE_PROPERTY = "x-nv-gpudirect-clique"
MAX_CLIQUES = 16
"""Clique numbers QEMU takes: 0-15 (a 4-bit field of the capability)."""


class TopologyReader(Protocol):
    """Where the GPUs' places in the host's PCIe tree come from (``runtime.pci_topology.SysfsTopology``)."""

    def read_all(self, addresses: Sequence[PciAddress]) -> list[PciPlace]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Clique:
    """One clique: its number, the host switch (its upstream port) the GPUs share, their aliases."""

    number: int
    switch: PciAddress
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class CliqueOutcome:
    """What the pass decided: the cliques it wrote, those the domain already had (alias → number), warnings."""

    cliques: tuple[Clique, ...] = ()
    kept: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


NO_CLIQUES = CliqueOutcome()
"""The outcome of a VM whose GPUs share no switch (most): nothing written."""


_KIND, _SOURCE = operator.itemgetter(0), operator.itemgetter(1)
"""``HostdevSpec.kind`` and ``.source`` (a NamedTuple's first two fields) as C functions."""


def existing_cliques(root: etree._Element) -> dict[str, str]:
    """alias → clique value the domain's ``<qemu:override>`` elements already give (the last one for an alias
    named more than once: libvirt applies them in order, so the last is what QEMU gets)."""
    found: dict[str, str] = {}
    for override in root.iterchildren(f"{{{QEMU_NS}}}override"):
        for device in override.iterchildren(f"{{{QEMU_NS}}}device"):
            alias = device.get("alias")
            for frontend in device.iterchildren(f"{{{QEMU_NS}}}frontend"):
                for prop in frontend.iterchildren(f"{{{QEMU_NS}}}property"):
                    if alias and prop.get("name") == CLIQUE_PROPERTY:
                        found[alias] = prop.get("value") or ""
    return found


def plan_cliques(
    specs: Sequence[HostdevSpec], places: Sequence[PciPlace], kept: Mapping[str, str]
) -> tuple[list[Clique], list[str]]:
    """The cliques of ``specs`` (their ``places`` in the same order): one per host switch below which two or
    more NVIDIA GPUs sit, numbered in the order of their first GPU, skipping the numbers ``kept`` (the domain's
    own cliques, alias → value) uses. GPUs in ``kept`` keep theirs, and the others below their switch join it
    (none do when the domain gives the switch's GPUs different cliques: a warning). Pure."""
    groups: dict[PciAddress, list[str]] = {}
    for spec, place in zip(specs, places, strict=True):
        switch = place.switch
        # (a user alias: libvirt keeps only those of its input, so only they name a device in <qemu:override>)
        if place.nvidia_gpu and switch is not None and spec.alias.startswith("ua-"):
            groups.setdefault(switch, []).append(spec.alias)
    taken = {_number(value) for value in kept.values()}
    free = (number for number in range(MAX_CLIQUES) if number not in taken)
    cliques: list[Clique] = []
    warnings: list[str] = []
    for switch, aliases in groups.items():
        joining = tuple(alias for alias in aliases if alias not in kept)
        if len(aliases) < 2 or not joining:
            continue
        # (compared as libvirt reads them: "0" and "00" are one clique)
        theirs = {kept[alias]: _number(kept[alias]) for alias in aliases if alias in kept}
        numbers = set(theirs.values())
        if len(numbers) > 1:
            warnings.append(
                f"GPUs below the host PCIe switch {switch} have different GPUDirect cliques in the domain "
                f"({', '.join(sorted(theirs))}); {', '.join(joining)} join none of them"
            )
            continue
        number = next(iter(numbers)) if numbers else next(free, None)
        if number is None:
            shown = (
                f"the domain's clique {next(iter(theirs))!r} is not a number"
                if theirs
                else f"all {MAX_CLIQUES} clique numbers are taken"
            )
            warnings.append(
                f"GPUs {', '.join(joining)} share the host PCIe switch {switch} but get no GPUDirect clique: {shown}"
            )
            continue
        cliques.append(Clique(number, switch, joining))
    return cliques, warnings


def _number(value: str) -> int | None:
    """A property value as libvirt 9.0 reads an ``unsigned`` one (base 10, leading zeros allowed: ``01`` is 1;
    it refuses ``0x1``), or None."""
    return int(value) if value.isascii() and value.isdigit() else None


GROUPS_KEPT = 16
"""Answers :func:`_shared_switches` keeps."""
_groups: dict[tuple[int, ...], tuple[tuple[PciPlace, ...], bool]] = {}


def _shared_switches(places: Sequence[PciPlace]) -> bool:
    """Whether two of the NVIDIA GPUs at ``places`` are below one host switch: kept for the very same place
    objects (a service keeps each GPU's place for its pod, so it gets the same objects on every call; found by
    their identities, which stay theirs while the answer, which holds them, is kept). A VM whose GPUs share no
    switch, the usual case, then costs one lookup per call."""
    key = tuple(map(id, places))
    found = _groups.get(key)
    if found is not None:
        return found[1]
    switches = [place.switch for place in places if place.nvidia_gpu]
    present = [switch for switch in switches if switch is not None]
    shared = len(set(present)) < len(present)
    if len(_groups) >= GROUPS_KEPT:
        _groups.clear()
    _groups[key] = (tuple(places), shared)
    return shared


def clique_pass(writer: DomainWriter, hostdevs: Sequence[HostdevSpec], reader: TopologyReader) -> CliqueOutcome:
    """The cliques of ``hostdevs``' GPUs (their places read by ``reader``), given to ``writer``."""
    if len(hostdevs) < 2:
        return NO_CLIQUES
    pci = ResourceKind.PCI
    # whole PCI functions (their sources are addresses); all of them in most VMs, found without a Python loop
    only_pci = list(map(_KIND, hostdevs)).count(pci) == len(hostdevs)  # (count: identity first, in C)
    specs = hostdevs if only_pci else [spec for spec in hostdevs if spec.kind is pci]
    if len(specs) < 2:
        return NO_CLIQUES
    try:
        places = reader.read_all(list(map(_SOURCE, specs)))
    except InputError as exc:
        raise InputError(
            f"{exc}; GPUDirect cliques are read from the PCIe tree under sysfs root {reader.describe()!r} "
            "(--sysfs-root, LAUNCHER_HOOK_SYSFS_ROOT)"
        ) from None
    if not _shared_switches(places):
        return NO_CLIQUES
    root = writer.parsed.root
    kept = existing_cliques(root) if b"override" in writer.parsed.source else {}
    cliques, warnings = _kept_plan(specs, places, kept)
    if cliques:
        splice = _override_splice(writer, cliques) if writer.fast else None
        if splice is not None:
            writer.splice(splice[0], splice[1], splice[2], lambda: _override_into_tree(writer, cliques))
        else:
            writer.no_fast()
            writer.tree_changed()
            _override_into_tree(writer, cliques)
    return CliqueOutcome(cliques, kept, warnings)


_plans: dict[tuple[object, ...], tuple[tuple[PciPlace, ...], tuple[Clique, ...], tuple[str, ...]]] = {}


def _kept_plan(
    specs: Sequence[HostdevSpec], places: Sequence[PciPlace], kept: Mapping[str, str]
) -> tuple[tuple[Clique, ...], tuple[str, ...]]:
    """:func:`plan_cliques`, kept for the same aliases, the very same place objects (see :func:`_shared_switches`)
    and the same cliques of the domain's own: a pod's calls plan the same VM."""
    key = (tuple(map(id, places)), tuple(spec.alias for spec in specs), tuple(kept.items()))
    found = _plans.get(key)
    if found is None:
        cliques, warnings = plan_cliques(specs, places, kept)
        if len(_plans) >= GROUPS_KEPT:
            _plans.clear()
        found = _plans[key] = (tuple(places), tuple(cliques), tuple(warnings))
    return found[1], found[2]


def _attribute(value: str) -> str:
    """``value`` for a double-quoted attribute (an alias read from the domain may hold any character)."""
    return escape(value, {'"': "&quot;"})


def _device_texts(prefix: str, cliques: Sequence[Clique], before: str, unit: str, expanded: bool) -> str:
    end = f"></{prefix}:property>" if expanded else "/>"
    inner, innermost = before + unit, before + unit + unit
    texts = []
    for clique in cliques:
        for alias in clique.aliases:
            texts.append(
                f'{before}<{prefix}:device alias="{_attribute(alias)}">{inner}<{prefix}:frontend>{innermost}'
                f'<{prefix}:property name="{CLIQUE_PROPERTY}" type="unsigned" value="{clique.number}"{end}'
                f"{inner}</{prefix}:frontend>{before}</{prefix}:device>"
            )
    return "".join(texts)


_texts: dict[tuple[object, ...], bytes] = {}


def _override_splice(writer: DomainWriter, cliques: Sequence[Clique]) -> Splice | None:
    """The splice writing ``<qemu:override>`` before ``</domain>`` (its namespace declared on it where the root
    does not declare libvirt's; empty elements as the document writes them, as a serialised tree would); None
    where the place is ambiguous. The text is kept per cliques and layout (a pod's calls write the same)."""
    parsed = writer.parsed
    root, source = parsed.root, parsed.source
    unit = indent_unit(root)
    expanded = parsed.expanded_empty
    overrides = list(root.iterchildren(f"{{{QEMU_NS}}}override")) if b"override" in source else []
    if overrides:
        return _into_override(source, overrides, cliques, unit, expanded)
    end = source.rfind(b"</domain")
    if end < 0 or source[end:].rstrip() != b"</domain>" or not len(root):
        return None
    before, closing = child_slots(root, unit)
    if before is None or closing is None:
        before = closing = None  # (compact: no layout to follow)
    cut = end - len(closing or "")
    if source[cut:end] != (closing or "").encode():
        return None
    prefix = next((str(p) for p, uri in root.nsmap.items() if uri == QEMU_NS and p is not None), None)
    key = (tuple(cliques), prefix, before, unit, expanded)
    text = _texts.get(key)
    if text is None:
        declare = "" if prefix is not None else f' xmlns:qemu="{QEMU_NS}"'
        name = prefix or "qemu"
        indent = before or ""
        step = unit if before else ""
        body = _device_texts(name, cliques, indent + step, step, expanded)
        text = f"{indent}<{name}:override{declare}>{body}{indent}</{name}:override>".encode()
        if len(_texts) >= GROUPS_KEPT:
            _texts.clear()
        _texts[key] = text
    return (cut, cut, text)


def _into_override(
    source: bytes, overrides: list[etree._Element], cliques: Sequence[Clique], unit: str, expanded: bool
) -> Splice | None:
    """The splice adding the devices at the end of the domain's one ``<qemu:override>`` (laid out like its
    children), or None where that is ambiguous in the bytes (two overrides, an empty or unprefixed one, its end
    tag not found exactly once)."""
    if len(overrides) != 1 or not len(overrides[0]) or overrides[0].prefix is None:
        return None
    override = overrides[0]
    own = str(override.prefix)
    end_tag = f"</{own}:override".encode()
    where = source.find(end_tag)
    if where < 0 or source.find(end_tag, where + 1) >= 0:
        return None
    before, closing = child_slots(override, unit)
    if before is None or closing is None:
        before = closing = None
    cut = where - len(closing or "")
    if source[cut:where] != (closing or "").encode():
        return None
    step = unit if before else ""
    return (cut, cut, _device_texts(own, cliques, before or "", step, expanded).encode())


def _override_into_tree(writer: DomainWriter, cliques: Sequence[Clique]) -> None:
    """The same on the tree: the devices appended to the domain's first ``<qemu:override>`` (one made, with its
    own namespace declaration where the root has none, when there is none)."""
    root = writer.parsed.root
    unit = indent_unit(root)
    override = next(root.iterchildren(f"{{{QEMU_NS}}}override"), None)
    if override is None:
        override = etree.Element(f"{{{QEMU_NS}}}override", nsmap={"qemu": QEMU_NS} if _undeclared(root) else None)
        append_child(root, override, *child_slots(root, unit))
    for clique in cliques:
        for alias in clique.aliases:
            device = etree.Element(f"{{{QEMU_NS}}}device", alias=alias)
            append_child(override, device, *child_slots(override, unit))
            frontend = etree.Element(f"{{{QEMU_NS}}}frontend")
            append_child(device, frontend, *child_slots(device, unit))
            prop = etree.Element(
                f"{{{QEMU_NS}}}property", name=CLIQUE_PROPERTY, type="unsigned", value=str(clique.number)
            )
            append_child(frontend, prop, *child_slots(frontend, unit))


def _undeclared(root: etree._Element) -> bool:
    return all(uri != QEMU_NS for uri in root.nsmap.values())
