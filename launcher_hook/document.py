"""Step 1 of a call: read the domain (and the VMI) once; every later step uses that one parse.

The domain XML comes from virt-launcher (or a user, through xmlgen) and goes straight back to libvirt, so
parsing refuses what could make it dangerous or ambiguous (a DOCTYPE, entities, oversized or non-UTF-8
input). The parsed document (:class:`ParsedDomain`) keeps the bytes it came from: the writer
(:mod:`launcher_hook.writer`) splices the passes' edits into them, so every byte no pass changed stays.

:class:`CallInputs` holds one call's domain and VMI, each parsed at most once: the allocation source that reads
the domain (``sources.DomainSource``), the passes and the writer all use the same parse.

Also here: the layout helpers every pass uses to lay new elements out like their neighbours (indentation,
the empty-element style), and where hostdev elements are in the bytes.
"""

from __future__ import annotations

import copy
import re
import threading
from dataclasses import dataclass

from lxml import etree

from schemas import InputError
from schemas.limits import check_utf8
from schemas.vmi import VirtualMachineInstance, parse_vmi

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

    def __post_init__(self) -> None:
        # What the properties below read of the bytes, once (plain attributes: ``cached_property`` takes a lock).
        self._self_closing: bool | None = None
        self._expanded_empty: bool | None = None
        self._elements_and_text: bool | None = None

    @property
    def has_self_closing(self) -> bool:
        """Whether ``/>`` is anywhere in the bytes."""
        found = self._self_closing
        if found is None:
            found = self._self_closing = b"/>" in self.source
        return found

    @property
    def expanded_empty(self) -> bool:
        """True for documents that write every empty element as ``<x></x>`` (Go's encoding/xml, KubeVirt)."""
        found = self._expanded_empty
        if found is None:
            found = self._expanded_empty = not self.has_self_closing and b"></" in self.source
        return found

    def writes_empty_expanded_near(self, offset: int) -> bool:
        """The empty-element style of the elements just before ``offset``, for new elements written there.

        Looks at a window rather than the whole document: it is what the new elements should match, and
        a search for ``/>`` is slow (a document without one is scanned to its end).
        """
        if not self.has_self_closing:
            return self.expanded_empty  # (what the window would say: no ``/>`` in it either)
        window = self.source[max(0, offset - 4096) : offset]
        return b"/>" not in window and (b"></" in window or self.expanded_empty)

    @property
    def has_only_elements_and_text(self) -> bool:
        """No comment, CDATA section or processing instruction (but the XML declaration) anywhere."""
        found = self._elements_and_text
        if found is None:
            found = self._elements_and_text = self._only_elements_and_text()
        return found

    def _only_elements_and_text(self) -> bool:
        """:attr:`has_only_elements_and_text`, read from the bytes.

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


def newline_whitespace(text: str | None) -> str | None:
    """``text`` if it is indentation (whitespace with a line break), else None."""
    return text if text and "\n" in text and not text.strip() else None


def indent_of(element: etree._Element) -> str | None:
    previous, parent = element.getprevious(), element.getparent()
    return newline_whitespace(previous.tail if previous is not None else (parent.text if parent is not None else None))


def indent_unit(root: etree._Element) -> str:
    """The document's indentation step (KubeVirt uses a tab), guessed from the root's first child."""
    text = newline_whitespace(root.text)
    return (text.rsplit("\n", 1)[1] or "\t") if text else "\t"


def child_slots(parent: etree._Element, unit: str) -> tuple[str | None, str | None]:
    """The indentation before a new last child of ``parent`` and before ``parent``'s end tag (None: compact)."""
    if not is_layout(parent[-1].tail if len(parent) else parent.text):
        # Text where the indentation would go (``<devices>text</devices>``, a CDATA section) is content, not
        # layout: append compactly rather than overwrite it.
        return None, None
    if len(parent):
        return newline_whitespace(parent.text), newline_whitespace(parent[-1].tail)
    parent_indent = indent_of(parent)
    return (parent_indent + unit, parent_indent) if parent_indent else (None, None)


def is_layout(text: str | None) -> bool:
    """True when ``text`` is only whitespace (or absent): indentation the splicer may rewrite."""
    return text is None or not text.strip()


def append_child(parent: etree._Element, child: etree._Element, before: str | None, closing: str | None) -> None:
    if before is not None:
        if len(parent):
            parent[-1].tail = before
        else:
            parent.text = before
        child.tail = closing if closing is not None else (indent_of(parent) or "\n")
    parent.append(child)


_HOSTDEV_START = re.compile(rb"<(?:[A-Za-z_][\w.-]*:)?hostdev[\s/>]")
HOSTDEV_END = re.compile(rb"</hostdev\s*>")


def hostdev_starts(source: bytes) -> list[int]:
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


def remove_keeping_layout(element: etree._Element) -> None:
    parent = element.getparent()
    if parent is None:
        return
    previous = element.getprevious()
    if previous is not None:
        previous.tail = kept_text(previous.tail, element.tail)
    else:
        parent.text = kept_text(parent.text, element.tail)
    parent.remove(element)


def kept_text(before: str | None, removed_tail: str | None) -> str | None:
    """What goes where an element and its tail are removed: the tail's layout, but never lose text."""
    if is_layout(before):
        return removed_tail
    return before if is_layout(removed_tail) else f"{before}{removed_tail}"


def element_bytes(element: etree._Element, expanded_empty: bool) -> bytes:
    clone = copy.deepcopy(element)  # detached: no namespace declarations of its ancestors
    clone.tail = None
    if expanded_empty:
        for child in clone.iter():
            if isinstance(child.tag, str) and len(child) == 0 and child.text is None:
                child.text = ""
    text: bytes = etree.tostring(clone, encoding="UTF-8", xml_declaration=False)
    return text


_UNREAD = object()


class CallInputs:
    """One call's domain XML and VMI JSON, each parsed at most once, when first asked for (a refusal is an
    ``InputError`` naming the document, raised to whichever step asks first)."""

    def __init__(self, domain_xml: bytes | None, vmi_json: bytes | None, max_bytes: int) -> None:
        self.domain_xml = domain_xml
        self.vmi_json = vmi_json
        self.max_bytes = max_bytes
        self._domain: ParsedDomain | object | None = _UNREAD
        self._vmi: VirtualMachineInstance | object | None = _UNREAD
        self.memo: dict[str, object] = {}
        """What later steps read of the untouched document once for all of them (``domain.hostdevs_of``)."""

    @property
    def domain(self) -> ParsedDomain | None:
        """The domain, parsed on first use (a plain attribute after that: ``cached_property`` takes a lock)."""
        if self._domain is _UNREAD:
            self._domain = parse_domain(self.domain_xml, self.max_bytes) if self.domain_xml is not None else None
        return self._domain  # type: ignore[return-value]

    @property
    def vmi(self) -> VirtualMachineInstance | None:
        """The VMI, decoded on first use."""
        if self._vmi is _UNREAD:
            self._vmi = parse_vmi(self.vmi_json, max_bytes=self.max_bytes) if self.vmi_json is not None else None
        return self._vmi  # type: ignore[return-value]


def hostdev_spans(
    parsed: ParsedDomain, in_order: list[etree._Element] | None = None
) -> tuple[dict[int, tuple[int, int]], list[etree._Element]] | None:
    """Where each element named hostdev is in the bytes (by ``id`` of its element; the list keeps the elements,
    so their ids stay valid), or None when that is ambiguous.

    Without comments, CDATA or PIs every ``<hostdev`` / ``<p:hostdev`` in the bytes is a start tag (``<`` is
    not allowed raw in text or attribute values), so the n-th one is the n-th element named hostdev. As many
    start tags as ``in_order`` (the hostdevs of ``<devices>``) means they are those, in order (the usual case);
    otherwise they are matched with every element named hostdev in the document.
    """
    source = parsed.source
    starts = hostdev_starts(source)
    elements = in_order if in_order is not None and len(in_order) == len(starts) else []
    elements = elements or list(parsed.root.iter("{*}hostdev"))
    if len(starts) != len(elements):
        return None
    spans: dict[int, tuple[int, int]] = {}
    search = HOSTDEV_END.search
    for position, (start, element) in enumerate(zip(starts, elements, strict=True)):
        end = search(source, start)
        if end is None or (position + 1 < len(starts) and starts[position + 1] < end.start()):
            return None
        spans[id(element)] = (start, end.end())
    return spans, elements
