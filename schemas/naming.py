"""How a resource name becomes an env var and a socket file name (the kinds themselves: :mod:`schemas.kinds`).

KubeVirt's virt-launcher derives the variable it reads from the resource name; the device plugin must
write exactly that variable. Both sides call ``env_var_for`` so they cannot drift apart.
"""

from __future__ import annotations

import re

from schemas.errors import InputError
from schemas.kinds import MDEV_VGPU, PCI_PASSTHROUGH, ResourceKind, kind_info

__all__ = [
    "MDEV_ENV_PREFIX",
    "PCI_ENV_PREFIX",
    "ResourceKind",
    "env_var_for",
    "socket_name_for",
    "validate_resource_name",
]

PCI_ENV_PREFIX = PCI_PASSTHROUGH.env_prefix
MDEV_ENV_PREFIX = MDEV_VGPU.env_prefix

# An extended resource name: a DNS subdomain prefix, '/', and a qualified name part (Kubernetes'
# IsQualifiedName rules for the part after the slash).
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def validate_resource_name(name: str) -> str:
    """Return ``name`` if it is an extended resource name (``domain/name``, not ``kubernetes.io``)."""
    domain, slash, part = name.partition("/")
    if not slash:
        raise InputError(f"resource name {name!r} has no domain: expected domain/name, e.g. nvidia.com/GRID_T4-1Q")
    if len(domain) > 253 or _DNS_SUBDOMAIN.fullmatch(domain) is None:
        raise InputError(f"resource name {name!r}: {domain!r} is not a DNS subdomain")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise InputError(f"resource name {name!r}: the kubernetes.io domain is reserved for native resources")
    if len(part) > 63 or _NAME_PART.fullmatch(part) is None:
        raise InputError(
            f"resource name {name!r}: {part!r} must be 1-63 characters of [A-Za-z0-9_.-], "
            "starting and ending with a letter or digit"
        )
    return name


def env_var_for(resource_name: str, kind: ResourceKind) -> str:
    """The variable virt-launcher reads for ``resource_name``: ``/`` and ``.`` become ``_``, upper-cased.

    >>> env_var_for("nvidia.com/GRID_T4-1Q", ResourceKind.MDEV)
    'MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q'
    """
    return kind_info(kind).env_var(resource_name)


def socket_name_for(resource_name: str) -> str:
    """The device plugin's socket file name: ``kubevirt-<name after the slash>.sock``."""
    return f"kubevirt-{resource_name.rpartition('/')[2]}.sock"
