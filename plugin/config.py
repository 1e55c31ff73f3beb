"""The device plugin's configuration: one pydantic model, read from a YAML/JSON file and the environment.

Which functions count as GPUs, which drivers mean "ready for a VM", and names for device IDs an old
pci.ids lacks are site decisions (docs/node.md; docs/protocols.md, "Resource names"), so they are configuration, not
code. The model is the single source of truth: its JSON Schema is exported to ``schemas/plugin-config.schema.json``
(run ``python -m plugin.config --write-schema``; a test fails when the file is stale) for editors and reviews.

Precedence, lowest first: defaults, the file (``--config`` or ``GPU_PLUGIN_CONFIG``), ``GPU_PLUGIN_*``
environment variables, command-line flags. Every problem is an ``InputError`` naming the file or variable
and the field.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from plugin.naming import DEFAULT_RESOURCE_DOMAIN
from runtime.env import PLUGIN_ENV_PREFIX as ENV_PREFIX
from runtime.files import read_regular_file
from runtime.node import VFIO_DRIVER_NAMES
from schemas.errors import InputError
from schemas.naming import validate_resource_name

CONFIG_FILE_ENV = "GPU_PLUGIN_CONFIG"
MAX_CONFIG_BYTES = 1024 * 1024
"""Largest configuration file read (1 MiB; a real one is a few hundred bytes)."""
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "plugin-config.schema.json"

_SELECTOR = re.compile(r"[0-9A-Fa-f]{4}:([0-9A-Fa-f]{4}|\*)")
_DEVICE_ID = re.compile(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}")
_DRIVER = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_MDEV_NAME = re.compile(r"[A-Za-z0-9_.:+-]{1,64}")
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def _selector(value: str) -> str:
    if _SELECTOR.fullmatch(value) is None:
        raise ValueError(f"selector {value!r} is not VENDOR:DEVICE in hex (e.g. 10DE:1F08) or VENDOR:* (e.g. 10DE:*)")
    return value.upper()


def _driver(value: str) -> str:
    if _DRIVER.fullmatch(value) is None:
        raise ValueError(f"driver name {value!r} is not a kernel driver name")
    return value


def _mdev_name(value: str) -> str:
    if _MDEV_NAME.fullmatch(value) is None:
        raise ValueError(f"{value!r} is not a sysfs device or mdev type name (1-64 characters of [A-Za-z0-9_.:+-])")
    return value


def _device_id(value: str) -> str:
    if _DEVICE_ID.fullmatch(value) is None:
        raise ValueError(f"device ID {value!r} is not VENDOR:DEVICE in hex, e.g. 10DE:2FFF")
    return value.upper()


def _override_name(value: str) -> str:
    if "/" in value:
        try:
            validate_resource_name(value)
        except InputError as exc:
            raise ValueError(str(exc)) from None
    elif _NAME_PART.fullmatch(value) is None:
        raise ValueError(
            f"name {value!r} must be 1-63 characters of [A-Za-z0-9_.-] starting and ending with a letter or digit "
            "(or a whole resource name, domain/name)"
        )
    return value


def _domain(value: str) -> str:
    try:
        validate_resource_name(f"{value}/x")
    except InputError:
        raise ValueError(f"resource domain {value!r} is not a DNS subdomain outside kubernetes.io") from None
    return value


def _pattern(regex: re.Pattern[str]) -> Any:
    """Show the validator's rule in the exported JSON Schema (the validator itself gives the better message)."""
    return Field(json_schema_extra={"pattern": f"^{regex.pattern}$"})


Selector = Annotated[str, AfterValidator(_selector), _pattern(_SELECTOR)]
DriverName = Annotated[str, AfterValidator(_driver), _pattern(_DRIVER)]
MdevName = Annotated[str, AfterValidator(_mdev_name), _pattern(_MDEV_NAME)]
DeviceId = Annotated[str, AfterValidator(_device_id), _pattern(_DEVICE_ID)]
OverrideName = Annotated[str, AfterValidator(_override_name)]
ResourceDomain = Annotated[str, AfterValidator(_domain)]


class PluginConfig(BaseModel):
    """What the node offers and how it is named. Every field has a working default."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="kubevirt-gpu-passthrough device plugin")

    host_root: str = Field(
        default="/",
        description="Where the node's / is mounted in this container; sysfs is read from <host_root>/sys, "
        "/dev/vfio from <host_root>/dev/vfio.",
    )
    pci_ids: str | None = Field(
        default=None,
        description="A pci.ids file to name devices by (it must exist). Unset: the first of "
        "usr/share/hwdata/pci.ids, usr/share/misc/pci.ids, usr/pci.ids under host_root, then under the image's /; "
        "none found means hex names and a warning.",
    )
    resource_domain: ResourceDomain = Field(
        default=DEFAULT_RESOURCE_DOMAIN,
        description="The domain of every resource name (nvidia.com keeps NVIDIA's plugin's names).",
    )
    pci_selectors: tuple[Selector, ...] = Field(
        default=("10DE:*",),
        description="Which PCI functions are GPUs, as VENDOR:DEVICE (like KubeVirt's pciVendorSelector). "
        "VENDOR:* matches display-class functions (class 0x03xxxx) only; an exact VENDOR:DEVICE matches that "
        "ID whatever its class. Mdevs count when their parent GPU matches.",
    )
    vfio_drivers: tuple[DriverName, ...] = Field(
        default=VFIO_DRIVER_NAMES,
        description="Drivers that mean a GPU is ready for passthrough. GPUs on any other driver (nvidia, "
        "nouveau, none) are not offered.",
    )
    allowed_companion_drivers: tuple[DriverName, ...] = Field(
        default=("pci-stub", "pcieport"),
        description="Besides vfio_drivers and no driver at all, the drivers the kernel lets share a viable IOMMU "
        "group with a VFIO device (they never touch the device's DMA). Any other driver in a GPU's group makes "
        "the GPU unhealthy.",
    )
    mdev_parent_selectors: tuple[MdevName, ...] = Field(
        default=(),
        description="Opt-in, off by default: mdevs whose parent is NOT a PCI function (e.g. the kernel's sample "
        "drivers' virtual devices mtty, mdpy, mbochs) are offered when their parent's sysfs name is listed here. "
        "Mdevs of PCI parents (NVIDIA vGPU) are not affected: they count when their parent matches pci_selectors. "
        "Their resource is <resource_domain>/<mdev type name>, like a vGPU type's.",
    )
    mdev_type_selectors: tuple[MdevName, ...] = Field(
        default=(),
        description="Opt-in, off by default: mdevs whose parent is NOT a PCI function are offered when their mdev "
        "type ID (the directory name under mdev_supported_types, e.g. mtty-2) is listed here. Mdevs of PCI parents "
        "are not affected.",
    )
    name_overrides: dict[DeviceId, OverrideName] = Field(
        default_factory=dict,
        description="Resource names per device ID (VENDOR:DEVICE), for IDs an old pci.ids lacks or names that "
        "drifted: a name part (GB202GL_RTX_PRO_6000, put under resource_domain) or a whole resource name. "
        "Two IDs with one name share one resource.",
    )

    def selector_vendors(self) -> frozenset[int]:
        return frozenset(int(selector[:4], 16) for selector in self.pci_selectors)

    def selects(self, vendor: int, device: int, pci_class: int) -> bool:
        """True when a function with these IDs is a GPU by :attr:`pci_selectors`."""
        exact = f"{vendor:04X}:{device:04X}"
        wildcard = f"{vendor:04X}:*"
        for selector in self.pci_selectors:
            if selector == exact or (selector == wildcard and pci_class >> 16 == 0x03):
                return True
        return False

    def selects_virtual_mdev(self, parent_name: str, type_id: str) -> bool:
        """True when an mdev of a non-PCI parent is offered, by :attr:`mdev_parent_selectors` or its type ID."""
        return parent_name in self.mdev_parent_selectors or type_id in self.mdev_type_selectors

    def override_for(self, vendor: int, device: int) -> str | None:
        """The resource name configured for ``vendor:device``, as a whole resource name, or None."""
        name = self.name_overrides.get(f"{vendor:04X}:{device:04X}")
        if name is None:
            return None
        return name if "/" in name else f"{self.resource_domain}/{name}"


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def _split_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _split_overrides(variable: str, value: str) -> dict[str, str]:
    if value.lstrip().startswith("{"):
        try:
            loaded = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InputError(f"environment variable {variable}: not valid JSON: {exc.msg}") from None
        except RecursionError:
            raise InputError(f"environment variable {variable}: nested too deeply") from None
        if not isinstance(loaded, dict):
            raise InputError(f"environment variable {variable}: expected a JSON object")
        return {str(key): str(item) for key, item in loaded.items()}
    overrides: dict[str, str] = {}
    for item in _split_list(value):
        key, equals, name = item.partition("=")
        if not equals:
            raise InputError(f"environment variable {variable}: {item!r} is not VENDOR:DEVICE=NAME")
        overrides[key.strip()] = name.strip()
    return overrides


_LIST_FIELDS = frozenset(
    {"pci_selectors", "vfio_drivers", "allowed_companion_drivers", "mdev_parent_selectors", "mdev_type_selectors"}
)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for variable, value in sorted(env.items()):
        if not variable.startswith(ENV_PREFIX) or variable == CONFIG_FILE_ENV:
            continue
        field = variable.removeprefix(ENV_PREFIX).lower()
        if field not in PluginConfig.model_fields:
            known = ", ".join(ENV_PREFIX + name.upper() for name in PluginConfig.model_fields)
            raise InputError(f"unknown environment variable {variable}: known are {known} and {CONFIG_FILE_ENV}")
        if field in _LIST_FIELDS:
            values[field] = _split_list(value)
        elif field == "name_overrides":
            values[field] = _split_overrides(variable, value)
        else:
            values[field] = value
    return values


def _from_file(path: Path) -> dict[str, Any]:
    data = read_regular_file(path, MAX_CONFIG_BYTES, "config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"cannot read config file {str(path)!r}: {exc}") from None
    import yaml  # noqa: PLC0415 -- only a config file needs it: serve without one never loads it

    try:
        loaded = yaml.safe_load(text)
    except RecursionError:
        raise InputError(f"config file {str(path)!r} is nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise InputError(f"config file {str(path)!r} is not valid YAML or JSON{where}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise InputError(f"config file {str(path)!r}: expected a mapping of settings, got {type(loaded).__name__}")
    return {str(key): value for key, value in loaded.items()}


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any) -> PluginConfig:
    """Defaults < the file (``path``, else ``$GPU_PLUGIN_CONFIG``) < ``GPU_PLUGIN_*`` in ``env`` < ``overrides``.

    ``overrides`` whose value is None are ignored (an option not given on the command line).
    """
    env = os.environ if env is None else env
    if path is None and env.get(CONFIG_FILE_ENV):
        path = Path(env[CONFIG_FILE_ENV])
    values: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        values.update(_from_file(path))
        source = f"config file {str(path)!r}"
    from_env = _from_env(env)
    if from_env:
        values.update(from_env)
        source += " and " + ", ".join(ENV_PREFIX + name.upper() for name in from_env)
    values.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return PluginConfig.model_validate(values)
    except ValidationError as exc:
        raise InputError(f"{source}: {_describe(exc)}") from None


def config_json_schema() -> str:
    """The JSON Schema of :class:`PluginConfig`, as written to ``schemas/plugin-config.schema.json``."""
    schema = PluginConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m plugin.config [--write-schema]``: print the JSON Schema, or rewrite the exported file."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--write-schema"]:
        SCHEMA_PATH.write_text(config_json_schema(), encoding="utf-8")
        print(f"wrote {SCHEMA_PATH}")
        return 0
    if args:
        print("usage: python -m plugin.config [--write-schema]", file=sys.stderr)
        return 2
    sys.stdout.write(config_json_schema())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
