"""The subset of a KubeVirt VirtualMachineInstance that decides which host devices a VM gets.

virt-launcher hands hooks the VMI as JSON; only ``spec.domain.devices.gpus[]`` and ``hostDevices[]``,
``spec.resourceClaims[]`` (the DRA claims those entries may name instead of a ``deviceName``), the metadata for
logs and the project's own annotations (:data:`COMPANIONS_ANNOTATION`) matter here. Unknown
fields are ignored so newer KubeVirt versions keep working; the fields read are type-checked strictly so that
a wrong shape is an error, not a silent default.

Read by hand into frozen dataclasses rather than with pydantic: this runs on every ``OnDefineDomain`` call
of the hook sidecar, and pydantic alone would add about 12 MB to the sidecar's memory. The errors keep
pydantic's wording (``spec.domain.devices.gpus.0.name: Field required``), all problems in one message.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from schemas.errors import InputError
from schemas.limits import DEFAULT_MAX_INPUT_BYTES, check_utf8

T = TypeVar("T")

COMPANIONS_ANNOTATION = "gpu-passthrough.kubevirt.io/companions"
"""``"off"`` keeps each passthrough GPU alone, as KubeVirt places it; ``"on"`` (the default) puts its companion
functions in its guest slot (docs/kubevirt-hostdevs.md, "Companions")."""
CLIQUES_ANNOTATION = "gpu-passthrough.kubevirt.io/gpudirect-cliques"
"""``"off"``: no GPU gets a GPUDirect P2P clique; ``"on"`` (the default): GPUs that share a host PCIe switch get
one (docs/p2p.md)."""
_SWITCH_VALUES = {"on": True, "off": False}


@dataclass(frozen=True, slots=True)
class RamFB:
    enabled: bool | None = None


@dataclass(frozen=True, slots=True)
class DisplayOptions:
    enabled: bool | None = None
    ram_fb: RamFB | None = None


@dataclass(frozen=True, slots=True)
class VGPUOptions:
    display: DisplayOptions | None = None


class GPU(NamedTuple):
    """One ``spec.domain.devices.gpus[]`` entry: a device-plugin resource (``deviceName``) or a DRA claim's
    request (``claimName``/``requestName``, KubeVirt's inlined ``ClaimRequest``).

    A NamedTuple rather than a frozen dataclass: one is built per entry on the OnDefineDomain path, and the
    matcher's memo key hashes and compares them (in C for a tuple).
    """

    name: str
    device_name: str | None = None
    virtual_gpu_options: VGPUOptions | None = None
    claim_name: str | None = None
    request_name: str | None = None

    @property
    def is_dra(self) -> bool:
        """KubeVirt's ``IsGPUDRA``: no ``deviceName`` and a claim request (either field) given."""
        return not self.device_name and (self.claim_name is not None or self.request_name is not None)


class HostDevice(NamedTuple):
    """One ``spec.domain.devices.hostDevices[]`` entry (``deviceName`` or ``claimName``/``requestName``); a
    NamedTuple, as :class:`GPU`."""

    name: str
    device_name: str | None = None
    claim_name: str | None = None
    request_name: str | None = None

    @property
    def is_dra(self) -> bool:
        """KubeVirt's ``IsHostDeviceDRA``: no ``deviceName`` and a claim request given."""
        return not self.device_name and (self.claim_name is not None or self.request_name is not None)


@dataclass(frozen=True, slots=True)
class ResourceClaim:
    """One ``spec.resourceClaims[]`` entry: the VMI's (and the pod's) name for a claim, and where the claim
    comes from; KubeVirt's admission wants exactly one of the two sources."""

    name: str
    resource_claim_name: str | None = None
    resource_claim_template_name: str | None = None


@dataclass(frozen=True, slots=True)
class Devices:
    gpus: list[GPU] = field(default_factory=list)
    host_devices: list[HostDevice] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DomainSpec:
    devices: Devices = field(default_factory=Devices)


@dataclass(frozen=True, slots=True)
class VMISpec:
    domain: DomainSpec = field(default_factory=DomainSpec)
    resource_claims: tuple[ResourceClaim, ...] = ()

    def resource_claim(self, name: str) -> ResourceClaim | None:
        """The ``resourceClaims[]`` entry called ``name`` (the first, as virt-launcher's lookup), or None."""
        return next((claim for claim in self.resource_claims if claim.name == name), None)


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    name: str = ""
    namespace: str = ""
    companions: bool = True
    """:data:`COMPANIONS_ANNOTATION`: whether GPUs get their companions in their guest slot."""
    cliques: bool = True
    """:data:`CLIQUES_ANNOTATION`: whether GPUs that share a host PCIe switch get a GPUDirect P2P clique."""


@dataclass(frozen=True, slots=True)
class VirtualMachineInstance:
    spec: VMISpec
    metadata: ObjectMeta = field(default_factory=ObjectMeta)

    @property
    def display_name(self) -> str:
        """``namespace/name`` for logs and messages."""
        return f"{self.metadata.namespace or '-'}/{self.metadata.name or '-'}"


class _Reader:
    """Reads the JSON document into the dataclasses, collecting every problem with its location."""

    _MISSING = object()

    def __init__(self) -> None:
        self.problems: list[str] = []

    def _problem(self, where: str, message: str) -> None:
        self.problems.append(f"{where or '(top)'}: {message}")

    def _get(self, document: dict[str, Any], key: str, where: str) -> tuple[Any, str]:
        return document.get(key, self._MISSING), f"{where}.{key}" if where else key

    def text(self, document: dict[str, Any], key: str, where: str, default: str | None) -> str | None:
        value, at = self._get(document, key, where)
        if value is self._MISSING:
            if default is None and key == "name":
                self._problem(at, "Field required")
            return default
        if value is None and default is None and key != "name":
            return None
        if not isinstance(value, str):
            self._problem(at, "Input should be a valid string")
            return default
        return value

    def flag(self, document: dict[str, Any], key: str, where: str) -> bool | None:
        value, at = self._get(document, key, where)
        if value is self._MISSING or value is None:
            return None
        if not isinstance(value, bool):
            self._problem(at, "Input should be a valid boolean")
            return None
        return value

    def child(
        self, document: dict[str, Any], key: str, where: str, read: Callable[[dict[str, Any], str], T], optional: bool
    ) -> T | None:
        value, at = self._get(document, key, where)
        if value is self._MISSING or (value is None and optional):
            return None
        if not isinstance(value, dict):
            self._problem(at, "Input should be a valid dictionary")
            return None
        return read(value, at)

    def items(
        self, document: dict[str, Any], key: str, where: str, read: Callable[[dict[str, Any], str], T]
    ) -> list[T]:
        value, at = self._get(document, key, where)
        if value is self._MISSING:
            return []
        if not isinstance(value, list):
            self._problem(at, "Input should be a valid list")
            return []
        result: list[T] = []
        for index, item in enumerate(value):
            if not isinstance(item, dict):
                self._problem(f"{at}.{index}", "Input should be a valid dictionary")
                continue
            result.append(read(item, f"{at}.{index}"))
        return result

    def ram_fb(self, document: dict[str, Any], where: str) -> RamFB:
        return RamFB(self.flag(document, "enabled", where))

    def display(self, document: dict[str, Any], where: str) -> DisplayOptions:
        return DisplayOptions(
            self.flag(document, "enabled", where), self.child(document, "ramFB", where, self.ram_fb, True)
        )

    def vgpu_options(self, document: dict[str, Any], where: str) -> VGPUOptions:
        return VGPUOptions(self.child(document, "display", where, self.display, True))

    def gpu(self, document: dict[str, Any], where: str) -> GPU:
        return GPU(
            self.text(document, "name", where, None) or "",
            self.text(document, "deviceName", where, None),
            self.child(document, "virtualGPUOptions", where, self.vgpu_options, True),
            self.text(document, "claimName", where, None),
            self.text(document, "requestName", where, None),
        )

    def host_device(self, document: dict[str, Any], where: str) -> HostDevice:
        return HostDevice(
            self.text(document, "name", where, None) or "",
            self.text(document, "deviceName", where, None),
            self.text(document, "claimName", where, None),
            self.text(document, "requestName", where, None),
        )

    def resource_claim(self, document: dict[str, Any], where: str) -> ResourceClaim:
        return ResourceClaim(
            self.text(document, "name", where, None) or "",
            self.text(document, "resourceClaimName", where, None),
            self.text(document, "resourceClaimTemplateName", where, None),
        )

    def devices(self, document: dict[str, Any], where: str) -> Devices:
        return Devices(
            self.items(document, "gpus", where, self.gpu), self.items(document, "hostDevices", where, self.host_device)
        )

    def domain(self, document: dict[str, Any], where: str) -> DomainSpec:
        return DomainSpec(self.child(document, "devices", where, self.devices, False) or Devices())

    def spec(self, document: dict[str, Any], where: str) -> VMISpec:
        return VMISpec(
            self.child(document, "domain", where, self.domain, False) or DomainSpec(),
            tuple(self.items(document, "resourceClaims", where, self.resource_claim)),
        )

    def metadata(self, document: dict[str, Any], where: str) -> ObjectMeta:
        companions, cliques = self.child(document, "annotations", where, self.switches, True) or (True, True)
        return ObjectMeta(
            self.text(document, "name", where, "") or "",
            self.text(document, "namespace", where, "") or "",
            companions,
            cliques,
        )

    def switches(self, annotations: dict[str, Any], where: str) -> tuple[bool, bool]:
        """The project's on/off annotations: (:data:`COMPANIONS_ANNOTATION`, :data:`CLIQUES_ANNOTATION`)."""
        found = []
        for name in (COMPANIONS_ANNOTATION, CLIQUES_ANNOTATION):
            value = annotations.get(name, "on")
            switch = _SWITCH_VALUES.get(value) if isinstance(value, str) else None
            if switch is None:
                self._problem(f"{where}.{name}", f"{value!r} should be 'on' or 'off'")
                switch = True
            found.append(switch)
        return found[0], found[1]

    def vmi(self, document: dict[str, Any]) -> VirtualMachineInstance:
        if "spec" not in document:
            self._problem("spec", "Field required")
        spec = self.child(document, "spec", "", self.spec, False) or VMISpec()
        return VirtualMachineInstance(spec, self.child(document, "metadata", "", self.metadata, False) or ObjectMeta())


_NO_DEVICES = Devices()


def _fast_vgpu_options(value: Any) -> VGPUOptions | bool | None:
    """``virtualGPUOptions`` read as :class:`_Reader` reads it, or False when it needs the reader's look."""
    if value is None:
        return None
    if type(value) is not dict:
        return False
    display = value.get("display")
    if display is None:
        return VGPUOptions(None)
    if type(display) is not dict:
        return False
    enabled, ram_fb = display.get("enabled"), display.get("ramFB")
    if enabled is not None and type(enabled) is not bool:
        return False
    if ram_fb is not None:
        if type(ram_fb) is not dict:
            return False
        ram_fb_enabled = ram_fb.get("enabled")
        if ram_fb_enabled is not None and type(ram_fb_enabled) is not bool:
            return False
        return VGPUOptions(DisplayOptions(enabled, RamFB(ram_fb_enabled)))
    return VGPUOptions(DisplayOptions(enabled, None))


def _fast_entries(entries: list[Any], gpus: list[GPU] | None, host_devices: list[HostDevice]) -> bool:
    """``gpus[]`` (into ``gpus``) or, when ``gpus`` is None, ``hostDevices[]`` entries (into ``host_devices``) read
    as :func:`_fast_vmi` reads them; False when one needs the reader's look."""
    new = tuple.__new__
    for entry in entries:
        if type(entry) is not dict:
            return False
        name, device_name = entry.get("name"), entry.get("deviceName")
        if len(entry) == 2 and type(name) is str and type(device_name) is str:
            # the usual entry, exactly {name, deviceName}: no other field to read (GPU(...) without its keyword
            # handling, one per entry)
            if gpus is not None:
                gpus.append(new(GPU, (name, device_name, None, None, None)))
            else:
                host_devices.append(new(HostDevice, (name, device_name, None, None)))
            continue
        if type(name) is not str or (device_name is not None and type(device_name) is not str):
            return False
        claim, request = entry.get("claimName"), entry.get("requestName")
        if (claim is not None and type(claim) is not str) or (request is not None and type(request) is not str):
            return False
        if gpus is not None:
            options = _fast_vgpu_options(entry.get("virtualGPUOptions"))
            if options is False:
                return False
            gpus.append(GPU(name, device_name, options, claim, request))  # type: ignore[arg-type]
        else:
            host_devices.append(HostDevice(name, device_name, claim, request))
    return True


def _fast_vmi(document: dict[str, Any]) -> VirtualMachineInstance | None:
    """The VMI when every field read has the expected type (nearly always), in one pass with no location
    strings; None when anything is off, and :class:`_Reader` then reads it again to name every problem.
    Gives exactly what :class:`_Reader` gives for the documents it accepts."""
    spec = document.get("spec", _Reader._MISSING)
    if type(spec) is not dict:
        return None
    domain = spec.get("domain", _Reader._MISSING)
    devices: Any = _NO_DEVICES
    if domain is not _Reader._MISSING:
        if type(domain) is not dict:
            return None
        devices = domain.get("devices", _Reader._MISSING)
        if devices is _Reader._MISSING:
            devices = _NO_DEVICES
        elif type(devices) is not dict:
            return None
    gpus: list[GPU] = []
    host_devices: list[HostDevice] = []
    if devices is not _NO_DEVICES:
        for key in ("gpus", "hostDevices"):
            entries = devices.get(key, _Reader._MISSING)
            if entries is _Reader._MISSING:
                continue
            if type(entries) is not list:
                return None
            if not _fast_entries(entries, gpus if key == "gpus" else None, host_devices):
                return None
    claims: list[ResourceClaim] = []
    entries = spec.get("resourceClaims", _Reader._MISSING)
    if entries is not _Reader._MISSING:
        if type(entries) is not list:
            return None
        for entry in entries:
            if type(entry) is not dict:
                return None
            name, claim, template = (
                entry.get("name"),
                entry.get("resourceClaimName"),
                entry.get("resourceClaimTemplateName"),
            )
            if type(name) is not str or any(v is not None and type(v) is not str for v in (claim, template)):
                return None
            claims.append(ResourceClaim(name, claim, template))
    metadata = document.get("metadata", _Reader._MISSING)
    meta = ObjectMeta()
    if metadata is not _Reader._MISSING:
        if type(metadata) is not dict:
            return None
        name, namespace = metadata.get("name", ""), metadata.get("namespace", "")
        if type(name) is not str or type(namespace) is not str:
            return None
        annotations = metadata.get("annotations")
        if annotations is not None and type(annotations) is not dict:
            return None
        value = annotations.get(COMPANIONS_ANNOTATION, "on") if annotations else "on"
        companions = _SWITCH_VALUES.get(value) if type(value) is str else None
        value = annotations.get(CLIQUES_ANNOTATION, "on") if annotations else "on"
        cliques = _SWITCH_VALUES.get(value) if type(value) is str else None
        if companions is None or cliques is None:
            return None
        meta = ObjectMeta(name, namespace, companions, cliques)
    return VirtualMachineInstance(VMISpec(DomainSpec(Devices(gpus, host_devices)), tuple(claims)), meta)


def _read_vmi(document: dict[str, Any]) -> VirtualMachineInstance:
    fast = _fast_vmi(document)
    if fast is not None:
        return fast
    reader = _Reader()
    vmi = reader.vmi(document)
    if reader.problems:
        raise InputError(f"VMI JSON does not have the expected shape: {'; '.join(reader.problems)}")
    return vmi


MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects a VMI document may have (a real one is about 10 deep). Checked before
parsing, not left to Python's recursion limit: that is process-wide and other code may raise it (cel-python's
``Environment`` sets 2500), which would let a deeper document through to the parser and the reader."""

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_OPENERS = str.maketrans("[{]}", "(())")


def _check_depth(text: str) -> None:
    """Refuse ``text`` if its arrays and objects nest deeper than :data:`MAX_JSON_DEPTH` (strings skipped).

    Nesting can only be as deep as there are openers, so a document with few of them (every real VMI) costs
    two ``str.count`` calls. Otherwise the brackets outside strings are kept and innermost pairs removed
    ``MAX_JSON_DEPTH`` times; anything left is deeper (unbalanced text is the parser's to refuse)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)).translate(_OPENERS)
    for _ in range(MAX_JSON_DEPTH):
        shorter = brackets.replace("()", "")
        if shorter == brackets:
            return
        brackets = shorter
    if "()" in brackets:
        raise InputError(f"VMI JSON is nested too deeply (more than {MAX_JSON_DEPTH} levels)")


def parse_vmi(data: bytes, *, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> VirtualMachineInstance:
    """Parse VMI JSON (a VirtualMachine's template is accepted too); refuse bad input with a clear error."""
    text = check_utf8(data, "VMI JSON", max_bytes)
    if data.startswith(codecs.BOM_UTF8):  # a UTF-8 BOM is allowed (README, Input limits); JSON parsers refuse it
        text = text[1:]
    _check_depth(text)
    try:
        document: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"VMI JSON is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise InputError("VMI JSON is nested too deeply") from None
    except ValueError as exc:  # not a JSONDecodeError: an integer literal over Python's 4300-digit limit
        raise InputError(f"VMI JSON has a value Python cannot read: {exc}") from None
    if not isinstance(document, dict):
        raise InputError(f"VMI JSON must be an object, not {type(document).__name__}")
    if document.get("kind") == "VirtualMachine":
        template = document.get("spec", {}).get("template") if isinstance(document.get("spec"), dict) else None
        if not isinstance(template, dict):
            raise InputError("VMI JSON is a VirtualMachine with no spec.template object")
        metadata = document.get("metadata", {})
        template_metadata = template.get("metadata")
        if isinstance(metadata, dict) and isinstance(template_metadata, dict) and "annotations" in template_metadata:
            # the VMI gets the template's annotations, not the VirtualMachine's
            metadata = {**metadata, "annotations": template_metadata["annotations"]}
        elif isinstance(metadata, dict):
            metadata = {key: value for key, value in metadata.items() if key != "annotations"}
        document = {"metadata": metadata, "spec": template.get("spec")}
    try:
        return _read_vmi(document)
    except RecursionError:
        raise InputError("VMI JSON is nested too deeply") from None
