"""Reading a libvirt domain safely and splicing hostdevs into it without disturbing anything else.

The domain XML comes from virt-launcher (or a user, through xmlgen) and goes straight back to libvirt, so
parsing refuses what could make it dangerous or ambiguous (a DOCTYPE, entities, oversized or non-UTF-8
input) and splicing keeps every other byte: the prolog, the root tag, namespaces such as ``qemu:``,
comments, CDATA, element order, indentation and the empty-element style.

Two ways to splice, one result:
- fast: when the hostdevs are only appended and ``</devices>`` is unambiguous in the bytes (the usual
  KubeVirt domain), the rendered text is inserted into the original bytes; nothing is re-serialised.
- general: otherwise (a hostdev to replace, no ``<devices>``, comments or CDATA around) the tree is edited
  and serialised, reusing the original prolog and root start tag verbatim.
Tests assert both give the same bytes wherever both apply.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from lxml import etree

from launcher_hook.hostdev import HostdevRenderer, HostdevSpec, Layout, render_hostdev
from schemas import InputError, PciAddress, ResourceKind
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


def _root_start_tag_end(data: bytes) -> int:
    """Offset just past the root element's start tag (after the declaration, comments and PIs)."""
    position = 0
    while True:
        position = data.index(b"<", position)
        if data.startswith(b"<?", position):
            position = data.index(b"?>", position) + 2
        elif data.startswith(b"<!--", position):
            position = data.index(b"-->", position) + 3
        else:
            break
    quote = 0
    for offset in range(position, len(data)):
        byte = data[offset]
        if quote:
            quote = 0 if byte == quote else quote
        elif byte in b"\"'":
            quote = byte
        elif byte == ord(">"):
            return offset + 1
    raise InputError("domain XML: the root start tag is not closed")


def parse_xml_document(data: bytes, what: str, max_bytes: int) -> ParsedDomain:
    """Parse ``data`` with no DTD, no entities and no network; any refusal names ``what`` and the reason."""
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


def libvirt_number(text: str | None) -> int | None:
    """A number as libvirt reads it (C-style: ``0x`` hex, leading ``0`` octal, else decimal), or None."""
    if text is None:
        return None
    value = text.strip()
    try:
        if value[:2].lower() == "0x":
            return int(value[2:], 16)
        if len(value) > 1 and value.startswith("0"):
            return int(value[1:], 8)
        return int(value, 10)
    except ValueError:
        return None


def hostdev_source_key(hostdev: etree._Element) -> tuple[str, str] | None:
    """What a ``<hostdev>`` passes through, as a comparable key (``("pci", "0000:86:00.0")`` …), or None."""
    address = hostdev.find("source/address")
    if address is None:
        return None
    kind = hostdev.get("type")
    if kind == ResourceKind.MDEV.value:
        uuid = address.get("uuid")
        return ("mdev", uuid.lower()) if uuid else None
    if kind == ResourceKind.PCI.value:
        numbers = [libvirt_number(address.get(part)) for part in ("domain", "bus", "slot", "function")]
        if any(number is None for number in numbers):
            return None
        try:
            return ("pci", str(PciAddress(*(number for number in numbers if number is not None))))
        except InputError:
            return None
    return None


def spec_source_key(spec: HostdevSpec) -> tuple[str, str]:
    return (spec.kind.value, spec.source_text)


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


def _check_aliases(parsed: ParsedDomain, specs: Sequence[HostdevSpec], doomed: set[int]) -> None:
    ours = {spec.alias for spec in specs}
    prefixes = {alias.rstrip("0123456789").encode() for alias in ours}
    if b"&" not in parsed.source and not any(prefix in parsed.source for prefix in prefixes):
        return  # no alias of ours can be in the document (a character reference could hide one)
    for element in parsed.root.iter("alias"):
        holder = element.getparent()
        if element.get("name") in ours and holder is not None and id(holder) not in doomed:
            raise InputError(
                f"alias {element.get('name')!r} is already used by <{holder.tag}> at line {element.sourceline} "
                "of the domain; it would collide with a GPU written by this hook"
            )


def splice_hostdevs(parsed: ParsedDomain, specs: Sequence[HostdevSpec], *, allow_fast: bool = True) -> bytes:
    """The domain with one ``<hostdev>`` per spec in ``/domain/devices``; a hostdev with the same source is
    replaced, which makes the build idempotent and absorbs hostdevs virt-launcher already rendered.

    An alias already held by any other element is an error, raised before anything is produced.
    """
    root = parsed.root
    devices = root.find("devices")
    replaced: dict[tuple[str, str], list[etree._Element]] = {}
    if devices is not None and devices.find("hostdev") is not None:
        wanted = {spec_source_key(spec) for spec in specs}
        for hostdev in devices.iterfind("hostdev"):
            key = hostdev_source_key(hostdev)
            if key is not None and key in wanted:
                replaced.setdefault(key, []).append(hostdev)
    _check_aliases(parsed, specs, {id(element) for elements in replaced.values() for element in elements})
    unit = _indent_unit(root)
    if allow_fast and not replaced and devices is not None:
        spliced = _splice_bytes(parsed, devices, specs, unit)
        if spliced is not None:
            return spliced
    _splice_tree(parsed, devices, specs, replaced, unit)
    return parsed.serialize()


def _splice_bytes(
    parsed: ParsedDomain, devices: etree._Element, specs: Sequence[HostdevSpec], unit: str
) -> bytes | None:
    """Insert the rendered hostdevs before ``</devices>`` in the original bytes, when that is unambiguous.

    Unambiguous: ``<devices>`` has children (so it is not written ``<devices/>``), ``</devices>`` occurs
    once, and no comment, CDATA section or processing instruction could hold a fake one.
    """
    source = parsed.source
    if not len(devices) or not parsed.has_only_elements_and_text or source.count(b"</devices>") != 1:
        return None
    before, closing = _child_slots(devices, unit)
    if (before is None) != (closing is None):
        return None
    end = source.index(b"</devices>")
    closing_bytes = (closing or "").encode()
    insert_at = end - len(closing_bytes)
    if source[insert_at:end] != closing_bytes:
        return None
    layout = Layout(before or "", unit if before else "", parsed.writes_empty_expanded_near(end))
    render = HostdevRenderer(layout)
    text = "".join(layout.indent + render(spec) for spec in specs)
    return source[:insert_at] + text.encode() + source[insert_at:]


def _splice_tree(
    parsed: ParsedDomain,
    devices: etree._Element | None,
    specs: Sequence[HostdevSpec],
    replaced: dict[tuple[str, str], list[etree._Element]],
    unit: str,
) -> None:
    root = parsed.root
    expanded = parsed.expanded_empty
    if devices is None:
        devices = etree.Element("devices")
        _append(root, devices, *_child_slots(root, unit))
    for spec in specs:
        existing = replaced.get(spec_source_key(spec), [])
        if existing:
            first, *extra = existing
            indent = _indent_of(first)
            element = etree.fromstring(render_hostdev(spec, Layout(indent or "", unit if indent else "", expanded)))
            element.tail = first.tail
            devices.replace(first, element)
            for duplicate in extra:
                _remove_keeping_layout(duplicate)
        else:
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
