"""Where a prepared claim's devices come from: the ResourceClaim's allocation result.

The kubelet's ``NodePrepareResources`` names a claim (namespace, name, UID) but not its devices: a DRA driver
reads the allocation from the ResourceClaim object (``status.allocation.devices.results``), as Kubernetes'
own kubelet-plugin helper does (k8s.io/dynamic-resource-allocation/kubeletplugin: it GETs the claim and
checks that the UID is the one the kubelet sent, so a claim deleted and re-created under the same name is
never prepared with the old one's devices). :class:`ClaimSource` is that lookup as a protocol, so the prepare
core is tested without an API server: :class:`StaticClaims` answers from a mapping or a directory of
ResourceClaim JSON files; the API-backed source (plugin/dra/kube.py) GETs the object and hands it to
:func:`results_from_claim_object`.

Bounds: a claim has at most :data:`MAX_RESULTS` results (Kubernetes' ``AllocationResultsMaxSize``); names
are bounded strings; a claim file is at most :data:`MAX_CLAIM_FILE_BYTES`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from plugin.dra.checkpoint import UID_PATTERN
from runtime.files import read_regular_file
from schemas.errors import InputError

MAX_RESULTS = 32
"""At most this many allocation results per claim (``resource.k8s.io`` ``AllocationResultsMaxSize``)."""
MAX_NAME = 253
"""Longest namespace, claim name, UID, request, driver, pool or device name accepted (a DNS subdomain's
length; device names and requests are shorter in Kubernetes' own validation)."""
MAX_CLAIM_FILE_BYTES = 1024 * 1024
"""Largest ResourceClaim JSON file :class:`StaticClaims` reads (etcd's object limit is 1.5 MiB; a claim is
a few KiB)."""
API_VERSIONS = frozenset({"resource.k8s.io/v1", "resource.k8s.io/v1beta2", "resource.k8s.io/v1beta1"})
"""ResourceClaim versions whose ``status.allocation.devices.results`` have the shape read here."""

POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
"""Kubernetes' annotation on a ResourceClaim generated from a template: the pod's name for the claim."""

DNS_LABEL_MAX = 63
DNS_SUBDOMAIN_MAX = 253
DRIVER_NAME_MAX = 63
"""``resource.k8s.io`` ``DriverNameMaxLength``: a driver name is a DNS subdomain of at most 63 characters."""
POOL_NAME_MAX = 253
"""``resource.k8s.io`` ``PoolNameMaxLength``: ``/``-separated DNS subdomains, 253 characters in all."""

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""apimachinery's ``IsDNS1123Label`` / ``IsDNS1123Subdomain`` patterns, always used with ``fullmatch`` (``$``
would let a trailing newline through)."""


def is_dns_label(value: str) -> bool:
    """Kubernetes' ``IsDNS1123Label``: lower-case alphanumerics and ``-``, at most 63 characters."""
    return len(value) <= DNS_LABEL_MAX and _DNS_LABEL.fullmatch(value) is not None


def is_dns_subdomain(value: str, limit: int = DNS_SUBDOMAIN_MAX) -> bool:
    """Kubernetes' ``IsDNS1123Subdomain``: dot-separated DNS labels' characters, at most ``limit`` characters."""
    return len(value) <= limit and _DNS_SUBDOMAIN.fullmatch(value) is not None


def is_pool_name(value: str) -> bool:
    """A ResourceSlice pool name as the API server validates it: ``/``-separated DNS subdomains."""
    return len(value) <= POOL_NAME_MAX and all(is_dns_subdomain(part) for part in value.split("/"))


def is_request_name(value: str) -> bool:
    """An allocation result's ``request``: a request name (DNS label), or ``<request>/<subrequest>``."""
    parts = value.split("/")
    return len(parts) <= 2 and all(is_dns_label(part) for part in parts)


class ClaimError(InputError):
    """The claim's allocation cannot be read or is not usable; the message names the claim."""


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it in ``NodePrepareResources``."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result: the claim's ``request`` (``req`` or ``req/subrequest``) got ``device`` of
    ``pool`` from ``driver``."""

    request: str
    driver: str
    pool: str
    device: str
    pod_claim_name: str | None = None
    """For a claim generated from a ResourceClaimTemplate, the pod's name for it (the annotation
    :data:`POD_CLAIM_NAME_ANNOTATION`): it names the claim's metadata directory (docs/dra.md); None for a
    claim the pod names directly. The same on every result of a claim."""
    admin_access: bool = False
    """The result's ``adminAccess``: the scheduler hands out such a device whether or not other claims hold it
    (monitoring, debugging), so it never counts as in use; the prepare core refuses it (docs/dra.md)."""


class ClaimSource(Protocol):
    """The allocation results of a claim, every driver's (the caller keeps its own driver's)."""

    def allocated(self, claim: ClaimRef, until: float | None = None) -> list[AllocatedDevice]:
        """The claim's results; :class:`ClaimError` naming the claim when it cannot be read (by ``until``, a
        ``time.monotonic()`` time, when given: the kubelet's call must be answered in time), is not the claim
        with that UID, or is not allocated."""
        ...


def _text(value: object, what: str, claim: ClaimRef) -> str:
    if not isinstance(value, str) or not value:
        raise ClaimError(f"claim {claim}: {what} is {_shown(value)}, not a non-empty string")
    if len(value) > MAX_NAME:
        raise ClaimError(f"claim {claim}: {what} {value[:80]!r}... is over {MAX_NAME} characters")
    return value


def _named(value: object, what: str, claim: ClaimRef, rule: Callable[[str], bool], rule_name: str) -> str:
    """``value`` when it is a string that ``rule`` accepts; :class:`ClaimError` naming ``what`` and the value."""
    text = _text(value, what, claim)
    if not rule(text):
        raise ClaimError(f"claim {claim}: {what} {text[:80]!r} is not {rule_name} (as Kubernetes validates it)")
    return text


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _mapping(value: object, what: str, claim: ClaimRef) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ClaimError(f"claim {claim}: {what} is {type(value).__name__}, not an object")
    return value


def check_ref(claim: ClaimRef) -> ClaimRef:
    """``claim`` when its namespace is a DNS label, its name a DNS subdomain (apimachinery's rules, the whole
    string) and its UID a bounded run of letters, digits and ``-``; :class:`ClaimError` naming the culprit
    otherwise (the kubelet never sends such a claim; a stand-in or an attacker might). These names reach file
    paths and the CDI spec."""
    if not is_dns_label(claim.namespace):
        raise ClaimError(f"claim namespace {claim.namespace[:80]!r} is not a DNS label (RFC 1123, at most 63)")
    if not is_dns_subdomain(claim.name):
        raise ClaimError(
            f"claim name {claim.name[:80]!r} in namespace {claim.namespace} is not a DNS subdomain (RFC 1123, "
            "at most 253)"
        )
    if UID_PATTERN.fullmatch(claim.uid) is None:
        raise ClaimError(f"claim {claim.namespace}/{claim.name}: uid {claim.uid[:80]!r} is not a plain UID")
    return claim


def results_from_claim_object(obj: Mapping[str, Any], claim: ClaimRef) -> list[AllocatedDevice]:
    """The ``status.allocation.devices.results`` of the ResourceClaim JSON object ``obj`` (``resource.k8s.io``
    v1, v1beta2 or v1beta1: the same shape), every driver's, in order. :class:`ClaimError` naming the claim
    when ``obj`` is not that claim (namespace, name or UID differ: a re-created claim), is not allocated, or
    its results are malformed or more than :data:`MAX_RESULTS`."""
    obj = _mapping(obj, "the object", claim)
    api_version = obj.get("apiVersion")
    if api_version is not None and api_version not in API_VERSIONS:
        raise ClaimError(f"claim {claim}: apiVersion {_shown(api_version)} is not one of {sorted(API_VERSIONS)}")
    kind = obj.get("kind")
    if kind is not None and kind != "ResourceClaim":
        raise ClaimError(f"claim {claim}: the object is a {_shown(kind)}, not a ResourceClaim")
    metadata = _mapping(obj.get("metadata"), "metadata", claim)
    uid = metadata.get("uid")
    if uid != claim.uid:
        raise ClaimError(f"claim {claim}: the ResourceClaim found has uid {_shown(uid)} (re-created?)")
    for field, expected in (("namespace", claim.namespace), ("name", claim.name)):
        found = metadata.get(field)
        if found is not None and found != expected:
            raise ClaimError(f"claim {claim}: the ResourceClaim found has {field} {_shown(found)}")
    annotations = _mapping(metadata.get("annotations") or {}, "metadata.annotations", claim)
    pod_claim_name = annotations.get(POD_CLAIM_NAME_ANNOTATION)
    if pod_claim_name is not None:
        pod_claim_name = _named(
            pod_claim_name, f"annotation {POD_CLAIM_NAME_ANNOTATION}", claim, is_dns_label, "a DNS label"
        )
    status = _mapping(obj.get("status", {}), "status", claim)
    allocation = status.get("allocation")
    if allocation is None:
        raise ClaimError(f"claim {claim} is not allocated (no status.allocation)")
    devices = _mapping(_mapping(allocation, "status.allocation", claim).get("devices", {}), "devices", claim)
    results = devices.get("results", [])
    if not isinstance(results, list):
        raise ClaimError(f"claim {claim}: status.allocation.devices.results is not a list")
    if len(results) > MAX_RESULTS:
        raise ClaimError(f"claim {claim} has {len(results)} allocation results, over the limit of {MAX_RESULTS}")
    found_devices: list[AllocatedDevice] = []
    for index, raw in enumerate(results):
        where = f"status.allocation.devices.results[{index}]"
        result = _mapping(raw, where, claim)
        admin_access = result.get("adminAccess")
        if admin_access is not None and not isinstance(admin_access, bool):
            raise ClaimError(f"claim {claim}: {where}.adminAccess is {_shown(admin_access)}, not a bool")
        found_devices.append(
            AllocatedDevice(
                request=_named(
                    result.get("request"),
                    f"{where}.request",
                    claim,
                    is_request_name,
                    "a request name (a DNS label, or two joined by '/')",
                ),
                driver=_named(
                    result.get("driver"),
                    f"{where}.driver",
                    claim,
                    lambda value: is_dns_subdomain(value, DRIVER_NAME_MAX),
                    f"a DNS subdomain of at most {DRIVER_NAME_MAX}",
                ),
                pool=_named(result.get("pool"), f"{where}.pool", claim, is_pool_name, "a pool name"),
                device=_named(result.get("device"), f"{where}.device", claim, is_dns_label, "a DNS label"),
                pod_claim_name=pod_claim_name,
                admin_access=bool(admin_access),
            )
        )
    return found_devices


def claim_file_name(namespace: str, name: str) -> str:
    """``<namespace>_<name>.json``: unambiguous, since neither a DNS label nor a subdomain has ``_``."""
    return f"{namespace}_{name}.json"


class StaticClaims:
    """A :class:`ClaimSource` without an API server: ResourceClaim objects from a mapping keyed by
    ``(namespace, name)``, or from a directory holding ``<namespace>_<name>.json`` files, read when asked
    (so a test or an operator can add claims while the plugin runs)."""

    def __init__(
        self, objects: Mapping[tuple[str, str], Mapping[str, Any]] | None = None, directory: Path | None = None
    ) -> None:
        self._objects = dict(objects or {})
        self._directory = directory

    @classmethod
    def from_directory(cls, directory: Path) -> StaticClaims:
        """Claims read from ``directory`` at each lookup."""
        return cls(directory=directory)

    @classmethod
    def from_results(cls, claims: Mapping[ClaimRef, list[AllocatedDevice]]) -> StaticClaims:
        """Claims built from results directly (tests, benchmarks): each becomes a v1 ResourceClaim object."""
        return cls({(ref.namespace, ref.name): claim_object(ref, devices) for ref, devices in claims.items()})

    def allocated(self, claim: ClaimRef, until: float | None = None) -> list[AllocatedDevice]:
        check_ref(claim)
        obj = self._objects.get((claim.namespace, claim.name))
        if obj is None and self._directory is not None:
            obj = self._read(claim)
        if obj is None:
            raise ClaimError(f"claim {claim} is not known")
        return results_from_claim_object(obj, claim)

    def _read(self, claim: ClaimRef) -> Mapping[str, Any] | None:
        assert self._directory is not None
        path = self._directory / claim_file_name(claim.namespace, claim.name)
        if not path.exists():
            return None
        try:
            data = read_regular_file(path, MAX_CLAIM_FILE_BYTES, "ResourceClaim file")
            obj = json.loads(data)
        except InputError as exc:
            raise ClaimError(f"claim {claim}: {exc}") from None
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ClaimError(f"claim {claim}: ResourceClaim file {str(path)!r} is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ClaimError(f"claim {claim}: ResourceClaim file {str(path)!r} does not hold an object")
        return obj


def claim_object(claim: ClaimRef, devices: list[AllocatedDevice]) -> dict[str, Any]:
    """A minimal allocated ``resource.k8s.io/v1`` ResourceClaim object for ``claim`` with ``devices`` (the
    first device's ``pod_claim_name``, if any, becomes the template annotation)."""
    requests = sorted({device.request.split("/")[0] for device in devices})
    metadata: dict[str, Any] = {"namespace": claim.namespace, "name": claim.name, "uid": claim.uid}
    if devices and devices[0].pod_claim_name is not None:
        metadata["annotations"] = {POD_CLAIM_NAME_ANNOTATION: devices[0].pod_claim_name}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": metadata,
        "spec": {"devices": {"requests": [{"name": request} for request in requests]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": d.request, "driver": d.driver, "pool": d.pool, "device": d.device}
                        | ({"adminAccess": True} if d.admin_access else {})
                        for d in devices
                    ]
                }
            }
        },
    }
