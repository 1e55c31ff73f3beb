"""Device names from pci.ids, found where NVIDIA's plugin and the node's tools look: one lookup, one warning.

Resource names come from the pci.ids device line (docs/node.md, "pci.ids"; docs/protocols.md, "Resource
names"), so which file is read decides what the node advertises. The search order is explicit and reported,
a file given on purpose must exist, and an absent database degrades to hex names with a warning instead of
failing discovery.

Only the vendor sections actually asked about are parsed (the file is over a megabyte, NVIDIA's section
a few hundred lines), so a lookup costs one read of the file plus a scan of one section.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from runtime.files import read_regular_file
from schemas.errors import InputError

SEARCH_PATHS: tuple[str, ...] = ("usr/share/hwdata/pci.ids", "usr/share/misc/pci.ids", "usr/pci.ids")
"""Relative to the host root first, then to the image's root: hwdata, Debian's pci.ids, NVIDIA's image."""

_TOP_LEVEL = re.compile(r"\n(?=[^\t\r\n# ])")  # where a vendor's section surely ends (the loop checks the rest)
_DEVICE_LINE = re.compile(r"\t([0-9a-fA-F]{4})[ \t][ \t]*([^\s][^\r]*)")  # tab, ID, one blank or more, name


def _vendor_line_end(text: str, vendor: int) -> int | None:
    """Where ``vendor``'s line (its four hex digits in either case at the start of a line, then a space or
    tab) ends its ID, or None. A leading ``\n`` in the pattern keeps the scan fast (a literal prefix)."""
    digits = "".join(f"[{c}{c.upper()}]" if c.isalpha() else c for c in f"{vendor:04x}")
    match = re.match(rf"{digits}[ \t]", text) or re.search(rf"\n{digits}[ \t]", text)
    return match.end() if match is not None else None


MAX_PCI_IDS_BYTES = 32 * 1024 * 1024
"""Largest pci.ids read (Debian's is about 1.4 MB): a FIFO or a huge file under the host root must not hang
or bloat the plugin."""


@dataclass(frozen=True)
class PciIds:
    """One pci.ids database: its path (for messages) and its text, parsed lazily per vendor."""

    path: str
    text: str
    _sections: dict[int, dict[int, str]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, path: Path) -> PciIds:
        """Read ``path`` (a regular file of at most :data:`MAX_PCI_IDS_BYTES`); otherwise an ``InputError``
        naming it."""
        data = read_regular_file(path, MAX_PCI_IDS_BYTES, "pci.ids file")
        return cls(str(path), data.decode("utf-8", errors="replace"))

    @classmethod
    def from_text(cls, text: str, path: str = "<memory>") -> PciIds:
        return cls(path, text)

    def device_name(self, vendor: int, device: int) -> str | None:
        """The device line's name for ``vendor:device`` (e.g. ``TU106 [GeForce RTX 2060 Rev. A]``), or None."""
        section = self._sections.get(vendor)
        if section is None:
            section = self._parse_vendor(vendor)
            self._sections[vendor] = section
        return section.get(device)

    def _parse_vendor(self, vendor: int) -> dict[int, str]:
        """The device lines of ``vendor``'s section, read as pciutils' ``id_parse_list`` reads them: an ID
        (hex, either case) then one space or tab, then any blanks before the name; CRLF and a trailing blank
        dropped; lines of blanks and comments skipped; nesting by leading tabs; a top-level line ends the
        section. A line pciutils would call a parse error names nothing (the rest of the file still counts)."""
        start = _vendor_line_end(self.text, vendor)
        if start is None:
            return {}
        following = _TOP_LEVEL.search(self.text, start)
        end = following.start() if following is not None else len(self.text)
        devices: dict[int, str] = {}
        for line in self.text[start:end].split("\n"):
            # nesting 1 only: subsystems (two tabs), blanks and comments (no hex after the tab) name nothing
            if line.startswith("\t") and not line.startswith("\t\t"):
                match = _DEVICE_LINE.match(line)
                if match is not None:
                    devices.setdefault(int(match.group(1), 16), match.group(2).rstrip())
        return devices


@dataclass(frozen=True, slots=True)
class PciIdsChoice:
    """Which pci.ids discovery uses (None: none found) and why, for the log and the warnings."""

    database: PciIds | None
    searched: tuple[str, ...]

    @property
    def warnings(self) -> list[str]:
        """What to warn about this choice: nothing when a database was found, else where we looked and what
        it means (hex names). The one wording for every caller (discovery, the plugin's manager, doctor)."""
        if self.database is not None:
            return []
        return [
            f"no pci.ids found (looked at {', '.join(self.searched)}): resources are named by hex device ID "
            "(nvidia.com/1f08); pass --pci-ids or set name_overrides"
        ]


def locate_pci_ids(explicit: Path | None, host_root: Path, image_root: Path = Path("/")) -> PciIdsChoice:
    """``explicit`` if given (it must exist), else the first of :data:`SEARCH_PATHS` under the host root, then
    under the image root; none found → ``database=None`` (the caller warns and names by hex)."""
    if explicit is not None:
        if not explicit.is_file():
            raise InputError(f"pci.ids file {str(explicit)!r} does not exist or is not a file")
        return PciIdsChoice(PciIds.load(explicit), (str(explicit),))
    searched: list[str] = []
    seen: set[str] = set()
    for root in (host_root, image_root):
        for relative in SEARCH_PATHS:
            candidate = os.path.normpath(root / relative)
            if candidate in seen:
                continue
            seen.add(candidate)
            searched.append(candidate)
            if os.path.isfile(candidate):
                return PciIdsChoice(PciIds.load(Path(candidate)), tuple(searched))
    return PciIdsChoice(None, tuple(searched))
