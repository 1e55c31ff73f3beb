"""CDI spec files for prepared claims: what the container runtime adds to a container that uses a claim.

The kubelet hands the container runtime the CDI device IDs NodePrepareResources returned; the runtime
(containerd, CRI-O) looks them up in the spec files of its CDI directories (``/var/run/cdi``, ``/etc/cdi``)
and applies their ``containerEdits`` (the Container Device Interface spec,
https://github.com/cncf-tags/container-device-interface/blob/main/SPEC.md). One spec file per prepared
claim, ``<vendor>-<class>_<claim uid>.json``, with one CDI device per claim request (``<uid>-<request>``):

- ``deviceNodes``: the VFIO nodes the device plugin gives for the same devices (:mod:`plugin.allocation`):
  ``/dev/vfio/vfio``, each ``/dev/vfio/<group>`` once, and with iommufd ``/dev/iommu`` and each device's
  ``/dev/vfio/devices/vfioN``; permissions ``rw`` (CDI's cgroup permission letters; ``m`` is not needed);
- ``mounts``: the request's KEP 5304 metadata file (schemas/dra_metadata.py), read-only, at the path
  virt-launcher reads (docs/dra.md).

``cdiVersion`` is :data:`CDI_VERSION`, the lowest version whose rules the spec meets (device names may start
with a digit from 0.5.0 on; a UID does), so older runtimes load it. Pure: the caller writes the bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas.dra import CDI_KIND

CDI_VERSION = "0.5.0"
SPEC_PREFIX = CDI_KIND.replace("/", "-") + "_"
"""Spec file names: ``gpu-passthrough.kubevirt.io-claim_<uid>.json`` (vendor and class, as CDI tools name them)."""
DEVICE_PERMISSIONS = "rw"
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "noexec", "bind")

_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
"""A CDI device name (SPEC.md, "CDI Devices"); used with ``fullmatch`` (``$`` lets a trailing newline in)."""
_UID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,126}[A-Za-z0-9])?")
"""A claim UID as spec files are named after it (``plugin.dra.checkpoint.UID_PATTERN``)."""


@dataclass(frozen=True, slots=True)
class Mount:
    host_path: str
    container_path: str


@dataclass(frozen=True, slots=True)
class CdiDevice:
    """One CDI device: a claim request's device nodes and mounts."""

    name: str
    device_nodes: tuple[str, ...]
    mounts: tuple[Mount, ...] = ()


def device_name(claim_uid: str, request: str) -> str:
    """The CDI device of one claim request: ``<uid>-<request>``; ValueError when it is not a CDI name."""
    name = f"{claim_uid}-{request}"
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name[:100]!r} is not a CDI device name")
    return name


def device_id(name: str) -> str:
    """The fully qualified CDI device ID the kubelet passes on: ``<kind>=<name>``."""
    return f"{CDI_KIND}={name}"


def spec_file_name(claim_uid: str) -> str:
    return f"{SPEC_PREFIX}{claim_uid}.json"


def claim_uid_of_spec(file_name: str) -> str | None:
    """The claim UID a spec file of ours is for; None for any other file (another vendor's, a temporary)."""
    if file_name.startswith(SPEC_PREFIX) and file_name.endswith(".json"):
        uid = file_name[len(SPEC_PREFIX) : -len(".json")]
        return uid if _UID.fullmatch(uid) else None
    return None


def spec_object(devices: Sequence[CdiDevice]) -> dict[str, Any]:
    """The CDI spec object for one claim's devices (non-empty: a spec with no device is invalid)."""
    if not devices:
        raise ValueError("a CDI spec needs at least one device")
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [
            {
                "name": device.name,
                "containerEdits": {
                    "deviceNodes": [{"path": path, "permissions": DEVICE_PERMISSIONS} for path in device.device_nodes],
                    **(
                        {
                            "mounts": [
                                {
                                    "hostPath": mount.host_path,
                                    "containerPath": mount.container_path,
                                    "options": list(MOUNT_OPTIONS),
                                }
                                for mount in device.mounts
                            ]
                        }
                        if device.mounts
                        else {}
                    ),
                },
            }
            for device in devices
        ],
    }


def render_spec(devices: Sequence[CdiDevice]) -> str:
    return json.dumps(spec_object(devices), indent=2) + "\n"
