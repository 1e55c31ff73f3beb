"""The NVSwitch variable: the NVLink switches of an HGX board that go to the VM with all of the board's GPUs.

On an HGX board (8 SXM GPUs, 4 NVSwitches on H100/H200) the GPUs reach each other over NVLink through the
NVSwitches, which are PCI functions of their own (NVIDIA, class ``0x0680``, "Bridge: other"), each in an IOMMU
group of its own. In NVIDIA's *full passthrough* model the VM gets every GPU and every NVSwitch of the board and
runs Fabric Manager itself; a VM with the GPUs and no switches sees its GPUs only over PCIe (docs/nvswitch.md).

The switches are not a resource of their own: the kubelet allocates each resource on its own, so a pod could
get switches without the GPUs or the other way round. They travel with the GPUs' resource instead, one rule on
both sides (:func:`board_switches`): an allocation that holds every GPU of the resource on the node carries
every switch, and any smaller one carries none. The device plugin then adds the switches' ``/dev/vfio`` nodes
and one more variable, ``PCI_NVSWITCHES_<NAME>`` (``<NAME>`` as in ``PCI_RESOURCE_<NAME>``), that the hook
reads to add their hostdevs::

    PCI_NVSWITCHES_NVIDIA_COM_GH100_H100_SXM5_80GB=0000:05:00.0,0000:06:00.0,0000:07:00.0,0000:08:00.0

Like the companion variable, its prefix starts with neither of KubeVirt's, which looks its variables up by
exact name. Both sides use this module: the plugin formats (:func:`format_switches`), the hook parses
(:func:`parse_switches`, strict and bounded, every refusal naming the variable).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from schemas.errors import InputError
from schemas.kinds import PCI_PASSTHROUGH, env_name_part, swap_prefix
from schemas.pci import PciAddress

NVIDIA_VENDOR = 0x10DE
NVSWITCH_CLASS = 0x0680
"""The class (base and sub-class) NVSwitches have: "Bridge", "other bridge" (``lspci``'s ``[0680]``)."""
SWITCHES_ENV_PREFIX = "PCI_NVSWITCHES"
"""The variable is ``PCI_NVSWITCHES_<NAME>``, ``<NAME>`` as in the GPUs' ``PCI_RESOURCE_<NAME>``."""
MAX_SWITCHES = 16
"""Most switches one variable may list: HGX-2 had 12 (two boards of 6), HGX A100 6, HGX H100 4, HGX B200 2."""
MAX_VALUE_CHARS = MAX_SWITCHES * 14
"""Longest value accepted: every switch with a 5-digit domain and a separator."""


def is_nvswitch(vendor: int, pci_class: int) -> bool:
    """True for an NVSwitch function: NVIDIA's, of class ``0x0680xx`` (any programming interface)."""
    return vendor == NVIDIA_VENDOR and pci_class >> 8 == NVSWITCH_CLASS


def switches_env_var(resource_name: str) -> str:
    """``PCI_NVSWITCHES_<NAME>`` for the GPUs' resource ``resource_name``."""
    return f"{SWITCHES_ENV_PREFIX}_{env_name_part(resource_name)}"


def switches_variable_for(allocation_variable: str) -> str | None:
    """The NVSwitch variable of a ``PCI_RESOURCE_<NAME>`` variable, or None for any other variable."""
    return swap_prefix(allocation_variable, PCI_PASSTHROUGH.env_prefix, SWITCHES_ENV_PREFIX)


def gpu_variable_for(switches_variable: str) -> str | None:
    """The ``PCI_RESOURCE_<NAME>`` variable of an NVSwitch variable, or None for any other variable."""
    return swap_prefix(switches_variable, SWITCHES_ENV_PREFIX, PCI_PASSTHROUGH.env_prefix)


def board_switches(
    chosen: Collection[str], board: Collection[str], switches: Sequence[PciAddress]
) -> tuple[PciAddress, ...]:
    """The switches an allocation of ``chosen`` GPU IDs carries: all of ``switches`` when ``chosen`` is every
    GPU of the ``board`` (the resource's devices on the node), else none (NVIDIA's full passthrough model gives
    one VM the whole board; docs/nvswitch.md)."""
    if not switches or not board or len(chosen) != len(board) or set(chosen) != set(board):
        return ()
    return tuple(sorted(set(switches)))


def format_switches(switches: Iterable[PciAddress]) -> str | None:
    """The variable's value (addresses in order), or None when there are none.

    Raises :class:`ValueError` for what :func:`parse_switches` would refuse (a caller's bug, not input)."""
    ordered = sorted(set(switches))
    if len(ordered) > MAX_SWITCHES:
        raise ValueError(f"{len(ordered)} NVSwitches, over the limit of {MAX_SWITCHES}")
    return ",".join(str(address) for address in ordered) or None


def parse_switches(variable: str, value: str) -> tuple[PciAddress, ...]:
    """Read an NVSwitch variable's value strictly: PCI addresses separated by ``,``, none twice, at most
    :data:`MAX_SWITCHES`; every refusal names ``variable``."""
    if len(value) > MAX_VALUE_CHARS:
        raise InputError(f"{variable}: {len(value)} characters, over the limit of {MAX_VALUE_CHARS}")
    if not value:
        raise InputError(f"{variable} is empty: the device plugin leaves the variable out when there is no switch")
    items = value.split(",")
    if len(items) > MAX_SWITCHES:
        raise InputError(f"{variable}: {len(items)} NVSwitches, over the limit of {MAX_SWITCHES}")
    found: list[PciAddress] = []
    for position, item in enumerate(items, start=1):
        try:
            address = PciAddress.parse(item)
        except InputError as exc:
            raise InputError(f"{variable}: entry {position}: {exc}") from None
        if address in found:
            raise InputError(f"{variable}: {item!r} is listed twice")
        found.append(address)
    return tuple(found)
