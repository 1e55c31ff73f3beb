"""What every per-kind hostdev model shares: the spec, the layout, libvirt's number rules and the model's API.

As in virt-manager's virtinst, each kind's ``<hostdev>`` is declared once, in one model
(:mod:`launcher_hook.hostdevs.pci`, :mod:`launcher_hook.hostdevs.mdev`), and that model is used everywhere the
element is touched: writing it (a printf template the model owns, so the render path stays a string format),
reading its source back (splice matching), checking it (:mod:`launcher_hook.validate`) and preparing it for
libvirt's QEMU driver on a test host (``xmlgen``'s libvirt checks). The element rules are libvirt's
(docs/protocols.md, "libvirt hostdev").
"""

from __future__ import annotations

import abc
import enum
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from lxml import etree

from schemas import DeviceId, DeviceKind, ResourceKind


class HostdevSpec(NamedTuple):
    """A host device for the VM: its source, the alias QEMU will know it by, and options.

    A NamedTuple rather than a frozen dataclass: one is built per GPU on the OnDefineDomain path.
    """

    kind: ResourceKind
    source: DeviceId
    alias: str
    variable: str
    """The allocation variable the source came from (for messages and logs)."""
    managed: bool = False
    driver: str | None = None
    display: bool = False
    ramfb: bool = False
    label: str = ""
    """Which VMI entry (or variable) asked for the device, for messages: ``gpus[0] 'gpu0' (deviceName …)``."""
    force_alias: bool = False
    """Give a hostdev already in the domain for this source ``alias`` too (``--force-gpu-aliases``); without it,
    such a hostdev keeps the alias it has (virt-launcher's ``ua-gpu-<name>``, which KubeVirt looks devices up by)."""

    @property
    def source_text(self) -> str:
        return device_text(self.source)


device_text = functools.lru_cache(maxsize=4096, typed=True)(str)
"""``str`` of a device ID, kept (a pod's hook names the same few IDs on every call: splice keys, the log line)."""


@dataclass(frozen=True)
class Layout:
    """How the surrounding document writes XML: indentation and empty elements."""

    indent: str = ""
    """Whitespace before the hostdev's start tag (``"\\n\\t\\t"`` in KubeVirt's domains; ``""`` when compact)."""
    unit: str = ""
    """One level of indentation (``"\\t"``), or ``""`` for a compact document."""
    expanded_empty: bool = False
    """Write empty elements as ``<x></x>`` (Go's encoding/xml, which KubeVirt uses) instead of ``<x/>``."""

    def empty(self, tag: str, attributes: str) -> str:
        return f"<{tag} {attributes}></{tag}>" if self.expanded_empty else f"<{tag} {attributes}/>"

    def tail(self, address_attributes: str) -> str:
        """``<source><address …/></source><alias name="%s"/></hostdev>`` laid out; the address attributes and
        the alias are printf fields the model fills."""
        inner = self.indent + self.unit if self.unit else ""
        innermost = inner + self.unit if self.unit else ""
        closing = self.indent if self.unit else ""
        alias = self.empty("alias", 'name="%s"')
        source = f"{inner}<source>{innermost}{self.empty('address', address_attributes)}{inner}</source>"
        return f"{source}{inner}{alias}{closing}</hostdev>"

    def driver(self) -> str:
        """A ``<driver name="%s"/>`` child laid out (printf field: the driver name)."""
        return (self.indent + self.unit if self.unit else "") + self.empty("driver", 'name="%s"')


class Severity(enum.Enum):
    ERROR = "error"
    WARNING = "warning"


Finding = tuple[Severity, str]

_C_NUMBER = re.compile(r"\s*\+?(?:0[xX](?P<hex>[0-9a-fA-F]+)|(?P<oct>0[0-7]*)|(?P<dec>[1-9][0-9]*))")
_DECIMAL = re.compile(r"\s*\+?(?P<digits>[0-9]+)")
_UINT_MAX = 0xFFFFFFFF


def c_number(text: str | None, base: int = 0) -> int | None:
    """``text`` read as libvirt's ``virStrToLong_uip(text, NULL, base, …)`` reads it, or None where it fails.

    Base 0 means C's rules: ``0x``/``0X`` then hex digits, a leading ``0`` then octal digits, else decimal;
    base 10 takes decimal digits only (leading zeros too). Leading blanks and a ``+`` are allowed, nothing
    may follow the digits, and the value must fit 32 bits.
    """
    if text is None:
        return None
    if base == 10:
        decimal = _DECIMAL.fullmatch(text)
        value = int(decimal["digits"], 10) if decimal is not None else None
    else:
        match = _C_NUMBER.fullmatch(text)
        if match is None:
            return None
        if match["hex"] is not None:
            value = int(match["hex"], 16)
        elif match["oct"] is not None:
            value = int(match["oct"], 8)
        else:
            value = int(match["dec"], 10)
    return value if value is not None and value <= _UINT_MAX else None


def ambiguous_number(text: str, usual_base: int = 16) -> str | None:
    """Why a number libvirt reads fine (base 0) may be misread by a person used to ``usual_base`` (hex for
    PCI numbers and USB IDs, as lspci and lsusb print them; decimal for USB bus/device and SCSI numbers), or
    None when its form is plain."""
    value = c_number(text)
    if value is None:
        return None
    digits = text.strip().lstrip("+")
    if digits[:2].lower() == "0x":
        return None
    usual = int(digits, usual_base)
    if usual == value:
        return None
    form = "octal" if len(digits) > 1 and digits.startswith("0") else "decimal"
    usual_name = "hex" if usual_base == 16 else "decimal"
    return f"libvirt reads {text!r} as {form} {value} ({value:#x}), not {usual_name} {digits}"


CHANGED_SOURCE_TYPE, CHANGED_SWITCHES, CHANGED_MODE, CHANGED_OTHER = "source type=", "display/ramfb", "mode=", "other"
"""What correcting an existing hostdev changed: the first three are patched in the bytes, anything else
re-serialises the hostdev (see :mod:`launcher_hook.domain`)."""


def set_switch(hostdev: etree._Element, attribute: str, on: bool) -> bool:
    """Make ``attribute`` say ``on``/not on; True if the element changed (an existing ``'off'`` stays)."""
    current = hostdev.get(attribute)
    if on and current != "on":
        hostdev.set(attribute, "on")
        return True
    if not on and current == "on":
        del hostdev.attrib[attribute]
        return True
    return False


class HostdevModel(abc.ABC):
    """One kind's ``<hostdev>``: written, read back, checked and prepared for QEMU by the same object."""

    kind: DeviceKind

    @property
    def type_name(self) -> str:
        """libvirt's ``type=`` of this kind's hostdev (also the first part of a source key)."""
        return self.kind.hostdev_type

    @abc.abstractmethod
    def template(self, layout: Layout) -> str:
        """The printf template of the whole element for ``layout`` (built once per layout)."""
        ...

    @abc.abstractmethod
    def render(self, template: str, driver_template: str, spec: HostdevSpec, *guest: str) -> str:
        """Fill ``template`` for ``spec`` (values are validated parts: nothing needs escaping); ``guest``: the text
        of a guest ``<address>`` for a template with a field before the alias (``HostdevRenderer.addressed``),
        filled just before the alias, which is always the last field."""
        ...

    @abc.abstractmethod
    def read_source(self, address: etree._Element) -> str | None:
        """The source's ID in the kernel's form (``0000:86:00.0``, a lower-case UUID) from ``<source><address>``,
        read as libvirt reads it; None when libvirt would not find a device there."""
        ...

    @abc.abstractmethod
    def source_problems(self, hostdev: etree._Element, label: str) -> Iterator[Finding]:
        """What libvirt's schema or QEMU driver would refuse (or silently drop) in this kind's element."""
        ...

    @abc.abstractmethod
    def correct_existing(
        self,
        hostdev: etree._Element,
        address: etree._Element | None,
        spec: HostdevSpec,
        alias: str,
        warnings: list[str],
    ) -> set[str]:
        """Correct a hostdev virt-launcher already wrote for ``spec``'s source (the attributes this kind
        owns); returns what changed (``CHANGED_*``)."""
        ...

    def prepare_for_qemu(self, hostdev: etree._Element) -> None:  # noqa: B027 (a kind may need nothing)
        """Change a copy of the element so libvirt's QEMU driver accepts it on a host without IOMMU groups;
        by default nothing (an mdev needs no change)."""
