"""A passthrough GPU and its companion functions as one multifunction guest device (issue 15).

A consumer GPU is one card of several functions (VGA, HDMI audio, USB, UCSI) in one IOMMU group; drivers in the
guest expect them together, as on the host. KubeVirt passes the GPU alone (its issues #14024, #10565, #14375).
The device plugin lists each GPU's companions in ``PCI_COMPANIONS_<NAME>`` (:mod:`schemas.companions`); this
module, run on the domain the merge produced, puts them in the GPU's guest slot (docs/kubevirt-hostdevs.md,
"Companions"):

- the GPU's hostdev gets a guest ``<address type="pci" … function="0x0" multifunction="on"/>``: on a PCIe
  machine (q35, arm ``virt``) at slot 0 of a new ``pcie-root-port`` whose index is one above every PCI
  controller's, on i440fx in the highest slot of bus 0 that no explicit address uses;
- each companion gets a ``<hostdev type="pci">`` in the same slot at its host function number, alias
  ``ua-gpuN-fnF`` (N: the GPU's place in the hook's hostdev list), ``managed`` and ``<driver>`` as the GPU's;
- a GPU that already has a guest address keeps it: its companions join its slot when it is function 0, else
  they are left out with a warning. Nothing KubeVirt placed moves; a companion already in the domain elsewhere
  stays where it is (warning).

Where the allocation source carries no companion variable (PodResources; DRA claims later), the builder asks a
:class:`CompanionReader` (``runtime.pci_companions.SysfsCompanions``) for each passthrough GPU's companions
instead (:func:`with_read_companions`); a variable the allocation does carry wins.

Step 2, the second pass (after the hostdev merge, on the same parsed document): it decides the edits and the
one writer (:mod:`launcher_hook.writer`) applies them with the merge's. Every other byte stays: new elements go
next to the GPU's hostdev and the GPU's address (or the one attribute ``multifunction``) into its element; for a
GPU the merge adds, into that pending hostdev's text. Applied to its own output it changes nothing.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import NamedTuple, Protocol

from lxml import etree

from launcher_hook.allocation import EnvAllocation
from launcher_hook.document import ParsedDomain, append_child, child_slots, parse_domain
from launcher_hook.domain import hostdev_source_key, hostdevs_from_tree
from launcher_hook.hostdev import HostdevRenderer, HostdevSpec, Layout, renderer_for
from launcher_hook.hostdevs.base import c_number, device_text
from launcher_hook.matching import DRA_VARIABLE_PREFIX, SourceKey
from launcher_hook.writer import DomainWriter, Handle, NewHostdev
from schemas import InputError, PciAddress, ResourceKind
from schemas.companions import MAX_GPUS, companions_variable_for


def companions_key(variable: str) -> str | None:
    """Where a GPU's companions are kept in ``EnvAllocation.companions``: its resource's companion variable
    (``PCI_COMPANIONS_<NAME>``), or for a GPU a DRA claim gave (``dra:<claim>/<request>``), which no variable
    can describe, that name itself; None for any other device."""
    if variable.startswith(DRA_VARIABLE_PREFIX):
        return variable
    return companions_variable_for(variable)


COMPANION_ALIAS = "ua-gpu%d-fn%d"
"""A companion's alias: the GPU's index in the hook's hostdev list and the function (never a KubeVirt alias,
``ua-gpu-<name>``, nor the hook's GPU alias, ``ua-gpuN``)."""
_ALIAS_PREFIX, _DIGITS = COMPANION_ALIAS.removesuffix("%d"), "01234567"
""":data:`COMPANION_ALIAS` without its function, and the digit of each function (0-7: ``PciAddress``)."""
ROOT_PORT = "pcie-root-port"
LEGACY_SLOTS = range(0x1F, 0x02, -1)
"""Slots of an i440fx bus 0 a GPU may take, highest first (0 is the host bridge, 1 the PIIX3, 2 the video
libvirt prefers): away from the low slots libvirt's own assignment fills first."""
MAX_BUS = 0xFF

_ALIAS_START = re.compile(rb"<alias[\s/>]")
_ADDRESS_START = re.compile(rb"<address[\s/>]")
_SOURCE_SPAN = re.compile(rb"<source[\s>].*?</source\s*>", re.DOTALL)
_START_TAG_END = re.compile(rb"""(?:[^>"']|"[^"]*"|'[^']*')*?(/?>)""")


class Placement(NamedTuple):
    """Where one GPU and its companions went: the guest slot and the functions in it.

    A NamedTuple rather than a frozen dataclass: one is built per GPU on the OnDefineDomain path.
    """

    gpu_alias: str
    gpu: str
    slot: tuple[int, int, int]
    """Guest domain, bus and slot."""
    functions: tuple[int, ...]
    """The companions' functions in the slot (the GPU is function 0)."""
    root_port: int | None = None
    """Index of the ``pcie-root-port`` added for the GPU, if one was."""

    def describe(self) -> str:
        domain, bus, slot = self.slot
        port = f" behind the new pcie-root-port index {self.root_port}" if self.root_port is not None else ""
        functions = ", ".join(f"{function} ({self.gpu[:-1]}{function})" for function in self.functions)
        return (
            f"{self.gpu_alias}: guest slot {domain:04x}:{bus:02x}:{slot:02x}{port}, function 0 {self.gpu} "
            f"(multifunction), companions at {functions or 'none'}"
        )


@dataclass(frozen=True)
class Companioned:
    """The domain with the companions placed, the hostdevs added for them, where each GPU went, warnings."""

    domain_xml: bytes
    hostdevs: list[HostdevSpec] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


Wanted = tuple[int, HostdevSpec, tuple[PciAddress, ...]]
Look = tuple[Layout, HostdevRenderer]
"""How what goes next to a hostdev is laid out, and the renderer of that layout."""


class CompanionReader(Protocol):
    """Where a GPU's companions are read when the allocation does not list them (sysfs; a stand-in in tests)."""

    def describe(self) -> str: ...

    def read(self, gpu: PciAddress, gpus: Collection[PciAddress] = ()) -> tuple[PciAddress, ...]:
        """``gpu``'s companions (none for a device that is no passthrough GPU); ``gpus``: the VM's other PCI
        devices, never companions. Raises ``InputError`` naming the device and the file."""
        ...


def with_read_companions(
    specs: Sequence[HostdevSpec],
    allocation: EnvAllocation,
    reader: CompanionReader,
    warnings: list[str],
    *,
    dra_only: bool = False,
) -> EnvAllocation:
    """``allocation`` with the companions ``reader`` finds for each PCI device among ``specs`` whose resource
    has no companion variable in it (a variable the allocation carries wins: the plugin saw the host at
    ``Allocate``).

    What ``reader`` read of a GPU may be kept by the reader for its service's life (``SysfsCompanions.keeping``:
    the facts are fixed while the pod holds the GPU, runtime/sysfs_paths.py); the rule runs on every call, and a
    read that failed is never kept. A device that cannot be read is a
    warning naming it and the file, and that GPU is placed alone. At most :data:`MAX_GPUS` are read.
    ``dra_only``: the allocation source carries the companion variables (env, environ file), so only GPUs a
    DRA claim gave are read (no variable can name theirs).
    """
    if dra_only:
        for spec in specs:  # (a plain loop: one per GPU)
            if spec.variable.startswith(DRA_VARIABLE_PREFIX):
                break
        else:
            return allocation  # (the usual case: no GPU from a DRA claim)
    pci = [
        (spec, spec.source) for spec in specs if spec.kind is ResourceKind.PCI and isinstance(spec.source, PciAddress)
    ]
    readable = [pair for pair in pci if pair[0].variable.startswith(DRA_VARIABLE_PREFIX)] if dra_only else pci
    keys: dict[str, str | None] = {}  # each resource's companions_key, worked out once (the GPUs share a few)
    for spec, _ in readable:
        if spec.variable not in keys:
            keys[spec.variable] = companions_key(spec.variable)
    present = allocation.companions
    wanted = [(spec, gpu) for spec, gpu in readable if keys[spec.variable] not in present]
    if not wanted:
        return allocation
    if len(wanted) > MAX_GPUS:
        warnings.append(
            f"{len(wanted)} PCI devices could have companions; only the first {MAX_GPUS} are read from "
            f"{reader.describe()}, the others are placed alone"
        )
        wanted = wanted[:MAX_GPUS]
    sources = {gpu for _, gpu in pci}
    tables: dict[str, dict[PciAddress, tuple[PciAddress, ...]]] = {}
    read_all = getattr(reader, "read_all", None)  # a reader that resolves its paths once for all the GPUs
    if read_all is not None:
        outcomes: list[tuple[PciAddress, ...] | InputError] = read_all([gpu for _, gpu in wanted], sources)
    else:
        outcomes = [_read_one(reader, gpu, sources) for _, gpu in wanted]
    for (spec, gpu), functions in zip(wanted, outcomes, strict=True):
        if isinstance(functions, InputError):
            warnings.append(
                f"{spec.label}: its companions cannot be read from sysfs, so it is placed alone: {functions}"
            )
            continue
        variable = keys[spec.variable]
        if functions and variable is not None:
            tables.setdefault(variable, {})[gpu] = functions
    if not tables:
        return allocation
    kept: tuple[object, EnvAllocation] | None = allocation.derived.get(_WITH_READ)
    if kept is not None and kept[0] == tables:
        return kept[1]  # (what the last call read: the same allocation, with what was derived of it)
    merged = dict(allocation.companions)
    merged.update((name, MappingProxyType(table)) for name, table in tables.items())
    result = replace(allocation, companions=MappingProxyType(merged))
    allocation.derived[_WITH_READ] = (tables, result)
    return result


_WITH_READ = object()
"""Where in ``allocation.derived`` the last :func:`with_read_companions` result is kept, with the companions
read for it: a call that reads the same gets the same allocation (and what was derived of it, such as
:func:`wanted_companions`)."""


def _read_one(
    reader: CompanionReader, gpu: PciAddress, sources: Collection[PciAddress]
) -> tuple[PciAddress, ...] | InputError:
    try:
        return reader.read(gpu, sources)
    except InputError as exc:
        return exc


def wanted_companions(specs: Sequence[HostdevSpec], allocation: EnvAllocation, warnings: list[str]) -> list[Wanted]:
    """The passthrough GPUs among ``specs`` that have companions in ``allocation``: (index, spec, companions).

    A companion that is itself one of the VM's GPUs is not placed twice (warning). A pure function of ``specs``
    and the allocation (which never changes): kept with the allocation (``allocation.derived``) by ``specs``,
    for the last :data:`WANTED_KEPT` lists, and handed out as a fresh list.
    """
    if not allocation.companions:
        return []
    key = tuple(specs)
    kept: dict[tuple[HostdevSpec, ...], tuple[list[Wanted], list[str]]] | None = allocation.derived.get(_WANTED)
    if kept is None:
        kept = allocation.derived[_WANTED] = {}
    found = kept.get(key)
    if found is None:
        problems: list[str] = []
        found = (_wanted_companions(key, allocation, problems), problems)
        if len(kept) >= WANTED_KEPT:
            kept.clear()
        kept[key] = found
    warnings += found[1]
    return list(found[0])


WANTED_KEPT = 16
"""Lists of hostdevs whose :func:`wanted_companions` an allocation keeps."""
_WANTED = object()
"""Where in ``allocation.derived`` they are."""


def _wanted_companions(specs: Sequence[HostdevSpec], allocation: EnvAllocation, warnings: list[str]) -> list[Wanted]:
    """:func:`wanted_companions`, worked out."""
    pci = ResourceKind.PCI
    allocated = {spec.source for spec in specs if spec.kind is pci}
    found: list[Wanted] = []
    keys: dict[str, str | None] = {}
    for index, spec in enumerate(specs):
        if spec.kind is not pci or not isinstance(spec.source, PciAddress):
            continue
        variable = keys.get(spec.variable, "")
        if variable == "":
            variable = keys[spec.variable] = companions_key(spec.variable)
        table = allocation.companions.get(variable) if variable is not None else None
        functions = table.get(spec.source) if table is not None else None
        if not functions:
            continue
        if allocated.isdisjoint(functions):
            found.append((index, spec, functions))
            continue
        taken = [function for function in functions if function in allocated]
        warnings.append(
            f"{spec.label}: companion {', '.join(map(str, taken))} is a GPU of this VM itself; "
            "it is not placed again in the GPU's slot"
        )
        keep = tuple(function for function in functions if function not in allocated)
        if keep:
            found.append((index, spec, keep))
    return found


def _number(element: etree._Element, name: str) -> int | None:
    text = element.get(name)
    return 0 if text is None else c_number(text)


def _guest_numbers(address: etree._Element) -> tuple[int, int, int, int] | None:
    numbers = tuple(_number(address, name) for name in ("domain", "bus", "slot", "function"))
    if any(number is None for number in numbers):
        return None
    return numbers  # type: ignore[return-value]


_ALIAS_NAMES = etree.XPath("//alias/@name", smart_strings=False)
_NONE_TYPE = type(None)


class _Domain:
    """What the placement needs to know of the domain: its bus kind, PCI controller indexes, used addresses."""

    def __init__(self, parsed: ParsedDomain) -> None:
        # The children are walked with iterchildren/iter (lxml's C loops): the same elements, in the same order,
        # as the paths "os/type", "devices/controller" and "devices//address[@type='pci'][not(parent::source)]"
        # (every guest PCI address of a device; a <source>'s is the host's), whose evaluation (lxml's ElementPath
        # in Python, an XPath over every device) cost more than the rest of the pass at one GPU.
        root = parsed.root
        os_type = None
        for os_element in root.iterchildren("os"):
            os_type = next(os_element.iterchildren("type"), None)
            if os_type is not None:
                break
        self.machine = machine = (os_type.get("machine") if os_type is not None else None) or ""
        devices = list(root.iterchildren("devices"))
        self.devices = len(devices)
        models: set[str | None] = set()
        self.unindexed = False
        top = 0
        for element in devices:
            for controller in element.iterchildren("controller"):
                if controller.get("type") != "pci":
                    continue
                models.add(controller.get("model"))
                index = c_number(controller.get("index"), 10)
                if index is None:
                    self.unindexed = True
                elif index > top:
                    top = index
        if "pcie-root" in models or "q35" in machine or machine.startswith("virt"):
            self.bus_kind: str | None = "pcie"
        elif "pci-root" in models or machine == "pc" or machine.startswith("pc-"):
            self.bus_kind = "pci"
        else:
            self.bus_kind = None
        self.used: dict[tuple[int, int, int, int], Handle] = {}
        used = self.used
        self.guests: dict[etree._Element, etree._Element] = {}
        """Each hostdev's first ``<address>`` child (its guest address, of any type), found by the same walk;
        a hostdev with none is not in it. (No pass before this one adds an address to the tree.)"""
        guests = self.guests
        # (no "<address" in the bytes: no address element, and the walk would visit every device for nothing)
        for element in devices if b"<address" in parsed.source else ():
            for address in element.iter("address"):  # (every guest PCI address of a device: not a <source>'s)
                owner = address.getparent()
                if owner is None:
                    continue
                tag = owner.tag
                if tag == "source":
                    continue
                if tag == "hostdev" and owner not in guests:
                    guests[owner] = address  # (in document order: the first child named address)
                if address.get("type") != "pci":
                    continue
                numbers = _guest_numbers(address)
                if numbers is not None and numbers[:3] != (0, 0, 0):  # domain, bus, slot 0: "assign one" to libvirt
                    used.setdefault(numbers, owner)
                    # An address on bus N makes libvirt add the controllers up to index N that the domain lacks:
                    # a new root port's index (its bus) must be above those too, or its slot 0 may be that address.
                    top = max(top, numbers[1])
        self.next_index = top + 1

    def slot_taken(self, domain: int, bus: int, slot: int) -> bool:
        return any(key[:3] == (domain, bus, slot) for key in self.used)

    def free_legacy_slot(self) -> int | None:
        return next((slot for slot in LEGACY_SLOTS if not self.slot_taken(0, 0, slot)), None)


def _label(hostdev: Handle) -> str:
    if isinstance(hostdev, NewHostdev):
        return f"<hostdev> {hostdev.spec.alias!r} (added by this hook)"
    alias = hostdev.find("alias")
    name = f" {alias.get('name')!r}" if alias is not None and alias.get("name") else ""
    return f"<{hostdev.tag}>{name} at line {hostdev.sourceline}"


def _empty(tag: str, attributes: str, expanded: bool) -> str:
    return f"<{tag} {attributes}></{tag}>" if expanded else f"<{tag} {attributes}/>"


def _guest_address_template(slot: tuple[int, int, int], multifunction: bool, expanded: bool) -> str:
    """A guest ``<address>`` in ``slot``; its one printf field is the function."""
    domain, bus, number = slot
    extra = ' multifunction="on"' if multifunction else ""
    attributes = f'type="pci" domain="0x{domain:04x}" bus="0x{bus:02x}" slot="0x{number:02x}" function="0x%x"{extra}'
    return _empty("address", attributes, expanded)


def _guest_address(slot: tuple[int, int, int], function: int, multifunction: bool, expanded: bool) -> str:
    return _guest_address_template(slot, multifunction, expanded) % function


class _Placer:
    """The pass's edits of one GPU's hostdev (an element of the domain, or one the merge adds), made on the tree
    and given to the writer.

    The edits of a domain's hostdev (a root port before it, its guest address or ``multifunction``, its
    companions after it) are gathered while the GPU is placed and given to the writer in one call
    (:meth:`flush`), which finds the hostdev's bytes once; those of a hostdev the merge adds go into it.
    """

    def __init__(self, writer: DomainWriter) -> None:
        self.writer = writer
        self.parsed = writer.parsed
        self._looks: dict[str, Look] = {}
        """By indentation, the looks of the domain's hostdevs where the empty-element style is the same at every
        offset (the bytes have no ``/>``, or the tree is serialised): worked out once for all of them."""
        self._styled = self.parsed.has_self_closing
        """Whether the empty-element style may differ from one offset of the bytes to another."""
        self._new: Look | None = None
        self._hostdev: etree._Element | None = None
        """The hostdev whose edits below are not given to the writer yet."""
        self._before: list[tuple[str, str]] = []
        self._after: list[tuple[Sequence[str], str]] = []
        self._inside: tuple[Callable[[bytes], int | None], str] | None = None
        self._fix_inside: Callable[[], None] | None = None

    def look(self, hostdev: Handle) -> Look:
        """How what goes in and next to ``hostdev`` is laid out (like it: its indentation, the empty-element
        style of the bytes before it), with that layout's renderer; one for all the hostdevs the merge adds
        (they share one layout)."""
        if isinstance(hostdev, NewHostdev):
            if self._new is None:
                layout = self.writer.new_layout
                self._new = (layout, renderer_for(layout))
            return self._new
        # indent_of(hostdev) or "", without its two calls (one per GPU)
        previous = hostdev.getprevious()
        if previous is not None:
            before = previous.tail
        else:
            parent = hostdev.getparent()
            before = parent.text if parent is not None else None
        indent = before if before and "\n" in before and not before.strip() else ""
        writer = self.writer
        if writer.fast and self._styled:  # the style of the bytes just before the hostdev
            span = writer.hostdev_span(hostdev)
            layout = writer.layout_at(indent, span[0] if span is not None else None)
            return (layout, renderer_for(layout))
        found = self._looks.get(indent)
        if found is None:
            layout = writer.layout_at(indent, None)  # (what any offset gives)
            found = self._looks[indent] = (layout, renderer_for(layout))
        return found

    def _editing(self, hostdev: etree._Element) -> None:
        """The edits that follow are ``hostdev``'s (those of another hostdev before are given to the writer)."""
        if self._hostdev is not hostdev:
            if self._hostdev is not None:
                self.flush()
            self._hostdev = hostdev

    def add_guest_address(self, hostdev: Handle, address_text: str) -> None:
        """Give ``hostdev`` its guest address, before its alias (or last)."""
        if isinstance(hostdev, NewHostdev):
            hostdev.address = address_text
            self.writer.new_decorated = True
            return
        # hostdev.find("alias") and its getprevious(), in one loop over the children (cheaper in lxml)
        alias = previous = None
        for child in hostdev:
            if child.tag == "alias":
                alias = child
                break
            previous = child
        if alias is None:
            self.writer.no_fast()
            self.writer.tree_changed()
            append_child(hostdev, etree.fromstring(address_text), *child_slots(hostdev, self.writer.unit))
            return
        whitespace = previous.tail if previous is not None else hostdev.text
        whitespace = whitespace if whitespace and not whitespace.strip() else ""
        if self._hostdev is not hostdev:
            self._editing(hostdev)
        self._inside = (_only_alias, address_text + whitespace)
        self._fix_inside = functools.partial(_address_before, alias, address_text, whitespace)

    def add_multifunction(self, hostdev: Handle, address: etree._Element) -> None:
        assert not isinstance(hostdev, NewHostdev)  # (a hostdev the merge adds has no guest address)
        if self._hostdev is not hostdev:
            self._editing(hostdev)
        self._inside = (_guest_address_end, ' multifunction="on"')
        self._fix_inside = functools.partial(address.set, "multifunction", "on")

    def add_before(self, hostdev: Handle, text: str, indent: str) -> None:
        if isinstance(hostdev, NewHostdev):
            hostdev.add_before(text)
            self.writer.new_decorated = True
            return
        if self._hostdev is not hostdev:
            self._editing(hostdev)
        self._before.append((text, indent))

    def add_after(self, hostdev: Handle, texts: Sequence[str], indent: str) -> None:
        if not texts:
            return
        if isinstance(hostdev, NewHostdev):
            hostdev.add_after(texts)
            self.writer.new_decorated = True
            return
        if self._hostdev is not hostdev:
            self._editing(hostdev)
        self._after.append((texts, indent))

    def flush(self) -> None:
        """Give the writer the edits gathered for the hostdev being edited, in one call."""
        hostdev = self._hostdev
        if hostdev is None:
            return
        before, after = self._before, self._after
        self._hostdev, self._before, self._after = None, [], []
        inside, fix_inside = self._inside, self._fix_inside
        self._inside = self._fix_inside = None
        fix_around = functools.partial(_around, hostdev, before, after) if before or after else None
        before_text = after_text = ""
        for text, indent in before:  # (one at most, in the pass's use: a root port)
            before_text += text + indent
        for texts, indent in after:  # (one at most: the companions)
            after_text += indent + indent.join(texts)
        self.writer.insert_around(hostdev, before_text, after_text, inside, fix_around, fix_inside)


def _address_before(alias: etree._Element, address_text: str, whitespace: str) -> None:
    """The tree's side of :meth:`_Placer.add_guest_address`: the address before the hostdev's alias."""
    element = etree.fromstring(address_text)
    element.tail = whitespace or None
    alias.addprevious(element)


def _around(
    hostdev: etree._Element, before: Sequence[tuple[str, str]], after: Sequence[tuple[Sequence[str], str]]
) -> None:
    """The tree's side of :meth:`_Placer.add_before` and :meth:`_Placer.add_after` (each text, then the
    indentation after each of its elements)."""
    for text, indent in before:
        element = etree.fromstring(text)
        element.tail = indent or None
        hostdev.addprevious(element)
    for texts, indent in after:
        tail = hostdev.tail
        anchor = hostdev
        for text in texts:
            element = etree.fromstring(text)
            anchor.tail = indent or None
            anchor.addnext(element)
            anchor = element
        anchor.tail = tail


def _only_alias(segment: bytes) -> int | None:
    """Where the one ``<alias`` of a hostdev's bytes starts (None: not exactly one)."""
    if segment.count(b"<alias") == 1:  # (the usual case, without the regular expression)
        first = segment.find(b"<alias")
        return first if segment[first + 6 : first + 7] in _AFTER_ALIAS else None
    found = _ALIAS_START.search(segment)
    if found is None or _ALIAS_START.search(segment, found.end()) is not None:
        return None
    return found.start()


_AFTER_ALIAS = frozenset((b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c", b"/", b">"))
"""The bytes :data:`_ALIAS_START` allows after ``<alias``."""


def _guest_address_end(segment: bytes) -> int | None:
    """Where the start tag of a hostdev's one guest ``<address>`` (not its source's) ends, for an attribute."""
    inside = [(match.start(), match.end()) for match in _SOURCE_SPAN.finditer(segment)]
    guest = [
        match.start()
        for match in _ADDRESS_START.finditer(segment)
        if not any(start <= match.start() < end for start, end in inside)
    ]
    end = _START_TAG_END.match(segment, guest[0] + 8) if len(guest) == 1 else None
    if end is None or b"multifunction" in segment[guest[0] : end.end()]:
        return None
    return end.start(1)


@dataclass(frozen=True)
class Placed:
    """What the pass decided: the hostdevs added for companions, where each GPU went, warnings."""

    hostdevs: list[HostdevSpec] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def place_companions(
    domain_xml: bytes,
    specs: Sequence[HostdevSpec],
    allocation: EnvAllocation,
    max_bytes: int,
    *,
    allow_fast: bool = True,
) -> Companioned:
    """:func:`companions_pass` alone on ``domain_xml`` (holding a hostdev for each of ``specs``), written; the
    bytes unchanged when no GPU has companions."""
    warnings: list[str] = []
    if not wanted_companions(specs, allocation, warnings):
        return Companioned(domain_xml, [], [], warnings)
    parsed = parse_domain(domain_xml, max_bytes)
    writer = DomainWriter(parsed, allow_fast=allow_fast)
    by_source = hostdevs_from_tree(parsed).by_source
    text = device_text
    handles: list[Handle | None] = [
        found[0] if (found := by_source.get(("pci", text(spec.source)))) else None for spec in specs
    ]
    placed = companions_pass(writer, specs, allocation, handles, by_source)
    return Companioned(writer.result(), placed.hostdevs, placed.placements, placed.warnings)


def companions_pass(
    writer: DomainWriter,
    specs: Sequence[HostdevSpec],
    allocation: EnvAllocation,
    handles: Sequence[Handle | None],
    by_source: Mapping[SourceKey, list[etree._Element]],
) -> Placed:
    """Every GPU's companions in its guest slot: ``handles`` says where each of ``specs`` is (the merge's
    result, in the same order; None: nowhere), ``by_source`` the domain's hostdevs."""
    warnings: list[str] = []
    wanted = wanted_companions(specs, allocation, warnings)
    if not wanted:
        return Placed([], [], warnings)
    parsed = writer.parsed
    domain = _Domain(parsed)
    edits = _Placer(writer)
    if domain.devices != 1:
        edits.writer.no_fast()
    aliases = _aliases(parsed, handles)
    passes = _passing(handles, by_source)
    added: list[HostdevSpec] = []
    placements: list[Placement] = []
    joined: dict[PciAddress, str] = {}  # companions placed in this run → the GPU whose slot each joined
    text_of, new_placement = device_text, tuple.__new__
    new_root_ports = domain.bus_kind == "pcie" and not domain.unindexed
    guests = domain.guests  # (next(hostdev.iterchildren("address"), None) of each, without an lxml walk per GPU)
    for index, spec, functions in wanted:
        hostdev = handles[index]
        if hostdev is None:
            continue  # (the merge wrote one for every spec)
        new = type(hostdev) is NewHostdev
        guest = None if new else guests.get(hostdev)  # type: ignore[arg-type]
        if guest is None:
            # Could any companion join a GPU's slot at all: not function 0, not placed by this run already, not
            # passed by a hostdev of the domain? (A plain loop: one per GPU.)
            for companion in functions:
                free = companion.function and companion not in joined
                if free and (passes is None or ("pci", text_of(companion)) not in passes):
                    break
            else:
                # none could join: leave the GPU as it is rather than give it a slot of its own for nothing
                for companion in functions:
                    problem = _companion_problem(companion, (-1, -1, -1), domain, by_source, joined)
                    warnings.append(f"{spec.label}: companion {companion} is not placed: {problem}")
                continue
        # (a GPU given its slot here needs its layout; for one with an address, only if a companion joins)
        look = edits.look(hostdev) if guest is None else None
        if new and new_root_ports:
            # (_slot_for's PCIe branch for a hostdev the merge adds, the path each of them takes there)
            bus = _new_root_port(hostdev, spec, domain, look, warnings)  # type: ignore[arg-type]
            if bus is None:
                continue
            writer.new_decorated = True
            slot: tuple[int, int, int] = (0, bus, 0)
            root_port: int | None = bus
        else:
            where = _slot_for(spec, hostdev, guest, domain, edits, look, warnings)
            if where is None:
                continue
            slot, root_port = where
        held, joining = _join(
            index, spec, functions, hostdev, slot, domain, passes, by_source, joined, aliases, warnings
        )
        if joining:
            added += _add_companions(edits, hostdev, look, slot, index, spec, joining)
        edits.flush()
        # Placement(...) without its keyword handling (one per GPU)
        where_placed = (spec.alias, text_of(spec.source), slot, held, root_port)
        placements.append(new_placement(Placement, where_placed))
    edits.flush()
    return Placed(added, placements, warnings)


def _passing(
    handles: Sequence[Handle | None], by_source: Mapping[SourceKey, list[etree._Element]]
) -> Mapping[SourceKey, list[etree._Element]] | None:
    """``by_source`` where a hostdev of the domain may pass a companion, else None.

    A companion is never a source of the specs (wanted_companions leaves those out): when every hostdev of the
    domain is one of ``handles``, none passes a companion, and no companion's source needs looking up."""
    kinds = list(map(type, handles))
    elements = len(kinds) - kinds.count(NewHostdev) - kinds.count(_NONE_TYPE)
    return by_source if len(by_source) > elements else None


def _join(
    index: int,
    spec: HostdevSpec,
    functions: Sequence[PciAddress],
    hostdev: Handle,
    slot: tuple[int, int, int],
    domain: _Domain,
    passes: Mapping[tuple[str, str], list[etree._Element]] | None,
    by_source: Mapping[tuple[str, str], list[etree._Element]],
    joined: dict[PciAddress, str],
    aliases: Collection[str],
    warnings: list[str],
) -> tuple[tuple[int, ...], tuple[PciAddress, ...]]:
    """The functions of ``slot`` that ``spec``'s companions hold (those already there too), in order, and the
    companions that join it now (recorded in ``domain.used`` and ``joined``); a companion that cannot is a
    warning. ``passes``: the domain's hostdevs where one may pass a companion (None: none does)."""
    used = domain.used
    placed: list[int] = []
    joining: list[PciAddress] = []
    guest_domain, bus, number = slot
    # COMPANION_ALIAS % (index, function) is this and the function's digit (needed only if aliases could collide)
    alias_prefix = _ALIAS_PREFIX % index if aliases else ""
    label = spec.label
    for companion in functions:
        function = companion.function
        at = (guest_domain, bus, number, function)
        if (
            function == 0
            or companion in joined
            or at in used
            or (passes is not None and passes.get(("pci", device_text(companion))))  # (a hostdev passes it)
        ):
            problem = _companion_problem(companion, slot, domain, by_source, joined)
            if problem == "there":
                placed.append(function)
            else:
                warnings.append(f"{label}: companion {companion} is not placed: {problem}")
            continue
        if aliases and (alias := alias_prefix + _DIGITS[function]) in aliases:
            raise InputError(
                f"alias {alias!r} is already used in the domain; it would collide with the companion "
                f"{companion} of {label}"
            )
        used[at] = hostdev
        joined[companion] = label
        placed.append(function)
        joining.append(companion)
    placed.sort()
    return tuple(placed), tuple(joining)


def _aliases(parsed: ParsedDomain, handles: Sequence[Handle | None]) -> set[str]:
    """The aliases a companion's must not take: the domain's and those of the hostdevs the merge adds."""
    source = parsed.source
    # A companion's alias (ua-gpuN-fnF) can be held only where "-fn" is in the bytes (or behind a reference).
    may_hold = b"-fn" in source or b"&" in source
    aliases = {str(name) for name in _ALIAS_NAMES(parsed.root)} if may_hold else set()  # type: ignore[union-attr]
    for handle in handles:  # (a plain loop: one per GPU)
        if type(handle) is NewHostdev:
            aliases.add(handle.spec.alias)
    return aliases


def _new_root_port(
    hostdev: NewHostdev,
    spec: HostdevSpec,
    domain: _Domain,
    look: Look,
    warnings: list[str],
) -> int | None:
    """Give ``hostdev`` (one the merge adds, on a PCIe machine whose controllers all have an index) a new
    ``pcie-root-port`` and the guest address of function 0 in its slot: the index of the port (its bus), or None
    when no index is left (a warning). :func:`_slot_for`'s PCIe branch; ``look``: the run's layout."""
    bus = domain.next_index
    if bus > MAX_BUS:
        warnings.append(f"{spec.label}: no PCI controller index is left for a root port; companions left out")
        return None
    domain.next_index = bus + 1
    layout, render = look
    texts = render.kept.get((_ROOT_PORT_KEY, bus, layout.expanded_empty))
    if texts is None:
        texts = _root_port_texts(render, bus, layout.expanded_empty)
    controller: str
    controller, hostdev.address = texts  # type: ignore[misc]
    hostdev.before = [*hostdev.before, controller]  # (NewHostdev.add_before)
    domain.used[(0, bus, 0, 0)] = hostdev
    return bus


def _add_companions(
    edits: _Placer,
    hostdev: Handle,
    look: Look | None,
    slot: tuple[int, int, int],
    index: int,
    spec: HostdevSpec,
    companions: tuple[PciAddress, ...],
) -> tuple[HostdevSpec, ...]:
    """Put the hostdevs of ``spec``'s ``companions`` next to ``hostdev`` (in ``slot``) and return them;
    ``look``: ``hostdev``'s (``_Placer.look``), if already asked for."""
    layout, render = look if look is not None else edits.look(hostdev)
    kept = render.kept.get((_COMPANIONS, slot, index, spec, companions))
    texts: tuple[str, ...]
    specs: tuple[HostdevSpec, ...]
    texts, specs = kept if kept is not None else _companion_texts(render, layout, slot, index, spec, companions)  # type: ignore[misc]
    if isinstance(hostdev, NewHostdev):
        hostdev.after = [*hostdev.after, *texts]  # (NewHostdev.add_after)
        edits.writer.new_decorated = True
    else:
        edits.add_after(hostdev, texts, layout.indent)
    return specs


def _companion_texts(
    render: HostdevRenderer,
    layout: Layout,
    slot: tuple[int, int, int],
    index: int,
    spec: HostdevSpec,
    companions: tuple[PciAddress, ...],
) -> tuple[tuple[str, ...], tuple[HostdevSpec, ...]]:
    """The hostdevs of ``spec``'s ``companions`` in ``slot`` and their text, rendered by ``render`` (the renderer
    of ``layout``): a pure function of its arguments, kept in the renderer (``HostdevRenderer.kept``: the hook
    writes the same GPUs on every call of a pod, as ``HostdevRenderer.run`` keeps its texts)."""
    key = (_COMPANIONS, slot, index, spec, companions)
    found = render.kept.get(key)
    if found is None:
        variable = companions_variable_for(spec.variable) or spec.variable
        address = _guest_address_template(slot, False, layout.expanded_empty)
        specs = tuple(
            _companion_spec(spec, companion, COMPANION_ALIAS % (index, companion.function), variable)
            for companion in companions
        )
        texts = tuple(render.addressed(added, address % added.source[3]) for added in specs)
        found = (texts, specs)
        render.keep(key, found)
    return found  # type: ignore[return-value]


_COMPANIONS = "companions"
"""The first part of the keys this pass keeps in ``HostdevRenderer.kept``."""


def _companion_spec(spec: HostdevSpec, companion: PciAddress, alias: str, variable: str) -> HostdevSpec:
    """The hostdev of ``spec``'s companion: ``HostdevSpec(...)`` without its keyword handling (one per companion
    on the OnDefineDomain path)."""
    label = f"{spec.label} companion {device_text(companion)}"
    fields = (ResourceKind.PCI, companion, alias, variable, spec.managed, spec.driver, False, False, label, False)
    return tuple.__new__(HostdevSpec, fields)


def _slot_for(
    spec: HostdevSpec,
    hostdev: Handle,
    guest: etree._Element | None,
    domain: _Domain,
    edits: _Placer,
    look: Look | None,
    warnings: list[str],
) -> tuple[tuple[int, int, int], int | None] | None:
    """The guest slot of the GPU (giving it its address, and a root port, when it has none); None: not placed.
    ``guest``: its guest address (none for one the merge adds); ``look``: the hostdev's (``_Placer.look``), given
    when ``guest`` is None."""
    if guest is not None:
        numbers = _guest_numbers(guest) if guest.get("type") == "pci" else None
        if numbers is None or numbers[3] != 0:
            where = f"type {guest.get('type')!r}" if numbers is None else f"function {numbers[3]}"
            warnings.append(
                f"{spec.label}: its guest address ({where}) is kept, and its companions are left out: they can "
                "share the GPU's slot only when the GPU is function 0 of a PCI address"
            )
            return None
        if numbers[:3] == (0, 0, 0):
            # libvirt reads an address of domain, bus and slot 0 as "none given" and assigns one (its
            # virPCIDeviceAddressIsEmpty): companions given "slot 0, function N" would each land elsewhere.
            warnings.append(
                f"{spec.label}: its guest address is 0000:00:00.0, which libvirt reads as 'assign one'; it is kept "
                "and the companions are left out (they cannot be given the slot libvirt will choose)"
            )
            return None
        switch = guest.get("multifunction")
        if switch == "off":
            warnings.append(
                f"{spec.label}: its guest address says multifunction='off'; it is kept and the companions are left out"
            )
            return None
        if switch != "on":
            edits.add_multifunction(hostdev, guest)
        return (numbers[0], numbers[1], numbers[2]), None
    if domain.bus_kind == "pcie":
        if domain.unindexed:
            warnings.append(
                f"{spec.label}: a PCI controller of the domain has no index, so the index of a new root port "
                "is not known; the companions are left out"
            )
            return None
        index = domain.next_index
        if index > MAX_BUS:
            warnings.append(f"{spec.label}: no PCI controller index is left for a root port; companions left out")
            return None
        domain.next_index += 1
        assert look is not None
        layout, render = look
        slot = (0, index, 0)
        root_port: int | None = index
        kept = render.kept.get((_ROOT_PORT_KEY, index, layout.expanded_empty))
        controller: str
        address: str
        controller, address = kept if kept is not None else _root_port_texts(render, index, layout.expanded_empty)  # type: ignore[misc]
        edits.add_before(hostdev, controller, layout.indent)
        edits.add_guest_address(hostdev, address)
        domain.used[(*slot, 0)] = hostdev
        return slot, root_port
    elif domain.bus_kind == "pci":
        free = domain.free_legacy_slot()
        if free is None:
            warnings.append(f"{spec.label}: no slot of bus 0 is free for the GPU and its companions; left out")
            return None
        slot, root_port = (0, 0, free), None
    else:
        warnings.append(
            f"{spec.label}: the machine type {domain.machine or '(none given)'!r} is neither PCIe (q35, virt) nor "
            "i440fx; the companions are left out"
        )
        return None
    assert look is not None
    edits.add_guest_address(hostdev, _guest_address(slot, 0, True, look[0].expanded_empty))
    domain.used[(*slot, 0)] = hostdev
    return slot, root_port


def _root_port_texts(render: HostdevRenderer, index: int, expanded: bool) -> tuple[str, str]:
    """A new ``pcie-root-port`` of ``index`` and the guest address of function 0 (multifunction) in its slot,
    as text (kept in ``render``, the renderer of the GPU's layout)."""
    key = (_ROOT_PORT_KEY, index, expanded)
    found = render.kept.get(key)
    if found is None:
        controller = _empty("controller", f'type="pci" index="{index}" model="{ROOT_PORT}"', expanded)
        found = (controller, _guest_address((0, index, 0), 0, True, expanded))
        render.keep(key, found)
    return found  # type: ignore[return-value]


_ROOT_PORT_KEY = "root port"
"""The first part of the keys of :func:`_root_port_texts` in ``HostdevRenderer.kept``."""


def _companion_problem(
    companion: PciAddress,
    slot: tuple[int, int, int],
    domain: _Domain,
    by_source: Mapping[tuple[str, str], list[etree._Element]],
    joined: Mapping[PciAddress, str],
) -> str | None:
    """Why ``companion`` cannot go to ``slot`` (``"there"``: it already is), or None when it can; ``joined``:
    the companions this run placed already, with the GPU each joined."""
    if companion.function == 0:
        return "it is function 0, which the GPU takes in its guest slot"
    if companion in joined:
        return f"it is a companion of {joined[companion]} too, and joined that GPU's guest slot"
    existing = by_source.get(("pci", device_text(companion))) if by_source else None
    if existing:
        guest = next(existing[0].iterchildren("address"), None)
        numbers = _guest_numbers(guest) if guest is not None and guest.get("type") == "pci" else None
        if numbers == (*slot, companion.function):
            return "there"
        return f"{_label(existing[0])} already passes it elsewhere in the guest, and it stays there"
    holder = domain.used.get((*slot, companion.function))
    if holder is not None:
        return f"function {companion.function} of the GPU's slot is taken by {_label(holder)}"
    return None


def slot_account(domain_xml: bytes, max_bytes: int) -> list[str]:
    """One line per multifunction guest slot holding hostdevs: the slot and its functions with their sources
    (for ``xmlgen simulate``'s account)."""
    parsed = parse_domain(domain_xml, max_bytes)
    slots: dict[tuple[int, int, int], dict[int, str]] = {}
    multifunction: set[tuple[int, int, int]] = set()
    for hostdev in parsed.root.iterfind("devices/hostdev"):
        guest = next(hostdev.iterchildren("address"), None)
        numbers = _guest_numbers(guest) if guest is not None and guest.get("type") == "pci" else None
        key = hostdev_source_key(hostdev)
        if numbers is None or key is None:
            continue
        slots.setdefault(numbers[:3], {})[numbers[3]] = f"{key[0]} {key[1]}"
        if guest is not None and guest.get("multifunction") == "on":
            multifunction.add(numbers[:3])
    buses = {
        c_number(controller.get("index"), 10): controller.get("model")
        for controller in parsed.root.iterfind("devices/controller")
        if controller.get("type") == "pci"
    }
    lines = []
    for slot in sorted(multifunction):
        functions = ", ".join(f"{function}: {source}" for function, source in sorted(slots[slot].items()))
        bus = f", bus {slot[1]} is a {buses[slot[1]]}" if slot[0] == 0 and buses.get(slot[1]) else ""
        lines.append(f"guest slot {slot[0]:04x}:{slot[1]:02x}:{slot[2]:02x} (multifunction{bus}): {functions}")
    return lines
