"""Which VFIO driver a device takes: the best ``alias vfio_pci:…`` match in the node's ``modules.alias``.

Variant drivers (``nvgrace_gpu_vfio_pci`` for Grace Hopper/Blackwell GPUs) declare the devices they drive
with ``vfio_pci:`` aliases; plain ``vfio_pci`` matches any device through its override-only wildcard entry.
The device's ``pci:`` modalias, with the prefix changed to ``vfio_pci:``, is matched against each pattern
(shell-style globs, as modprobe matches them); the most specific match (most literal characters) wins, and
with no match (or no ``modules.alias``) the answer is ``vfio-pci``. Pure functions: the caller reads the file.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from node_agent.kernel import AgentError
from runtime.node import VFIO_DRIVER_NAMES

DEFAULT_MODULE = "vfio_pci"
MAX_MODULES_ALIAS = 32 * 1024 * 1024
"""modules.alias is ~1 MiB on a distribution kernel; a bound far above it."""


@dataclass(frozen=True, slots=True)
class VfioAlias:
    pattern: str
    module: str


def parse_vfio_aliases(text: str) -> list[VfioAlias]:
    """The ``alias vfio_pci:<pattern> <module>`` lines of a modules.alias file, in file order."""
    aliases = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] == "alias" and fields[1].startswith("vfio_pci:"):
            aliases.append(VfioAlias(fields[1], fields[2]))
    return aliases


def driver_of_module(module: str) -> str:
    """The driver name a VFIO module registers (``vfio_pci`` → ``vfio-pci``; variants keep their name)."""
    for driver in VFIO_DRIVER_NAMES:
        if driver.replace("-", "_") == module.replace("-", "_"):
            return driver
    raise AgentError(
        f"modules.alias names {module!r} as the VFIO driver, which is none of the known ones "
        f"({', '.join(VFIO_DRIVER_NAMES)}); refusing to guess its driver name"
    )


def choose_module(modalias: str, aliases: list[VfioAlias]) -> str:
    """The module of the most specific alias matching ``modalias`` (``pci:v…``); ``vfio_pci`` when none does."""
    if not modalias.startswith("pci:"):
        raise AgentError(f"modalias {modalias!r} is not a PCI one")
    wanted = "vfio_pci:" + modalias[len("pci:") :]
    best: tuple[int, str] | None = None
    for alias in aliases:
        if fnmatch.fnmatchcase(wanted, alias.pattern):
            literal = sum(1 for char in alias.pattern if char not in "*?[]")
            if best is None or literal > best[0]:
                best = (literal, alias.module)
    return DEFAULT_MODULE if best is None else best[1]
