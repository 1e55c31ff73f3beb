"""A stand-in for the Kubernetes scheduler's DRA allocator, for ``xmlgen simulate --dra`` and tests.

Given a node's ResourceSlices (:mod:`plugin.dra.slices`) and a ResourceClaim's ``spec.devices`` (requests and
``matchAttribute`` constraints), it picks devices as the structured allocator does and returns the claim with
``status.allocation.devices.results`` and the node selector a node-local allocation gets (``resource.k8s.io/v1``).

- Selectors: the request's DeviceClass selectors, then the request's own, each a CEL expression over Kubernetes'
  ``device`` variable (``device.driver``, ``device.attributes[<domain>].<name>``; a driver's unqualified
  attributes are in its own domain). With cel-python (``celpy``, a dev dependency) importable they are evaluated;
  a result that is not a bool, or an error on any device, fails the allocation, as in Kubernetes. Without it,
  a documented simplification: a device matches a class of ours when it is our driver's, of the class's
  ``kind`` and ``healthy``; the request's own selectors are not evaluated (the account says so).
- Requests: ``exactly`` (``ExactCount`` with ``count``, or ``All``) and ``firstAvailable`` (the first
  subrequest that can be satisfied, the result naming ``<request>/<subrequest>``). Constraints:
  ``matchAttribute`` (every device of the named requests has the attribute, with one value).
- Device taints (KEP 5055, ``spec.devices[].taints``): a device with a ``NoSchedule`` or ``NoExecute`` taint
  is not a candidate for a request (``exactly`` or a ``firstAvailable`` subrequest) unless one of that
  request's ``tolerations`` tolerates it; ``None`` and unknown effects are ignored. The rule of the structured
  allocator (k8s.io/dynamic-resource-allocation ``structured``, ``taintPreventsAllocation``) and of
  ``resourceclaim.ToleratesTaint``: a toleration's empty effect matches every effect, its empty key every key
  (operator ``Exists``), ``Exists`` every value, ``Equal`` (the default) the same value. Eviction
  (``NoExecute`` on an allocated device) is not modelled.
- Search: requests in order, candidates in device-name order, backtracking; at most :data:`MAX_STEPS` steps.
  A device is never given twice (``taken``). Deterministic, so tests and the account are reproducible.

Not modelled: admin access, capacity, eviction, several nodes or pools. The DeviceClasses are
built here from :mod:`schemas.dra` (a test checks they equal ``deploy/dra/deviceclasses.yaml``), because
``deploy/`` is not installed with the package.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.dra import DEVICE_CLASSES, DRIVER_NAME, KIND_VALUES
from schemas.dra_metadata import POD_CLAIM_NAME_ANNOTATION
from schemas.errors import InputError

MAX_STEPS = 100_000
"""Most candidate combinations the search tries before it gives up (a real scheduler bounds it too)."""
MAX_REQUESTS = 32
STANDARD_DOMAIN = "resource.kubernetes.io"
API_VERSION = "resource.k8s.io/v1"
_UID_NAMESPACE = uuid.UUID("6f1c8a52-3d0e-4b7a-9c55-2e8f4a1d7b90")

Selector = Callable[[Mapping[str, Any]], bool]
"""A compiled selector: the ``device`` variable → matches or not (raises :class:`AllocationError` on an error)."""


class AllocationError(InputError):
    """The claim cannot be allocated on this node; the message names the claim and the request."""


def device_class_objects() -> dict[str, dict[str, Any]]:
    """The DeviceClasses ``deploy/dra/deviceclasses.yaml`` ships, by name."""
    classes = {}
    for kind, name in DEVICE_CLASSES.items():
        expression = (
            f'device.driver == "{DRIVER_NAME}" && '
            f'device.attributes["{DRIVER_NAME}"].kind == "{KIND_VALUES[kind]}" && '
            f'device.attributes["{DRIVER_NAME}"].healthy'
        )
        classes[name] = {
            "apiVersion": API_VERSION,
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expression}}]},
        }
    return classes


def cel_device(driver: str, attributes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The ``device`` variable Kubernetes gives a selector: attributes grouped by domain (our own and the
    standard domain always present, as an unknown domain is an empty map), values unwrapped."""
    grouped: dict[str, dict[str, Any]] = {driver: {}, STANDARD_DOMAIN: {}}
    for name, value in attributes.items():
        domain, _, short = name.rpartition("/")
        ((_, plain),) = value.items()
        grouped.setdefault(domain or driver, {})[short] = plain
    return {"driver": driver, "attributes": grouped, "capacity": {}}


def cel_compiler() -> Callable[[str], Selector] | None:
    """A CEL compiler (cel-python), or None when it is not installed (it is a dev dependency only)."""
    try:
        import celpy  # noqa: PLC0415 -- optional: the image installs no dev dependencies
        import celpy.adapter  # noqa: PLC0415
        import celpy.evaluation  # noqa: PLC0415
    except ImportError:
        return None

    def compile_selector(expression: str) -> Selector:
        environment = celpy.Environment()
        try:
            program = environment.program(environment.compile(expression))
        except Exception as exc:  # celpy raises its own parse errors
            raise AllocationError(f"CEL selector {expression!r} does not compile: {exc}") from None

        def evaluate(device: Mapping[str, Any]) -> bool:
            try:
                result = program.evaluate({"device": celpy.adapter.json_to_cel(dict(device))})
            except celpy.evaluation.CELEvalError as exc:
                raise AllocationError(f"CEL selector {expression!r} fails on a device: {exc}") from None
            if isinstance(result, celpy.evaluation.CELEvalError):
                raise AllocationError(f"CEL selector {expression!r} fails on a device: {result}")
            if not isinstance(result, celpy.celtypes.BoolType):
                raise AllocationError(f"CEL selector {expression!r} gave {result!r}, not a bool")
            return bool(result)

        return evaluate

    return compile_selector


BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
"""The taint effects that keep a device from an allocation that does not tolerate them."""


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Whether ``toleration`` (a v1 ``DeviceToleration``) tolerates ``taint`` (a v1 ``DeviceTaint``)."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return operator == "Exists"


def taint_prevents(taints: Sequence[Mapping[str, Any]], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a device with ``taints`` is kept from a request with ``tolerations``."""
    return any(
        taint.get("effect") in BLOCKING_EFFECTS and not any(tolerates(t, taint) for t in tolerations)
        for taint in taints
    )


@dataclass(frozen=True)
class SliceDevice:
    driver: str
    pool: str
    name: str
    attributes: Mapping[str, Mapping[str, Any]]
    taints: tuple[Mapping[str, Any], ...] = ()

    @property
    def variable(self) -> dict[str, Any]:
        return cel_device(self.driver, self.attributes)

    def attribute(self, qualified: str) -> object:
        """The plain value of ``domain/name`` (our unqualified attributes are in our domain), or None."""
        domain, _, short = qualified.rpartition("/")
        return self.variable["attributes"].get(domain or self.driver, {}).get(short)


def slice_devices(slices: Sequence[Mapping[str, Any]]) -> list[SliceDevice]:
    """Every device of ``slices`` (v1 ResourceSlice objects), in device-name order."""
    found = [
        SliceDevice(
            obj["spec"]["driver"],
            obj["spec"]["pool"]["name"],
            device["name"],
            device.get("attributes", {}),
            tuple(device.get("taints") or ()),
        )
        for obj in slices
        for device in obj["spec"].get("devices", [])
    ]
    return sorted(found, key=lambda device: (device.driver, device.pool, device.name))


@dataclass(frozen=True)
class _Alternative:
    request: str
    """The result's request name: ``req`` or ``req/sub``."""
    candidates: tuple[SliceDevice, ...]
    count: int | None
    """None: allocation mode All."""


@dataclass(frozen=True)
class Allocation:
    claim: dict[str, Any]
    """The claim with ``status.allocation``."""
    results: list[tuple[str, SliceDevice]]
    """(request, device) in result order."""
    cel: bool
    """Whether the selectors were evaluated as CEL (else by ``kind`` and ``healthy``)."""


class Scheduler:
    """Allocates claims from one node's slices; remembers what it gave (``taken``)."""

    def __init__(
        self,
        node: str,
        slices: Sequence[Mapping[str, Any]],
        *,
        classes: Mapping[str, Mapping[str, Any]] | None = None,
        compiler: Callable[[str], Selector] | None = None,
        use_cel: bool = True,
    ) -> None:
        self.node = node
        self.devices = slice_devices(slices)
        self.classes = dict(classes if classes is not None else device_class_objects())
        self.compiler = (compiler or cel_compiler()) if use_cel else None
        self.taken: set[tuple[str, str, str]] = set()

    @property
    def cel(self) -> bool:
        return self.compiler is not None

    def _class_filter(self, class_name: str, where: str) -> Callable[[SliceDevice], bool]:
        device_class = self.classes.get(class_name)
        if device_class is None:
            raise AllocationError(f"{where}: DeviceClass {class_name!r} does not exist (known: {sorted(self.classes)})")
        if self.compiler is not None:
            compiled = [self.compiler(item["cel"]["expression"]) for item in device_class["spec"].get("selectors", [])]
            return lambda device: all(selector(device.variable) for selector in compiled)
        kind = next((KIND_VALUES[k] for k, name in DEVICE_CLASSES.items() if name == class_name), None)
        if kind is None:
            raise AllocationError(
                f"{where}: DeviceClass {class_name!r} is not one of ours; without CEL it cannot be read"
            )
        return lambda device: (
            device.driver == DRIVER_NAME and device.attribute("kind") == kind and device.attribute("healthy") is True
        )

    def _candidates(self, spec: Mapping[str, Any], where: str) -> tuple[SliceDevice, ...]:
        class_filter = self._class_filter(str(spec.get("deviceClassName", "")), where)
        own: list[Selector] = []
        if self.compiler is not None:
            own = [self.compiler(item["cel"]["expression"]) for item in spec.get("selectors", []) or []]
        tolerations = spec.get("tolerations") or []
        # the class's selectors, then the request's, in order, on every device (an error fails the allocation);
        # then the device's taints against the request's tolerations
        return tuple(
            device
            for device in self.devices
            if class_filter(device)
            and all(selector(device.variable) for selector in own)
            and not taint_prevents(device.taints, tolerations)
        )

    def _count(self, spec: Mapping[str, Any], where: str) -> int | None:
        mode = spec.get("allocationMode", "ExactCount")
        if mode == "All":
            return None
        if mode != "ExactCount":
            raise AllocationError(f"{where}: allocationMode {mode!r} is not ExactCount or All")
        count = spec.get("count", 1)
        if not isinstance(count, int) or not 1 <= count <= 32:
            raise AllocationError(f"{where}: count {count!r} is not 1..32")
        return count

    def _alternatives(self, request: Mapping[str, Any], where: str) -> list[_Alternative]:
        name = request.get("name")
        if "exactly" in request:
            spec = request["exactly"]
            return [_Alternative(str(name), self._candidates(spec, where), self._count(spec, where))]
        subs = request.get("firstAvailable") or []
        if not subs:
            raise AllocationError(f"{where}: neither exactly nor firstAvailable")
        return [
            _Alternative(
                f"{name}/{sub.get('name')}",
                self._candidates(sub, f"{where} subrequest {sub.get('name')!r}"),
                self._count(sub, f"{where} subrequest {sub.get('name')!r}"),
            )
            for sub in subs
        ]

    def allocate(self, claim: Mapping[str, Any]) -> Allocation:
        """``claim`` allocated on this node, or :class:`AllocationError` saying which request cannot be met
        (or that the claim is malformed)."""
        try:
            return self._allocate(claim)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, AllocationError):
                raise
            name = claim.get("metadata", {}).get("name") if isinstance(claim, Mapping) else None
            raise AllocationError(
                f"ResourceClaim {name!r} is malformed (not the resource.k8s.io/v1 shape): {type(exc).__name__}: {exc}"
            ) from None

    def _allocate(self, claim: Mapping[str, Any]) -> Allocation:
        metadata = claim.get("metadata", {})
        label = f"ResourceClaim {metadata.get('namespace', '')}/{metadata.get('name', '')}"
        devices_spec = claim.get("spec", {}).get("devices", {})
        requests = devices_spec.get("requests", [])
        if not isinstance(requests, list) or not 1 <= len(requests) <= MAX_REQUESTS:
            raise AllocationError(f"{label}: spec.devices.requests must list 1..{MAX_REQUESTS} requests")
        names = [str(request.get("name")) for request in requests]
        options = [self._alternatives(r, f"{label} request {n!r}") for r, n in zip(requests, names, strict=True)]
        constraints = [
            (set(c.get("requests") or names), str(c["matchAttribute"]))
            for c in devices_spec.get("constraints", []) or []
            if c.get("matchAttribute")
        ]
        steps = [0]
        chosen = self._search(options, names, constraints, [], steps)
        if chosen is None:
            raise AllocationError(self._why_not(label, names, options, constraints, steps[0]))
        for _, device in chosen:
            self.taken.add((device.driver, device.pool, device.name))
        allocated = dict(claim)
        allocated["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": request, "driver": d.driver, "pool": d.pool, "device": d.name}
                        for request, d in chosen
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [self.node]}]}
                    ]
                },
            }
        }
        return Allocation(allocated, chosen, self.cel)

    def _search(
        self,
        options: list[list[_Alternative]],
        names: list[str],
        constraints: list[tuple[set[str], str]],
        chosen: list[tuple[str, SliceDevice]],
        steps: list[int],
    ) -> list[tuple[str, SliceDevice]] | None:
        if len(chosen) and not self._consistent(chosen, constraints):
            return None
        index = len({request.split("/")[0] for request, _ in chosen})
        if index == len(options):
            return chosen
        used = {(d.driver, d.pool, d.name) for _, d in chosen} | self.taken
        for alternative in options[index]:
            free = [d for d in alternative.candidates if (d.driver, d.pool, d.name) not in used]
            groups: Iterator[tuple[SliceDevice, ...]]
            if alternative.count is None:
                groups = iter([tuple(free)] if free else [])
            else:
                groups = itertools.combinations(free, alternative.count)
            for group in groups:
                steps[0] += 1
                if steps[0] > MAX_STEPS:
                    return None
                found = self._search(
                    options, names, constraints, [*chosen, *((alternative.request, d) for d in group)], steps
                )
                if found is not None:
                    return found
        return None

    @staticmethod
    def _consistent(chosen: list[tuple[str, SliceDevice]], constraints: list[tuple[set[str], str]]) -> bool:
        for requests, attribute in constraints:
            values = [d.attribute(attribute) for request, d in chosen if request.split("/")[0] in requests]
            if any(value is None for value in values) or len(set(map(repr, values))) > 1:
                return False
        return True

    def _why_not(
        self,
        label: str,
        names: list[str],
        options: list[list[_Alternative]],
        constraints: list[tuple[set[str], str]],
        steps: int,
    ) -> str:
        if steps > MAX_STEPS:
            return f"{label}: no allocation found within {MAX_STEPS} tries"
        for name, alternatives in zip(names, options, strict=True):
            if all(
                len([d for d in a.candidates if (d.driver, d.pool, d.name) not in self.taken]) < (a.count or 1)
                for a in alternatives
            ):
                wanted = " or ".join(f"{a.count or 'all (at least 1)'} ({a.request})" for a in alternatives)
                matching = " / ".join(str(len(a.candidates)) for a in alternatives)
                return (
                    f"{label}: request {name!r} wants {wanted}, but node {self.node} has {matching} matching "
                    f"device(s) not already allocated: the pod would stay Pending"
                )
        total = sum(min(a.count or 1 for a in alternatives) for alternatives in options)
        free = {
            (d.driver, d.pool, d.name)
            for alternatives in options
            for a in alternatives
            for d in a.candidates
            if (d.driver, d.pool, d.name) not in self.taken
        }
        which = ", ".join(f"matchAttribute {attribute}" for _, attribute in constraints)
        return (
            f"{label}: requests {', '.join(map(repr, names))} cannot be met together on node {self.node}: "
            f"{total} device(s) wanted, {len(free)} matching not already allocated"
            + (f", under the constraints ({which})" if which else "")
        )


def claim_uid(namespace: str, name: str) -> str:
    """A reproducible UID for a simulated claim."""
    return str(uuid.uuid5(_UID_NAMESPACE, f"{namespace}/{name}"))


def claim_from_template(
    template: Mapping[str, Any], pod: str, pod_claim_name: str, namespace: str, suffix: str
) -> dict[str, Any]:
    """The ResourceClaim Kubernetes' resourceclaim controller makes from ``template`` for a pod's claim:
    named ``<pod>-<pod claim>-<suffix>``, annotated with the pod's claim name, owned by the pod."""
    name = f"{pod}-{pod_claim_name}-{suffix}"
    spec = template.get("spec", {}).get("spec", {})
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": claim_uid(namespace, name),
            "annotations": {POD_CLAIM_NAME_ANNOTATION: pod_claim_name},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod,
                    "uid": claim_uid(namespace, f"pod/{pod}"),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": dict(spec),
    }
