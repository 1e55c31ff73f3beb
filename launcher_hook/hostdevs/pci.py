"""``<hostdev type='pci'>``: a whole PCI function passed through (docs/protocols.md, "libvirt hostdev").

Written with all four address fields as ``0x`` hex (libvirt reads numbers C-style, so ``bus='10'`` would be
ten), ``managed='no'`` unless asked (the node's GPUs are already on vfio-pci and virt-launcher may not rebind),
an optional ``<driver name='vfio'/>`` right before ``<source>``, no ``display``/``ramfb`` (libvirt's schema
has them on mdevs only and its parser drops them here).
"""

from __future__ import annotations

from collections.abc import Iterator

from lxml import etree

from launcher_hook.hostdevs.base import (
    CHANGED_OTHER,
    CHANGED_SWITCHES,
    Finding,
    HostdevModel,
    HostdevSpec,
    Layout,
    Severity,
    ambiguous_number,
    c_number,
)
from schemas import InputError, PciAddress
from schemas.kinds import PCI_PASSTHROUGH

RANGES = {"domain": 0xFFFFFFFF, "bus": 0xFF, "slot": 0x1F, "function": 0x7}
"""What libvirt accepts in a PCI address (the domain up to 32 bits: VMD domains are 5 hex digits)."""
_FIELDS = ("domain", "bus", "slot", "function")
_HEX_FORMS = ("0x%04x", "0x%02x", "0x%02x", "0x%x")


def _hex_numbers(texts: tuple[str | None, str | None, str | None, str | None]) -> tuple[int, int, int, int] | None:
    """The usual form (ours and KubeVirt's): all four ``0x`` hex in the kernel's ranges, else None."""
    domain, bus, slot, function = texts
    if not (domain and bus and slot and function):
        return None
    if not domain[:2] == bus[:2] == slot[:2] == function[:2] == "0x":
        return None
    if not (domain[2:].isalnum() and bus[2:].isalnum() and slot[2:].isalnum() and function[2:].isalnum()):
        return None  # int() would also take "_", signs and surrounding whitespace
    try:
        numbers = (int(domain, 16), int(bus, 16), int(slot, 16), int(function, 16))
    except ValueError:
        return None
    if numbers[0] > 0xFFFF or numbers[1] > 0xFF or numbers[2] > 0x1F or numbers[3] > 7:
        return None
    return numbers


class PciHostdev(HostdevModel):
    kind = PCI_PASSTHROUGH

    def template(self, layout: Layout) -> str:
        address = 'domain="0x%04x" bus="0x%02x" slot="0x%02x" function="0x%x"'
        return '<hostdev mode="subsystem" type="pci" managed="%s">%s' + layout.tail(address)

    def render(self, template: str, driver_template: str, spec: HostdevSpec, *guest: str) -> str:
        driver = driver_template % spec.driver if spec.driver else ""
        return template % ("yes" if spec.managed else "no", driver, *spec.source, *guest, spec.alias)

    def read_source(self, address: etree._Element) -> str | None:
        get = address.get
        texts = (get("domain"), get("bus"), get("slot"), get("function"))
        fast = _hex_numbers(texts)
        if fast is not None:  # the usual form: the kernel's text without a round trip
            return "%04x:%02x:%02x.%x" % fast  # noqa: UP031
        numbers = [c_number(text) for text in texts]
        if any(number is None for number in numbers):
            return None
        try:
            return str(PciAddress(*(number for number in numbers if number is not None)))
        except InputError:
            return None

    def source_problems(self, hostdev: etree._Element, label: str) -> Iterator[Finding]:
        address = hostdev.find("source/address")
        if address is None:
            yield Severity.ERROR, f"{label}: no <source><address/></source>"
            return
        if address.get("type") is not None:
            yield (
                Severity.ERROR,
                f"{label}: <source><address type={address.get('type')!r}> - the source address takes no type "
                "attribute in libvirt's schema (KubeVirt writes one; drop it)",
            )
        for attribute in ("display", "ramfb"):
            if hostdev.get(attribute) is not None:
                yield (
                    Severity.ERROR,
                    f"{label}: {attribute}= is allowed on mdev hostdevs only; libvirt drops it on PCI ones",
                )
        for part, top in RANGES.items():
            text = address.get(part)
            if text is None:
                yield Severity.WARNING, f"{label}: source address has no {part}=; libvirt reads it as 0"
                continue
            value = c_number(text)
            if value is None or value > top:
                yield (
                    Severity.ERROR,
                    f"{label}: source address {part}={text!r} is not a number libvirt reads in 0..{top:#x} "
                    "(0x hex, 0-prefixed octal or decimal)",
                )
                continue
            why = ambiguous_number(text)
            if why is not None:
                yield Severity.WARNING, f"{label}: source address {part}={text!r}: {why}; write {value:#0{4}x}"

    def correct_existing(
        self,
        hostdev: etree._Element,
        address: etree._Element | None,
        spec: HostdevSpec,
        alias: str,
        warnings: list[str],
    ) -> set[str]:
        changed: set[str] = set()
        if address is not None and isinstance(spec.source, PciAddress) and _hex_source_address(address, spec.source):
            changed.add(CHANGED_OTHER)
        dropped = [attribute for attribute in ("display", "ramfb") if hostdev.get(attribute) is not None]
        for attribute in dropped:
            del hostdev.attrib[attribute]
        if dropped:
            changed.add(CHANGED_SWITCHES)
            warnings.append(
                f"{spec.label}: {'/'.join(dropped)} removed from the PCI hostdev {alias!r} (libvirt's schema has "
                "them on mdev hostdevs only and its parser drops them)"
            )
        return changed

    def prepare_for_qemu(self, hostdev: etree._Element) -> None:
        if hostdev.find("driver") is None:
            hostdev.insert(0, etree.Element("driver", {"name": "vfio"}))


def _hex_source_address(address: etree._Element, source: PciAddress) -> bool:
    """Write a source address given in decimal or octal (which libvirt reads C-style) in ``0x`` hex, the same
    numbers in the one unambiguous form; an address already all ``0x`` stays as written."""
    get = address.get
    domain, bus, slot, function = get("domain"), get("bus"), get("slot"), get("function")
    if domain and bus and slot and function and domain[:2] == bus[:2] == slot[:2] == function[:2] == "0x":
        return False  # (the source key was read from these numbers, so they are valid)
    if all((get(field) or "").lower().startswith("0x") for field in _FIELDS):
        return False
    for field, value in zip(_FIELDS, _HEX_FORMS, strict=True):
        address.set(field, value % getattr(source, field))
    return True


MODEL = PciHostdev()
