"""A PCI function's place in the host's PCIe tree, as sysfs shows it: the contract between the reader
(:mod:`runtime.pci_topology`) and the hook's GPUDirect clique pass (:mod:`launcher_hook.cliques`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

from schemas.errors import InputError
from schemas.pci import PciAddress

MAX_LINK_BYTES = 4096
"""Longest link target taken (PATH_MAX)."""


_Bridge = TypeVar("_Bridge")


def switch_of(bridges: Sequence[_Bridge]) -> _Bridge | None:
    """The upstream port of the PCIe switch a function is behind, given its upstream ``bridges`` (root port
    first): the first bridge below the root port when another bridge (the switch's downstream port) follows it;
    None on a root port itself or behind a lone bridge, where nothing but the root complex joins it to others.
    The rule the hook's cliques (docs/p2p.md) and the device plugin's preferred allocation share."""
    return bridges[1] if len(bridges) >= 3 else None


class PciPlace(NamedTuple):
    """A function's place in the host's PCIe tree: ``bridges``, its upstream bridges (root port first, from
    sysfs), and ``nvidia_gpu``: an NVIDIA display-class physical function (what a clique may hold)."""

    bridges: tuple[PciAddress, ...]
    nvidia_gpu: bool

    @property
    def switch(self) -> PciAddress | None:
        """The upstream port of the PCIe switch below the root port that the function is behind, or None (on
        the root port itself, or behind a lone bridge: no switch between it and the root complex)."""
        return switch_of(self.bridges)


ABSENT = PciPlace((), False)
"""The place of a function sysfs does not show (no clique)."""


def bridges_from_link(target: str, address: PciAddress) -> tuple[PciAddress, ...] | None:
    """The upstream bridges in the target of ``bus/pci/devices/<address>`` (``../../../devices/pci0000:3a/
    0000:3a:00.0/0000:3b:00.0``: root port first), or None when the target is not that shape."""
    if len(target) > MAX_LINK_BYTES:
        return None
    parts = target.split("/")
    try:
        start = next(index for index, part in enumerate(parts) if part.startswith("pci") and ":" in part)
    except StopIteration:
        return None
    chain: list[PciAddress] = []
    for part in parts[start + 1 :]:
        try:
            chain.append(PciAddress.parse(part))
        except InputError:
            return None
    if not chain or chain[-1] != address:
        return None
    return tuple(chain[:-1])
