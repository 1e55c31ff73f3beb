"""Checks every ``<hostdev>`` of a domain the way libvirt 9.0 will judge it, with messages a person can act on.

libvirt validates against its RNG schema only when asked, and its parser silently drops what it does not
understand (a ``display`` on a PCI hostdev, an alias with a bad character), so a domain can look accepted
and still give the VM the wrong devices. This module checks each hostdev of any type (pci, mdev, usb, scsi,
scsi_host) against libvirt's own ``domain.rng`` (wrapped in a minimal domain, because KubeVirt's full domains
do not all pass the schema) and adds what the schema cannot express:

- numbers as libvirt's parser reads them (``strtoul`` with base 0: ``0x`` hex, a leading ``0`` octal, else
  decimal); a form a reader may take for another number (``bus='10'`` is ten, not sixteen) is a warning;
- aliases: in a configuration (inactive) domain user aliases must start with ``ua-`` and use only
  ``[a-zA-Z0-9_-]`` (libvirt silently drops any other); live XML (``virsh dumpxml`` of a running domain,
  recognised by ``id=`` on ``<domain>``) carries libvirt's own aliases (``hostdev0``), which are fine there;
  aliases are unique either way;
- the domain-level rules of libvirt's parser and QEMU driver (:func:`domain_rules`, pure, usable by the
  builder): ``display='on'`` needs a ``<graphics>``, at most one ``ramfb='on'``, no source passed twice, no
  SCSI drive address used twice; and the per-device ones (mdev model and guest address type, no boot order
  on vfio-pci mdevs or vhost-scsi).

Each finding is an :class:`Problem` with a severity: errors are what libvirt refuses, or what it would
silently change from what was written; warnings are accepted as written but easy to misread.
docs/validation.md lists every rule with its source in libvirt.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lxml import etree

from launcher_hook.hostdevs import model_for_type
from launcher_hook.hostdevs.base import Severity, ambiguous_number, c_number
from launcher_hook.hostdevs.pci import RANGES as PCI_RANGES

__all__ = [
    "DEFAULT_SCHEMAS_DIR",
    "SCHEMAS_DIR_ENV",
    "Problem",
    "SchemaNotFound",
    "Severity",
    "ambiguous_number",
    "c_number",
    "domain_rules",
    "hostdev_schema",
    "is_live",
    "review_domain",
    "schemas_dir",
    "source_identity",
    "validate_domain",
]

DEFAULT_SCHEMAS_DIR = Path("/usr/share/libvirt/schemas")
SCHEMAS_DIR_ENV = "LIBVIRT_SCHEMAS_DIR"
USER_ALIAS_PREFIX = "ua-"
_ALIAS_CHARS = re.compile(r"[a-zA-Z0-9_-]+")
_WRAPPER = (
    b'<domain type="kvm"><name>hostdev-check</name><memory>1</memory><os><type>hvm</type></os><devices/></domain>'
)
# Numbers libvirt's parser reads in a hostdev, by hostdev type: (element, attributes, base, usual base).
# Base 0 is C's (0x hex, 0 octal, else decimal); drive addresses are read in base 10 (device_conf.c).
_SOURCE_NUMBERS: dict[str, list[tuple[str, tuple[str, ...], int, int]]] = {
    "usb": [
        ("source/vendor", ("id",), 0, 16),
        ("source/product", ("id",), 0, 16),
        ("source/address", ("bus", "device"), 0, 10),
    ],
    "scsi": [("source/address", ("bus", "target", "unit"), 0, 10)],
}
_GUEST_NUMBERS: list[tuple[str, tuple[str, ...], int, int]] = [
    ("address[@type='pci']", ("domain", "bus", "slot", "function"), 0, 16),
    ("address[@type='drive']", ("controller", "bus", "target", "unit"), 10, 10),
]


class SchemaNotFound(RuntimeError):
    """libvirt's RNG schemas are not installed where we looked."""


@dataclass(frozen=True)
class Problem:
    line: int | None
    message: str
    severity: Severity = Severity.ERROR

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"{where}{self.severity.value}: {self.message}"


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


def is_live(root: etree._Element) -> bool:
    """Whether ``root`` is live XML (a running domain's, as ``virsh dumpxml`` prints it): it has ``id=``."""
    return root.get("id") is not None


def _label(hostdev: etree._Element) -> str:
    alias = hostdev.find("alias")
    name = alias.get("name") if alias is not None else None
    kind = hostdev.get("type") or "?"
    return f"<hostdev type={kind!r}> {name!r}" if name else f"<hostdev type={kind!r}> without alias"


def _number_problems(hostdev: etree._Element, label: str) -> Iterator[tuple[Severity, str]]:
    """Numbers outside a PCI source, read as libvirt's parser reads them (see _SOURCE_NUMBERS)."""
    fields = [*_SOURCE_NUMBERS.get(hostdev.get("type") or "", []), *_GUEST_NUMBERS]
    for path, attributes, base, usual_base in fields:
        element = hostdev.find(path)
        if element is None:
            continue
        where = f"{'guest' if path.startswith('address') else 'source'} <{element.tag}>"
        for attribute in attributes:
            text = element.get(attribute)
            if text is None:
                continue
            value = c_number(text, base)
            if value is None:
                form = "decimal digits" if base == 10 else "a number (0x hex, 0-prefixed octal or decimal)"
                yield Severity.ERROR, f"{label}: {where} {attribute}={text!r} is not {form} libvirt reads"
                continue
            if path == "address[@type='pci']" and value > PCI_RANGES[attribute]:
                yield (
                    Severity.ERROR,
                    f"{label}: {where} {attribute}={text!r} is over {PCI_RANGES[attribute]:#x}",
                )
                continue
            why = ambiguous_number(text, usual_base) if base == 0 else None
            if why is not None:
                yield Severity.WARNING, f"{label}: {where} {attribute}={text!r}: {why}"


def _hostdev_problems(hostdev: etree._Element) -> Iterator[tuple[Severity, str]]:
    """The mistakes seen in practice, explained, and libvirt's per-device rules the schema lacks."""
    label = _label(hostdev)
    if hostdev.get("mode", "subsystem") != "subsystem":
        return
    yield from _number_problems(hostdev, label)
    kind = hostdev.get("type")
    model = model_for_type(kind)
    if model is not None:
        yield from model.source_problems(hostdev, label)
    elif kind == "scsi_host" and hostdev.find("boot") is not None:
        yield (
            Severity.ERROR,
            f"{label}: <boot> is not supported on vhost-scsi hostdevs (libvirt's QEMU driver)",
        )


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


def _alias_problems(root: etree._Element, live: bool) -> Iterator[Problem]:
    holders: dict[str, etree._Element] = {}
    for alias in root.iter("alias"):
        name = alias.get("name") or ""
        parent = alias.getparent()
        is_hostdev = parent is not None and parent.tag == "hostdev"
        if not live:
            if is_hostdev and not name.startswith(USER_ALIAS_PREFIX):
                yield Problem(
                    line_of(alias),
                    f"hostdev alias {name!r} does not start with 'ua-': libvirt drops it from a configuration "
                    "(only live XML, with id= on <domain>, carries libvirt's own aliases)",
                )
                continue
            if name.startswith(USER_ALIAS_PREFIX) and _ALIAS_CHARS.fullmatch(name) is None:
                yield Problem(
                    line_of(alias),
                    f"alias {name!r} has characters outside [a-zA-Z0-9_-]; libvirt silently drops such an alias",
                )
                continue
        if name in holders:
            first = holders[name]
            yield Problem(line_of(alias), f"alias {name!r} is used again (first at line {line_of(first)})")
        else:
            holders[name] = alias


# ---- domain-level rules: pure, on the domain tree alone -------------------------------------------------


def _numbers(element: etree._Element | None, parts: Sequence[str]) -> tuple[int | None, ...]:
    """Each attribute as libvirt reads it (absent = 0, unreadable = None)."""
    if element is None:
        return tuple(0 for _ in parts)
    return tuple(0 if element.get(part) is None else c_number(element.get(part)) for part in parts)


def source_identity(device: etree._Element) -> tuple[str, ...] | None:
    """What a ``<hostdev>`` (or ``<interface type='hostdev'>``) passes through, compared as libvirt's
    ``virDomainHostdevMatch`` does: PCI by address, mdev by UUID string, USB by bus/device (else by
    vendor/product), SCSI by adapter and address (iSCSI by host, port and path), vhost-scsi by wwpn."""
    if device.tag == "interface":
        address = device.find("source/address")
        if address is None:
            return None
        if address.get("type") == "usb":
            return ("usb-address", *map(str, _numbers(address, ("bus", "device"))))
        return ("pci", *map(str, _numbers(address, ("domain", "bus", "slot", "function"))))
    if device.get("mode", "subsystem") != "subsystem":
        return None
    kind = device.get("type")
    source = device.find("source")
    if source is None:
        return None
    if kind == "pci":
        return ("pci", *map(str, _numbers(source.find("address"), ("domain", "bus", "slot", "function"))))
    if kind == "mdev":
        address = source.find("address")
        uuid = address.get("uuid") if address is not None else None
        return ("mdev", uuid) if uuid else None
    if kind == "usb":
        address = source.find("address")
        bus, number = _numbers(address, ("bus", "device"))
        if address is not None and bus and number:
            return ("usb-address", str(bus), str(number))
        vendor, product = source.find("vendor"), source.find("product")
        ids = (c_number(part.get("id")) if part is not None else 0 for part in (vendor, product))
        return ("usb-id", *map(str, ids))
    if kind == "scsi":
        if source.get("protocol") == "iscsi":
            host = source.find("host")
            name = host.get("name", "") if host is not None else ""
            port = host.get("port", "3260") if host is not None else ""
            return ("iscsi", name, port, source.get("name", ""))
        adapter = source.find("adapter")
        return (
            "scsi",
            adapter.get("name", "") if adapter is not None else "",
            *map(str, _numbers(source.find("address"), ("bus", "target", "unit"))),
        )
    if kind == "scsi_host":
        return ("scsi_host", source.get("protocol", ""), source.get("wwpn", ""))
    return None


def _usb_ids(device: etree._Element) -> list[tuple[str, ...]]:
    """A USB hostdev's vendor/product identity, when it also has a bus/device address (else [])."""
    if device.tag != "hostdev" or device.get("type") != "usb" or device.find("source/address") is None:
        return []
    ids = tuple(str(c_number(_id_of(device, part))) for part in ("vendor", "product"))
    return [("usb-id", *ids)] if "None" not in ids else []


def _id_of(device: etree._Element, part: str) -> str | None:
    element = device.find(f"source/{part}")
    return element.get("id") if element is not None else None


def _show_source(identity: tuple[str, ...]) -> str:
    kind, *rest = identity
    if kind == "pci" and all(part.isdigit() for part in rest):
        domain, bus, slot, function = (int(part) for part in rest)
        return f"PCI {domain:04x}:{bus:02x}:{slot:02x}.{function:x}"
    if kind == "usb-address":
        return f"USB bus {rest[0]} device {rest[1]}"
    if kind == "usb-id" and all(part.isdigit() for part in rest):
        return f"USB device {int(rest[0]):04x}:{int(rest[1]):04x}"
    if kind == "scsi":
        return f"SCSI {rest[0]} bus {rest[1]} target {rest[2]} unit {rest[3]}"
    if kind == "iscsi":
        return f"iSCSI {rest[0]}:{rest[1]} {rest[2]}"
    if kind == "scsi_host":
        return f"vhost-scsi {rest[1]}"
    return f"{kind} {':'.join(rest)}"


def _disk_index(name: str) -> int | None:
    """libvirt's ``virDiskNameToIndex`` for ``sdX`` names: ``sda`` = 0, ``sdz`` = 25, ``sdaa`` = 26."""
    match = re.fullmatch(r"sd([a-z]+)", name)
    if match is None:
        return None
    index = 0
    for letter in match[1]:
        index = index * 26 + (ord(letter) - ord("a") + 1)
    return index - 1


def _drive(address: etree._Element) -> tuple[int | None, ...]:
    return _numbers(address, ("controller", "bus", "target", "unit"))


def domain_rules(root: etree._Element) -> list[Problem]:
    """libvirt's domain-level hostdev rules (its parser's and QEMU driver's) on a domain tree; no I/O.

    - an mdev with ``display='on'`` needs a ``<graphics>`` device (qemu_validate.c);
    - at most one mdev with ``ramfb='on'`` (domain_validate.c);
    - no source passed through twice (PCI, mdev, USB, SCSI, vhost-scsi; ``<interface type='hostdev'>``
      counts too, as libvirt keeps those among its hostdevs);
    - a SCSI hostdev's guest drive address used by no other SCSI hostdev nor SCSI disk.
    The builder can call it on the domain it wrote.
    """
    problems: list[Problem] = []
    devices = root.find("devices")
    if devices is None:
        return problems
    hostdevs = devices.findall("hostdev")
    has_graphics = devices.find("graphics") is not None
    ramfb_first: etree._Element | None = None
    for hostdev in hostdevs:
        if hostdev.get("type") != "mdev":
            continue
        if hostdev.get("display") == "on" and not has_graphics:
            problems.append(
                Problem(
                    line_of(hostdev),
                    f"{_label(hostdev)}: display='on' needs a <graphics> device in the domain, which has none "
                    "(libvirt's QEMU driver refuses it)",
                )
            )
        if hostdev.get("ramfb") == "on":
            if ramfb_first is None:
                ramfb_first = hostdev
            else:
                problems.append(
                    Problem(
                        line_of(hostdev),
                        f"{_label(hostdev)}: ramfb='on' again (first at line {line_of(ramfb_first)}); "
                        "only one vGPU may have ramfb",
                    )
                )
    seen: dict[tuple[str, ...], etree._Element] = {}
    for device in [*hostdevs, *devices.iterfind("interface[@type='hostdev']")]:
        identity = source_identity(device)
        if identity is None or any(part == "None" for part in identity):
            continue
        # libvirt compares a USB device with an earlier one by the earlier one's form: its bus/device when it
        # has them, else vendor/product; so a later device with an address also matches by its IDs.
        candidates = [identity, *_usb_ids(device)]
        match = next((candidate for candidate in candidates if candidate in seen), None)
        if match is not None:
            identity, first = match, seen[match]
            what = _label(device) if device.tag == "hostdev" else "<interface type='hostdev'>"
            problems.append(
                Problem(
                    line_of(device),
                    f"{what}: {_show_source(identity)} is passed through again (first at line {line_of(first)})",
                )
            )
        else:
            seen[identity] = device
    drives: dict[tuple[int | None, ...], etree._Element] = {}
    for hostdev in hostdevs:
        address = hostdev.find("address[@type='drive']")
        if hostdev.get("type") != "scsi" or address is None:
            continue
        drive = _drive(address)
        if drive in drives:
            problems.append(
                Problem(
                    line_of(hostdev),
                    f"{_label(hostdev)}: guest drive address controller={drive[0]} bus={drive[1]} target={drive[2]} "
                    f"unit={drive[3]} is taken already (line {line_of(drives[drive])})",
                )
            )
        else:
            drives[drive] = hostdev
    for disk in devices.iterfind("disk"):
        target = disk.find("target")
        if target is None or target.get("bus") != "scsi":
            continue
        address = disk.find("address[@type='drive']")
        if address is not None:
            drive = _drive(address)
        else:
            index = _disk_index(target.get("dev", ""))
            if index is None or index >= 7:  # beyond unit 6 libvirt's mapping depends on the controller model
                continue
            drive = (0, 0, 0, index)
        if drive in drives:
            problems.append(
                Problem(
                    line_of(drives[drive]),
                    f"{_label(drives[drive])}: guest drive address controller={drive[0]} bus={drive[1]} "
                    f"target={drive[2]} unit={drive[3]} is used by the SCSI disk {target.get('dev')!r} "
                    f"(line {line_of(disk)})",
                )
            )
    return problems


def _zpci_problems(root: etree._Element) -> Iterator[Problem]:
    os_type = root.find("os/type")
    arch = os_type.get("arch") if os_type is not None else None
    if arch == "s390x":
        return
    for hostdev in root.iterfind("devices/hostdev"):
        if hostdev.find("address/zpci") is not None:
            yield Problem(
                line_of(hostdev),
                f"{_label(hostdev)}: a <zpci> guest address exists only on s390x (arch={arch!r}); "
                "libvirt's QEMU driver refuses it",
            )


def review_domain(root: etree._Element, schema: etree.RelaxNG, *, live: bool | None = None) -> list[Problem]:
    """Every error and warning about the domain's hostdevs and aliases, in document order.

    ``live`` says whether ``root`` is live XML (libvirt's own aliases allowed); None decides by ``id=``.
    """
    live = is_live(root) if live is None else live
    problems: list[Problem] = []
    for hostdev in root.iterfind("devices/hostdev"):
        specific = list(_hostdev_problems(hostdev))
        problems += [Problem(line_of(hostdev), message, severity) for severity, message in specific]
        if not any(severity is Severity.ERROR for severity, _ in specific):
            problems += [Problem(line_of(hostdev), message) for message in _schema_problems(hostdev, schema)]
    problems += domain_rules(root)
    problems += _zpci_problems(root)
    problems += _alias_problems(root, live)
    return sorted(problems, key=lambda problem: problem.line or 0)


def validate_domain(root: etree._Element, schema: etree.RelaxNG, *, live: bool | None = None) -> list[Problem]:
    """The errors of :func:`review_domain` (empty when libvirt accepts the hostdevs as written)."""
    return [problem for problem in review_domain(root, schema, live=live) if problem.is_error]
