"""Driving KubeVirt's own virt-launcher code against the hook: ``launcher-harness`` (docs/kubevirt-harness.md).

The harness is the Go command ``tests/cluster/peers/kubevirt/cmd/launcher-harness``, built by
``tests/cluster/build-peers.sh kubevirt`` (cgo, kubevirt.io/kubevirt at the module's pin) into a cache outside
the repository. Each run here starts ``launcher-hook serve`` on a socket in a short temporary directory, runs
the harness for one VMI and allocation env (it binds the directory onto KubeVirt's fixed socket paths in its
own mount namespace), stops the hook and returns the harness's JSON report.

Without Go, root or libvirtd the tests skip, and fail under CI=true (:func:`tests.libvirt_support.missing`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lxml import etree

from schemas.vmi import parse_vmi
from simkit.dra_files import write_vmi_tree
from tests.hook_support import short_dir, wait_for_socket
from tests.libvirt_support import missing
from tests.peer_support import peer_binary

ROOT = Path(__file__).resolve().parent.parent
HOOK_CONTAINER = "hook-sidecar-0"
"""The sidecar's container name: KubeVirt mounts its socket directory at /var/run/kubevirt-hooks/<container>."""
PLUGIN = "gpu-hostdev"
PLUGIN_SOCKET = f"/var/run/kubevirt-plugin/{PLUGIN}/hook.sock"
BUILD_TIMEOUT = 3600.0  # a cold build of KubeVirt's launcher packages on a busy 2-core machine
RUN_TIMEOUT = 300.0


def harness_binary(name: str = "launcher-harness") -> Path:
    """The built tool, or a skip (a failure under CI=true) saying what is missing."""
    if os.geteuid() != 0:
        missing("the launcher harness needs root (a mount namespace for KubeVirt's fixed socket paths)", "root")
    if shutil.which("unshare") is None:
        missing("unshare(1) is missing (util-linux)", "unshare")
    return peer_binary("kubevirt", name, BUILD_TIMEOUT)


@dataclass
class HarnessRun:
    """The harness's report and the hook's log lines."""

    report: dict[str, Any]
    returncode: int
    stderr: str
    hook_log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final(self) -> bytes:
        return str(self.report.get("final", "")).encode()

    def hook_events(self, event: str) -> list[dict[str, Any]]:
        return [line for line in self.hook_log if line.get("event") == event]


def unique_vmi(vmi: Mapping[str, Any]) -> dict[str, Any]:
    """``vmi`` in a namespace of its own: the domain (``<namespace>_<name>``) is one no other test defines."""
    document: dict[str, Any] = json.loads(json.dumps(vmi))
    document.setdefault("metadata", {})["namespace"] = f"kgp{uuid.uuid4().hex[:10]}"
    return document


@contextmanager
def _hook(directory: Path, env_file: Path | None, api: str, hook_args: Sequence[str]) -> Iterator[list[dict[str, Any]]]:
    hooks = directory / "hooks" / HOOK_CONTAINER
    plugin = directory / "plugins" / PLUGIN
    hooks.mkdir(parents=True)
    plugin.mkdir(parents=True)
    sockets = {"hooks": hooks / "gpu-hostdev.sock", "plugins": plugin / "hook.sock"}
    program = Path(sys.executable).parent / "launcher-hook"
    source = ["--environ-file", str(env_file)] if env_file is not None else []
    command = [str(program), "serve", "--api", api, *source, *hook_args]
    command += ["--socket", str(sockets["hooks"]), "--plugin-socket", str(sockets["plugins"])]
    log_path = directory / "hook.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    lines: list[dict[str, Any]] = []
    try:
        for kind, socket in sockets.items():
            if api in (kind, "both"):
                wait_for_socket(socket, timeout=60.0)
        yield lines
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        for line in log_path.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                lines.append({"event": "unparsed", "text": line})


def run_harness(
    vmi: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    api: str = "hooks",
    hook_args: Sequence[str] = (),
    harness_args: Sequence[str] = (),
    dra_devices: Mapping[tuple[str, str], str] | None = None,
    hook_reads_env: bool = True,
) -> HarnessRun:
    """One virt-launcher sequence for ``vmi`` with the compute container's ``env``, against ``launcher-hook
    serve --api <api>``. ``dra_devices`` ((claimName, requestName) → device ID) are written as KEP-5304's
    metadata files, which KubeVirt's DRA code and the hook's (``--dra-metadata-root``) both read. Without
    ``hook_reads_env`` the hook gets no source option and no allocation variable: it reads the allocation
    from virt-launcher's domain, as the recommended sidecar does."""
    binary = harness_binary()
    with short_dir() as directory:
        env_file = directory / "compute.environ"
        env_file.write_text("".join(f"{key}={value}\n" for key, value in env.items()))
        vmi_file = directory / "vmi.json"
        vmi_file.write_text(json.dumps(vmi))
        disks = directory / "disks"
        disks.mkdir()
        dra = directory / "dra"
        dra.mkdir()
        if dra_devices:
            write_vmi_tree(dra, parse_vmi(json.dumps(vmi).encode()), dra_devices)
        hook_args = [*hook_args, "--dra-metadata-root", str(dra)]
        out = directory / "report.json"
        args = [str(binary), "--vmi", str(vmi_file), "--env-file", str(env_file), "--container-disks", str(disks)]
        args += ["--out", str(out), "--dra-dir", str(dra)]
        # --api both: the same hook as a sidecar hook and as a Plugin's domain hook (KubeVirt calls the sidecar
        # API first, SetDomainSpecStrWithHooks); the hooks dir is bound either way (Collect reads it)
        args += ["--hooks-dir", str(directory / "hooks")]
        if api in ("hooks", "both"):
            args += ["--sidecars", "1"]
        if api in ("plugins", "both"):
            args += ["--plugins-dir", str(directory / "plugins"), "--plugin", PLUGIN, "--plugin-socket", PLUGIN_SOCKET]
        with _hook(directory, env_file if hook_reads_env else None, api, hook_args) as hook_log:
            done = subprocess.run(
                [*args, *harness_args], capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
            )
        if not out.exists():
            raise AssertionError(f"launcher-harness wrote no report ({done.returncode}):\n{done.stderr[-4000:]}")
        report = json.loads(out.read_text())
        if "connect" in str(report.get("error", "")).lower() and report.get("stage") == "libvirt":
            missing(f"libvirtd is not reachable: {report['error']}; as root: scripts/ensure-system.sh")
        return HarnessRun(report, done.returncode, done.stderr, hook_log)


def hostdevs(domain_xml: str | bytes) -> list[etree._Element]:
    text = domain_xml.encode() if isinstance(domain_xml, str) else domain_xml
    return list(etree.fromstring(text).iterfind("devices/hostdev"))


def hostdev_sources(domain_xml: str | bytes) -> list[str]:
    """Each hostdev's source as the kernel names it (PCI address, mdev UUID, USB bus:device), in order."""
    sources = []
    for hostdev in hostdevs(domain_xml):
        address = hostdev.find("source/address")
        if address is None:
            sources.append("")
        elif hostdev.get("type") == "pci":
            numbers = [int(address.get(field, "0"), 0) for field in ("domain", "bus", "slot", "function")]
            sources.append("%04x:%02x:%02x.%x" % tuple(numbers))  # noqa: UP031
        elif hostdev.get("type") == "mdev":
            sources.append(str(address.get("uuid")))
        else:
            sources.append(f"{address.get('bus')}:{address.get('device')}")
    return sources


def aliases(domain_xml: str | bytes) -> dict[str, str]:
    """alias → source of each hostdev."""
    found = {}
    for hostdev, source in zip(hostdevs(domain_xml), hostdev_sources(domain_xml), strict=True):
        alias = hostdev.find("alias")
        found[str(alias.get("name") if alias is not None else "")] = source
    return found
