"""``gpu-device-plugin serve --dra`` as a real process against the kubelet DRA stand-in: registration,
prepare, unprepare, SIGTERM (exit 0, registration socket removed, prepared claims kept); configuration from
``GPU_PLUGIN_*`` variables; a missing claim source is a clear error, not a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from plugin.dra import cdi
from plugin.dra.claims import AllocatedDevice, ClaimRef
from plugin.dra.service import REGISTRATION_SOCKET
from schemas.dra import CDI_KIND, DRIVER_NAME
from simkit.fixture_nodes import NODE01
from simkit.kubelet_dra_standin import KubeletDraStandIn
from tests.dra_support import DraPaths, load_cdi_spec, write_claim
from tests.plugin_support import WAIT, build_tree, plugin_env, serve_command, short_dir, wait_until

UID = "0f4c6a4e-2b7a-4c3e-9d2f-8a1b2c3d4e5f"
CLAIM = ClaimRef("vms", "gpu-claim", UID)


def test_serve_dra_process_registers_prepares_and_stops_on_sigterm() -> None:
    with short_dir() as base:
        paths = DraPaths.under(base, build_tree(NODE01, base))
        write_claim(paths, CLAIM, [AllocatedDevice("gpu", DRIVER_NAME, "node01", "pci-0000-86-00-0")])
        paths.cdi_dir.mkdir()
        env = plugin_env(
            GPU_PLUGIN_DRA="true",
            GPU_PLUGIN_DRA_PLUGIN_DIR=str(paths.plugin_dir),
            GPU_PLUGIN_PLUGINS_REGISTRY=str(paths.registry),
            GPU_PLUGIN_CDI_DIR=str(paths.cdi_dir),
            GPU_PLUGIN_CLAIMS_DIR=str(paths.claims_dir),
            GPU_PLUGIN_NODE_NAME="node01",
        )
        log = base / "plugin.log"
        command = serve_command(paths.root, base / "kubelet", "--scan-interval", "0.2")
        with log.open("wb") as stderr, KubeletDraStandIn(paths.registry) as kubelet:
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            try:
                registration = kubelet.wait_for_registration(DRIVER_NAME, timeout=30)
                assert registration.service == "v1.DRAPlugin"
                key = (CLAIM.namespace, CLAIM.name, CLAIM.uid)
                devices, error = kubelet.prepare(DRIVER_NAME, [key])[UID]
                assert error == "" and devices[0].cdi_ids == (f"{CDI_KIND}={UID}-gpu",)
                load_cdi_spec(paths.cdi_dir / cdi.spec_file_name(UID))
                unknown = kubelet.prepare(DRIVER_NAME, [("vms", "missing", "u-1")])["u-1"][1]
                assert "vms/missing (uid u-1) is not known" in unknown
                process.send_signal(signal.SIGTERM)
                assert process.wait(WAIT * 2) == 0
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            wait_until(lambda: kubelet.registered(DRIVER_NAME) is None, what="deregistration")
        assert not (paths.registry / REGISTRATION_SOCKET).exists()
        assert (paths.cdi_dir / cdi.spec_file_name(UID)).exists()  # prepared claims outlive the process
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        assert {"dra_serving", "dra_registered", "dra_prepared", "dra_stopped", "signal"} <= {x["event"] for x in lines}
        (refused,) = [line for line in lines if line["event"] == "dra_prepare_refused"]
        assert refused["level"] == "warning" and "vms/missing" in refused["error"]


def test_serve_dra_without_a_claim_source_is_a_clear_error(tmp_path: Path) -> None:
    root = build_tree(NODE01, tmp_path)
    done = subprocess.run(
        [*serve_command(root, tmp_path / "kubelet"), "--dra"],
        env=plugin_env(),
        capture_output=True,
        timeout=60,
        check=False,
        text=True,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "serve --dra without --claims-dir reads claims from the API server" in done.stderr
    assert "it needs --node-name" in done.stderr


def test_the_device_plugin_command_loads_no_dra_machinery() -> None:
    """Issue 12 (start to registered): ``serve`` without ``--dra`` imports neither the DRA servicers, prepare core,
    runner or slices nor the DRA and plugin-registration stubs (a third of the command's import time); the
    options they share with the command line come from :mod:`plugin.dra.options` alone."""
    code = (
        "import sys, plugin.cli, plugin.manager; "
        "print(sorted(m for m in sys.modules "
        "if m.startswith('plugin.dra') or '.dra.' in m or 'pluginregistration' in m))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "['plugin.dra', 'plugin.dra.options']", done.stdout + done.stderr
