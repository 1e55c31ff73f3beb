"""The KEP 5304 device metadata file: where a DRA driver puts it, what it holds, how it is read (issue 16).

KubeVirt's virt-launcher finds a device given through DRA (a ``gpus[]``/``hostDevices[]`` entry with
``claimName``/``requestName``) by reading a file the DRA driver mounts into the pod (KEP 5304, "DRA device
attributes in the downward API"). The driver (``plugin/dra``) writes that file; the hook reads it exactly as
virt-launcher does, so both parties use this module and cannot drift apart. The facts below were checked
against KubeVirt's reader (``pkg/dra/utils.go``, ``pkg/dra/metadata/types.go``; docs/dra.md, "Hook side"):

- Path: ``<root>/resourceclaims/<ResourceClaim name>/<request>/<driver>-metadata.json`` for a claim the VMI
  names directly (``resourceClaimName``), ``<root>/resourceclaimtemplates/<pod claim name>/<request>/…`` for
  a claim generated from a template (the pod claim name is the VMI's ``resourceClaims[].name``). The root in
  the container is :data:`DEFAULT_ROOT`. virt-launcher globs ``*-metadata.json`` in the request directory and
  refuses none or more than one file.
- Content: a JSON *stream*, the same data once per API version, newest first; a reader takes the first object
  whose ``apiVersion`` it knows and skips the others. The one version known is :data:`API_VERSION`, kind
  ``DeviceMetadata``: ``metadata`` (the ResourceClaim's name/namespace/uid), ``podClaimName`` (template claims
  only), ``requests[]`` of ``{name, devices[]}``, each device ``{driver, pool, name, attributes}``, attributes
  in the ResourceSlice's ``DeviceAttribute`` form (``{"string": "0000:86:00.0"}``).
- Device: exactly one per request. An mdev is named by the unqualified attribute ``mdevUUID`` (not yet a
  standard one), a PCI function by ``resource.kubernetes.io/pciBusID``; ``mdevUUID`` wins when both are there
  (a vGPU's driver may also give its parent's PCI address).

The parser is strict and bounded (size, object count, list lengths, string lengths, types of every field
read); unknown fields are ignored as a Go decoder ignores them, so a newer driver keeps working.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath, PurePosixPath
from typing import Any, Literal

from schemas.dra import ATTR_MDEV_UUID, ATTR_PCI_BUS_ID
from schemas.errors import InputError
from schemas.mdev import parse_mdev_uuid
from schemas.pci import PciAddress

DEFAULT_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
"""Where virt-launcher reads metadata files in its container (KubeVirt ``dra.DefaultMetadataBasePath``)."""
CLAIMS_DIR = "resourceclaims"
"""Subdirectory for claims the pod names directly (``resourceClaimName``), by ResourceClaim name."""
TEMPLATES_DIR = "resourceclaimtemplates"
"""Subdirectory for claims generated from a template, by the pod's claim name."""
FILE_SUFFIX = "-metadata.json"
"""A metadata file is ``<driver><FILE_SUFFIX>``."""
API_VERSION = "metadata.resource.k8s.io/v1alpha1"
KIND = "DeviceMetadata"
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
"""The annotation Kubernetes puts on a ResourceClaim generated from a template: the pod's name for the claim,
which names the claim's directory under :data:`TEMPLATES_DIR`."""

MAX_FILE_BYTES = 256 * 1024
"""A metadata file for one request of one driver is a few hundred bytes; anything near this is not one."""
MAX_STREAM_OBJECTS = 8
MAX_REQUESTS = 32
MAX_DEVICES = 32
MAX_ATTRIBUTES = 64
MAX_NAME = 253
"""Longest name accepted anywhere in the file (a DNS subdomain; attribute names and values are shorter)."""
MAX_STRING_VALUE = 64
"""Longest string or version attribute value (Kubernetes' limit for a ResourceSlice attribute)."""

AttributeType = Literal["string", "int", "bool", "version"]
_ATTRIBUTE_TYPES: tuple[AttributeType, ...] = ("string", "int", "bool", "version")
SourceKind = Literal["claim", "template"]


@dataclass(frozen=True, slots=True)
class Attribute:
    """One device attribute: exactly one typed value, as in a ResourceSlice."""

    type: AttributeType
    value: str | int | bool

    @staticmethod
    def string(value: str) -> Attribute:
        return Attribute("string", value)

    def to_json(self) -> dict[str, str | int | bool]:
        return {self.type: self.value}


@dataclass(frozen=True, slots=True)
class MetadataDevice:
    driver: str
    pool: str
    name: str
    attributes: Mapping[str, Attribute] = field(default_factory=dict)

    def string_attribute(self, key: str) -> str | None:
        """The non-empty string value of ``key``, None otherwise (virt-launcher reads only string values)."""
        attr = self.attributes.get(key)
        if attr is None or attr.type != "string" or not isinstance(attr.value, str) or not attr.value:
            return None
        return attr.value


@dataclass(frozen=True, slots=True)
class MetadataRequest:
    name: str
    devices: tuple[MetadataDevice, ...] = ()


@dataclass(frozen=True, slots=True)
class DeviceMetadata:
    """One ``DeviceMetadata`` object: a claim's allocated devices, by request."""

    claim_name: str
    namespace: str = ""
    uid: str = ""
    pod_claim_name: str | None = None
    requests: tuple[MetadataRequest, ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimedDevice:
    """What a request resolved to: an mdev UUID (``kind == "mdev"``) or a PCI address (``kind == "pci"``)."""

    kind: Literal["pci", "mdev"]
    id: str
    device: MetadataDevice


def request_dir(root: str | PurePath, source: SourceKind, claim_dir_name: str, request: str) -> PurePosixPath:
    """The directory of one request's metadata files: ``claim_dir_name`` is the ResourceClaim's name for a
    ``"claim"`` source, the pod claim name for a ``"template"`` one. Names are checked to be one path component."""
    return PurePosixPath(root) / request_subpath(source, claim_dir_name, request)


def request_subpath(source: SourceKind, claim_dir_name: str, request: str) -> str:
    """:func:`request_dir` below the root, as text (``resourceclaims/<claim>/<request>``): three components."""
    for what, name in (("claim directory name", claim_dir_name), ("request name", request)):
        _check_component(name, what)
    return f"{CLAIMS_DIR if source == 'claim' else TEMPLATES_DIR}/{claim_dir_name}/{request}"


def metadata_path(
    root: str | PurePath, source: SourceKind, claim_dir_name: str, request: str, driver: str
) -> PurePosixPath:
    """The file a driver writes for one request: ``<request_dir>/<driver>-metadata.json``."""
    _check_component(driver, "driver name")
    return request_dir(root, source, claim_dir_name, request) / f"{driver}{FILE_SUFFIX}"


def claim_directory(claim_name: str, pod_claim_name: str | None) -> tuple[SourceKind, str]:
    """Where a driver puts the files of the ResourceClaim ``claim_name``: a claim generated from a template
    (its :data:`POD_CLAIM_NAME_ANNOTATION` is ``pod_claim_name``) under :data:`TEMPLATES_DIR` by that name, any
    other under :data:`CLAIMS_DIR` by its own name. Pass the result to :func:`metadata_path`."""
    if pod_claim_name:
        return "template", pod_claim_name
    return "claim", claim_name


def _check_component(name: str, what: str) -> None:
    if not name or len(name) > MAX_NAME or "/" in name or "\0" in name or name in {".", ".."}:
        raise InputError(f"{what} {name[:80]!r} cannot be a path component (empty, '.', '..', '/', or too long)")


# ---------------------------------------------------------------------------------------------------- writer


def render_metadata(metadata: DeviceMetadata) -> bytes:
    """The file's bytes: one ``DeviceMetadata`` object of :data:`API_VERSION` (a stream of one), newline-ended,
    in the shape KubeVirt decodes. The result parses back with :func:`parse_metadata`."""
    meta: dict[str, Any] = {"name": metadata.claim_name}
    if metadata.namespace:
        meta["namespace"] = metadata.namespace
    if metadata.uid:
        meta["uid"] = metadata.uid
    # Kubernetes' kubelet-plugin helper writes generation 1 (a file is written once per prepare, never updated);
    # readers that follow the object convention expect the field.
    meta["generation"] = 1
    obj: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta}
    if metadata.pod_claim_name is not None:
        obj["podClaimName"] = metadata.pod_claim_name
    obj["requests"] = [
        {
            "name": request.name,
            "devices": [
                {
                    "driver": dev.driver,
                    "pool": dev.pool,
                    "name": dev.name,
                    "attributes": {key: attr.to_json() for key, attr in sorted(dev.attributes.items())},
                }
                for dev in request.devices
            ],
        }
        for request in metadata.requests
    ]
    data = (json.dumps(obj, indent=2) + "\n").encode("utf-8")
    parse_metadata(data, "the rendered metadata")  # never write what the reader would refuse
    return data


def device_attributes(*, pci_bus_id: str | None = None, mdev_uuid: str | None = None) -> dict[str, Attribute]:
    """The identifying attributes virt-launcher reads: ``pciBusID`` and/or ``mdevUUID`` (canonical forms)."""
    attrs: dict[str, Attribute] = {}
    if pci_bus_id is not None:
        attrs[ATTR_PCI_BUS_ID] = Attribute.string(str(PciAddress.parse(pci_bus_id)))
    if mdev_uuid is not None:
        attrs[ATTR_MDEV_UUID] = Attribute.string(parse_mdev_uuid(mdev_uuid))
    return attrs


# ---------------------------------------------------------------------------------------------------- parser


def parse_metadata(data: bytes, shown: str) -> DeviceMetadata:
    """The first object of :data:`API_VERSION` in the JSON stream ``data`` (the file ``shown``); InputError
    naming ``shown`` when the stream is oversized, not UTF-8, not a stream of objects, has no known version, or
    the known object has a wrong shape."""
    if len(data) > MAX_FILE_BYTES:
        raise InputError(f"DRA metadata file {shown} is {len(data)} bytes, over the {MAX_FILE_BYTES}-byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"DRA metadata file {shown} is not valid UTF-8 (byte {exc.start})") from None
    decoder = _DECODER
    position = _skip_space(text, 0)
    unknown: list[str] = []
    count = 0
    while position < len(text):
        count += 1
        if count > MAX_STREAM_OBJECTS:
            raise InputError(f"DRA metadata file {shown} holds more than {MAX_STREAM_OBJECTS} objects")
        try:
            obj, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            raise InputError(f"DRA metadata file {shown} is not a JSON stream: {exc.msg} at offset {exc.pos}") from None
        except (ValueError, RecursionError) as exc:
            raise InputError(f"DRA metadata file {shown} is not a JSON stream: {exc}") from None
        position = _skip_space(text, end)
        if not isinstance(obj, dict):
            raise InputError(f"DRA metadata file {shown}: object {count} is {_type_name(obj)}, not an object")
        version = obj.get("apiVersion")
        if not isinstance(version, str) or not version:
            raise InputError(f"DRA metadata file {shown}: object {count} has no apiVersion")
        if version != API_VERSION:
            unknown.append(version[:80])
            continue
        return _device_metadata(obj, f"DRA metadata file {shown}")
    if not unknown:
        raise InputError(f"DRA metadata file {shown} holds no metadata object")
    raise InputError(
        f"DRA metadata file {shown} has no object of apiVersion {API_VERSION} (found: {', '.join(unknown)})"
    )


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):  # the first key seen twice, named
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key[:80]!r}")
            seen.add(key)
    return result


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)
"""One decoder for every file, as :func:`json.loads` keeps one: it holds no state from one decode to the next."""


def _type_name(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


# Each check below returns the value when it is right, in a few operations, and only builds the message naming
# the field (``where`` + ``field``) when it is not: a file that is right costs no message text.


def _device_metadata(obj: Mapping[str, Any], where: str) -> DeviceMetadata:
    kind = obj.get("kind")
    if kind is not None and kind != KIND:
        raise InputError(f"{where}: kind is {str(kind)[:80]!r}, expected {KIND!r}")
    meta = _mapping(obj.get("metadata", {}), where, ": metadata")
    pod_claim = obj.get("podClaimName")
    requests = _sequence(obj.get("requests", []), where, ": requests", MAX_REQUESTS)
    parsed = tuple([_request(item, f"{where}: requests[{i}]") for i, item in enumerate(requests)])
    if len(parsed) > 1:
        names = [r.name for r in parsed]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise InputError(f"{where}: request {duplicate!r} appears more than once")
    return DeviceMetadata(
        claim_name=_string(meta.get("name", ""), where, ": metadata.name"),
        namespace=_string(meta.get("namespace", ""), where, ": metadata.namespace"),
        uid=_string(meta.get("uid", ""), where, ": metadata.uid"),
        pod_claim_name=None if pod_claim is None else _string(pod_claim, where, ": podClaimName"),
        requests=parsed,
    )


def _request(obj: object, where: str) -> MetadataRequest:
    item = _mapping(obj, where, "")
    name = _string(item.get("name"), where, ".name", required=True)
    devices = _sequence(item.get("devices", []), where, ".devices", MAX_DEVICES)
    return MetadataRequest(name, tuple([_device(dev, f"{where}.devices[{i}]") for i, dev in enumerate(devices)]))


def _device(obj: object, where: str) -> MetadataDevice:
    item = _mapping(obj, where, "")
    attrs = _mapping(item.get("attributes", {}), where, ".attributes")
    if len(attrs) > MAX_ATTRIBUTES:
        raise InputError(f"{where}.attributes has {len(attrs)} entries, over the limit of {MAX_ATTRIBUTES}")
    parsed: dict[str, Attribute] = {}
    for key, value in attrs.items():
        if not key or len(key) > MAX_NAME:
            raise InputError(f"{where}.attributes: attribute name {key[:80]!r} is empty or too long")
        parsed[key] = _attribute(value, where, key)
    return MetadataDevice(
        driver=_string(item.get("driver", ""), where, ".driver"),
        pool=_string(item.get("pool", ""), where, ".pool"),
        name=_string(item.get("name", ""), where, ".name"),
        attributes=parsed,
    )


def _attribute(obj: object, device: str, key: str) -> Attribute:
    item = _mapping(obj, device, f".attributes[{key!r}]") if not isinstance(obj, dict) else obj
    if len(item) == 1:  # the usual shape: the one typed value alone
        kind = next(iter(item))
        present = [kind] if kind in _ATTRIBUTE_TYPES else []
    else:
        present = [t for t in _ATTRIBUTE_TYPES if t in item]
    if len(present) != 1:
        where = f"{device}.attributes[{key!r}]"
        raise InputError(f"{where} must have exactly one of {', '.join(_ATTRIBUTE_TYPES)}; it has {len(present)}")
    kind = present[0]
    value = item[kind]
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**63:
            raise InputError(f"{device}.attributes[{key!r}].int is {_type_name(value)}, not a 64-bit integer")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise InputError(f"{device}.attributes[{key!r}].bool is {_type_name(value)}, not a boolean")
    elif not isinstance(value, str) or len(value) > MAX_STRING_VALUE:
        raise InputError(
            f"{device}.attributes[{key!r}].{kind} must be a string of at most {MAX_STRING_VALUE} characters"
        )
    return Attribute(kind, value)


def _mapping(value: object, where: str, field: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise InputError(f"{where}{field} is {_type_name(value)}, not an object")
    return value


def _sequence(value: object, where: str, field: str, limit: int) -> Sequence[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InputError(f"{where}{field} is {_type_name(value)}, not a list")
    if len(value) > limit:
        raise InputError(f"{where}{field} has {len(value)} entries, over the limit of {limit}")
    return value


def _string(value: object, where: str, field: str, *, required: bool = False) -> str:
    if isinstance(value, str) and len(value) <= MAX_NAME and (value or not required):
        return value
    if not isinstance(value, str):
        raise InputError(f"{where}{field} is {_type_name(value)}, not a string")
    if not value:
        raise InputError(f"{where}{field} is empty")
    raise InputError(f"{where}{field} is {len(value)} characters, over the limit of {MAX_NAME}")


# ---------------------------------------------------------------------------------------------------- lookup


def claimed_device(metadata: DeviceMetadata, request: str, shown: str) -> ClaimedDevice:
    """The one device of ``request`` and what names it, as virt-launcher decides: ``mdevUUID`` first, then
    ``resource.kubernetes.io/pciBusID``; InputError naming the file ``shown`` when the request is absent, has
    no device or more than one, or its device has neither attribute or a malformed one."""
    match = next((r for r in metadata.requests if r.name == request), None)
    if match is None:
        available = ", ".join(repr(r.name) for r in metadata.requests) or "none"
        raise InputError(
            f"DRA metadata file {shown} has no request {request!r} for claim {metadata.claim_name!r} "
            f"(requests: {available})"
        )
    if len(match.devices) != 1:
        raise InputError(
            f"DRA metadata file {shown}: request {request!r} has {len(match.devices)} devices; "
            "KubeVirt takes exactly one device per request"
        )
    device = match.devices[0]
    uuid = device.string_attribute(ATTR_MDEV_UUID)
    if uuid is not None:
        return ClaimedDevice("mdev", _checked(parse_mdev_uuid, uuid, shown, ATTR_MDEV_UUID), device)
    bus_id = device.string_attribute(ATTR_PCI_BUS_ID)
    if bus_id is not None:
        return ClaimedDevice(
            "pci", _checked(lambda t: str(PciAddress.parse(t)), bus_id, shown, ATTR_PCI_BUS_ID), device
        )
    raise InputError(
        f"DRA metadata file {shown}: device {device.name!r} of request {request!r} has neither "
        f"{ATTR_MDEV_UUID!r} nor {ATTR_PCI_BUS_ID!r} as a string attribute"
    )


def _checked(parse: Any, value: str, shown: str, attribute: str) -> str:
    try:
        result: str = parse(value)
    except InputError as exc:
        raise InputError(f"DRA metadata file {shown}: attribute {attribute!r}: {exc}") from None
    return result
