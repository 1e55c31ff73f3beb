"""Golden in/out cases: KubeVirt-shaped domain + VMI + allocation env → the exact domain we write.

Each case folder holds ``domain.xml``, ``env`` (KEY=VALUE), optionally ``vmi.json``, ``options.json`` and
``dra/`` (the KEP 5304 metadata tree the DRA entries' devices are read from, docs/dra.md), and
``expected.xml``. ``pytest tests/test_golden.py --regen-golden`` rewrites ``expected.xml``; every expected
document is also checked by real libvirt (RNG schema, test driver, QEMU argv for PCI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher_hook import BuildOptions, build_domain
from launcher_hook.allocation import parse_environ
from launcher_hook.dra import MetadataFiles
from tests.conftest import FIXTURES
from tests.libvirt_support import libvirt_verdict
from xmlgen.libvirt_check import qemu_sources

CASES = sorted(path for path in (FIXTURES / "golden").iterdir() if path.is_dir())


def _options(case: Path) -> BuildOptions:
    options = json.loads((case / "options.json").read_text()) if (case / "options.json").exists() else {}
    claims = MetadataFiles(case / "dra") if (case / "dra").is_dir() else None
    return BuildOptions(**options, claims=claims)


def _build(case: Path) -> tuple[bytes, dict[str, str]]:
    vmi = case / "vmi.json"
    result = build_domain(
        (case / "domain.xml").read_bytes(),
        vmi.read_bytes() if vmi.exists() else None,
        parse_environ((case / "env").read_bytes()),
        _options(case),
    )
    return result.domain_xml, result.aliases


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_golden_output(case: Path, regen_golden: bool) -> None:
    output, _ = _build(case)
    expected = case / "expected.xml"
    if regen_golden:
        expected.write_bytes(output)
    assert output == expected.read_bytes()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_golden_output_is_accepted_by_libvirt(case: Path) -> None:
    output, aliases = _build(case)
    report = libvirt_verdict(output, aliases)
    assert set(report.hostdevs) == set(aliases)
    assert qemu_sources(report) == aliases


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_building_twice_gives_the_same_document(case: Path) -> None:
    once, _ = _build(case)
    vmi = case / "vmi.json"
    twice = build_domain(
        once,
        vmi.read_bytes() if vmi.exists() else None,
        parse_environ((case / "env").read_bytes()),
        _options(case),
    )
    assert twice.domain_xml == once
