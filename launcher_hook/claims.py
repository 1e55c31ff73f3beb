"""What the matcher needs to know of a VMI's DRA entries: which entries they are and what device each got.

The builder core stays free of file access (the import contracts in pyproject.toml): the metadata files are read
by :class:`launcher_hook.dra.MetadataFiles` (or any :class:`ClaimResolver`) and only the outcomes come here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from schemas import DeviceId, ResourceKind
from schemas.vmi import GPU, HostDevice, VirtualMachineInstance

EntryKey = tuple[str, int]
"""A VMI entry: ``("gpus", 0)`` or ``("hostDevices", 2)``."""


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    """What a DRA entry's metadata says: its device (``kind`` PCI or MDEV, ``source``) read from ``file``, or,
    with ``source`` None, why no file was found (``missing``: the path or pattern tried)."""

    kind: ResourceKind | None
    source: DeviceId | None
    file: str
    missing: str | None = None


class ClaimResolver(Protocol):
    """Reads the device of every DRA entry of a VMI (nothing, and an empty answer, for a VMI without one);
    InputError for a file that is there and wrong."""

    def describe(self) -> str: ...

    def resolve(self, vmi: VirtualMachineInstance) -> Mapping[EntryKey, ClaimOutcome]: ...


def dra_entries(vmi: VirtualMachineInstance) -> list[tuple[EntryKey, str, str, str]]:
    """The VMI's complete DRA entries: (entry, entry name, claimName, requestName), gpus first, in order.
    Incomplete ones (one of the two names missing) are the matcher's to refuse."""
    devices = vmi.spec.domain.devices
    found: list[tuple[EntryKey, str, str, str]] = []
    entries: list[tuple[str, int, GPU | HostDevice]] = [("gpus", i, gpu) for i, gpu in enumerate(devices.gpus)]
    entries += [("hostDevices", i, host) for i, host in enumerate(devices.host_devices)]
    for list_name, index, entry in entries:
        if entry.is_dra and entry.claim_name and entry.request_name:
            found.append(((list_name, index), entry.name, entry.claim_name, entry.request_name))
    return found
