"""Step 2, the first pass: merge the GPUs' hostdevs with the ones virt-launcher already wrote.

Runs on the call's one parsed document (:mod:`launcher_hook.document`) and decides edits that the one writer
(:mod:`launcher_hook.writer`) applies; it keeps every byte it does not change: the prolog, the root tag,
namespaces such as ``qemu:``, comments, CDATA, element order, indentation and the empty-element style.

virt-launcher has usually rendered the GPUs already: such a hostdev is kept and only corrected where libvirt
would refuse or silently drop something (``_merge_into``; docs/kubevirt-hostdevs.md); the others are added
(pending :class:`~launcher_hook.writer.NewHostdev` elements, which later passes may give a guest address and
neighbours). Hostdevs are read from every ``<devices>`` element, as libvirt's parser reads them: from the bytes
when every one is in virt-launcher's exact PCI form (one regular expression; the text then says all the tree
would), from the tree otherwise. Tests assert both reads agree.

Each correction is made once: on the tree, and as the splice the writer needs where the bytes say where (the
changed attributes of a hostdev; the hostdev re-serialised alone for any other correction). virt-launcher's own
form, where only ``type=`` is cut from the source address and ``mode=`` added, is spliced from the bytes and
its tree change kept for the writer in case the tree is serialised.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from lxml import etree

from launcher_hook.document import (
    _HOSTDEV_START,
    HOSTDEV_END,
    CallInputs,
    ParsedDomain,
    append_child,
    child_slots,
    hostdev_starts,
    indent_of,
    newline_whitespace,
    parse_domain,
    parse_xml_document,
    remove_keeping_layout,
)
from launcher_hook.hostdev import HostdevSpec, Layout, render_hostdev
from launcher_hook.hostdevs import HOSTDEV_MODELS, model_for_type
from launcher_hook.hostdevs.base import CHANGED_MODE as _MODE
from launcher_hook.hostdevs.base import CHANGED_OTHER as _OTHER
from launcher_hook.hostdevs.base import CHANGED_SOURCE_TYPE as _SOURCE_TYPE
from launcher_hook.hostdevs.base import CHANGED_SWITCHES as _SWITCHES
from launcher_hook.hostdevs.base import device_text
from launcher_hook.matching import NO_HOSTDEVS, DomainHostdevs, SourceKey
from launcher_hook.writer import DomainWriter, Handle, NewHostdev, Splice
from schemas import InputError

__all__ = [
    "HOSTDEV_END",
    "_HOSTDEV_START",
    "ParsedDomain",
    "hostdev_starts",
    "parse_domain",
    "parse_xml_document",
]
_hostdev_starts = hostdev_starts
_HOSTDEV_END = HOSTDEV_END


def hostdev_source_key(hostdev: etree._Element) -> tuple[str, str] | None:
    """What a ``<hostdev>`` passes through, as a comparable key (``("pci", "0000:86:00.0")`` …), or None."""
    return _source_key(hostdev.get("type"), hostdev.find("source/address"))


def _source_key(hostdev_type: str | None, address: etree._Element | None) -> tuple[str, str] | None:
    model = model_for_type(hostdev_type)
    if model is None or address is None:
        return None
    source = model.read_source(address)
    return (model.type_name, source) if source is not None else None


def spec_source_key(spec: HostdevSpec) -> tuple[str, str]:
    return (_TYPE_NAMES[spec.kind], device_text(spec.source))


_TYPE_NAMES = {kind: model.type_name for kind, model in HOSTDEV_MODELS.items()}


@dataclass(frozen=True)
class HostdevsInDomain:
    """The hostdevs of every ``<devices>`` (libvirt's parser reads them all), indexed for the merge."""

    by_source: dict[SourceKey, list[etree._Element]]
    view: DomainHostdevs
    in_order: list[etree._Element] | None = None
    """Every hostdev of every ``<devices>``, in document order."""
    spans: dict[int, tuple[int, int]] | None = None
    """Where each hostdev of ``in_order`` is in the bytes (by ``id``), when the read found them there."""
    kubevirt_forms: dict[SourceKey, KubevirtForm] | None = None
    """Set when every hostdev is in virt-launcher's own PCI form (read from the bytes, see
    :func:`_kubevirt_hostdevs`): what the merge needs to know of each, by source."""


KubevirtForm = tuple[str, tuple[Splice, ...]]
"""A hostdev in virt-launcher's PCI form: its alias and the splices of the bytes that correct it, in order:
`` mode="subsystem"`` inserted in its start tag (when it is not there; KubeVirt 1.9 writes its PCI hostdevs
without it, docs/kubevirt-hostdevs.md), `` type="pci"`` cut from its source address (when there)."""

_MODE_ATTRIBUTE = b' mode="subsystem"'


def _hostdev_label(hostdev: etree._Element, alias: str | None) -> str:
    name = f" {alias!r}" if alias else ""
    return f"<hostdev>{name} at line {hostdev.sourceline}"


_SOURCE_ADDRESSES = etree.XPath("devices/hostdev/source[1]/address[1]")
_ALIASES = etree.XPath("devices/hostdev/alias[1]")
_RAMFB_ON = etree.XPath("devices/hostdev[@ramfb='on']")


def read_hostdevs(parsed: ParsedDomain) -> HostdevsInDomain:
    """Index the domain's hostdevs by source, and tell the matcher their aliases and ramfb state.

    Each hostdev's first ``<source>``, its first ``<address>`` and its first ``<alias>`` count, as for libvirt's
    parser; three XPath queries find them for every hostdev of every ``<devices>`` at once.
    """
    if b"<hostdev" not in parsed.source:
        return HostdevsInDomain({}, NO_HOSTDEVS)
    return _kubevirt_hostdevs(parsed) or hostdevs_from_tree(parsed)


def hostdevs_of(inputs: CallInputs) -> HostdevsInDomain:
    """:func:`read_hostdevs` of the call's domain, read once for the allocation source and the merge (before any
    pass changes the tree)."""
    found = inputs.memo.get("hostdevs")
    if not isinstance(found, HostdevsInDomain):
        parsed = inputs.domain
        assert parsed is not None
        found = inputs.memo["hostdevs"] = read_hostdevs(parsed)
    return found


# virt-launcher's PCI hostdev (docs/kubevirt-hostdevs.md, "Shape"), exactly, with the children that do not
# change what the merge does (a guest address, a boot order) allowed; the address numbers in the one form
# whose text is already the kernel's (``0x`` and 4/2/2/1 lower-case hex digits, slot <= 0x1f). It never holds
# ``</hostdev>`` before its end, so an element in the form is the bytes from its ``<hostdev`` to the first
# ``</hostdev>`` after it.
_WS = rb"[ \t\r\n]*"
_KUBEVIRT_FORM = re.compile(
    rb'<hostdev type="pci" managed="(?:no|yes)"((?: mode="subsystem")?)>'
    + (_WS + rb"<source>" + _WS)
    + rb'<address( type="pci")? domain="0x([0-9a-f]{4})" bus="0x([0-9a-f]{2})" slot="0x([01][0-9a-f])" '
    + rb'function="0x([0-7])"(?:></address>|/>)'
    + (_WS + rb"</source>" + _WS)
    + (rb'(?:<boot order="[0-9]+"(?:></boot>|/>)' + _WS + rb")?")
    + (rb'(?:<address(?: [a-z]+="[0-9a-z]*")*(?:></address>|/>)' + _WS + rb")?")
    + rb'<alias name="(ua-[a-zA-Z0-9_-]+)"(?:></alias>|/>)'
    + (_WS + rb"</hostdev>")
)
_HOSTDEV_CLOSE = b"</hostdev>"

FormRead = tuple[SourceKey, str, tuple[int, int] | None, int | None]
"""What a hostdev's bytes in virt-launcher's form say: its source, its alias, where `` type="pci"`` sits on its
source address and where `` mode="subsystem"`` goes (as :data:`KubevirtForm`), offsets from its ``<hostdev``."""

FORMS_KEPT = 1024
"""Most hostdev texts :func:`_form_read` keeps (a pod's hook reads the same few hostdevs on every call)."""
_forms_read: dict[bytes, FormRead | None] = {}


def _form_read(segment: bytes) -> FormRead | None:
    """What ``segment`` (the bytes of one element, ``<hostdev`` to ``</hostdev>``) says when it is wholly in
    virt-launcher's form, else None: a pure function of the bytes, so kept by them (at most :data:`FORMS_KEPT`)."""
    read = _forms_read.get(segment, _NOT_READ)
    if read is not _NOT_READ:
        return read  # type: ignore[return-value]
    found = _KUBEVIRT_FORM.fullmatch(segment)
    if found is None:
        read = None
    else:
        mode, source_type, domain, bus, slot, function, alias = found.groups()
        key = ("pci", (b"%s:%s:%s.%s" % (domain, bus, slot, function)).decode())
        read = (key, alias.decode(), found.span(2) if source_type else None, None if mode else found.start(1))
    if len(_forms_read) >= FORMS_KEPT:
        _forms_read.clear()
    _forms_read[segment] = read
    return read


_NOT_READ = object()


def _kubevirt_hostdevs(parsed: ParsedDomain) -> HostdevsInDomain | None:
    """The hostdevs read from the bytes when every one is in virt-launcher's PCI form, else None.

    Without comments, CDATA sections and PIs, every ``<hostdev`` in the bytes starts an element named hostdev
    (or one named ``hostdev…``, which is not in the form). When each is the whole of an element in the form and
    there are as many as ``devices/hostdev`` finds in the tree, they are those elements, in order. The form's
    text then says all the tree would: the source (the same key as ``read_source``), the one alias, no
    ``ramfb``, no ``<driver>``; it has no character references (no ``&`` is allowed in it). Two hostdevs for
    one source are left to the tree read (one is removed)."""
    source = parsed.source
    if not parsed.has_only_elements_and_text:
        return None
    in_order: list[etree._Element] = parsed.root.findall("devices/hostdev")
    count = len(in_order)
    by_source: dict[SourceKey, list[etree._Element]] = {}
    alias_sources: dict[str, SourceKey | None] = {}
    forms: dict[SourceKey, KubevirtForm] = {}
    spans: dict[int, tuple[int, int]] = {}
    find, read_form, close = source.find, _form_read, _HOSTDEV_CLOSE
    start = find(b"<hostdev")
    position = 0
    while start >= 0:
        end = find(close, start)
        if end < 0 or position >= count:
            return None
        end += 10  # len(close)
        read = read_form(source[start:end])
        if read is None:
            return None
        key, alias, source_type, mode_at = read
        if key in by_source:
            return None
        element = in_order[position]
        by_source[key] = [element]
        spans[id(element)] = (start, end)
        alias_sources.setdefault(alias, key)
        cut: tuple[Splice, ...]
        if mode_at is None:
            cut = () if source_type is None else ((start + source_type[0], start + source_type[1], b""),)
        else:
            at = start + mode_at
            mode: Splice = (at, at, _MODE_ATTRIBUTE)
            cut = (mode,) if source_type is None else (mode, (start + source_type[0], start + source_type[1], b""))
        forms[key] = (alias, cut)
        position += 1
        start = find(b"<hostdev", end)
    if len(forms) != count:
        return None
    return HostdevsInDomain(by_source, DomainHostdevs(alias_sources, {}), in_order, spans, forms)


def hostdevs_from_tree(parsed: ParsedDomain) -> HostdevsInDomain:
    """:func:`read_hostdevs` from the tree, for any domain."""
    if b"<hostdev" not in parsed.source:
        return HostdevsInDomain({}, NO_HOSTDEVS)
    root = parsed.root
    by_source: dict[SourceKey, list[etree._Element]] = {}
    keys: dict[etree._Element, SourceKey] = {}
    for address in _elements(_SOURCE_ADDRESSES(root)):
        source = address.getparent()
        hostdev = source.getparent() if source is not None else None
        key = _source_key(hostdev.get("type"), address) if hostdev is not None else None
        if key is not None and hostdev is not None:
            by_source.setdefault(key, []).append(hostdev)
            keys[hostdev] = key
    alias_sources: dict[str, SourceKey | None] = {}
    for alias in _elements(_ALIASES(root)):
        name = alias.get("name")
        if name:
            alias_sources.setdefault(name, keys.get(alias.getparent()))  # type: ignore[arg-type]
    ramfb_on: dict[SourceKey, str] = {}
    for hostdev in _elements(_RAMFB_ON(root)):
        key = keys.get(hostdev)
        if key is not None and key[0] == "mdev":
            first_alias = hostdev.find("alias")
            name = first_alias.get("name") if first_alias is not None else None
            ramfb_on.setdefault(key, _hostdev_label(hostdev, name))
    return HostdevsInDomain(by_source, DomainHostdevs(alias_sources, ramfb_on), root.findall("devices/hostdev"))


def _elements(result: object) -> list[etree._Element]:
    """An XPath result that selects elements, typed."""
    return [item for item in result if isinstance(item, etree._Element)] if isinstance(result, list) else []


@dataclass(frozen=True)
class Spliced:
    """The new domain, the hostdevs the hook owns in it (with the aliases they have there) and warnings."""

    domain_xml: bytes
    hostdevs: list[HostdevSpec]
    warnings: list[str]


def _merge_into(
    hostdev: etree._Element, spec: HostdevSpec, unit: str, warnings: list[str]
) -> tuple[str, str | None, set[str]]:
    """Correct a hostdev already in the domain for ``spec``'s source. Returns its alias in the output, the alias
    it had, and what changed (``_SOURCE_TYPE``, ``_SWITCHES``, ``_OTHER``; empty: untouched). Everything libvirt
    accepts is kept: alias, guest address, boot order, rom, acpi, driver."""
    changed: set[str] = set()
    alias_element = source = driver = None
    for child in hostdev.iterchildren("alias", "source", "driver"):
        if child.tag == "alias":
            alias_element = alias_element if alias_element is not None else child
        elif child.tag == "source":
            source = source if source is not None else child
        else:
            driver = driver if driver is not None else child
    current = alias_element.get("name") if alias_element is not None else None
    alias = current or spec.alias
    if current is None or _USER_ALIAS.fullmatch(current) is None:
        alias = spec.alias
        if current is not None:
            warnings.append(
                f"{spec.label}: alias {current!r} is not one libvirt keeps ('ua-' then [a-zA-Z0-9_-]); "
                f"it is now {alias!r}"
            )
    elif spec.force_alias and current != spec.alias:
        alias = spec.alias
        warnings.append(
            f"{spec.label}: alias {current!r} renamed {alias!r} (--force-gpu-aliases); KubeVirt looks the device "
            f"up by {current!r} and will not find it"
        )
    if alias != current:
        if alias_element is None:
            append_child(hostdev, etree.Element("alias", name=alias), *child_slots(hostdev, unit))
        else:
            alias_element.set("name", alias)
        changed.add(_OTHER)
    mode = hostdev.get("mode")
    if mode != "subsystem":  # libvirt's Go XML library refuses a hostdev without mode= (KubeVirt's plugin API)
        hostdev.set("mode", "subsystem")
        if mode is None:
            changed.add(_MODE)
        else:
            changed.add(_OTHER)
            warnings.append(
                f"{spec.label}: mode={mode!r} is not libvirt's for a {hostdev.get('type')} hostdev; "
                "it is now 'subsystem'"
            )
    address = next(source.iterchildren("address"), None) if source is not None else None
    if address is not None and "type" in address.attrib:
        del address.attrib["type"]  # libvirt's parser ignores it, its schema refuses it
        changed.add(_SOURCE_TYPE)
    model = HOSTDEV_MODELS[spec.kind]
    changed |= model.correct_existing(hostdev, address, spec, alias, warnings)
    if model.kind.takes_driver_element:
        if driver is not None and source is not None and _driver_next_to_source(driver, source):
            changed.add(_OTHER)
        if spec.driver is not None and driver is None:
            driver = etree.Element("driver", name=spec.driver)
            driver.tail = newline_whitespace(hostdev.text)
            hostdev.insert(0, driver)
            changed.add(_OTHER)
    return alias, current, changed


def _driver_next_to_source(driver: etree._Element, source: etree._Element) -> bool:
    """Move a PCI hostdev's ``<driver>`` just before its ``<source>``: libvirt's schema wants them together
    (virt-launcher writes the driver last, after the alias, which its parser accepts and its schema refuses)."""
    if source.getprevious() is driver or source.getnext() is driver:
        return False
    remove_keeping_layout(driver)
    driver.tail = indent_of(source)
    source.addprevious(driver)
    return True


def _check_aliases(
    parsed: ParsedDomain, introduced: dict[str, etree._Element | None], doomed: Sequence[etree._Element]
) -> None:
    """Each alias the hook writes (on a new hostdev, None, or on the hostdev given) is held by nothing else."""
    if not introduced:
        return
    prefixes = [prefix.encode() for prefix in {alias.rstrip("0123456789") for alias in introduced}]
    if b"&" not in parsed.source and not any(prefix in parsed.source for prefix in prefixes):
        return  # no alias of ours can be in the document (a character reference could hide one)
    skipped = {id(element) for element in doomed}
    for element in parsed.root.iter("alias"):
        name = element.get("name")
        if name not in introduced:
            continue
        holder = element.getparent()
        if holder is None or id(holder) in skipped or holder is introduced[name]:
            continue
        raise InputError(
            f"alias {name!r} is already used by <{holder.tag}> at line {element.sourceline} "
            "of the domain; it would collide with a GPU written by this hook"
        )


@dataclass(frozen=True)
class Merged:
    """What the merge decided: the hostdevs the hook owns in the output (with the aliases they have there), where
    each is (by source), the domain's hostdevs that stay (by source) and warnings."""

    hostdevs: list[HostdevSpec]
    warnings: list[str]
    placed: list[Handle]
    """Where each of ``hostdevs`` is: the domain's hostdev, or the one the merge adds."""
    by_source: dict[SourceKey, list[etree._Element]]


def merge_pass(writer: DomainWriter, specs: Sequence[HostdevSpec], existing: HostdevsInDomain) -> Merged:
    """One ``<hostdev>`` per spec: a hostdev already there for the same source (virt-launcher's) is kept and only
    corrected (``_merge_into``); the others are added to the last ``<devices>``. A second hostdev for one source
    is removed (libvirt refuses it). Untouched elements keep their bytes.

    An alias the hook writes that another element holds is an error, raised before anything is written.
    """
    parsed = writer.parsed
    unit = writer.unit
    writer.in_order = existing.in_order
    if existing.spans is not None and existing.in_order is not None:
        writer.know_spans(existing.spans, existing.in_order)
    warnings: list[str] = []
    final: list[HostdevSpec] = []
    new: list[NewHostdev] = []
    placed: list[Handle] = []
    touched: list[tuple[etree._Element, set[str]]] = []
    doomed: list[etree._Element] = []
    introduced: dict[str, etree._Element | None] = {}
    by_source = existing.by_source
    forms = existing.kubevirt_forms if writer.fast else None
    splices: list[Splice] = []
    corrected: dict[int, tuple[etree._Element, HostdevSpec]] = {}
    """The hostdevs in virt-launcher's form that ``splices`` correct (by ``id``), with their specs."""
    type_names = _TYPE_NAMES
    for spec in specs:
        key = (type_names[spec.kind], device_text(spec.source)) if by_source else None  # spec_source_key
        found = by_source.get(key) if key is not None else None
        if not found:
            item = NewHostdev(spec)
            new.append(item)
            placed.append(item)
            final.append(spec)
            introduced[spec.alias] = None
            continue
        placed.append(found[0])
        form = forms.get(key) if forms and key is not None else None
        if form is not None and spec.driver is None and (not spec.force_alias or form[0] == spec.alias):
            # virt-launcher's form with nothing but type= and mode= to correct: _merge_into would only drop
            # type= (``_SOURCE_TYPE``) and add mode= (``_MODE``), which the bytes say where to cut and insert;
            # the tree is corrected only if it is serialised.
            form_alias, form_splices = form
            if form_splices:
                splices += form_splices
                corrected[id(found[0])] = (found[0], spec)
            final.append(spec if form_alias == spec.alias else _with_alias(spec, form_alias))
            continue
        hostdev, *extra = found
        for duplicate in extra:
            warnings.append(
                f"{spec.label}: {spec.source_text} is passed by {_hostdev_label(hostdev, None)} and again by "
                f"{_hostdev_label(duplicate, None)}; libvirt refuses that, so the second is removed"
            )
            doomed.append(duplicate)
        alias, old_alias, changed = _merge_into(hostdev, spec, unit, warnings)
        if alias != old_alias:
            introduced[alias] = hostdev
        if changed:
            touched.append((hostdev, changed))
        final.append(spec if alias == spec.alias else _with_alias(spec, alias))
    _check_aliases(parsed, introduced, doomed)
    left = by_source
    if new or touched or doomed or splices:
        left = _record(writer, new, touched, doomed, (splices, list(corrected.values())), by_source)
    return Merged(final, warnings, placed, left)


def _record(
    writer: DomainWriter,
    new: list[NewHostdev],
    touched: list[tuple[etree._Element, set[str]]],
    doomed: list[etree._Element],
    forms: tuple[list[Splice], list[tuple[etree._Element, HostdevSpec]]],
    by_source: dict[SourceKey, list[etree._Element]],
) -> dict[SourceKey, list[etree._Element]]:
    """Give the writer the merge's edits (``forms``: the splices correcting the hostdevs in virt-launcher's form,
    and those hostdevs with their specs); returns the domain's hostdevs that stay, by source."""
    parsed, unit = writer.parsed, writer.unit
    left = by_source
    devices_elements = parsed.root.findall("devices")
    if doomed or len(devices_elements) != 1:
        writer.no_fast()
    splices, corrected = forms
    if splices:
        writer.splice_all(splices, functools.partial(_correct_forms, corrected, unit))
    for hostdev, changes in touched:
        _write_corrected(writer, hostdev, changes)
    if doomed:
        gone = {id(element) for element in doomed}
        left = {key: [e for e in found if id(e) not in gone] for key, found in by_source.items()}
        for duplicate in doomed:
            remove_keeping_layout(duplicate)
        writer.tree_changed()
    if new:
        _add_new(writer, devices_elements, new)
    return left


def _correct_forms(corrected: list[tuple[etree._Element, HostdevSpec]], unit: str) -> None:
    """The hostdevs in virt-launcher's form corrected on the tree (the bytes had the corrections spliced)."""
    for hostdev, spec in corrected:
        _merge_into(hostdev, spec, unit, [])


def _write_corrected(writer: DomainWriter, hostdev: etree._Element, changes: set[str]) -> None:
    """The corrected ``hostdev`` (the tree has it) in the bytes: its changed attributes patched, or the element
    written anew for any other change."""
    if not writer.fast:
        writer.tree_changed()
        return
    span = writer.hostdev_span(hostdev)
    if span is None:
        writer.no_fast()
        writer.tree_changed()
        return
    segment = writer.parsed.source[span[0] : span[1]]
    patches = _segment_patches(segment, hostdev, changes) if _OTHER not in changes else None
    if patches is None:
        writer.reserialise(hostdev, b"/>" not in segment and (b"></" in segment or writer.parsed.expanded_empty))
        return
    for start, end, text in patches:
        writer.splice(span[0] + start, span[0] + end, text)


def _add_new(writer: DomainWriter, devices_elements: list[etree._Element], new: list[NewHostdev]) -> None:
    """The new hostdevs, appended to the last ``<devices>`` (one is created if there is none)."""
    parsed, unit = writer.parsed, writer.unit
    if devices_elements:
        devices = devices_elements[-1]
    else:
        devices = etree.Element("devices")
        append_child(parsed.root, devices, *child_slots(parsed.root, unit))
        writer.no_fast()
    if writer.fast:
        insertion = _insertion(parsed, devices, unit)
        if insertion is not None:
            writer.add_hostdevs(devices, new, insertion[1], insertion[0])
            return
    before, _ = child_slots(devices, unit)
    writer.add_hostdevs(devices, new, Layout(before or "", unit if before else "", parsed.expanded_empty), None)


def merge_hostdevs(
    parsed: ParsedDomain,
    specs: Sequence[HostdevSpec],
    existing: HostdevsInDomain | None = None,
    *,
    allow_fast: bool = True,
) -> Spliced:
    """:func:`merge_pass` alone, written (``allow_fast=False``: the tree serialised, for tests)."""
    writer = DomainWriter(parsed, allow_fast=allow_fast)
    merged = merge_pass(writer, specs, existing if existing is not None else read_hostdevs(parsed))
    return Spliced(writer.result(), merged.hostdevs, merged.warnings)


def _with_alias(spec: HostdevSpec, alias: str) -> HostdevSpec:
    """``spec._replace(alias=alias)``, without its keyword handling (one per GPU on the merge path)."""
    return tuple.__new__(HostdevSpec, (*spec[:2], alias, *spec[3:]))


def splice_hostdevs(parsed: ParsedDomain, specs: Sequence[HostdevSpec], *, allow_fast: bool = True) -> bytes:
    """``merge_hostdevs``'s document alone."""
    return merge_hostdevs(parsed, specs, allow_fast=allow_fast).domain_xml


_USER_ALIAS = re.compile(r"ua-[a-zA-Z0-9_-]+")
"""The aliases libvirt keeps on an inactive domain; it silently drops others (the device becomes hostdevN)."""
_SOURCE_START = re.compile(rb"<source[\s/>]")
_KUBEVIRT_SOURCE_TYPE = re.compile(rb"""(<source>\s*<address)\s+type\s*=\s*(?:"[^"]*"|'[^']*')""")
_ADDRESS_START = re.compile(rb"<address[\s/>]")


_START_TAG = re.compile(rb"""<[^>"']*(?:(?:"[^"]*"|'[^']*')[^>"']*)*>""")


def _start_tag_end(data: bytes, start: int) -> int | None:
    """Offset of the ``>`` closing the start tag at ``start`` (quoted values may hold ``>``)."""
    match = _START_TAG.match(data, start)
    return match.end() - 1 if match is not None else None


def _attribute_pattern(name: str) -> re.Pattern[bytes]:
    return re.compile(rb"\s+" + name.encode() + rb"""\s*=\s*(?:"([^"]*)"|'([^']*)')""")


_ATTRIBUTES = {name: _attribute_pattern(name) for name in ("type", "display", "ramfb", "mode")}


def _segment_patches(segment: bytes, hostdev: etree._Element, changes: set[str]) -> list[Splice] | None:
    """The splices (offsets in ``segment``, one hostdev's original bytes) that rewrite only the changed
    attributes, or None if that cannot be done safely (the caller then writes the element anew)."""
    patches: list[Splice] = []
    if _MODE in changes or _SWITCHES in changes:
        end = _start_tag_end(segment, 0)
        if end is None:
            return None
        tag = segment[:end]
        if _MODE in changes:  # mode= added last of the start tag's attributes, as lxml adds it to the tree
            if _ATTRIBUTES["mode"].search(tag):
                return None
            at = len(tag) - 1 if tag.endswith(b"/") else len(tag)
            tag = tag[:at] + _MODE_ATTRIBUTE + tag[at:]
        if _SWITCHES in changes:
            for name in ("display", "ramfb"):
                value = hostdev.get(name)
                found = _ATTRIBUTES[name].findall(tag)
                if len(found) > 1 or (value is not None and not value.isalpha()):
                    return None
                if found and value is not None and b"".join(found[0]) == value.encode():
                    continue  # unchanged: keep it where it is
                tag = _ATTRIBUTES[name].sub(b"", tag)
                if value is not None:
                    slash = b"/" if tag.endswith(b"/") else b""
                    tag = tag.removesuffix(b"/") + f' {name}="{value}"'.encode() + slash
        patches.append((0, end, tag))
    if _SOURCE_TYPE in changes:
        # virt-launcher's form in one step: <source> holding just the address, type= its first attribute
        quick = _KUBEVIRT_SOURCE_TYPE.search(segment)
        if quick is not None:
            patches.append((quick.end(1), quick.end(), b""))
            return patches
        source_tag = _SOURCE_START.search(segment)
        address_tag = _ADDRESS_START.search(segment, source_tag.end()) if source_tag else None
        source_end = segment.find(b"</source", source_tag.end()) if source_tag else -1
        if address_tag is None or source_end < address_tag.start():
            return None
        end = _start_tag_end(segment, address_tag.start())
        if end is None:
            return None
        tag = segment[address_tag.start() : end]
        found = _ATTRIBUTES["type"].findall(tag)
        if len(found) != 1:
            return None
        patches.append((address_tag.start(), end, _ATTRIBUTES["type"].sub(b"", tag)))
    return patches


def _insertion(parsed: ParsedDomain, devices: etree._Element, unit: str) -> tuple[int, Layout] | None:
    """Where to insert new hostdevs before ``</devices>`` and their layout, when that is unambiguous.

    Unambiguous: ``<devices>`` has children (so it is not written ``<devices/>``) and ``</devices>`` occurs
    once.
    """
    source = parsed.source
    end = source.find(b"</devices>")
    if not len(devices) or end < 0 or source.find(b"</devices>", end + 10) >= 0:
        return None
    before, closing = child_slots(devices, unit)
    if (before is None) != (closing is None):
        return None
    closing_bytes = (closing or "").encode()
    insert_at = end - len(closing_bytes)
    if source[insert_at:end] != closing_bytes:
        return None
    return insert_at, Layout(before or "", unit if before else "", parsed.writes_empty_expanded_near(end))


def devices_document(specs: Sequence[HostdevSpec]) -> bytes:
    """A standalone ``<devices>`` element holding just the rendered hostdevs, tab-indented."""
    if not specs:
        return b"<devices/>\n"
    layout = Layout("\n\t", "\t")
    return (
        "<devices>" + "".join(layout.indent + render_hostdev(spec, layout) for spec in specs) + "\n</devices>\n"
    ).encode()
