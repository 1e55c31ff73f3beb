"""Reading a libvirt domain safely and splicing hostdevs into it without disturbing anything else.

The domain XML comes from virt-launcher (or a user, through xmlgen) and goes straight back to libvirt, so
parsing refuses what could make it dangerous or ambiguous (a DOCTYPE, entities, oversized or non-UTF-8
input) and splicing keeps every other byte's meaning: namespaces such as ``qemu:``, comments, CDATA,
element order and the document's own indentation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from lxml import etree

from launcher_hook.hostdev import HostdevSpec, render_hostdev
from schemas import InputError, PciAddress, ResourceKind
from schemas.limits import check_utf8

_DECLARED_ENCODING = re.compile(rb"""^\s*<\?xml[^>]*?encoding\s*=\s*["']([A-Za-z0-9._-]+)["']""")
_UTF8_NAMES = {"utf-8", "utf8", "us-ascii", "ascii"}


@dataclass
class ParsedDomain:
    """A parsed domain and the bytes it came from, to write it back byte for byte where it is unchanged.

    lxml reflows the prolog, puts ``xmlns:`` declarations before other attributes and writes ``<x></x>``
    (Go's encoding/xml style, which KubeVirt uses) as ``<x/>``. To keep a diff of the domain down to the
    hostdevs, serialising reuses the original prolog and root start tag verbatim and keeps the document's
    empty-element style.
    """

    tree: etree._ElementTree
    source: bytes

    @property
    def root(self) -> etree._Element:
        return self.tree.getroot()

    def serialize(self) -> bytes:
        if _writes_empty_elements_expanded(self.source):
            for element in self.root.iter():
                if isinstance(element.tag, str) and len(element) == 0 and element.text is None:
                    element.text = ""
        body: bytes = etree.tostring(self.tree, encoding="UTF-8", xml_declaration=False)
        original_end = _root_start_tag_end(self.source)
        if not self.source[:original_end].endswith(b"/>"):
            body = self.source[:original_end] + body[_root_start_tag_end(body) :]
        trailing = self.source[len(self.source.rstrip()) :]
        return body + trailing


def _writes_empty_elements_expanded(source: bytes) -> bool:
    """True for documents that write every empty element as ``<x></x>`` (no ``/>`` anywhere)."""
    return b"/>" not in source and b"></" in source


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


def _safe_parser() -> etree.XMLParser:
    return etree.XMLParser(
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


def parse_xml_document(data: bytes, what: str, max_bytes: int) -> ParsedDomain:
    """Parse ``data`` with no DTD, no entities and no network; any refusal names ``what`` and the reason."""
    check_utf8(data, what, max_bytes)
    declared = _DECLARED_ENCODING.match(data)
    if declared and declared.group(1).decode().lower() not in _UTF8_NAMES:
        raise InputError(f"{what} declares encoding {declared.group(1).decode()!r}; only UTF-8 is accepted")
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise InputError(f"{what} has a DOCTYPE or entity declaration; these are refused")
    try:
        root = etree.fromstring(data, _safe_parser())
    except etree.XMLSyntaxError as exc:
        raise InputError(f"{what} is not well-formed XML: {exc}") from None
    tree = root.getroottree()
    if tree.docinfo.internalDTD is not None or tree.docinfo.system_url or tree.docinfo.public_id:
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


def _child_indent(parent: etree._Element) -> tuple[str | None, str | None]:
    """The whitespace before ``parent``'s children and before its end tag, if the document is indented."""
    children = list(parent)
    if not children:
        return None, None
    before = parent.text if parent.text and not parent.text.strip() else None
    closing = children[-1].tail if children[-1].tail and not children[-1].tail.strip() else None
    return before, closing


def _indent_of(element: etree._Element) -> str | None:
    previous, parent = element.getprevious(), element.getparent()
    text = previous.tail if previous is not None else (parent.text if parent is not None else None)
    return text if text and not text.strip() and "\n" in text else None


def _format(element: etree._Element, indent: str, unit: str) -> None:
    """Indent ``element``'s subtree so that its children sit one ``unit`` deeper than ``indent``."""
    children = list(element)
    if not children:
        return
    inner = indent + unit
    element.text = inner
    for child in children:
        _format(child, inner, unit)
        child.tail = inner
    children[-1].tail = indent


def _append(parent: etree._Element, child: etree._Element, unit: str) -> None:
    """Append ``child`` as the last child of ``parent``, keeping the document's indentation style."""
    before, closing = _child_indent(parent)
    parent_indent = _indent_of(parent)
    if before is None and parent_indent is not None and not len(parent):
        before, closing = parent_indent + unit, parent_indent
    if before is not None:
        _format(child, before, unit)
        if len(parent):
            parent[-1].tail = before
        else:
            parent.text = before
        child.tail = closing if closing is not None else (parent_indent or "\n")
    parent.append(child)


def _indent_unit(root: etree._Element) -> str:
    """The document's indentation step (KubeVirt uses a tab), guessed from the root's first child."""
    text = root.text or ""
    if text.strip() or "\n" not in text:
        return "\t"
    step = text.rsplit("\n", 1)[1]
    return step or "\t"


def splice_hostdevs(parsed: ParsedDomain, specs: Sequence[HostdevSpec]) -> None:
    """Put one ``<hostdev>`` per spec into ``/domain/devices``; a hostdev with the same source is replaced.

    Replacing (rather than adding) makes the build idempotent and absorbs hostdevs virt-launcher already
    rendered. An alias already held by any other element is an error, raised before anything changes.
    """
    root = parsed.root
    unit = _indent_unit(root)
    devices = root.find("devices")
    wanted = {spec_source_key(spec) for spec in specs}
    replaced: dict[tuple[str, str], list[etree._Element]] = {}
    if devices is not None:
        for hostdev in devices.iterfind("hostdev"):
            key = hostdev_source_key(hostdev)
            if key is not None and key in wanted:
                replaced.setdefault(key, []).append(hostdev)
    doomed = {id(element) for elements in replaced.values() for element in elements}
    ours = {spec.alias for spec in specs}
    for element in root.iter("alias"):
        holder = element.getparent()
        if element.get("name") in ours and holder is not None and id(holder) not in doomed:
            raise InputError(
                f"alias {element.get('name')!r} is already used by <{holder.tag}> at line {element.sourceline} "
                "of the domain; it would collide with a GPU written by this hook"
            )
    if devices is None:
        devices = etree.Element("devices")
        _append(root, devices, unit)
    for spec in specs:
        element = render_hostdev(spec)
        existing = replaced.get(spec_source_key(spec), [])
        if existing:
            first, *extra = existing
            indent = _indent_of(first)
            if indent is not None:
                _format(element, indent, unit)
            element.tail = first.tail
            devices.replace(first, element)
            for duplicate in extra:
                _remove_keeping_layout(duplicate)
        else:
            _append(devices, element, unit)


def _remove_keeping_layout(element: etree._Element) -> None:
    parent = element.getparent()
    if parent is None:
        return
    previous = element.getprevious()
    if previous is not None:
        previous.tail = element.tail
    else:
        parent.text = element.tail
    parent.remove(element)


def devices_document(specs: Sequence[HostdevSpec]) -> bytes:
    """A standalone ``<devices>`` element holding just the rendered hostdevs, tab-indented."""
    devices = etree.Element("devices")
    for spec in specs:
        devices.append(render_hostdev(spec))
    _format(devices, "\n", "\t")
    body: bytes = etree.tostring(devices, encoding="UTF-8", xml_declaration=False)
    return body + b"\n"
