"""The companion variable: which other functions of each allocated GPU go to the VM in the GPU's guest slot.

A consumer or workstation GPU is one multifunction card: VGA at function 0, HDMI audio at 1, often USB and UCSI
at 2 and 3, all in one IOMMU group. KubeVirt's variables (``PCI_RESOURCE_<NAME>``) carry only the GPU, so the
device plugin adds one more variable for a passthrough GPU resource, ``PCI_COMPANIONS_<NAME>`` (the same
``<NAME>`` part), and the hook reads it to put the card's functions together in one guest slot
(docs/protocols.md, "Companion variable"; docs/kubevirt-hostdevs.md, "Companions").

The value lists, for each allocated GPU that has companions, the companions' PCI addresses::

    PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A=0000:86:00.0=0000:86:00.1+0000:86:00.2,0000:af:00.0=0000:af:00.1

A GPU without companions is left out; the variable is left out when no GPU has any. A companion is another
function of the same bus and slot as its GPU (only those can keep their function numbers in one guest slot),
so there are at most seven per GPU. The prefix starts with neither ``PCI_RESOURCE_`` nor
``MDEV_PCI_RESOURCE_``: KubeVirt looks its variables up by exact name and the hook by those prefixes, so
neither mistakes this one for an allocation.

Both sides use this module: the plugin formats (:func:`format_companions`), the hook parses
(:func:`parse_companions`, strict and bounded, every refusal naming the variable). Which functions are a GPU's
companions is one rule, :func:`select_companions`, that the plugin applies at ``Allocate`` and the hook applies
to sysfs when its allocation source carries no companion variable (PodResources, DRA claims): the two cannot
disagree on what they read.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from schemas.errors import InputError
from schemas.kinds import PCI_PASSTHROUGH, env_name_part, swap_prefix
from schemas.pci import MAX_FUNCTION, PciAddress

COMPANIONS_ENV_PREFIX = "PCI_COMPANIONS"
"""The companion variable is ``PCI_COMPANIONS_<NAME>``, ``<NAME>`` as in the GPU's ``PCI_RESOURCE_<NAME>``."""
MAX_GPUS = 64
"""Most GPUs one companion variable may list (a node has a handful; a pod asks for fewer)."""
MAX_COMPANIONS = MAX_FUNCTION
"""Most companions of one GPU: the other functions of its slot (functions 0-7, the GPU holds one)."""
MAX_VALUE_CHARS = MAX_GPUS * (1 + MAX_COMPANIONS) * 14
"""Longest value accepted: every GPU with every companion, 5-digit domains (``DDDDD:BB:SS.F``, 13 characters,
and a separator each)."""

Companions = Mapping[PciAddress, tuple[PciAddress, ...]]
"""Each GPU → its companions, in function order."""


def companions_env_var(resource_name: str) -> str:
    """``PCI_COMPANIONS_<NAME>`` for ``resource_name`` (``<NAME>`` as KubeVirt names the resource's variable)."""
    return f"{COMPANIONS_ENV_PREFIX}_{env_name_part(resource_name)}"


def companions_variable_for(allocation_variable: str) -> str | None:
    """The companion variable of a ``PCI_RESOURCE_<NAME>`` variable, or None for any other variable."""
    return swap_prefix(allocation_variable, PCI_PASSTHROUGH.env_prefix, COMPANIONS_ENV_PREFIX)


def is_companions_variable(name: str) -> bool:
    return name.startswith(COMPANIONS_ENV_PREFIX + "_")


def same_slot(gpu: PciAddress, other: PciAddress) -> bool:
    """True when ``other`` is another function of ``gpu``'s bus and slot (a possible companion)."""
    return gpu[:3] == other[:3] and gpu.function != other.function


def select_companions(
    gpu: PciAddress,
    members: Iterable[tuple[PciAddress, str | None]],
    vfio_drivers: Collection[str],
    gpus: Collection[PciAddress] = (),
) -> tuple[PciAddress, ...]:
    """The companions of ``gpu``, in function order, among ``members``: the other functions of its IOMMU group,
    each with its driver as read now (None: no driver).

    A companion is on one of ``vfio_drivers`` (a function with no driver, or on a host driver the group allows
    such as ``pci-stub``, keeps the group usable but cannot be passed) and on the GPU's bus and slot (a bridge
    or a function of another slot cannot keep its function number in the GPU's guest slot). A function that is
    itself one of ``gpus`` (the GPUs given with this one) is a GPU, not a companion.
    """
    return tuple(
        sorted(
            {
                address
                for address, driver in members
                if driver is not None and driver in vfio_drivers and same_slot(gpu, address) and address not in gpus
            }
        )
    )


def format_companions(companions: Iterable[tuple[PciAddress, Iterable[PciAddress]]]) -> str | None:
    """The variable's value for ``(gpu, companions)`` pairs in allocation order, or None when no GPU has one.

    Raises :class:`ValueError` for what :func:`parse_companions` would refuse (a caller's bug, not input).
    """
    entries: list[str] = []
    seen: set[PciAddress] = set()
    for gpu, functions in companions:
        ordered = sorted(set(functions))
        if not ordered:
            continue
        if gpu in seen:
            raise ValueError(f"GPU {gpu} is listed twice")
        seen.add(gpu)
        for function in ordered:
            if not same_slot(gpu, function):
                raise ValueError(f"{function} is not another function of {gpu}'s slot")
        entries.append(f"{gpu}={'+'.join(str(function) for function in ordered)}")
    if len(entries) > MAX_GPUS:
        raise ValueError(f"{len(entries)} GPUs with companions, over the limit of {MAX_GPUS}")
    return ",".join(entries) or None


def parse_companions(variable: str, value: str) -> dict[PciAddress, tuple[PciAddress, ...]]:
    """Read a companion variable's value strictly; every refusal names ``variable``.

    An empty value means no companions. Each entry is ``GPU=C1+C2…``; a GPU once, at most :data:`MAX_GPUS`;
    each companion another function of its GPU's bus and slot, at most :data:`MAX_COMPANIONS`, none twice.
    """
    if len(value) > MAX_VALUE_CHARS:
        raise InputError(f"{variable} is {len(value)} characters long, over the limit of {MAX_VALUE_CHARS}")
    if not value:
        return {}
    entries = value.split(",")
    if len(entries) > MAX_GPUS:
        raise InputError(f"{variable} lists {len(entries)} GPUs, over the limit of {MAX_GPUS}")
    found: dict[PciAddress, tuple[PciAddress, ...]] = {}
    for position, entry in enumerate(entries, start=1):
        gpu_text, equals, rest = entry.partition("=")
        if not equals or not rest:
            raise InputError(f"{variable}: entry {position} {entry[:80]!r} is not GPU=COMPANION[+COMPANION…]")
        try:
            gpu = PciAddress.parse(gpu_text)
        except InputError as exc:
            raise InputError(f"{variable}: entry {position}: {exc}") from None
        if gpu in found:
            raise InputError(f"{variable}: GPU {gpu} is listed twice")
        items = rest.split("+")
        if len(items) > MAX_COMPANIONS:
            raise InputError(f"{variable}: GPU {gpu} has {len(items)} companions, over the limit of {MAX_COMPANIONS}")
        functions: set[PciAddress] = set()
        for item in items:
            try:
                function = PciAddress.parse(item)
            except InputError as exc:
                raise InputError(f"{variable}: GPU {gpu}: {exc}") from None
            if not same_slot(gpu, function):
                raise InputError(
                    f"{variable}: {function} is not another function of GPU {gpu}'s bus and slot "
                    f"({gpu.slot_address}): only those can share the GPU's guest slot"
                )
            if function in functions:
                raise InputError(f"{variable}: GPU {gpu} lists {function} twice")
            functions.add(function)
        found[gpu] = tuple(sorted(functions))
    return found
