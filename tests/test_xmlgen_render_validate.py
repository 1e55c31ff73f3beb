"""``xmlgen render`` and ``xmlgen validate`` as a user runs them: exit codes, stdout, stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher_hook.validate import SCHEMAS_DIR_ENV
from tests.conftest import EXAMPLES, FIXTURES
from xmlgen.cli import cli

SEED = EXAMPLES / "seed-node01"
PCI = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"


def run(*args: str, env: dict[str, str] | None = None, stdin: bytes | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), env=env, input=stdin, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def seed_args() -> list[str]:
    return [
        "--domain",
        str(SEED / "domain.xml"),
        "--vmi",
        str(SEED / "vmi.json"),
        "--environ-file",
        str(SEED / "compute.environ"),
    ]


def test_render_seed_example_matches_golden() -> None:
    code, out, err = run("render", *seed_args())
    assert (code, err) == (0, "")
    assert out.encode() == (FIXTURES / "golden" / "seed-two-gpus" / "expected.xml").read_bytes()


def test_render_reads_the_allocation_from_the_process_env_and_the_domain_from_stdin() -> None:
    code, out, _ = run("render", "--domain", "-", env={PCI: "0000:3b:00.0"}, stdin=(SEED / "domain.xml").read_bytes())
    assert code == 0
    assert 'bus="0x3b"' in out and "ua-gpu0" in out


def test_environ_file_replaces_the_process_allocation_variables(tmp_path: Path) -> None:
    environ = tmp_path / "environ"
    environ.write_bytes(f"HOME=/root\0{PCI}=0000:af:00.0\0".encode())
    code, out, _ = run(
        "render", "--environ-file", str(environ), env={PCI: "0000:86:00.0", "MDEV_PCI_RESOURCE_X": "bad"}
    )
    assert code == 0
    assert 'bus="0xaf"' in out and "0x86" not in out


def test_environ_file_replaces_the_process_companion_variables_too(tmp_path: Path) -> None:
    companions = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
    environ = tmp_path / "environ"
    environ.write_bytes(f"{PCI}=0000:af:00.0\n".encode())
    stale = {companions: "0000:86:00.0=0000:86:00.1"}
    code, out, err = run("render", "--domain", str(SEED / "domain.xml"), "--environ-file", str(environ), env=stale)
    assert (code, err) == (0, "")
    assert "multifunction" not in out
    environ.write_bytes(f"{PCI}=0000:af:00.0\n{companions}=0000:af:00.0=0000:af:00.1\n".encode())
    code, out, err = run("render", "--domain", str(SEED / "domain.xml"), "--environ-file", str(environ), env=stale)
    assert code == 0
    assert 'multifunction="on"' in out and '<alias name="ua-gpu0-fn1"' in out
    assert err == (
        "companions: ua-gpu0: guest slot 0000:01:00 behind the new pcie-root-port index 1, function 0 0000:af:00.0 "
        "(multifunction), companions at 1 (0000:af:00.1)\n"
    )


def test_render_without_domain_prints_devices_with_options() -> None:
    code, out, _ = run("render", "--managed", "yes", "--driver", "vfio", env={PCI: "0000:86:00.0"})
    assert code == 0
    assert out == (
        '<devices>\n\t<hostdev mode="subsystem" type="pci" managed="yes">\n\t\t<driver name="vfio"/>\n'
        '\t\t<source>\n\t\t\t<address domain="0x0000" bus="0x86" slot="0x00" function="0x0"/>\n\t\t</source>\n'
        '\t\t<alias name="ua-gpu0"/>\n\t</hostdev>\n</devices>\n'
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--domain", "/nonexistent/domain.xml"], {}, "error: cannot read domain XML '/nonexistent/domain.xml'"),
        (["--vmi", str(SEED / "domain.xml")], {PCI: "0000:86:00.0"}, "error: VMI JSON is not valid JSON"),
        (
            ["--vmi", str(SEED / "vmi.json")],
            {},
            "error: gpus[0] 'gpu0' (deviceName nvidia.com/TU106_GEFORCE_RTX_2060_REV__A)",
        ),
        (["--vmi", str(SEED / "vmi.json")], {PCI: "0000:86:00.0"}, "error: too few devices"),
        ([], {PCI: "0000:86:00.0,zz"}, f"error: {PCI}: malformed PCI address 'zz'"),
        (["--domain", str(SEED / "vmi.json")], {PCI: "0000:86:00.0"}, "error: domain XML is not well-formed XML"),
        (["--domain", str(SEED / "domain.xml"), "--max-input-bytes", "100"], {}, "over the 100-byte limit"),
    ],
)
def test_render_errors_exit_1_with_nothing_on_stdout(args: list[str], env: dict[str, str], message: str) -> None:
    code, out, err = run("render", *args, env=env)
    assert (code, out) == (1, "")
    assert message in err


def test_render_warns_when_nothing_was_allocated() -> None:
    code, out, err = run("render", env={})
    assert (code, out) == (0, "<devices/>\n")
    assert "warning: no PCI_RESOURCE_*/MDEV_PCI_RESOURCE_* variable" in err


def test_the_console_script_keeps_stdout_clean_on_error(tmp_path: Path) -> None:
    env = {**os.environ, PCI: "0000:86:00.0"}
    done = subprocess.run(
        [sys.executable, "-m", "xmlgen", "render", "--vmi", str(SEED / "vmi.json")],
        env=env,
        capture_output=True,
        check=False,
    )
    assert done.returncode == 1 and done.stdout == b""
    assert done.stderr.startswith(b"error: too few devices for nvidia.com/TU106_GEFORCE_RTX_2060_REV__A")


def test_validate_accepts_every_golden_output() -> None:
    for expected in sorted((FIXTURES / "golden").glob("*/expected.xml")):
        code, out, _ = run("validate", str(expected))
        assert code == 0, out
        assert out.startswith("ok: ")


BROKEN = """<domain type="kvm">
  <devices>
    <hostdev mode="subsystem" type="pci" managed="no">
      <source><address type="pci" domain="0x0000" bus="0x86" slot="0x00" function="0x0"/></source>
      <alias name="ua-gpu-gpu0"/>
    </hostdev>
    <hostdev mode="subsystem" type="pci" managed="no" display="on">
      <source><address domain="0x0000" bus="0x86" slot="0x00" function="0x0"/></source>
      <alias name="hostdev7"/>
    </hostdev>
    <hostdev mode="subsystem" type="pci" managed="no">
      <source><address domain="0x0000" bus="134" slot="0x20" function="0x0"/></source>
      <alias name="ua-gpu.1"/>
    </hostdev>
    <hostdev mode="subsystem" type="mdev" model="vfio-pci" ramfb="maybe">
      <source><address uuid="4b20d080-1b54-4048-85b3-a6a62d165c01"/></source>
      <alias name="ua-gpu-gpu0"/>
    </hostdev>
  </devices>
</domain>
"""


def test_validate_reports_each_problem_on_its_own_line() -> None:
    code, out, _ = run("validate", "-", stdin=BROKEN.encode())
    assert code == 1
    lines = out.splitlines()
    expected = [
        "line 3: error: <hostdev type='pci'> 'ua-gpu-gpu0': <source><address type='pci'> - the source address takes no",
        "line 7: error: <hostdev type='pci'> 'hostdev7': display= is allowed on mdev hostdevs only",
        "line 7: error: <hostdev type='pci'> 'hostdev7': PCI 0000:86:00.0 is passed through again (first at line 3)",
        "line 9: error: hostdev alias 'hostdev7' does not start with 'ua-'",
        "line 11: warning: <hostdev type='pci'> 'ua-gpu.1': source address bus='134': libvirt reads '134' as decimal",
        "line 11: error: <hostdev type='pci'> 'ua-gpu.1': source address slot='0x20' is not a number libvirt reads",
        "line 13: error: alias 'ua-gpu.1' has characters outside [a-zA-Z0-9_-]",
        "line 15: error: <hostdev type='mdev'> 'ua-gpu-gpu0': ramfb='maybe' must be 'on' or 'off'",
        "line 17: error: alias 'ua-gpu-gpu0' is used again (first at line 5)",
        "invalid: 8 errors, 1 warning (configuration)",
    ]
    assert len(lines) == len(expected), out
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(start), (line, start)


def test_validate_falls_back_to_the_rng_verdict_for_other_schema_errors() -> None:
    domain = (
        b"<domain><devices><hostdev mode='subsystem' type='pci' managed='sometimes'><source>"
        b"<address domain='0x0000' bus='0x86' slot='0x00' function='0x0'/></source><alias name='ua-gpu0'/></hostdev>"
        b"</devices></domain>"
    )
    code, out, _ = run("validate", "-", stdin=domain)
    assert code == 1
    assert out.startswith("line 1: error: <hostdev type='pci'> 'ua-gpu0' fails libvirt's RNG schema (domain.rng): ")


def test_validate_names_missing_schemas(tmp_path: Path) -> None:
    from launcher_hook.validate import _load_schema

    _load_schema.cache_clear()
    try:
        code, out, err = run("validate", str(SEED / "domain.xml"), env={SCHEMAS_DIR_ENV: str(tmp_path)})
    finally:
        _load_schema.cache_clear()
    assert (code, out) == (1, "")
    assert f"error: libvirt's RNG schema {tmp_path}/domain.rng is missing" in err


def test_validate_refuses_unparseable_input() -> None:
    code, out, err = run("validate", "-", stdin=b"<domain>")
    assert (code, out) == (1, "")
    assert err.startswith("error: domain XML is not well-formed XML")
