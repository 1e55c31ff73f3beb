"""Resource names must equal NVIDIA's plugin's, byte for byte (docs/protocols.md, "Resource names")."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plugin.naming import (
    fallback_device_name,
    mdev_resource_name,
    normalize_device_name,
    normalize_mdev_type_name,
    pci_resource_name,
)
from schemas import ResourceKind, env_var_for, socket_name_for
from tests.discovery_support import FIXTURES

VECTORS = json.loads((FIXTURES / "nvidia_naming_vectors.json").read_text(encoding="utf-8"))["vectors"]


def test_there_are_at_least_forty_real_vectors() -> None:
    assert len(VECTORS) >= 40
    assert len({vector["id"] for vector in VECTORS}) == len(VECTORS)


@pytest.mark.parametrize("vector", VECTORS, ids=[vector["id"] for vector in VECTORS])
def test_pci_ids_name_vector(vector: dict[str, str]) -> None:
    device = int(vector["id"].split(":")[1], 16)
    assert pci_resource_name(vector["pci_ids_name"], device) == vector["resource"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("TU106 [GeForce RTX 2060 Rev. A]", "TU106_GEFORCE_RTX_2060_REV__A"),
        ("GA100 [A100-SXM-64GB]", "GA100_A100SXM64GB"),
        ("TU102GL [Tesla T10 16GB / GRID RTX T10-2/T10-4/T10-8]", "TU102GL_TESLA_T10_16GB___GRID_RTX_T102_T104_T108"),
    ],
)
def test_facts_examples(name: str, expected: str) -> None:
    assert normalize_device_name(name) == expected


def test_trim_and_whitespace_runs_follow_go() -> None:
    assert normalize_device_name("  GA102GL \t [A10]\n") == "GA102GL_A10"
    # Go's \s is ASCII only: a vertical tab or a no-break space is dropped, not turned into "_".
    assert normalize_device_name("A\vB") == "AB"
    assert normalize_device_name("A\u00a0B") == "AB"


def test_upper_casing_is_per_character_like_go() -> None:
    # Python's "ß".upper() is "SS"; Go keeps one rune, which the final filter then drops.
    assert normalize_device_name("Straße") == "STRAE"


def test_hex_fallback_when_pci_ids_lacks_the_id() -> None:
    assert pci_resource_name(None, 0x2FFF) == "nvidia.com/2fff"
    assert fallback_device_name(0x1F08) == "1f08"
    assert pci_resource_name("[]", 0x1F08) == "nvidia.com/1f08"


def test_domain_is_configurable() -> None:
    assert pci_resource_name("GA102GL [A10]", 0x2236, "example.com") == "example.com/GA102GL_A10"


@pytest.mark.parametrize(
    ("type_name", "expected"),
    [
        ("GRID T4-1Q", "nvidia.com/GRID_T4-1Q"),
        ("GRID T4-2Q\n", "nvidia.com/GRID_T4-2Q"),
        ("NVIDIA A10-4C", "nvidia.com/NVIDIA_A10-4C"),
        ("GRID  RTX6000-4Q", "nvidia.com/GRID_RTX6000-4Q"),
    ],
)
def test_mdev_type_names(type_name: str, expected: str) -> None:
    assert mdev_resource_name(type_name) == expected


def test_mdev_names_keep_everything_but_whitespace() -> None:
    assert normalize_mdev_type_name("GRID A100-1-5C.x") == "GRID_A100-1-5C.x"


def test_env_and_socket_for_the_seed_resource() -> None:
    name = pci_resource_name("TU106 [GeForce RTX 2060 Rev. A]", 0x1F08)
    assert env_var_for(name, ResourceKind.PCI) == "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
    assert socket_name_for(name) == "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
    assert env_var_for(mdev_resource_name("GRID T4-1Q"), ResourceKind.MDEV) == "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q"


@given(st.text(max_size=80))
def test_normalized_names_use_only_the_kept_characters_and_are_stable(name: str) -> None:
    part = normalize_device_name(name)
    assert all(char in "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_" for char in part)
    assert normalize_device_name(part) == part


@given(st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789[]-./ ", min_size=1, max_size=40))
def test_ascii_names_match_a_literal_reading_of_the_rule(name: str) -> None:
    upper = name.strip().upper().replace("/", "_").replace(".", "_")
    collapsed = "_".join(part for part in upper.split(" ") if part) if upper else ""
    # A literal reading: whitespace runs become one "_" (split/join keeps interior runs as one).
    expected = "".join(char for char in collapsed if char.isalnum() or char == "_")
    assert normalize_device_name(name) == expected
