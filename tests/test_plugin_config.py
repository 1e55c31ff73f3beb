"""The plugin configuration: defaults, file, environment, precedence, errors, and the exported schema."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from plugin.config import SCHEMA_PATH, PluginConfig, config_json_schema, load_config
from schemas import InputError

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_match_nvidia_plugin_behaviour() -> None:
    config = load_config(env={})
    assert config == PluginConfig()
    assert config.host_root == "/"
    assert config.pci_selectors == ("10DE:*",)
    assert config.vfio_drivers == ("vfio-pci", "nvgrace_gpu_vfio_pci")
    assert config.resource_domain == "nvidia.com"
    assert config.name_overrides == {}


def test_selectors_wildcard_only_display_class_exact_any_class() -> None:
    config = PluginConfig(pci_selectors=("10de:*", "10DE:10f9"))
    assert config.pci_selectors == ("10DE:*", "10DE:10F9")
    assert config.selects(0x10DE, 0x1F08, 0x030000)
    assert config.selects(0x10DE, 0x1EB8, 0x030200)
    assert not config.selects(0x10DE, 0x1ADA, 0x0C0330)
    assert config.selects(0x10DE, 0x10F9, 0x040300)  # named exactly
    assert not config.selects(0x1002, 0x1F08, 0x030000)
    assert config.selector_vendors() == {0x10DE}


def test_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "plugin.yaml"
    path.write_text(
        "pci_selectors: ['10DE:2236', '10DE:2FFF']\n"
        "name_overrides:\n  10de:2fff: GB202GL_RTX_PRO_6000\n  10DE:2237: example.com/a10g\n",
        encoding="utf-8",
    )
    config = load_config(path, env={})
    assert config.pci_selectors == ("10DE:2236", "10DE:2FFF")
    assert config.override_for(0x10DE, 0x2FFF) == "nvidia.com/GB202GL_RTX_PRO_6000"
    assert config.override_for(0x10DE, 0x2237) == "example.com/a10g"
    assert config.override_for(0x10DE, 0x2236) is None


def test_json_file_and_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps({"vfio_drivers": ["vfio-pci"], "host_root": "/host"}), encoding="utf-8")
    config = load_config(path, env={})
    assert config.vfio_drivers == ("vfio-pci",)
    assert config.host_root == "/host"
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    assert load_config(empty, env={}) == PluginConfig()


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "plugin.yaml"
    path.write_text("host_root: /from-file\npci_ids: /file.ids\nresource_domain: example.com\n", encoding="utf-8")
    env = {"GPU_PLUGIN_HOST_ROOT": "/from-env", "GPU_PLUGIN_PCI_SELECTORS": "10DE:*, 10DE:10F9"}
    config = load_config(path, env=env, host_root="/from-flag", pci_ids=None)
    assert config.host_root == "/from-flag"
    assert config.pci_ids == "/file.ids"  # a flag not given (None) does not override
    assert config.resource_domain == "example.com"
    assert config.pci_selectors == ("10DE:*", "10DE:10F9")
    assert load_config(path, env=env).host_root == "/from-env"


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = tmp_path / "plugin.yaml"
    path.write_text("vfio_drivers: [vfio-pci]\n", encoding="utf-8")
    assert load_config(env={"GPU_PLUGIN_CONFIG": str(path)}).vfio_drivers == ("vfio-pci",)


def test_env_overrides_both_forms() -> None:
    pairs = load_config(env={"GPU_PLUGIN_NAME_OVERRIDES": "10DE:2FFF=NEW_GPU, 10de:2237=A10G"})
    assert pairs.name_overrides == {"10DE:2FFF": "NEW_GPU", "10DE:2237": "A10G"}
    as_json = load_config(env={"GPU_PLUGIN_NAME_OVERRIDES": '{"10DE:2FFF": "NEW_GPU"}'})
    assert as_json.name_overrides == {"10DE:2FFF": "NEW_GPU"}


@pytest.mark.parametrize(
    ("content", "culprit"),
    [
        ("pci_selectors: ['10DE-1F08']\n", "pci_selectors.0"),
        ("pci_selector: ['10DE:*']\n", "pci_selector"),
        ("name_overrides: {'10DE:2FFF': 'bad name!'}\n", "name_overrides"),
        ("name_overrides: {'2FFF': 'GOOD'}\n", "name_overrides"),
        ("resource_domain: kubernetes.io\n", "resource_domain"),
        ("vfio_drivers: 'vfio-pci'\n", "vfio_drivers"),
    ],
)
def test_invalid_settings_name_the_file_and_field(tmp_path: Path, content: str, culprit: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError) as caught:
        load_config(path, env={})
    assert str(path) in str(caught.value)
    assert culprit in str(caught.value)


def test_broken_yaml_and_wrong_shape(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("pci_selectors: [10DE:*\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"broken\.yaml.*not valid YAML or JSON at line"):
        load_config(broken, env={})
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(InputError, match="expected a mapping"):
        load_config(listed, env={})
    with pytest.raises(InputError, match=r"missing\.yaml.*does not exist"):
        load_config(tmp_path / "missing.yaml", env={})


def test_env_errors_name_the_variable() -> None:
    with pytest.raises(InputError, match="GPU_PLUGIN_HOST_ROT"):
        load_config(env={"GPU_PLUGIN_HOST_ROT": "/x"})
    with pytest.raises(InputError, match="GPU_PLUGIN_PCI_SELECTORS"):
        load_config(env={"GPU_PLUGIN_PCI_SELECTORS": "nvidia"})
    with pytest.raises(InputError, match="GPU_PLUGIN_NAME_OVERRIDES"):
        load_config(env={"GPU_PLUGIN_NAME_OVERRIDES": "10DE:2FFF"})
    assert load_config(env={"OTHER_VARIABLE": "x"}) == PluginConfig()


def test_config_is_immutable() -> None:
    config = PluginConfig()
    with pytest.raises(ValueError, match="frozen"):
        config.host_root = "/elsewhere"  # type: ignore[misc]


def test_exported_json_schema_is_current() -> None:
    assert SCHEMA_PATH.read_text(encoding="utf-8") == config_json_schema(), (
        "schemas/plugin-config.schema.json is stale: run python -m plugin.config --write-schema"
    )
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(PluginConfig.FIELDS)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"host_root": 5}, "host_root: expected a string, got int"),
        ({"pci_ids": ["/a"]}, "pci_ids: expected a string or null, got list"),
        ({"vfio_drivers": [1]}, "vfio_drivers.0: expected a string, got int"),
        ({"name_overrides": ["10DE:2FFF"]}, "name_overrides: expected a mapping of strings, got list"),
        ({"name_overrides": {"10DE:2FFF": 7}}, "name_overrides.10DE:2FFF: expected a string, got int"),
        ({"pci_selectors": ["10DE:*"] * 1025}, "pci_selectors: 1025 entries, more than 1024"),
        ({"host_root": "/x" * 2049}, "host_root: not a path: longer than 4096 characters"),
        ({"pci_selector": [], "vfio_driver": []}, "pci_selector: unknown setting (known are host_root, pci_ids"),
    ],
)
def test_types_and_bounds_are_checked(tmp_path: Path, settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PluginConfig.from_mapping(settings)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(settings), encoding="utf-8")
    with pytest.raises(InputError, match=re.escape(f"config file {str(path)!r}: {message}")):
        load_config(path, env={})


def test_a_key_that_is_not_a_string_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name_overrides: {12: A}\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"name_overrides\.12: expected a string key, got int"):
        load_config(path, env={})


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError, match="frozen") as frozen:
        PluginConfig().pci_ids = None  # type: ignore[misc]
    assert "pci_ids" in str(frozen.value)
    with pytest.raises(ValueError, match=r"pci_selectors\.1: selector 'x'.*; vfio_drivers\.0: driver name '/'"):
        PluginConfig(pci_selectors=("10DE:*", "x"), vfio_drivers=("/",))


def test_serve_path_imports_neither_pydantic_nor_yaml(tmp_path: Path) -> None:
    """The plugin's memory (issue 12): its command, manager and a JSON config load without pydantic or YAML;
    a YAML config file still works (and only then loads YAML)."""
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps({"vfio_drivers": ["vfio-pci"]}), encoding="utf-8")
    yaml_path = tmp_path / "plugin.yaml"
    yaml_path.write_text("vfio_drivers: [vfio-pci]\n", encoding="utf-8")
    code = (
        "import sys; import plugin.cli, plugin.manager; from plugin.config import load_config; "
        f"assert load_config({str(path)!r}, env={{}}).vfio_drivers == ('vfio-pci',); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'pydantic_core', 'yaml'))); "
        f"assert load_config({str(yaml_path)!r}, env={{}}).vfio_drivers == ('vfio-pci',); "
        "print('yaml' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT
    )
    assert result.stdout.split("\n")[:2] == ["[]", "True"], result.stdout + result.stderr
