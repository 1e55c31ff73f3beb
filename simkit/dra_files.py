"""The KEP 5304 metadata tree a DRA driver would give a virt-launcher pod, built for tests and ``xmlgen simulate``.

Given a VMI and which device each of its DRA entries' ``(claimName, requestName)`` got, write the files
virt-launcher (and the hook) read, at the paths they look in (:mod:`schemas.dra_metadata`): direct claims by
ResourceClaim name, template claims by the pod's claim name with a generated ResourceClaim name in the file, as
Kubernetes names claims it generates (``<pod>-<pod claim>-<5 random characters>``; here a fixed suffix, so the
tree is reproducible). Each file is written whole (a temporary file renamed over it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from schemas.dra import DRIVER_NAME, device_name
from schemas.dra_metadata import (
    DeviceMetadata,
    MetadataDevice,
    MetadataRequest,
    device_attributes,
    metadata_path,
    render_metadata,
)
from schemas.errors import InputError
from schemas.kinds import ResourceKind
from schemas.mdev import looks_like_mdev_uuid
from schemas.vmi import VirtualMachineInstance

GENERATED_SUFFIX = "x7k2q"
"""The fixed 'random' suffix of generated ResourceClaim names in simulated trees."""


def claim_metadata(
    claim_object_name: str,
    request: str,
    device_id: str,
    *,
    namespace: str = "default",
    pod_claim_name: str | None = None,
    driver: str = DRIVER_NAME,
    pool: str = "node01",
) -> DeviceMetadata:
    """One request's metadata naming ``device_id`` (a PCI address: ``pciBusID``; an mdev UUID: ``mdevUUID``), with
    the device name the project's driver gives it."""
    if looks_like_mdev_uuid(device_id):
        attributes = device_attributes(mdev_uuid=device_id)
        name = device_name(ResourceKind.MDEV, device_id)
    else:
        attributes = device_attributes(pci_bus_id=device_id)
        name = device_name(ResourceKind.PCI, device_id)
    device = MetadataDevice(driver, pool, name, attributes)
    return DeviceMetadata(
        claim_object_name, namespace, f"uid-{claim_object_name}", pod_claim_name, (MetadataRequest(request, (device,)),)
    )


def write_file(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def write_vmi_tree(
    root: Path,
    vmi: VirtualMachineInstance,
    devices: Mapping[tuple[str, str], str],
    *,
    driver: str = DRIVER_NAME,
    pod_name: str | None = None,
) -> list[Path]:
    """Write the metadata file of every ``(claimName, requestName)`` in ``devices`` (→ device ID) below
    ``root`` for ``vmi``; the files written. InputError when a claim is not in ``spec.resourceClaims``."""
    pod = pod_name or f"virt-launcher-{vmi.metadata.name or 'vmi'}-abcde"
    namespace = vmi.metadata.namespace or "default"
    written: list[Path] = []
    for (claim_name, request), device_id in devices.items():
        claim = vmi.spec.resource_claim(claim_name)
        if claim is None:
            raise InputError(f"claim {claim_name!r} is not in the VMI's spec.resourceClaims")
        if claim.resource_claim_name:
            path = metadata_path(root, "claim", claim.resource_claim_name, request, driver)
            metadata = claim_metadata(claim.resource_claim_name, request, device_id, namespace=namespace, driver=driver)
        else:
            generated = f"{pod}-{claim_name}-{GENERATED_SUFFIX}"
            path = metadata_path(root, "template", claim_name, request, driver)
            metadata = claim_metadata(
                generated, request, device_id, namespace=namespace, pod_claim_name=claim_name, driver=driver
            )
        write_file(Path(path), render_metadata(metadata))
        written.append(Path(path))
    return written
