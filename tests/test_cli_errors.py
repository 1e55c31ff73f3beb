"""Finding 13: hostile or odd command-line input is an ``error: …`` line naming the culprit, never a traceback.

Each case runs the real console entry point as a process. ``error:`` lines are single lines: control
characters from the input (a NUL in XML, lxml's own newline) are escaped, not written raw.
"""

from __future__ import annotations

import codecs
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.clirun import escape_controls
from schemas.vmi import parse_vmi
from tests.conftest import EXAMPLES
from tests.plugin_support import plugin_env

DEEP = 100_000


def run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = f"from {module} import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        input=b"",
        capture_output=True,
        timeout=60,
        check=False,
        env=env if env is not None else plugin_env(),
    )
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def assert_error(done: subprocess.CompletedProcess[str], *needles: str, code: int = 1) -> str:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == code, done.stderr[-3000:]
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, done.stderr[-3000:]
    if code == 1:  # not a usage error (those print the usage first): the error line is all of stderr
        assert done.stderr == lines[0] + "\n", done.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def deep_json(tmp_path: Path) -> Path:
    path = tmp_path / "deep.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    return path


@pytest.fixture
def deep_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "deep.yaml"
    path.write_text("pci_selectors: " + "[" * DEEP + "]" * DEEP + "\n")
    return path


# -- xmlgen ---------------------------------------------------------------------------------------------------


def test_validate_with_a_huge_max_input_bytes_reads_the_file(tmp_path: Path) -> None:
    domain = tmp_path / "domain.xml"
    domain.write_bytes((EXAMPLES / "seed-node01" / "domain.xml").read_bytes())
    done = run("xmlgen.cli", "validate", "--max-input-bytes", "9223372036854775806", str(domain))
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode in (0, 1), done.stderr
    assert not done.stderr.startswith("error: ") or "9223372036854775806" not in done.stderr


def test_validate_max_input_bytes_still_limits(tmp_path: Path) -> None:
    domain = tmp_path / "domain.xml"
    domain.write_bytes(b"<domain>" + b" " * 100 + b"</domain>")
    assert_error(run("xmlgen.cli", "validate", "--max-input-bytes", "10", str(domain)), "over the 10-byte limit")


def test_discover_with_a_deeply_nested_json_config(deep_json: Path) -> None:
    assert_error(run("xmlgen.cli", "discover", "--config", str(deep_json)), str(deep_json), "nested too deeply")


def test_a_nul_byte_in_xml_stays_on_one_escaped_error_line(tmp_path: Path) -> None:
    domain = tmp_path / "nul.xml"
    domain.write_bytes(b"<domain>\0x</domain>")
    line = assert_error(run("xmlgen.cli", "validate", str(domain)), "not well-formed")
    assert "\0" not in line


def test_a_nul_byte_in_an_argument_is_escaped_in_the_error() -> None:
    done = run("xmlgen.cli", "validate", "no\x01such\x1bfile")
    assert_error(done, "no\\x01such\\x1bfile")
    assert "\x1b" not in done.stderr and "\x01" not in done.stderr


def test_a_vmi_with_a_utf8_bom_is_accepted(tmp_path: Path) -> None:
    seed = (EXAMPLES / "seed-node01" / "vmi.json").read_bytes()
    assert parse_vmi(codecs.BOM_UTF8 + seed) == parse_vmi(seed)
    vmi = tmp_path / "vmi.json"
    vmi.write_bytes(codecs.BOM_UTF8 + seed)
    done = run("xmlgen.cli", "simulate", "--vmi", str(vmi))
    assert done.returncode == 0, done.stderr
    assert "ua-gpu0" in done.stdout


def test_a_vmi_with_a_bom_and_then_garbage_is_still_refused() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_vmi(codecs.BOM_UTF8 + b"{nope")


def test_usage_errors_are_error_lines_with_exit_2() -> None:
    assert_error(run("xmlgen.cli", "validate", "--no-such-flag"), "--no-such-flag", code=2)
    assert_error(run("plugin.cli", "serve", "--no-such-flag"), "--no-such-flag", code=2)


def test_help_and_version_still_exit_0() -> None:
    for module in ("xmlgen.cli", "plugin.cli"):
        for flag in ("--help", "--version"):
            done = run(module, flag)
            assert done.returncode == 0 and done.stdout and not done.stderr, (module, flag, done.stderr)


# -- gpu-device-plugin serve ----------------------------------------------------------------------------------


def test_plugin_config_deeply_nested_yaml(deep_yaml: Path) -> None:
    assert_error(run("plugin.cli", "serve", "--config", str(deep_yaml)), str(deep_yaml), "nested too deeply")


def test_plugin_config_dev_zero_is_not_read_forever() -> None:
    assert_error(run("plugin.cli", "serve", "--config", "/dev/zero"), "/dev/zero", "not a regular file")


def test_plugin_config_over_the_size_limit(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 * 1024 * 1024) + "\n")
    assert_error(run("plugin.cli", "serve", "--config", str(big)), str(big), "over the")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0"])
def test_plugin_scan_interval_must_be_finite_and_in_range(value: str) -> None:
    assert_error(run("plugin.cli", "serve", "--scan-interval", value), "--scan-interval", code=2)
    env = {**plugin_env(), "GPU_PLUGIN_SCAN_INTERVAL": value}
    assert_error(run("plugin.cli", "serve", env=env), "GPU_PLUGIN_SCAN_INTERVAL", code=2)


def test_plugin_kubelet_dir_that_is_not_a_directory(tmp_path: Path) -> None:
    assert_error(run("plugin.cli", "serve", "--host-root", str(tmp_path), "--kubelet-dir", "/dev/null"),
                 "/dev/null", "not a directory")  # fmt: skip


def test_plugin_deeply_nested_name_overrides_env(tmp_path: Path) -> None:
    nested = '{"a":' * 20_000 + "1" + "}" * 20_000  # an env string is at most 128 KiB
    env = {**plugin_env(), "GPU_PLUGIN_NAME_OVERRIDES": nested}
    assert_error(run("plugin.cli", "serve", "--host-root", str(tmp_path), env=env),
                 "GPU_PLUGIN_NAME_OVERRIDES", "nested too deeply")  # fmt: skip


def test_escape_controls() -> None:
    assert escape_controls("a\0b\nc\td\x1b[31m\u2028é") == "a\\x00b\\nc\\td\\x1b[31m\\u2028é"
    assert escape_controls("plain text: 'ok'") == "plain text: 'ok'"
    assert json.loads(json.dumps(escape_controls("\x7f"))) == "\\x7f"
    assert os.sep == "/"
