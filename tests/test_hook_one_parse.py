"""One ``OnDefineDomain`` call reads each of its documents once (issue 26).

The domain XML is parsed once and the VMI JSON decoded once per call, whatever the call does: the allocation
source that reads the domain (the deployed default), the hostdev merge, the companions and their root ports,
the EFI guest's 64-bit window all use that one parse, and one writer writes the result. Counted here at the
parser (``lxml.etree.fromstring`` given a ``<domain>``) and the decoder (``json.loads`` given the VMI), on the
seed's case with virt-launcher's GPUs rendered, companions read from sysfs and an OVMF guest with BARs that need
the window.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from launcher_hook import BuildOptions
from launcher_hook.service import HookService
from launcher_hook.sources import DomainSource, ProcessEnvSource
from runtime.pci_bars import SysfsBars
from runtime.pci_companions import SysfsCompanions
from schemas.companions import companions_variable_for
from simkit.fixture_nodes import NODE01
from simkit.sysfs_fixture import build
from tests.hook_support import RTX_VAR, seed_case
from tests.launcher_render_support import virt_launcher_domain

GPUS = ("0000:86:00.0", "0000:af:00.0")
LOADER = b'\t\t<loader readonly="yes" secure="no" type="pflash">/usr/share/OVMF/OVMF_CODE.fd</loader>\n\t</os>'


class Counted:
    """Calls of ``real`` whose first argument ``wanted`` accepts."""

    def __init__(self, real: Callable[..., Any], wanted: Callable[[object], bool]) -> None:
        self.real, self.wanted, self.calls = real, wanted, 0

    def __call__(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        if self.wanted(data):
            self.calls += 1
        return self.real(data, *args, **kwargs)


def _is_domain(data: object) -> bool:
    return isinstance(data, bytes | str) and ("<domain" in data if isinstance(data, str) else b"<domain" in data)


def _is_vmi(data: object) -> bool:
    return isinstance(data, bytes | str) and ("spec" in data if isinstance(data, str) else b"spec" in data)


def _case(tmp_path: Path) -> tuple[bytes, bytes, dict[str, str], Path]:
    domain, vmi, env = seed_case()
    rendered = virt_launcher_domain(domain.replace(b"\t</os>", LOADER, 1), vmi, env)
    return rendered, vmi, env, build(NODE01, tmp_path / "root") / "sys"


@pytest.mark.parametrize("source_name", ["domain", "env"])
def test_a_call_parses_the_domain_once_and_decodes_the_vmi_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source_name: str
) -> None:
    domain, vmi, env, sysfs = _case(tmp_path)
    companions = ",".join(f"{gpu}={'+'.join(f'{gpu[:-1]}{f}' for f in (1, 2, 3))}" for gpu in GPUS)
    env = {**env, companions_variable_for(RTX_VAR) or "": companions}  # the plugin's variable, as Allocate gives
    source = DomainSource() if source_name == "domain" else ProcessEnvSource(env)
    options = BuildOptions(companion_reader=SysfsCompanions(sysfs), bars=SysfsBars(sysfs))
    service = HookService(source, options)
    parses = Counted(etree.fromstring, _is_domain)
    decodes = Counted(json.loads, _is_vmi)
    monkeypatch.setattr(etree, "fromstring", parses)
    monkeypatch.setattr(json, "loads", decodes)
    outcome = service.define_domain(domain, vmi, via="test")
    monkeypatch.undo()
    # it did all of it: companions in the GPUs' slots behind new root ports, and the EFI window
    assert outcome.result.placements
    assert b"pcie-root-port" in outcome.domain_xml
    assert outcome.result.mmio is not None
    assert (parses.calls, decodes.calls) == (1, 1)
