"""Helpers for the DRA tests: CDI spec validation against the vendored CDI schema (tests/fixtures/cdi) and
the naming rules of the CDI spec the schema does not carry, plus a prepared fixture node."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # a test-only dependency (via kubernetes-validate) without type hints
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

CDI_SCHEMA_DIR = Path(__file__).parent / "fixtures" / "cdi"
_KIND = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$"
)
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_SEMVER = re.compile(r"^\d+\.\d+\.\d+$")


@cache
def _validator() -> jsonschema.Draft7Validator:
    schema = json.loads((CDI_SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((CDI_SCHEMA_DIR / "defs.json").read_text())
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=DRAFT7)
    )
    return jsonschema.Draft7Validator(schema, registry=registry)


def validate_cdi_spec(spec: Any) -> None:
    """Raise when ``spec`` breaks the CDI JSON schema or the spec's kind/name/version rules."""
    _validator().validate(spec)
    assert _SEMVER.match(spec["cdiVersion"]), spec["cdiVersion"]
    assert _KIND.match(spec["kind"]) and len(spec["kind"].split("/")[0]) <= 253, spec["kind"]
    assert spec["devices"], "a CDI spec needs at least one device"
    names = [device["name"] for device in spec["devices"]]
    assert len(set(names)) == len(names), names
    for device in spec["devices"]:
        assert _DEVICE_NAME.match(device["name"]), device["name"]
        edits = device["containerEdits"]
        for node in edits.get("deviceNodes", []):
            assert node["path"].startswith("/dev/"), node
            assert set(node.get("permissions", "")) <= set("rwm"), node
        for mount in edits.get("mounts", []):
            assert mount["hostPath"].startswith("/") and mount["containerPath"].startswith("/"), mount


def load_cdi_spec(path: Path) -> Any:
    spec = json.loads(path.read_text())
    validate_cdi_spec(spec)
    return spec
