"""Contracts shared by the device plugin and the launcher hook.

Both sides of the allocation hand-off (the plugin that writes ``PCI_RESOURCE_*`` and the hook that reads
it) must agree byte for byte on addresses, resource names and variable names; this package is the single
place those rules live.
"""

from schemas.errors import InputError
from schemas.kinds import (
    DEVICE_KINDS,
    VM_KINDS,
    DeviceId,
    DeviceKind,
    ResourceKind,
    kind_info,
    kind_of_id,
    kind_of_variable,
)
from schemas.mdev import parse_mdev_uuid
from schemas.naming import (
    MDEV_ENV_PREFIX,
    PCI_ENV_PREFIX,
    env_var_for,
    socket_name_for,
    validate_resource_name,
)
from schemas.pci import PciAddress

__all__ = [
    "DEVICE_KINDS",
    "MDEV_ENV_PREFIX",
    "PCI_ENV_PREFIX",
    "VM_KINDS",
    "DeviceId",
    "DeviceKind",
    "InputError",
    "PciAddress",
    "ResourceKind",
    "env_var_for",
    "kind_info",
    "kind_of_id",
    "kind_of_variable",
    "parse_mdev_uuid",
    "socket_name_for",
    "validate_resource_name",
]
