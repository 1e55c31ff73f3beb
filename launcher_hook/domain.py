"""Reading a libvirt domain safely and merging hostdevs into it without disturbing anything else.

The domain XML comes from virt-launcher (or a user, through xmlgen) and goes straight back to libvirt, so
parsing refuses what could make it dangerous or ambiguous (a DOCTYPE, entities, oversized or non-UTF-8
input) and merging keeps every other byte: the prolog, the root tag, namespaces such as ``qemu:``,
comments, CDATA, element order, indentation and the empty-element style.

virt-launcher has usually rendered the GPUs already: such a hostdev is kept and only corrected where libvirt
would refuse or silently drop something (``_merge_into``; docs/kubevirt-hostdevs.md); the others are added.
Hostdevs are read from every ``<devices>`` element, as libvirt's parser reads them: from the bytes when every
one is in virt-launcher's exact PCI form (one regular expression; the text then says all the tree would), from
the tree otherwise. Tests assert both reads agree.

Two ways to write the result, one document:
- fast: when nothing but elements and text is around and ``</devices>`` is unambiguous in the bytes (the
  usual KubeVirt domain), new hostdevs are inserted into the original bytes and corrected ones patched in
  place (changed attributes only; a hostdev with another correction is re-serialised alone).
- general: otherwise (comments or CDATA, a hostdev to remove, no or two ``<devices>``) the tree is edited
  and serialised, reusing the original prolog and root start tag verbatim.
Tests assert both give the same bytes wherever both apply.
"""

from __future__ import annotations

import copy
import functools
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from lxml import etree

from launcher_hook.hostdev import HostdevSpec, Layout, render_hostdev, renderer_for
from launcher_hook.hostdevs import HOSTDEV_MODELS, model_for_type
from launcher_hook.hostdevs.base import CHANGED_MODE as _MODE
from launcher_hook.hostdevs.base import CHANGED_OTHER as _OTHER
from launcher_hook.hostdevs.base import CHANGED_SOURCE_TYPE as _SOURCE_TYPE
from launcher_hook.hostdevs.base import CHANGED_SWITCHES as _SWITCHES
from launcher_hook.hostdevs.base import device_text
from launcher_hook.matching import NO_HOSTDEVS, DomainHostdevs, SourceKey
from schemas import InputError
from schemas.limits import check_utf8

# A UTF-8 byte order mark may precede the declaration; it must not hide the encoding it declares.
_DECLARED_ENCODING = re.compile(rb"""^(?:\xef\xbb\xbf)?\s*<\?xml[^>]*?encoding\s*=\s*["']([A-Za-z0-9._-]+)["']""")
_UTF8_NAMES = {"utf-8", "utf8", "us-ascii", "ascii"}
_parsers = threading.local()


def _safe_parser() -> etree.XMLParser:
    """This thread's parser (lxml parsers are not thread-safe; building one per call is slow)."""
    parser: etree.XMLParser | None = getattr(_parsers, "parser", None)
    if parser is None:
        parser = etree.XMLParser(
            resolve_entities=False,
            no_network=True,
            load_dtd=False,
            dtd_validation=False,
            huge_tree=False,
            remove_blank_text=False,
            remove_comments=False,
            remove_pis=False,
            strip_cdata=False,
        )
        _parsers.parser = parser
    return parser


@dataclass
class ParsedDomain:
    """A parsed domain and the bytes it came from."""

    tree: etree._ElementTree
    source: bytes

    @property
    def root(self) -> etree._Element:
        return self.tree.getroot()

    @functools.cached_property
    def expanded_empty(self) -> bool:
        """True for documents that write every empty element as ``<x></x>`` (Go's encoding/xml, KubeVirt)."""
        return b"/>" not in self.source and b"></" in self.source

    def writes_empty_expanded_near(self, offset: int) -> bool:
        """The empty-element style of the elements just before ``offset``, for new elements written there.

        Looks at a window rather than the whole document: it is what the new elements should match, and
        a search for ``/>`` is slow (a document without one is scanned to its end).
        """
        window = self.source[max(0, offset - 4096) : offset]
        return b"/>" not in window and (b"></" in window or self.expanded_empty)

    @functools.cached_property
    def has_only_elements_and_text(self) -> bool:
        """No comment, CDATA section or processing instruction (but the XML declaration) anywhere.

        Single-byte probes first: ``!`` and ``?`` are rare in domains, and searching for ``<!`` is slow
        because ``<`` is everywhere.
        """
        source = self.source
        if b"!" in source and (b"<!-" in source or b"<![" in source):
            return False
        if not source.lstrip().startswith(b"<?xml"):
            return b"?" not in source or b"<?" not in source
        after = source.index(b"?>") + 2
        return source.find(b"?", after) < 0 or source.find(b"<?", after) < 0

    def serialize(self) -> bytes:
        """The tree as bytes, with the original prolog, root start tag and empty-element style."""
        if self.expanded_empty:
            for element in self.root.iter():
                if isinstance(element.tag, str) and len(element) == 0 and element.text is None:
                    element.text = ""
        body: bytes = etree.tostring(self.tree, encoding="UTF-8", xml_declaration=False)
        original_end = _root_start_tag_end(self.source)
        if not self.source[:original_end].endswith(b"/>"):
            body = self.source[:original_end] + body[_root_start_tag_end(body) :]
        return body + self.source[len(self.source.rstrip()) :]


def root_start(data: bytes) -> int:
    """Offset of the root element's ``<`` in a well-formed document (after the declaration, comments and PIs)."""
    position = 0
    while True:
        position = data.index(b"<", position)
        if data.startswith(b"<?", position):
            position = data.index(b"?>", position) + 2
        elif data.startswith(b"<!--", position):
            position = data.index(b"-->", position) + 3
        else:
            return position


def tag_close(data: bytes, position: int) -> int | None:
    """Offset of the ``>`` ending the tag that starts at ``position`` (quoted attribute values skipped), or None."""
    quote = 0
    for offset in range(position, len(data)):
        byte = data[offset]
        if quote:
            quote = 0 if byte == quote else quote
        elif byte in b"\"'":
            quote = byte
        elif byte == ord(">"):
            return offset
    return None


def _root_start_tag_end(data: bytes) -> int:
    """Offset just past the root element's start tag (after the declaration, comments and PIs)."""
    close = tag_close(data, root_start(data))
    if close is None:
        raise InputError("domain XML: the root start tag is not closed")
    return close + 1


def parse_xml_document(data: bytes, what: str, max_bytes: int) -> ParsedDomain:
    """Parse ``data`` with no DTD, no entities and no network; any refusal names ``what`` and the reason."""
    if len(data) > max_bytes or not data.isascii():  # ASCII is UTF-8: no decoded copy to check it
        check_utf8(data, what, max_bytes)
    declared = _DECLARED_ENCODING.match(data)
    if declared and declared.group(1).decode().lower() not in _UTF8_NAMES:
        raise InputError(f"{what} declares encoding {declared.group(1).decode()!r}; only UTF-8 is accepted")
    if b"!" in data and (b"<!DOCTYPE" in data or b"<!ENTITY" in data):
        raise InputError(f"{what} has a DOCTYPE or entity declaration; these are refused")
    try:
        root = etree.fromstring(data, _safe_parser())
    except etree.XMLSyntaxError as exc:
        raise InputError(f"{what} is not well-formed XML: {exc}") from None
    tree = root.getroottree()
    if b"!" in data and (tree.docinfo.internalDTD is not None or tree.docinfo.system_url or tree.docinfo.public_id):
        raise InputError(f"{what} has a DOCTYPE; it is refused")
    return ParsedDomain(tree, data)


def parse_domain(data: bytes, max_bytes: int) -> ParsedDomain:
    parsed = parse_xml_document(data, "domain XML", max_bytes)
    if parsed.root.tag != "domain":
        raise InputError(f"domain XML: the root element is <{parsed.root.tag}>, expected <domain>")
    return parsed


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


def _newline_whitespace(text: str | None) -> str | None:
    """``text`` if it is indentation (whitespace with a line break), else None."""
    return text if text and "\n" in text and not text.strip() else None


def _indent_of(element: etree._Element) -> str | None:
    previous, parent = element.getprevious(), element.getparent()
    return _newline_whitespace(previous.tail if previous is not None else (parent.text if parent is not None else None))


def _indent_unit(root: etree._Element) -> str:
    """The document's indentation step (KubeVirt uses a tab), guessed from the root's first child."""
    text = _newline_whitespace(root.text)
    return (text.rsplit("\n", 1)[1] or "\t") if text else "\t"


def _child_slots(parent: etree._Element, unit: str) -> tuple[str | None, str | None]:
    """The indentation before a new last child of ``parent`` and before ``parent``'s end tag (None: compact)."""
    if not _is_layout(parent[-1].tail if len(parent) else parent.text):
        # Text where the indentation would go (``<devices>text</devices>``, a CDATA section) is content, not
        # layout: append compactly rather than overwrite it.
        return None, None
    if len(parent):
        return _newline_whitespace(parent.text), _newline_whitespace(parent[-1].tail)
    parent_indent = _indent_of(parent)
    return (parent_indent + unit, parent_indent) if parent_indent else (None, None)


def _is_layout(text: str | None) -> bool:
    """True when ``text`` is only whitespace (or absent): indentation the splicer may rewrite."""
    return text is None or not text.strip()


def _append(parent: etree._Element, child: etree._Element, before: str | None, closing: str | None) -> None:
    if before is not None:
        if len(parent):
            parent[-1].tail = before
        else:
            parent.text = before
        child.tail = closing if closing is not None else (_indent_of(parent) or "\n")
    parent.append(child)


@dataclass(frozen=True)
class HostdevsInDomain:
    """The hostdevs of every ``<devices>`` (libvirt's parser reads them all), indexed for the merge."""

    by_source: dict[SourceKey, list[etree._Element]]
    view: DomainHostdevs
    in_order: list[etree._Element] | None = None
    """Every hostdev of every ``<devices>``, in document order."""
    kubevirt_forms: dict[SourceKey, KubevirtForm] | None = None
    """Set when every hostdev is in virt-launcher's own PCI form (read from the bytes, see
    :func:`_kubevirt_hostdevs`): what the merge needs to know of each, by source."""


KubevirtForm = tuple[str, tuple[int, int] | None, int | None]
"""A hostdev in virt-launcher's PCI form: its alias, where `` type="pci"`` sits on its source address in the
bytes (None: the address has no type) and where `` mode="subsystem"`` goes in its start tag (None: it is there;
KubeVirt 1.9 writes its PCI hostdevs without it, docs/kubevirt-hostdevs.md)."""

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


# virt-launcher's PCI hostdev (docs/kubevirt-hostdevs.md, "Shape"), exactly, with the children that do not
# change what the merge does (a guest address, a boot order) allowed; the address numbers in the one form
# whose text is already the kernel's (``0x`` and 4/2/2/1 lower-case hex digits, slot <= 0x1f).
_WS = rb"[ \t\r\n]*"
_HOSTDEV_OR_KUBEVIRT_FORM = re.compile(
    rb"<hostdev(?:"  # every <hostdev…; group 1 when it is the whole element in the form
    + rb'( type="pci" managed="(?:no|yes)"((?: mode="subsystem")?)>'
    + (_WS + rb"<source>" + _WS)
    + rb'<address( type="pci")? domain="0x([0-9a-f]{4})" bus="0x([0-9a-f]{2})" slot="0x([01][0-9a-f])" '
    + rb'function="0x([0-7])"(?:></address>|/>)'
    + (_WS + rb"</source>" + _WS)
    + (rb'(?:<boot order="[0-9]+"(?:></boot>|/>)' + _WS + rb")?")
    + (rb'(?:<address(?: [a-z]+="[0-9a-z]*")*(?:></address>|/>)' + _WS + rb")?")
    + rb'<alias name="(ua-[a-zA-Z0-9_-]+)"(?:></alias>|/>)'
    + (_WS + rb"</hostdev>))?")
)


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
    first = max(source.find(b"<hostdev"), 0)  # the scan starts there (re's own search for it is slower)
    for position, found in enumerate(_HOSTDEV_OR_KUBEVIRT_FORM.finditer(source, first)):
        form, mode, source_type, domain, bus, slot, function, alias_bytes = found.groups()
        if form is None or position >= count:
            return None
        key = ("pci", (b"%s:%s:%s.%s" % (domain, bus, slot, function)).decode())
        if key in by_source:
            return None
        alias = alias_bytes.decode()
        by_source[key] = [in_order[position]]
        alias_sources.setdefault(alias, key)
        forms[key] = (alias, found.span(3) if source_type else None, None if mode else found.start(2))
    if len(forms) != count:
        return None
    return HostdevsInDomain(by_source, DomainHostdevs(alias_sources, {}), in_order, forms)


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
            _append(hostdev, etree.Element("alias", name=alias), *_child_slots(hostdev, unit))
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
            driver.tail = _newline_whitespace(hostdev.text)
            hostdev.insert(0, driver)
            changed.add(_OTHER)
    return alias, current, changed


def _driver_next_to_source(driver: etree._Element, source: etree._Element) -> bool:
    """Move a PCI hostdev's ``<driver>`` just before its ``<source>``: libvirt's schema wants them together
    (virt-launcher writes the driver last, after the alias, which its parser accepts and its schema refuses)."""
    if source.getprevious() is driver or source.getnext() is driver:
        return False
    _remove_keeping_layout(driver)
    driver.tail = _indent_of(source)
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


def merge_hostdevs(
    parsed: ParsedDomain,
    specs: Sequence[HostdevSpec],
    existing: HostdevsInDomain | None = None,
    *,
    allow_fast: bool = True,
) -> Spliced:
    """The domain with one ``<hostdev>`` per spec: a hostdev already there for the same source (virt-launcher's)
    is kept and only corrected (``_merge_into``); the others are added to the last ``<devices>``. A second
    hostdev for one source is removed (libvirt refuses it). Untouched elements keep their bytes.

    An alias the hook writes that another element holds is an error, raised before anything is produced.
    """
    existing = existing if existing is not None else read_hostdevs(parsed)
    unit = _indent_unit(parsed.root)
    warnings: list[str] = []
    final: list[HostdevSpec] = []
    new: list[HostdevSpec] = []
    touched: list[tuple[etree._Element, set[str]]] = []
    doomed: list[etree._Element] = []
    introduced: dict[str, etree._Element | None] = {}
    by_source = existing.by_source
    forms = existing.kubevirt_forms if allow_fast else None
    untouched_in_tree: list[tuple[etree._Element, HostdevSpec]] = []
    removals: list[tuple[int, int, bytes]] = []
    type_names = _TYPE_NAMES
    for spec in specs:
        key = (type_names[spec.kind], device_text(spec.source)) if by_source else None  # spec_source_key
        found = by_source.get(key) if key is not None else None
        if not found:
            new.append(spec)
            final.append(spec)
            introduced[spec.alias] = None
            continue
        form = forms.get(key) if forms and key is not None else None
        if form is not None and spec.driver is None and (not spec.force_alias or form[0] == spec.alias):
            # virt-launcher's form with nothing but type= and mode= to correct: _merge_into would only drop
            # type= (``_SOURCE_TYPE``) and add mode= (``_MODE``), which the bytes say where to cut and insert;
            # the tree is corrected only if needed.
            form_alias, source_type, mode_at = form
            if source_type is not None:
                removals.append((*source_type, b""))
            if mode_at is not None:
                removals.append((mode_at, mode_at, _MODE_ATTRIBUTE))
            if source_type is not None or mode_at is not None:
                untouched_in_tree.append((found[0], spec))
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
    if not (new or touched or doomed or removals):
        return Spliced(parsed.source, final, warnings)
    devices_elements = parsed.root.findall("devices")
    if allow_fast and not doomed and len(devices_elements) == 1 and parsed.has_only_elements_and_text:
        patched = _patch_bytes(parsed, devices_elements[0], touched, new, unit, existing.in_order, removals)
        if patched is not None:
            return Spliced(patched, final, warnings)
    for hostdev, spec in untouched_in_tree:  # the general path writes the tree: correct these there too
        _merge_into(hostdev, spec, unit, warnings)
    _splice_tree(parsed, devices_elements, new, doomed, unit)
    return Spliced(parsed.serialize(), final, warnings)


def _with_alias(spec: HostdevSpec, alias: str) -> HostdevSpec:
    """``spec._replace(alias=alias)``, without its keyword handling (one per GPU on the merge path)."""
    return tuple.__new__(HostdevSpec, (*spec[:2], alias, *spec[3:]))


def splice_hostdevs(parsed: ParsedDomain, specs: Sequence[HostdevSpec], *, allow_fast: bool = True) -> bytes:
    """``merge_hostdevs``'s document alone."""
    return merge_hostdevs(parsed, specs, allow_fast=allow_fast).domain_xml


_USER_ALIAS = re.compile(r"ua-[a-zA-Z0-9_-]+")
"""The aliases libvirt keeps on an inactive domain; it silently drops others (the device becomes hostdevN)."""
_HOSTDEV_START = re.compile(rb"<(?:[A-Za-z_][\w.-]*:)?hostdev[\s/>]")
_HOSTDEV_END = re.compile(rb"</hostdev\s*>")


def _patch_bytes(
    parsed: ParsedDomain,
    devices: etree._Element,
    touched: Sequence[tuple[etree._Element, set[str]]],
    new: Sequence[HostdevSpec],
    unit: str,
    in_order: list[etree._Element] | None,
    removals: Sequence[tuple[int, int, bytes]] = (),
) -> bytes | None:
    """The original bytes with each touched hostdev re-serialised in place, the ``removals`` (spans of bytes and
    what replaces each) made and the new ones inserted before ``</devices>``, when every position is unambiguous
    (the caller checked: no comment, CDATA section or processing instruction, one ``<devices>``); None
    otherwise."""
    source = parsed.source
    edits: list[tuple[int, int, bytes]] = list(removals)
    if touched:
        spans = _hostdev_spans(parsed, touched, in_order)
        if spans is None:
            return None
        edits += spans
    if new:
        insertion = _insertion(parsed, devices, new, unit)
        if insertion is None:
            return None
        edits.append(insertion)
    edits.sort(key=lambda edit: edit[0])
    pieces: list[bytes] = []
    position = 0
    for start, end, text in edits:
        if start < position:
            return None
        pieces += (source[position:start], text)
        position = end
    pieces.append(source[position:])
    return b"".join(pieces)


def _hostdev_starts(source: bytes) -> list[int]:
    """Offsets of every start tag named hostdev (``<hostdev`` or ``<p:hostdev``) in ``source``."""
    if b":hostdev" in source:
        return [match.start() for match in _HOSTDEV_START.finditer(source)]
    starts: list[int] = []
    find = source.find
    position = find(b"<hostdev")
    while position >= 0:
        if source[position + 8 : position + 9] in _AFTER_NAME:
            starts.append(position)
        position = find(b"<hostdev", position + 8)
    return starts


_AFTER_NAME = frozenset((b" ", b"\t", b"\n", b"\r", b">", b"/"))


def _hostdev_spans(
    parsed: ParsedDomain, touched: Sequence[tuple[etree._Element, set[str]]], in_order: list[etree._Element] | None
) -> list[tuple[int, int, bytes]] | None:
    """Where each touched hostdev is in the bytes, and its new text.

    Without comments, CDATA or PIs every ``<hostdev`` / ``<p:hostdev`` in the bytes is a start tag (``<`` is
    not allowed raw in text or attribute values), so the n-th one is the n-th element named hostdev.
    """
    source = parsed.source
    starts = _hostdev_starts(source)
    # As many start tags as hostdevs in <devices>: they are those, in order (the usual case); otherwise match
    # them with every element named hostdev in the document.
    elements = in_order if in_order is not None and len(in_order) == len(starts) else []
    elements = elements or list(parsed.root.iter("{*}hostdev"))
    if len(starts) != len(elements):
        return None
    index = {id(element): position for position, element in enumerate(elements)}
    spans: list[tuple[int, int, bytes]] = []
    for hostdev, changes in touched:
        position = index[id(hostdev)]
        start = starts[position]
        end_tag = _HOSTDEV_END.search(source, start)
        if end_tag is None or (position + 1 < len(starts) and starts[position + 1] < end_tag.start()):
            return None
        segment = source[start : end_tag.end()]
        patched = _patched_segment(segment, hostdev, changes) if _OTHER not in changes else None
        if patched is None:
            expanded = b"/>" not in segment and (b"></" in segment or parsed.expanded_empty)
            patched = _element_bytes(hostdev, expanded)
        spans.append((start, end_tag.end(), patched))
    return spans


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


def _patched_segment(segment: bytes, hostdev: etree._Element, changes: set[str]) -> bytes | None:
    """``segment`` (one hostdev's bytes) with only the changed attributes rewritten, or None if it cannot be
    done safely (the caller then re-serialises the element)."""
    if _MODE in changes:  # mode= added last of the start tag's attributes, as lxml adds it to the tree
        end = _start_tag_end(segment, 0)
        if end is None or _ATTRIBUTES["mode"].search(segment[:end]):
            return None
        at = end - 1 if segment[end - 1 : end] == b"/" else end
        segment = segment[:at] + _MODE_ATTRIBUTE + segment[at:]
    if _SWITCHES in changes:
        end = _start_tag_end(segment, 0)
        if end is None:
            return None
        tag = segment[:end]
        for name in ("display", "ramfb"):
            value = hostdev.get(name)
            found = _ATTRIBUTES[name].findall(tag)
            if len(found) > 1 or (value is not None and not value.isalpha()):
                return None
            if found and value is not None and b"".join(found[0]) == value.encode():
                continue  # unchanged: keep it where it is
            tag = _ATTRIBUTES[name].sub(b"", tag)
            if value is not None:
                tag = tag.removesuffix(b"/") + f' {name}="{value}"'.encode() + (b"/" if tag.endswith(b"/") else b"")
        segment = tag + segment[end:]
    if _SOURCE_TYPE in changes:
        # virt-launcher's form in one step: <source> holding just the address, type= its first attribute
        segment, done = _KUBEVIRT_SOURCE_TYPE.subn(rb"\1", segment, count=1)
        if done:
            return segment
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
        segment = segment[: address_tag.start()] + _ATTRIBUTES["type"].sub(b"", tag) + segment[end:]
    return segment


def _element_bytes(element: etree._Element, expanded_empty: bool) -> bytes:
    clone = copy.deepcopy(element)  # detached: no namespace declarations of its ancestors
    clone.tail = None
    if expanded_empty:
        for child in clone.iter():
            if isinstance(child.tag, str) and len(child) == 0 and child.text is None:
                child.text = ""
    text: bytes = etree.tostring(clone, encoding="UTF-8", xml_declaration=False)
    return text


def _insertion(
    parsed: ParsedDomain, devices: etree._Element, specs: Sequence[HostdevSpec], unit: str
) -> tuple[int, int, bytes] | None:
    """Where and what to insert for ``specs`` before ``</devices>``, when that is unambiguous.

    Unambiguous: ``<devices>`` has children (so it is not written ``<devices/>``) and ``</devices>`` occurs
    once.
    """
    source = parsed.source
    end = source.find(b"</devices>")
    if not len(devices) or end < 0 or source.find(b"</devices>", end + 10) >= 0:
        return None
    before, closing = _child_slots(devices, unit)
    if (before is None) != (closing is None):
        return None
    closing_bytes = (closing or "").encode()
    insert_at = end - len(closing_bytes)
    if source[insert_at:end] != closing_bytes:
        return None
    layout = Layout(before or "", unit if before else "", parsed.writes_empty_expanded_near(end))
    return insert_at, insert_at, renderer_for(layout).run(specs).encode()


def _splice_tree(
    parsed: ParsedDomain,
    devices_elements: Sequence[etree._Element],
    new: Sequence[HostdevSpec],
    doomed: Sequence[etree._Element],
    unit: str,
) -> None:
    """The general path: remove the doomed hostdevs, append the new ones to the last ``<devices>``."""
    for duplicate in doomed:
        _remove_keeping_layout(duplicate)
    if not new:
        return
    root = parsed.root
    expanded = parsed.expanded_empty
    if devices_elements:
        devices = devices_elements[-1]
    else:
        devices = etree.Element("devices")
        _append(root, devices, *_child_slots(root, unit))
    for spec in new:
        before, closing = _child_slots(devices, unit)
        element = etree.fromstring(render_hostdev(spec, Layout(before or "", unit if before else "", expanded)))
        _append(devices, element, before, closing)


def _remove_keeping_layout(element: etree._Element) -> None:
    parent = element.getparent()
    if parent is None:
        return
    previous = element.getprevious()
    if previous is not None:
        previous.tail = _kept_text(previous.tail, element.tail)
    else:
        parent.text = _kept_text(parent.text, element.tail)
    parent.remove(element)


def _kept_text(before: str | None, removed_tail: str | None) -> str | None:
    """What goes where an element and its tail are removed: the tail's layout, but never lose text."""
    if _is_layout(before):
        return removed_tail
    return before if _is_layout(removed_tail) else f"{before}{removed_tail}"


def devices_document(specs: Sequence[HostdevSpec]) -> bytes:
    """A standalone ``<devices>`` element holding just the rendered hostdevs, tab-indented."""
    if not specs:
        return b"<devices/>\n"
    layout = Layout("\n\t", "\t")
    return (
        "<devices>" + "".join(layout.indent + render_hostdev(spec, layout) for spec in specs) + "\n</devices>\n"
    ).encode()
