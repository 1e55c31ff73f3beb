"""The guest's 64-bit PCI MMIO window: sized from the passed-through BARs, written for OVMF guests.

A GPU whose BAR does not fit OVMF's 64-bit PCI window boots an EFI guest without it (KubeVirt #11093). OVMF
reads the window's size from the fw_cfg item ``opt/ovmf/X-PciMmio64Mb`` (MiB); this module computes the size
the allocated devices need and writes that item into EFI domains. The facts behind every number here
(OVMF's default, alignment, hotplug padding; why libvirt's ``<sysinfo type='fwcfg'>`` cannot carry it) are in
docs/large-bar.md.

- :func:`plan_window` is pure: BARs in, window out; :func:`kept_plan` keeps its answer for the very same
  (kept, immutable) BARs objects, which a service gets on every call of its pod.
- :func:`guest_firmware` and :func:`explicit_window` read a parsed domain.
- :func:`window_pass` (step 2, the last pass, on the call's one parsed document) decides to write
  ``-fw_cfg name=opt/ovmf/X-PciMmio64Mb,string=<N>`` into ``<qemu:commandline>``; the one writer
  (:mod:`launcher_hook.writer`) applies it with the other passes' edits, keeping every other byte: a splice
  when the document is elements and text only and the place is unambiguous, an edit of the tree otherwise
  (tests assert both give the same bytes where both apply).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lxml import etree

from launcher_hook.document import (
    ParsedDomain,
    append_child,
    indent_of,
    indent_unit,
    newline_whitespace,
    parse_domain,
    root_start,
    tag_close,
)
from launcher_hook.hostdev import HostdevSpec
from launcher_hook.writer import DomainWriter, Splice
from schemas.errors import InputError
from schemas.pci import PciAddress
from schemas.pci_bars import DeviceBars, format_size

MIB = 1 << 20
GIB = 1 << 30
FW_CFG_NAME = "opt/ovmf/X-PciMmio64Mb"
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"

OVMF_DEFAULT_WINDOW = 32 * GIB
"""``PcdPciMmio64Size`` of OVMF's x86 builds: the window OVMF gives without the fw_cfg item when it does not size
one from the CPU's address width (all OVMF before edk2-stable202211, and newer ones on most default QEMU CPUs)."""
OVMF_WINDOW_ALIGNMENT = GIB
"""OVMF rounds the window's size (and base) up to 1 GiB."""
OVMF_MAX_MIB = 0x1000000
"""The largest value OVMF accepts (16 TiB); it ignores a larger one."""
BRIDGE_GRANULARITY = MIB
"""A PCI bridge's prefetchable window is a multiple of 1 MiB, aligned to 1 MiB at least."""
HOTPLUG_PORTS = 32
"""Root ports the window keeps room for: KubeVirt numbers PCI controllers up to 31 (one bus-0 slot each), and OVMF
(edk2-stable202211 on) pads each hotplug-capable port's 64-bit prefetchable window to 1/256 of the whole window
once that is over 32 GiB. A port is given the larger of its padding and its devices' needs, so the ports holding
the passed-through devices cost nothing more."""
HOTPLUG_PADDING_DIVISOR = 256
PHYS_BITS_40_LIMIT = 512 * GIB
"""The largest window that still ends within 40 address bits (QEMU's default guest ``phys-bits``): OVMF puts the
window at a multiple of its own size above RAM, so it ends at twice its size or later."""


class BarSource(Protocol):
    """Where the BARs come from (``runtime.pci_bars.SysfsBars``, a stand-in in tests)."""

    def read_all(self, addresses: Iterable[PciAddress]) -> list[DeviceBars]: ...

    def describe(self) -> str: ...


def port_window(device: DeviceBars) -> tuple[int, int]:
    """(size, alignment) of the 64-bit window a root port needs for ``device``'s 64-bit BARs: BARs packed largest
    first, each naturally aligned (so none leaves a gap), rounded to the bridge granularity. (0, 0): none.

    Each BAR takes the power of two at least its size; packed largest first they leave no gap, so the span is
    their sum, and the window's alignment is the largest (the arithmetic inline: it runs per device per call)."""
    bars = device.bars_64bit
    if not bars:
        return 0, 0
    sizes = [1 << max(bar.size - 1, 0).bit_length() for bar in bars]
    return -(-sum(sizes) // BRIDGE_GRANULARITY) * BRIDGE_GRANULARITY, max(*sizes, BRIDGE_GRANULARITY)


def needed_bytes(devices: Sequence[DeviceBars]) -> int:
    """The span the devices' 64-bit BARs may take in the window, each device behind its own root port (KubeVirt
    and libvirt give every PCIe device one). OVMF's PCI bus driver places the ports' windows most-aligned first,
    each at a multiple of its alignment; among equally aligned ones the order is the bus order. So every port
    but the last takes its window rounded up to its alignment (a 128 GiB BAR and a 32 MiB one take 256 GiB),
    and the last one, among the least aligned, may be the one that wastes least: that order is the worst."""
    ports = [port_window(device) for device in devices if device.bars_64bit]
    if not ports:
        return 0
    least = min(alignment for _, alignment in ports)
    total = 0
    spare = -1
    for size, alignment in ports:
        taken = -(-size // alignment) * alignment
        total += taken
        if alignment == least and (spare < 0 or taken - size < spare):
            spare = taken - size
    return total - spare


def window_for(needed: int, own_ports: int = 0) -> int:
    """The smallest power-of-two window (1 GiB at least) that holds ``needed`` bytes and the hotplug padding
    (1/256 of the window each) of the :data:`HOTPLUG_PORTS` ports but the ``own_ports`` holding the devices."""
    padded = max(HOTPLUG_PORTS - own_ports, 0)
    window = OVMF_WINDOW_ALIGNMENT
    while needed + padded * (window // HOTPLUG_PADDING_DIVISOR) > window:
        window *= 2
    return window


@dataclass(frozen=True)
class MmioPlan:
    """The window the devices need and whether the hook writes it."""

    devices: tuple[DeviceBars, ...]
    needed: int
    window: int

    @property
    def window_mib(self) -> int:
        return min(self.window // MIB, OVMF_MAX_MIB)

    @property
    def writes(self) -> bool:
        """Only a window larger than OVMF's default is written."""
        return self.window > OVMF_DEFAULT_WINDOW

    def bar_summary(self) -> str:
        """``0000:3b:00.0 BAR1 128 GiB, BAR3 32 MiB; …`` (64-bit BARs only), or ``no 64-bit BAR``."""
        parts = [
            f"{device.address} " + ", ".join(f"BAR{bar.index} {format_size(bar.size)}" for bar in device.bars_64bit)
            for device in self.devices
            if device.bars_64bit
        ]
        return "; ".join(parts) or "no 64-bit BAR"

    def warnings(self) -> list[str]:
        found: list[str] = []
        if self.window // MIB > OVMF_MAX_MIB:
            found.append(
                f"the passed-through devices need a {format_size(self.window)} 64-bit PCI window, more than the "
                f"16 TiB OVMF accepts; {FW_CFG_NAME} is set to 16 TiB and some BARs will not be mapped"
            )
        elif self.writes and self.window > PHYS_BITS_40_LIMIT:
            found.append(
                f"the {format_size(self.window)} 64-bit PCI window ends above 1 TiB: the guest CPU needs more than "
                "40 physical address bits (KubeVirt's host-passthrough CPU model), or OVMF cannot map it"
            )
        return found


def plan_window(devices: Iterable[DeviceBars]) -> MmioPlan:
    """The 64-bit window for ``devices`` (docs/large-bar.md, "The window")."""
    listed = tuple(devices)
    needed = needed_bytes(listed)
    return MmioPlan(listed, needed, window_for(needed, sum(1 for device in listed if device.bars_64bit)))


PLANS_KEPT = 16
"""Plans :func:`kept_plan` keeps."""
_plans: dict[tuple[int, ...], MmioPlan] = {}


def kept_plan(devices: Sequence[DeviceBars]) -> MmioPlan:
    """:func:`plan_window` of ``devices``, kept for the very same objects (the BARs a service keeps for its pod
    are the same objects on every call, ``runtime.pci_bars.SysfsBars.keeping``): found by their identities, which
    stay theirs while the plan, which holds them, is kept. A plan is a pure function of immutable objects."""
    key = tuple(map(id, devices))
    plan = _plans.get(key)
    if plan is None:
        plan = plan_window(devices)
        if len(_plans) >= PLANS_KEPT:
            _plans.clear()
        _plans[key] = plan
    return plan


# ---- the domain ------------------------------------------------------------------------------------------

_X86 = frozenset(("x86_64", "i686"))


def guest_firmware(root: etree._Element) -> str | None:
    """Why the domain boots OVMF (``loader /usr/share/OVMF/OVMF_CODE.fd``, ``firmware='efi'``), or None.

    The x86 OVMF reads the item; SeaBIOS and AArch64's firmware do not. EFI is ``<os firmware='efi'>`` (libvirt
    picks the firmware) or a ``<loader>`` of type ``pflash`` or whose file is OVMF's (KubeVirt's SEV-SNP and TDX
    guests load OVMF as a ``rom``)."""
    os_element = root.find("os")
    if os_element is None:
        return None
    os_type = os_element.find("type")
    arch = os_type.get("arch") if os_type is not None else None
    if arch is not None and arch not in _X86:
        return None
    if os_element.get("firmware") == "efi":
        return "firmware='efi'"
    loader = os_element.find("loader")
    if loader is None:
        return None
    path = (loader.text or "").strip()
    name = path.rpartition("/")[2].lower()
    if loader.get("type") == "pflash" or "ovmf" in name or "edk2" in name:
        return f"loader {path or '(no path)'}"
    return None


@dataclass(frozen=True)
class ExplicitWindow:
    """A window the domain already sets: its value in MiB (None: not a number this hook reads) and where."""

    mib: int | None
    where: str
    in_sysinfo: bool = False


_NUMBER = re.compile(r"\s*(0[xX][0-9a-fA-F]+|[0-9]+)\s*")


def _mib(text: str | None) -> int | None:
    """A value as OVMF's fw_cfg parser reads it (decimal, or hex with ``0x``), or None."""
    match = _NUMBER.fullmatch(text or "")
    if match is None or len(match.group(1)) > 20:
        return None
    return int(match.group(1), 0)


def _fw_cfg_options(text: str) -> dict[str, str]:
    """QEMU's ``-fw_cfg`` option string as key → value (``,,`` is a literal comma; a bare first item is the name)."""
    options: dict[str, str] = {}
    for position, item in enumerate(text.replace(",,", "\0").split(",")):
        key, equals, value = item.partition("=")
        if not equals and position == 0:
            key, value = "name", key
        options.setdefault(key, value.replace("\0", ","))
    return options


def explicit_window(root: etree._Element) -> ExplicitWindow | None:
    """The ``opt/ovmf/X-PciMmio64Mb`` the domain already carries: a ``-fw_cfg`` in ``<qemu:commandline>`` or an
    entry of a ``<sysinfo type='fwcfg'>``."""
    for commandline in root.iterchildren(f"{{{QEMU_NS}}}commandline"):
        args = list(commandline.iterchildren(f"{{{QEMU_NS}}}arg"))
        for arg, following in itertools.pairwise(args):
            if arg.get("value") not in ("-fw_cfg", "--fw_cfg"):
                continue
            options = _fw_cfg_options(following.get("value") or "")
            if options.get("name") == FW_CFG_NAME:
                value = _mib(options["string"]) if "string" in options else None
                return ExplicitWindow(value, f"<qemu:commandline> -fw_cfg at line {following.sourceline}")
    for sysinfo in root.iterchildren("sysinfo"):
        if sysinfo.get("type") != "fwcfg":
            continue
        for entry in sysinfo.iterchildren("entry"):
            if entry.get("name") == FW_CFG_NAME:
                value = None if entry.get("file") is not None else _mib(entry.text)
                return ExplicitWindow(value, f"<sysinfo type='fwcfg'> entry at line {entry.sourceline}", True)
    return None


@dataclass
class WindowOutcome:
    """What :func:`add_window` did, for the log line and ``xmlgen simulate``."""

    firmware: str | None
    plan: MmioPlan | None = None
    written_mib: int | None = None
    explicit: ExplicitWindow | None = None
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: ``not EFI: nothing written`` or ``… → opt/ovmf/X-PciMmio64Mb=262144 (EFI guest, …)``."""
        if self.firmware is None:
            return "not an OVMF (x86 EFI) guest: nothing written (SeaBIOS and AArch64 firmware ignore the item)"
        if self.plan is None:
            return f"EFI guest ({self.firmware}) without a PCI device of ours: nothing written"
        head = (
            f"{self.plan.bar_summary()}: 64-bit BARs span {format_size(self.plan.needed) if self.plan.needed else '0'}"
            f", window {format_size(self.plan.window)}"
        )
        if self.explicit is not None:
            value = f"{self.explicit.mib}" if self.explicit.mib is not None else "a value this hook cannot read"
            return f"{head}; the domain sets {FW_CFG_NAME}={value} ({self.explicit.where}): kept"
        if self.written_mib is not None:
            return f"{head} → {FW_CFG_NAME}={self.written_mib} (EFI guest, {self.firmware})"
        return f"{head}: within OVMF's default {format_size(OVMF_DEFAULT_WINDOW)}, nothing written"


def window_pass(writer: DomainWriter, hostdevs: Sequence[HostdevSpec], source: BarSource) -> WindowOutcome:
    """The window the PCI functions among ``hostdevs`` need (every one the hook passes counts: GPUs, SR-IOV VFs,
    companions), given to ``writer`` when the guest boots OVMF, needs more than the default and does not set the
    item itself."""
    root = writer.parsed.root
    outcome = WindowOutcome(guest_firmware(root))
    if outcome.firmware is None:
        return outcome
    addresses = [spec.source for spec in hostdevs if isinstance(spec.source, PciAddress)]
    if not addresses:
        return outcome
    try:
        bars = source.read_all(addresses)
    except InputError as exc:
        raise InputError(
            f"{exc}; the 64-bit PCI window of this EFI guest is sized from its devices' BARs under sysfs root "
            f"{source.describe()!r} (--sysfs-root, LAUNCHER_HOOK_SYSFS_ROOT; --pci-mmio64 off to skip it)"
        ) from None
    plan = outcome.plan = kept_plan(bars)
    outcome.explicit = explicit_window(root)
    if outcome.explicit is not None:
        outcome.warnings += _explicit_warnings(outcome.explicit, plan)
        return outcome
    if not plan.writes:
        return outcome
    outcome.warnings += plan.warnings()
    outcome.written_mib = plan.window_mib
    args = ("-fw_cfg", f"name={FW_CFG_NAME},string={plan.window_mib}")
    parsed = writer.parsed
    splices = _args_splices(root, parsed.source, args, parsed.has_only_elements_and_text) if writer.fast else None
    if splices is not None:
        writer.late(splices, functools.partial(_args_into_tree, writer, args))
    else:
        writer.no_fast()
        _args_into_tree(writer, args)
    return outcome


def _explicit_warnings(explicit: ExplicitWindow, plan: MmioPlan) -> list[str]:
    found: list[str] = []
    if explicit.in_sysinfo:
        found.append(
            f"{FW_CFG_NAME} is set in a <sysinfo type='fwcfg'> ({explicit.where}); libvirt's QEMU driver refuses "
            "names under opt/ovmf/ there ('That firmware name is reserved'); use <qemu:commandline> -fw_cfg instead"
        )
    if explicit.mib is not None and plan.writes and explicit.mib < plan.window_mib:
        found.append(
            f"the domain sets {FW_CFG_NAME}={explicit.mib} ({explicit.where}), smaller than the {plan.window_mib} "
            f"MiB the passed-through BARs need ({plan.bar_summary()}); kept as it is, the guest may not map them"
        )
    return found


# ---- writing <qemu:arg> elements --------------------------------------------------------------------------


def _slots(parent: etree._Element, unit: str) -> tuple[str | None, str | None]:
    """The indentation before a new last child of ``parent`` and before its end tag (None, None: compact)."""
    if len(parent):
        before, closing = newline_whitespace(parent.text), newline_whitespace(parent[-1].tail)
        if not (before and closing):
            return None, None
        return before, closing
    parent_indent = indent_of(parent)
    if parent.text is not None and parent.text.strip():
        return None, None
    return (parent_indent + unit, parent_indent) if parent_indent else (None, None)


def _expanded(source: bytes) -> bool:
    """Empty elements written ``<x></x>`` throughout (Go's encoding/xml, KubeVirt), as ParsedDomain decides."""
    return b"/>" not in source and b"></" in source


def _qemu_prefix(root: etree._Element) -> str | None:
    """The prefix the root binds to libvirt's QEMU namespace (libvirt reads it there), or None."""
    for prefix, uri in root.nsmap.items():
        if uri == QEMU_NS and prefix is not None:
            return str(prefix)
    return None


def _free_prefix(root: etree._Element) -> str:
    taken = set(root.nsmap)
    return next(name for name in ("qemu", *(f"qemu{n}" for n in range(1, 100))) if name not in taken)


def _args_text(prefix: str, args: Sequence[str], before: str, expanded: bool) -> str:
    end = f"></{prefix}:arg>" if expanded else "/>"
    return "".join(f'{before}<{prefix}:arg value="{value}"{end}' for value in args)


def _only_elements_and_text(source: bytes) -> bool:
    return ParsedDomain(etree.ElementTree(etree.Element("x")), source).has_only_elements_and_text


def insert_qemu_args_text(parsed: ParsedDomain, output: bytes, args: Sequence[str]) -> bytes | None:
    """``output`` with ``args`` appended to ``<qemu:commandline>`` (created before ``</domain>`` if absent) by
    the writer's splice, or None where the place is ambiguous in the bytes. ``parsed`` is a document whose layout
    outside ``<devices>`` is ``output``'s."""
    splices = _args_splices(parsed.root, output, args)
    if splices is None:
        return None
    edits = sorted(splices(_expanded(output)))
    pieces: list[bytes] = []
    position = 0
    for start, end, text in edits:
        pieces += (output[position:start], text)
        position = end
    return b"".join([*pieces, output[position:]])


def _args_splices(
    root: etree._Element, source: bytes, args: Sequence[str], only_elements_and_text: bool | None = None
) -> Callable[[bool], list[Splice]] | None:
    """Where and what to insert into ``source`` (the bytes of the document ``root`` is of, outside
    ``<devices>``) for ``args``, given the output's empty-element style; None where the place is ambiguous.
    ``only_elements_and_text``: what the caller knows of ``source`` (None: it is looked at)."""
    plain = _only_elements_and_text(source) if only_elements_and_text is None else only_elements_and_text
    if not plain or any(not _plain_value(value) for value in args):
        return None
    commandlines = list(root.iterchildren(f"{{{QEMU_NS}}}commandline"))
    unit = indent_unit(root)
    if len(commandlines) > 1:
        return None
    if commandlines:
        commandline = commandlines[0]
        own_prefix = commandline.prefix
        if own_prefix is None or root.nsmap.get(own_prefix) != QEMU_NS:
            return None
        end_tag = f"</{own_prefix}:commandline".encode()
        where = source.find(end_tag)
        if where < 0 or source.find(end_tag, where + 1) >= 0 or not len(commandline):
            return None
        before, closing = _slots(commandline, unit)
        cut = where - len(closing or "")
        if source[cut:where] != (closing or "").encode():
            return None
        return lambda expanded: [(cut, cut, _args_text(own_prefix, args, before or "", expanded).encode())]
    prefix = _qemu_prefix(root)
    declare = b""
    if prefix is None:
        prefix = _free_prefix(root)
        declare = f' xmlns:{prefix}="{QEMU_NS}"'.encode()
    end = source.rfind(b"</domain")
    if end < 0 or source[end:].rstrip() not in (b"</domain>",) or not len(root):
        return None
    before, closing = _slots(root, unit)
    cut = end - len(closing or "")
    if source[cut:end] != (closing or "").encode():
        return None
    start_end = _root_start_tag_close(source) if declare else None
    if declare and start_end is None:
        return None
    inner = before + unit if before else ""
    indent = before or ""
    name = prefix

    def splices(expanded: bool) -> list[Splice]:
        body = _args_text(name, args, inner, expanded)
        element = f"{indent}<{name}:commandline>{body}{indent}</{name}:commandline>"
        found: list[Splice] = [(cut, cut, element.encode())]
        if start_end is not None:
            found.append((start_end, start_end, declare))
        return found

    return splices


_PLAIN = re.compile(r"[A-Za-z0-9/_.,=:+-]*")


def _plain_value(value: str) -> bool:
    """Nothing to escape in an attribute value."""
    return _PLAIN.fullmatch(value) is not None


def _root_start_tag_close(data: bytes) -> int | None:
    """Offset of the ``>`` (or ``/>``) closing the root start tag, in a document without comments or PIs but the
    XML declaration."""
    position = data.find(b"<")
    if data.startswith(b"<?", position):
        position = data.find(b"<", data.index(b"?>", position) + 2)
    offset = tag_close(data, position)
    if offset is None:
        return None
    return offset - 1 if data[offset - 1 : offset] == b"/" else offset


def _args_into_tree(writer: DomainWriter, args: Sequence[str]) -> None:
    """``args`` appended to the tree's ``<qemu:commandline>`` (created if absent). A root that does not declare
    libvirt's QEMU namespace cannot take one in the tree (the writer keeps the root start tag's bytes): the
    serialised output then gets it, through :func:`insert_qemu_args_tree` (the one case where the hook parses
    its own output again: a domain with a comment, CDATA or a PI and no ``xmlns:qemu``, which KubeVirt's
    domains always declare)."""
    writer.tree_changed()
    if _qemu_prefix(writer.parsed.root) is None:
        writer.after_serialise(lambda written: insert_qemu_args_tree(written, args, len(written)))
        return
    _append_args(writer.parsed.root, args)


def _append_args(root: etree._Element, args: Sequence[str]) -> None:
    unit = indent_unit(root)
    commandline = next(root.iterchildren(f"{{{QEMU_NS}}}commandline"), None)
    compact = False
    if commandline is None:
        before, closing = _slots(root, unit)
        commandline = etree.Element(f"{{{QEMU_NS}}}commandline")
        append_child(root, commandline, before, closing)
        compact = before is None
    for value in args:
        before, closing = (None, None) if compact else _slots(commandline, unit)
        append_child(commandline, etree.Element(f"{{{QEMU_NS}}}arg", value=value), before, closing)


def insert_qemu_args_tree(output: bytes, args: Sequence[str], max_bytes: int) -> bytes:
    """:func:`insert_qemu_args_text`'s result by editing the tree of ``output`` (any document)."""
    parsed = parse_domain(output, max_bytes)
    root = parsed.root
    if _qemu_prefix(root) is None:
        # serialize() keeps the root start tag verbatim: declare the namespace in its bytes first.
        start_end = _root_start_tag_end_any(output)
        declaration = f' xmlns:{_free_prefix(root)}="{QEMU_NS}"'.encode()
        # (the declaration's bytes on top of the bound: ``output`` is this hook's own, within it already)
        parsed = parse_domain(output[:start_end] + declaration + output[start_end:], max_bytes + len(declaration))
        root = parsed.root
    _append_args(root, args)
    return parsed.serialize()


def _root_start_tag_end_any(data: bytes) -> int:
    """Offset of the ``>`` (or ``/>``) closing the root start tag, skipping a declaration, comments and PIs."""
    position = root_start(data)
    close = _root_start_tag_close(data[position:])
    assert close is not None
    return position + close
