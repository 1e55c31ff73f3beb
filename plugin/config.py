"""The device plugin's configuration: one frozen, typed value, read from a YAML/JSON file and the environment.

Which functions count as GPUs, which drivers mean "ready for a VM", and names for device IDs an old
pci.ids lacks are site decisions (docs/node.md; docs/protocols.md, "Resource names"), so they are configuration, not
code. The field table below is the single source of truth: values are checked against it (unknown keys refused,
types checked, every value bounded), and its JSON Schema is exported to ``schemas/plugin-config.schema.json``
(run ``python -m plugin.config --write-schema``; a test fails when the file is stale) for editors and reviews.

Read by hand rather than with pydantic, as the hook reads its VMI (``schemas/vmi.py``): pydantic alone added
about 11 MB to the plugin's memory (issue 12). The loader imports YAML only for a config file that is not JSON.

Precedence, lowest first: defaults, the file (``--config`` or ``GPU_PLUGIN_CONFIG``), ``GPU_PLUGIN_*``
environment variables, command-line flags. Every problem is an ``InputError`` naming the file or variable
and the field.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from plugin.naming import DEFAULT_RESOURCE_DOMAIN
from runtime.env import PLUGIN_ENV_PREFIX as ENV_PREFIX
from runtime.files import read_regular_file
from runtime.node import VFIO_DRIVER_NAMES
from schemas.errors import InputError
from schemas.naming import validate_resource_name
from schemas.node_agent_state import DEFAULT_STATE_PATH

CONFIG_FILE_ENV = "GPU_PLUGIN_CONFIG"
MAX_CONFIG_BYTES = 1024 * 1024
"""Largest configuration file read (1 MiB; a real one is a few hundred bytes)."""
MAX_ITEMS = 1024
"""Most entries of one list or of ``name_overrides`` (a real node needs a handful)."""
MAX_PATH_CHARS = 4096
"""Longest ``host_root``, ``pci_ids`` or ``node_agent_state`` (the kernel's PATH_MAX)."""
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "plugin-config.schema.json"
TITLE = "kubevirt-gpu-passthrough device plugin"

_SELECTOR = re.compile(r"[0-9A-Fa-f]{4}:([0-9A-Fa-f]{4}|\*)")
_DEVICE_ID = re.compile(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}")
_DRIVER = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_MDEV_NAME = re.compile(r"[A-Za-z0-9_.:+-]{1,64}")
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


class ConfigError(ValueError):
    """Settings that do not fit the field table; ``problems`` are ``field: reason`` strings, all of them."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _path(value: str) -> str:
    if len(value) > MAX_PATH_CHARS or "\0" in value:
        raise ValueError(f"not a path: longer than {MAX_PATH_CHARS} characters or holding a NUL")
    return value


def _in_root_file(value: str) -> str:
    """An absolute path inside the host root naming a file, or empty (off)."""
    _path(value)
    if value and (not value.startswith("/") or value.endswith("/") or "/../" in f"{value}/"):
        raise ValueError(f"{value!r} is not an absolute path of a file without '..' (or empty: off)")
    return value


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


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the field table: its shape, its check (which may normalise), and its documentation."""

    shape: str
    """``str``, ``str?`` (a string or null), ``list`` (of strings) or ``map`` (string → string)."""
    check: Callable[[str], str]
    """Checks one string (each item of a list, each value of a map); raises ``ValueError`` with the reason."""
    description: str
    pattern: re.Pattern[str] | None = None
    """Shown in the JSON Schema (the check itself gives the better message)."""
    key_check: Callable[[str], str] | None = None
    key_pattern: re.Pattern[str] | None = None

    def parse(self, name: str, value: object, problems: list[str]) -> Any:
        """``value`` checked and normalised (lists become tuples); each problem appended as ``name…: reason``."""
        if self.shape in ("str", "str?"):
            if value is None and self.shape == "str?":
                return None
            if not isinstance(value, str):
                wanted = "a string or null" if self.shape == "str?" else "a string"
                problems.append(f"{name}: expected {wanted}, got {_type_name(value)}")
                return None
            return self._one(name, value, self.check, problems)
        if self.shape == "list":
            if not isinstance(value, list | tuple):
                problems.append(f"{name}: expected a list of strings, got {_type_name(value)}")
                return ()
            if len(value) > MAX_ITEMS:
                problems.append(f"{name}: {len(value)} entries, more than {MAX_ITEMS}")
                return ()
            items = []
            for index, item in enumerate(value):
                if not isinstance(item, str):
                    problems.append(f"{name}.{index}: expected a string, got {_type_name(item)}")
                    continue
                items.append(self._one(f"{name}.{index}", item, self.check, problems))
            return tuple(items)
        if not isinstance(value, Mapping):
            problems.append(f"{name}: expected a mapping of strings, got {_type_name(value)}")
            return {}
        if len(value) > MAX_ITEMS:
            problems.append(f"{name}: {len(value)} entries, more than {MAX_ITEMS}")
            return {}
        key_check = self.key_check or _path
        result: dict[str, str] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(f"{name}.{str(key)[:64]}: expected a string key, got {_type_name(key)}")
                continue
            checked_key = self._one(f"{name}.{key[:64]}", key, key_check, problems)
            if not isinstance(item, str):
                problems.append(f"{name}.{key[:64]}: expected a string, got {_type_name(item)}")
                continue
            checked = self._one(f"{name}.{key[:64]}", item, self.check, problems)
            if checked_key is not None and checked is not None:
                result[checked_key] = checked
        return result

    @staticmethod
    def _one(where: str, value: str, check: Callable[[str], str], problems: list[str]) -> str | None:
        try:
            return check(value)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            return None

    def json_schema(self, name: str, default: object) -> dict[str, Any]:
        """This setting's JSON Schema (the layout pydantic gave it, so the exported file did not change)."""
        schema: dict[str, Any] = {"description": self.description, "title": name.replace("_", " ").title()}
        if self.shape == "str":
            schema["type"] = "string"
        elif self.shape == "str?":
            schema["anyOf"] = [{"type": "string"}, {"type": "null"}]
        elif self.shape == "list":
            item: dict[str, Any] = {"type": "string"}
            if self.pattern is not None:
                item["pattern"] = f"^{self.pattern.pattern}$"
            schema["items"] = item
            schema["type"] = "array"
        else:
            assert self.key_pattern is not None
            schema["patternProperties"] = {f"^{self.key_pattern.pattern}$": {"type": "string"}}
            schema["type"] = "object"
        if self.shape != "map":  # a map's default is built per instance: pydantic left it out, so do we
            schema["default"] = list(default) if isinstance(default, tuple) else default
        return schema


SETTINGS: dict[str, Setting] = {
    "host_root": Setting(
        "str",
        _path,
        "Where the node's / is mounted in this container; sysfs is read from <host_root>/sys, "
        "/dev/vfio from <host_root>/dev/vfio.",
    ),
    "pci_ids": Setting(
        "str?",
        _path,
        "A pci.ids file to name devices by (it must exist). Unset: the first of "
        "usr/share/hwdata/pci.ids, usr/share/misc/pci.ids, usr/pci.ids under host_root, then under the image's /; "
        "none found means hex names and a warning.",
    ),
    "resource_domain": Setting(
        "str",
        _domain,
        "The domain of every resource name (nvidia.com keeps NVIDIA's plugin's names).",
    ),
    "pci_selectors": Setting(
        "list",
        _selector,
        "Which PCI functions are GPUs, as VENDOR:DEVICE (like KubeVirt's pciVendorSelector). "
        "VENDOR:* matches display-class functions (class 0x03xxxx) only; an exact VENDOR:DEVICE matches that "
        "ID whatever its class. Mdevs count when their parent GPU matches.",
        _SELECTOR,
    ),
    "vfio_drivers": Setting(
        "list",
        _driver,
        "Drivers that mean a GPU is ready for passthrough. GPUs on any other driver (nvidia, "
        "nouveau, none) are not offered.",
        _DRIVER,
    ),
    "allowed_companion_drivers": Setting(
        "list",
        _driver,
        "Besides vfio_drivers and no driver at all, the drivers the kernel lets share a viable IOMMU "
        "group with a VFIO device (they never touch the device's DMA). Any other driver in a GPU's group makes "
        "the GPU unhealthy.",
        _DRIVER,
    ),
    "mdev_parent_selectors": Setting(
        "list",
        _mdev_name,
        "Opt-in, off by default: mdevs whose parent is NOT a PCI function (e.g. the kernel's sample "
        "drivers' virtual devices mtty, mdpy, mbochs) are offered when their parent's sysfs name is listed here. "
        "Mdevs of PCI parents (NVIDIA vGPU) are not affected: they count when their parent matches pci_selectors. "
        "Their resource is <resource_domain>/<mdev type name>, like a vGPU type's.",
        _MDEV_NAME,
    ),
    "mdev_type_selectors": Setting(
        "list",
        _mdev_name,
        "Opt-in, off by default: mdevs whose parent is NOT a PCI function are offered when their mdev "
        "type ID (the directory name under mdev_supported_types, e.g. mtty-2) is listed here. Mdevs of PCI parents "
        "are not affected.",
        _MDEV_NAME,
    ),
    "name_overrides": Setting(
        "map",
        _override_name,
        "Resource names per device ID (VENDOR:DEVICE), for IDs an old pci.ids lacks or names that "
        "drifted: a name part (GB202GL_RTX_PRO_6000, put under resource_domain) or a whole resource name. "
        "Two IDs with one name share one resource.",
        key_check=_device_id,
        key_pattern=_DEVICE_ID,
    ),
    "node_agent_state": Setting(
        "str",
        _in_root_file,
        "The node agent's state file as a path on the node, read under host_root (mount the agent's state "
        "directory there, read-only). Its vgpu.type_names names SR-IOV vGPU types no creatable_vgpu_types "
        "lists any more (every VF of the GPU in use), and the plugin rescans when the agent replaces it. "
        "Empty: not read. A missing file is normal (no agent, or it has not run); a broken one is a warning.",
    ),
}
"""Every setting, in the order of :class:`PluginConfig`'s fields."""


@dataclass(frozen=True, slots=True)
class _Fields:
    host_root: str = "/"
    pci_ids: str | None = None
    resource_domain: str = DEFAULT_RESOURCE_DOMAIN
    pci_selectors: tuple[str, ...] = ("10DE:*",)
    vfio_drivers: tuple[str, ...] = VFIO_DRIVER_NAMES
    allowed_companion_drivers: tuple[str, ...] = ("pci-stub", "pcieport")
    mdev_parent_selectors: tuple[str, ...] = ()
    mdev_type_selectors: tuple[str, ...] = ()
    name_overrides: dict[str, str] = field(default_factory=dict)
    node_agent_state: str = DEFAULT_STATE_PATH

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name, setting in SETTINGS.items():
            object.__setattr__(self, name, setting.parse(name, getattr(self, name), problems))
        if problems:
            raise ConfigError(problems)


class PluginConfig(_Fields):
    """What the node offers and how it is named. Every field has a working default.

    Built from keyword arguments (checked and normalised as a file's values are: ``ConfigError``, a
    ``ValueError``, lists every problem) or with :meth:`from_mapping` (unknown keys refused too). Frozen.
    """

    __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = tuple(SETTINGS)

    def __setattr__(self, name: str, value: object) -> None:
        raise ValueError(f"PluginConfig is frozen: cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise ValueError(f"PluginConfig is frozen: cannot delete {name}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> PluginConfig:
        """Settings by name (a config file's mapping, merged with env and flags): unknown names are refused."""
        unknown = [str(key) for key in values if key not in SETTINGS]
        if unknown:
            known = ", ".join(SETTINGS)
            raise ConfigError([f"{key[:64]}: unknown setting (known are {known})" for key in unknown])
        return cls(**values)  # type: ignore[arg-type]  # checked and normalised by __post_init__

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


assert tuple(item.name for item in fields(_Fields)) == PluginConfig.FIELDS, "the field table and the fields differ"


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


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for variable, value in sorted(env.items()):
        if not variable.startswith(ENV_PREFIX) or variable == CONFIG_FILE_ENV:
            continue
        name = variable.removeprefix(ENV_PREFIX).lower()
        setting = SETTINGS.get(name)
        if setting is None:
            known = ", ".join(ENV_PREFIX + known.upper() for known in SETTINGS)
            raise InputError(f"unknown environment variable {variable}: known are {known} and {CONFIG_FILE_ENV}")
        if setting.shape == "list":
            values[name] = _split_list(value)
        elif setting.shape == "map":
            values[name] = _split_overrides(variable, value)
        else:
            values[name] = value
    return values


def _parse_text(text: str, path: Path) -> object:
    """The file's data: JSON (no YAML import: the plugin's memory), else YAML (JSON is nearly a YAML subset)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(f"config file {str(path)!r} is nested too deeply") from None
    except ValueError:
        pass  # not JSON: YAML tells where it is wrong, if it is
    import yaml  # noqa: PLC0415 -- only a YAML config file needs it: serve without one never loads it

    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise InputError(f"config file {str(path)!r} is nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise InputError(f"config file {str(path)!r} is not valid YAML or JSON{where}") from None


def _from_file(path: Path) -> dict[str, Any]:
    data = read_regular_file(path, MAX_CONFIG_BYTES, "config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"cannot read config file {str(path)!r}: {exc}") from None
    loaded = _parse_text(text, path)
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
        return PluginConfig.from_mapping(values)
    except ConfigError as exc:
        raise InputError(f"{source}: {exc}") from None


def config_json_schema() -> str:
    """The JSON Schema of :class:`PluginConfig`, as written to ``schemas/plugin-config.schema.json``."""
    defaults = PluginConfig()
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "additionalProperties": False,
        "description": (PluginConfig.__doc__ or "").split("\n\n")[0],
        "properties": {name: setting.json_schema(name, getattr(defaults, name)) for name, setting in SETTINGS.items()},
        "title": TITLE,
        "type": "object",
    }
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
