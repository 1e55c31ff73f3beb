"""Helpers for the DRA tests: CDI spec validation against the vendored CDI schema (tests/fixtures/cdi) and
the naming rules of the CDI spec the schema does not carry, plus a prepared fixture node."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # a test-only dependency (via kubernetes-validate) without type hints
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from plugin.config import PluginConfig
from plugin.dra.claims import AllocatedDevice, ClaimRef, StaticClaims, claim_file_name, claim_object
from plugin.dra.prepare import PrepareCore
from plugin.dra.runner import DraRunner, InventorySink
from plugin.dra.service import DraServer
from runtime.pciids import PciIds
from tests.plugin_support import WAIT

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


# -- a running DRA plugin ------------------------------------------------------------------------------------


@dataclass
class DraPaths:
    """Where a test's DRA plugin lives: a short base (unix socket paths stay under 108 bytes)."""

    base: Path
    root: Path
    registry: Path
    plugin_dir: Path
    cdi_dir: Path
    claims_dir: Path

    @classmethod
    def under(cls, base: Path, root: Path) -> DraPaths:
        return cls(base, root, base / "reg", base / "plugin", base / "cdi", base / "claims")


def dra_runner(paths: DraPaths, sinks: Sequence[InventorySink] = (), pool: str | None = None) -> DraRunner:
    """The ``serve --dra`` pieces on ``paths``: claims read from ``paths.claims_dir``, the tree's own pci.ids."""
    pci_ids_path = paths.root / "usr" / "share" / "misc" / "pci.ids"
    pci_ids = PciIds.load(pci_ids_path) if pci_ids_path.is_file() else None
    paths.claims_dir.mkdir(parents=True, exist_ok=True)
    core = PrepareCore(
        StaticClaims.from_directory(paths.claims_dir), paths.root, paths.plugin_dir, paths.cdi_dir, pool=pool
    )
    server = DraServer(core, paths.plugin_dir, paths.registry)
    config = PluginConfig(host_root=str(paths.root))
    return DraRunner(config, core, server, registry_dir=paths.registry, scan_interval=0.2, pci_ids=pci_ids, sinks=sinks)


@contextmanager
def running_dra(runner: DraRunner) -> Iterator[DraRunner]:
    """Run ``runner`` in a thread until the block ends; then stop it and check it ended."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            runner.run()
        except BaseException as exc:  # surfaced in the test
            errors.append(exc)

    thread = threading.Thread(target=target, name="dra-runner", daemon=True)
    thread.start()
    try:
        assert runner.ready.wait(WAIT), f"the DRA plugin did not get ready: {errors}"
        yield runner
    finally:
        runner.request_stop()
        thread.join(WAIT)
        assert not thread.is_alive(), "the DRA plugin did not stop"
    if errors:
        raise errors[0]


def write_claim(paths: DraPaths, ref: ClaimRef, devices: list[AllocatedDevice]) -> None:
    """Put ``ref``'s allocated ResourceClaim where :class:`StaticClaims` reads it."""
    paths.claims_dir.mkdir(parents=True, exist_ok=True)
    (paths.claims_dir / claim_file_name(ref.namespace, ref.name)).write_text(json.dumps(claim_object(ref, devices)))
