"""The subset of a KubeVirt VirtualMachineInstance that decides which host devices a VM gets.

virt-launcher hands hooks the VMI as JSON; only ``spec.domain.devices.gpus[]`` and ``hostDevices[]`` (and
the metadata for logs) matter here. Unknown fields are ignored so newer KubeVirt versions keep working;
the fields read are type-checked strictly so that a wrong shape is an error, not a silent default.
"""

from __future__ import annotations

import codecs
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from schemas.errors import InputError
from schemas.limits import DEFAULT_MAX_INPUT_BYTES, check_utf8


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class RamFB(_Model):
    enabled: StrictBool | None = None


class DisplayOptions(_Model):
    enabled: StrictBool | None = None
    ram_fb: RamFB | None = Field(default=None, alias="ramFB")


class VGPUOptions(_Model):
    display: DisplayOptions | None = None


class GPU(_Model):
    """One ``spec.domain.devices.gpus[]`` entry."""

    name: StrictStr
    device_name: StrictStr | None = Field(default=None, alias="deviceName")
    virtual_gpu_options: VGPUOptions | None = Field(default=None, alias="virtualGPUOptions")


class HostDevice(_Model):
    """One ``spec.domain.devices.hostDevices[]`` entry."""

    name: StrictStr
    device_name: StrictStr | None = Field(default=None, alias="deviceName")


class Devices(_Model):
    gpus: list[GPU] = Field(default_factory=list)
    host_devices: list[HostDevice] = Field(default_factory=list, alias="hostDevices")


class DomainSpec(_Model):
    devices: Devices = Field(default_factory=Devices)


class VMISpec(_Model):
    domain: DomainSpec = Field(default_factory=DomainSpec)


class ObjectMeta(_Model):
    name: StrictStr = ""
    namespace: StrictStr = ""


class VirtualMachineInstance(_Model):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: VMISpec

    @property
    def display_name(self) -> str:
        """``namespace/name`` for logs and messages."""
        return f"{self.metadata.namespace or '-'}/{self.metadata.name or '-'}"


def _problems(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in detail['loc']) or '(top)'}: {detail['msg']}" for detail in error.errors()
    )


def parse_vmi(data: bytes, *, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> VirtualMachineInstance:
    """Parse VMI JSON (a VirtualMachine's template is accepted too); refuse bad input with a clear error."""
    text = check_utf8(data, "VMI JSON", max_bytes)
    if data.startswith(codecs.BOM_UTF8):  # a UTF-8 BOM is allowed (README, Input limits); JSON parsers refuse it
        data, text = data[len(codecs.BOM_UTF8) :], text[1:]
    if b'"VirtualMachine"' not in data:
        # The usual case, a VMI: pydantic's own JSON parser (fast; its recursion limit is an error).
        try:
            return VirtualMachineInstance.model_validate_json(data)
        except ValidationError:
            pass  # the slow path below words the error (line and column for bad JSON)
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
        document = {"metadata": document.get("metadata", {}), "spec": template.get("spec")}
    try:
        return VirtualMachineInstance.model_validate(document)
    except ValidationError as exc:
        raise InputError(f"VMI JSON does not have the expected shape: {_problems(exc)}") from None
    except RecursionError:
        raise InputError("VMI JSON is nested too deeply") from None
