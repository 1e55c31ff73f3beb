"""Host side of the in-guest scenarios (``tests/realnode/inguest.py``): boot, serve libvirt, read the record."""

from __future__ import annotations

import compileall
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.realnode.assets import Assets
from tests.realnode.guest import BootResult, boot

REPO = Path(__file__).resolve().parents[2]
PLUGIN_CONFIG = """pci_selectors: ["1234:1111"]
name_overrides: {"1234:1111": QEMU_BOCHS_DISPLAY}
"""
BASE_DOMAIN = """<domain type="qemu">
  <name>realnode</name>
  <memory unit="MiB">64</memory>
  <os><type arch="x86_64" machine="q35">hvm</type></os>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
  </devices>
</domain>
"""
MODULES = ("vfio_pci", "vfio_iommu_type1", "mtty", "mdpy", "mbochs", "snd_hda_intel")


@dataclass(frozen=True)
class Scenario:
    boot: BootResult
    observations: dict[str, Any]


def libvirt_native(results: Path) -> None:
    """Answer the guest's ``request-native``: libvirt's QEMU driver (on the host) turns domain.xml into argv."""
    request = results / "request-native"
    if not request.exists():
        return
    request.unlink()
    try:
        from xmlgen.libvirt_check import check_domain

        report = check_domain((results / "domain.xml").read_bytes())
        (results / "native.json.tmp").write_text(json.dumps(report.qemu_devices))
        (results / "native.json.tmp").rename(results / "native.json")
    except Exception as exc:
        (results / "native.error").write_text(f"{type(exc).__name__}: {exc}")


def compile_project() -> None:
    """Byte-compile the project on the host: the guest sees it read-only, and compiling under TCG costs seconds."""
    for package in ("schemas", "plugin", "launcher_hook", "xmlgen", "tests"):
        compileall.compile_dir(REPO / package, quiet=1)


def run_scenario(assets: Assets, name: str, results: Path, *, iommu: bool = True, timeout: float = 240) -> Scenario:
    """Boot a guest and run ``python -m tests.realnode.inguest NAME`` in it with the project's venv."""
    compile_project()
    command = (
        f"cd {REPO} && export PYTHONDONTWRITEBYTECODE=1 PATH={REPO}/.venv/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
        f"exec {REPO}/.venv/bin/python -m tests.realnode.inguest {name}\n"
    )
    result = boot(
        assets,
        command,
        results,
        iommu=iommu,
        modules=MODULES,
        files={"plugin.yaml": PLUGIN_CONFIG, "base-domain.xml": BASE_DOMAIN},
        timeout=timeout,
        service=libvirt_native,
    )
    try:
        observations = json.loads((results / "observations.json").read_text())
    except (OSError, ValueError):
        observations = {}
    return Scenario(result, observations)
