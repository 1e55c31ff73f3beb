"""Checks every ``<hostdev>`` of a domain the way libvirt will judge it, with messages a person can act on.

libvirt validates against its RNG schema only when asked, and its parser silently drops what it does not
understand (a ``display`` on a PCI hostdev, an alias with a bad character), so a domain can look accepted
and still give the VM the wrong devices. This module checks each hostdev against libvirt's own
``domain.rng`` (wrapped in a minimal domain, because KubeVirt's full domains do not all pass the schema) and
adds the rules the schema cannot express: ``ua-`` aliases, alias characters, unique aliases, one hostdev per
source. It explains the mistakes seen in practice instead of only echoing the schema's vague verdict.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lxml import etree

from launcher_hook.domain import hostdev_source_key, libvirt_number

DEFAULT_SCHEMAS_DIR = Path("/usr/share/libvirt/schemas")
SCHEMAS_DIR_ENV = "LIBVIRT_SCHEMAS_DIR"
_ALIAS_CHARS = re.compile(r"[a-zA-Z0-9_-]+")
_WRAPPER = (
    b'<domain type="kvm"><name>hostdev-check</name><memory>1</memory><os><type>hvm</type></os><devices/></domain>'
)
_PCI_RANGES = {"domain": 0xFFFFFFFF, "bus": 0xFF, "slot": 0x1F, "function": 0x7}


class SchemaNotFound(RuntimeError):
    """libvirt's RNG schemas are not installed where we looked."""


@dataclass(frozen=True)
class Problem:
    line: int | None
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


def schemas_dir() -> Path:
    """Where libvirt's RNG schemas are: ``$LIBVIRT_SCHEMAS_DIR`` or Debian's ``/usr/share/libvirt/schemas``."""
    return Path(os.environ.get(SCHEMAS_DIR_ENV) or DEFAULT_SCHEMAS_DIR)


@functools.cache
def _load_schema(directory: Path) -> etree.RelaxNG:
    entry = directory / "domain.rng"
    if not entry.is_file():
        raise SchemaNotFound(
            f"libvirt's RNG schema {entry} is missing (Debian: apt-get install libvirt0; or set {SCHEMAS_DIR_ENV})"
        )
    return etree.RelaxNG(etree.parse(str(entry)))


def hostdev_schema(directory: Path | None = None) -> etree.RelaxNG:
    """libvirt's ``domain.rng``, loaded once per directory."""
    return _load_schema(directory or schemas_dir())


def line_of(element: etree._Element) -> int | None:
    """The element's source line (lxml-stubs types it loosely)."""
    line: object = element.sourceline
    return line if isinstance(line, int) else None


def _label(hostdev: etree._Element) -> str:
    alias = hostdev.find("alias")
    name = alias.get("name") if alias is not None else None
    return f"<hostdev> {name!r}" if name else "<hostdev> without alias"


def _specific_problems(hostdev: etree._Element) -> Iterator[str]:
    """The mistakes seen in practice, explained; the RNG check catches the rest."""
    label = _label(hostdev)
    kind = hostdev.get("type")
    address = hostdev.find("source/address")
    if address is None:
        yield f"{label}: no <source><address/></source>"
        return
    if kind == "pci":
        if address.get("type") is not None:
            yield (
                f"{label}: <source><address type={address.get('type')!r}> - the source address takes no type "
                "attribute in libvirt's schema (KubeVirt writes one; drop it)"
            )
        for attribute in ("display", "ramfb"):
            if hostdev.get(attribute) is not None:
                yield f"{label}: {attribute}= is allowed on mdev hostdevs only; libvirt drops it on PCI ones"
        for part, top in _PCI_RANGES.items():
            text = address.get(part)
            value = libvirt_number(text)
            if text is None:
                yield f"{label}: source address has no {part}"
            elif value is None or not 0 <= value <= top:
                yield f"{label}: source address {part}={text!r} is not a number in 0..{top:#x}"
            elif not text.lower().startswith("0x"):
                yield f"{label}: source address {part}={text!r} is not 0x hex; libvirt reads it C-style"
    elif kind == "mdev":
        if hostdev.get("model") is None:
            yield f"{label}: mdev hostdev has no model= (vfio-pci for vGPUs)"
        for attribute in ("display", "ramfb"):
            switch = hostdev.get(attribute)
            if switch is not None and switch not in ("on", "off"):
                yield f"{label}: {attribute}={switch!r} must be 'on' or 'off'"


def _schema_problems(hostdev: etree._Element, schema: etree.RelaxNG) -> Iterator[str]:
    wrapper = etree.fromstring(_WRAPPER)
    devices = wrapper.find("devices")
    assert devices is not None
    clone = copy.deepcopy(hostdev)
    clone.tail = None
    devices.append(clone)
    if not schema.validate(wrapper):
        details = "; ".join(dict.fromkeys(entry.message for entry in schema.error_log))
        yield f"{_label(hostdev)} fails libvirt's RNG schema (domain.rng): {details}"


def _alias_problems(root: etree._Element) -> Iterator[Problem]:
    holders: dict[str, etree._Element] = {}
    for alias in root.iter("alias"):
        name = alias.get("name") or ""
        parent = alias.getparent()
        is_hostdev = parent is not None and parent.tag == "hostdev"
        if is_hostdev and not name.startswith("ua-"):
            yield Problem(line_of(alias), f"hostdev alias {name!r} does not start with 'ua-' (user aliases must)")
        if name.startswith("ua-") and _ALIAS_CHARS.fullmatch(name) is None:
            yield Problem(
                line_of(alias),
                f"alias {name!r} has characters outside [a-zA-Z0-9_-]; libvirt silently drops such an alias",
            )
        if name in holders:
            first = holders[name]
            yield Problem(line_of(alias), f"alias {name!r} is used again (first at line {line_of(first)})")
        else:
            holders[name] = alias


def validate_domain(root: etree._Element, schema: etree.RelaxNG) -> list[Problem]:
    """Every problem with the domain's hostdevs and aliases, in document order (empty when valid)."""
    problems: list[Problem] = []
    sources: dict[tuple[str, str], int | None] = {}
    for hostdev in root.iterfind("devices/hostdev"):
        specific = list(_specific_problems(hostdev))
        problems += [Problem(line_of(hostdev), message) for message in specific]
        if not specific:
            problems += [Problem(line_of(hostdev), message) for message in _schema_problems(hostdev, schema)]
        key = hostdev_source_key(hostdev)
        if key is not None:
            if key in sources:
                problems.append(
                    Problem(
                        line_of(hostdev),
                        f"{_label(hostdev)}: {key[1]} is passed through again (first at line {sources[key]})",
                    )
                )
            else:
                sources[key] = line_of(hostdev)
    problems += _alias_problems(root)
    return sorted(problems, key=lambda problem: problem.line or 0)
