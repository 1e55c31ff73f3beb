"""Resource names for GPUs and vGPU types, exactly as NVIDIA's KubeVirt GPU device plugin derives them.

A VM asks for ``nvidia.com/TU106_GEFORCE_RTX_2060_REV__A``; that string is what NVIDIA's plugin registers
for a ``10de:1f08`` and what existing VM manifests and KubeVirt CRs already name. Replacing the plugin must
not rename a single resource, so the normalisation below mirrors its Go code rule for rule (docs/protocols.md,
"Resource names"), including the Go semantics of ``\\s`` (ASCII whitespace only) and of per-rune upper-casing.
"""

from __future__ import annotations

import re

DEFAULT_RESOURCE_DOMAIN = "nvidia.com"

# Go's RE2 ``\s`` is ASCII whitespace only: tab, newline, form feed, carriage return, space.
_GO_WHITESPACE_RUN = re.compile(r"[\t\n\f\r ]+")
_OUTSIDE_KEPT = re.compile(r"[^a-zA-Z0-9_.]+")


def _go_upper(text: str) -> str:
    """Upper-case one character at a time, as Go's ``strings.ToUpper`` does (``ß`` stays one rune)."""
    out = []
    for char in text:
        upper = char.upper()
        out.append(upper if len(upper) == 1 else char)
    return "".join(out)


def normalize_device_name(pci_ids_name: str) -> str:
    """The resource name part for a pci.ids device name.

    Trim, upper-case, ``/`` and ``.`` to ``_``, each whitespace run to ``_``, then drop everything outside
    ``[A-Z0-9_.]``.

    >>> normalize_device_name("TU106 [GeForce RTX 2060 Rev. A]")
    'TU106_GEFORCE_RTX_2060_REV__A'
    >>> normalize_device_name("GA100 [A100-SXM-64GB]")
    'GA100_A100SXM64GB'
    """
    name = _go_upper(pci_ids_name.strip())
    name = name.replace("/", "_").replace(".", "_")
    name = _GO_WHITESPACE_RUN.sub("_", name)
    return _OUTSIDE_KEPT.sub("", name)


def normalize_mdev_type_name(type_name: str) -> str:
    """The resource name part for an mdev type's ``name`` file: trailing newlines trimmed, whitespace runs to ``_``.

    >>> normalize_mdev_type_name("GRID T4-1Q\\n")
    'GRID_T4-1Q'
    """
    return _GO_WHITESPACE_RUN.sub("_", type_name.strip("\n"))


def fallback_device_name(device_id: int) -> str:
    """The name NVIDIA's plugin uses when pci.ids lacks the device ID: its lower-case hex, e.g. ``2fff``."""
    return f"{device_id:04x}"


def pci_resource_name(pci_ids_name: str | None, device_id: int, domain: str = DEFAULT_RESOURCE_DOMAIN) -> str:
    """``<domain>/<normalised pci.ids name>``, or the hex fallback when the name is unknown (or normalises away)."""
    part = normalize_device_name(pci_ids_name) if pci_ids_name is not None else ""
    return f"{domain}/{part or fallback_device_name(device_id)}"


def mdev_resource_name(type_name: str, domain: str = DEFAULT_RESOURCE_DOMAIN) -> str:
    """``<domain>/<mdev type name with whitespace runs as _>``: ``GRID T4-1Q`` → ``nvidia.com/GRID_T4-1Q``."""
    return f"{domain}/{normalize_mdev_type_name(type_name)}"
