"""The hook sidecar against its floors: OnDefineDomain round trip for a 16-GPU VM, and resident memory.

Run: ``python -m bench.hook_sidecar [--rounds N]`` or ``python bench/hook_sidecar.py``. Every server runs in
its own process on a unix socket, as in a pod, and one client here calls them in turn:

- latency: ``launcher-hook serve`` (allocation from its env, one JSON log line per call) against a gRPC
  server that only parses and serialises the same domain with lxml (``bench/hook_floor_server.py``),
  interleaved in the same run; goal: median round trip at most 1.5x the floor's;
- memory: the hook's RSS after the latency run against an idle Python gRPC server's; goal at most 1.6x.

Prints figures and ratios and exits 0; a measurement, not a test.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.workloads import kubevirt_sized_domain, median_seconds, sixteen_gpus
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc

LATENCY_GOAL = 1.5
MEMORY_GOAL = 1.6
ROOT = Path(__file__).resolve().parent.parent
FLOOR_SERVER = Path(__file__).resolve().parent / "hook_floor_server.py"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


@contextmanager
def server(command: list[str], socket_path: Path, env: dict[str, str] | None = None) -> Iterator[int]:
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not socket_path.is_socket():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[:3]} did not start (exit {process.poll()})")
            time.sleep(0.02)
        yield process.pid
    finally:
        process.terminate()
        process.wait(timeout=20)


def hook_command(socket_path: Path) -> list[str]:
    code = "from launcher_hook.cli import main; main()"
    return [sys.executable, "-c", code, "serve", "--socket", str(socket_path)]


def floor_command(socket_path: Path, mode: str) -> list[str]:
    return [sys.executable, str(FLOOR_SERVER), "--socket", str(socket_path), "--mode", mode]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000, help="round trips per server (default: %(default)s)")
    rounds = max(parser.parse_args().rounds, 10)
    domain = kubevirt_sized_domain()
    vmi, allocation = sixteen_gpus()
    params = v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi)
    directory = Path(tempfile.mkdtemp(prefix="hkbench", dir="/tmp"))
    env = {key: value for key, value in __import__("os").environ.items() if not key.startswith("PCI_RESOURCE")}
    env.update(allocation)
    env["PYTHONPATH"] = str(ROOT)
    try:
        hook_socket, floor_socket, idle_socket = (directory / name for name in ("hook.sock", "floor.sock", "idle.sock"))
        with (
            server(hook_command(hook_socket), hook_socket, env) as hook_pid,
            server(floor_command(floor_socket, "floor"), floor_socket, env),
            grpc.insecure_channel(f"unix:{hook_socket}") as hook_channel,
            grpc.insecure_channel(f"unix:{floor_socket}") as floor_channel,
        ):
            hook_call = v1alpha3_pb2_grpc.CallbacksStub(hook_channel).OnDefineDomain
            floor_call = v1alpha3_pb2_grpc.CallbacksStub(floor_channel).OnDefineDomain
            produced = hook_call(params, timeout=60).domainXML
            assert produced.count(b"<hostdev ") == 16, "the hook did not write 16 GPUs"
            for _ in range(100):  # warm up both
                hook_call(params, timeout=60)
                floor_call(params, timeout=60)
            hooks, floors = [], []
            for _ in range(5):  # interleave so machine noise hits both alike
                floors.append(median_seconds(lambda: floor_call(params, timeout=60), rounds // 5))
                hooks.append(median_seconds(lambda: hook_call(params, timeout=60), rounds // 5))
            hook_rss = rss_kib(hook_pid)
        with server(floor_command(idle_socket, "idle"), idle_socket, env) as idle_pid:
            time.sleep(0.5)
            idle_rss = rss_kib(idle_pid)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    hook_s, floor_s = statistics.median(hooks), statistics.median(floors)
    latency_ratio, memory_ratio = hook_s / floor_s, hook_rss / idle_rss
    print(f"domain: {len(domain)} bytes in, {len(produced)} bytes out, 16 GPUs; {rounds} round trips each, unix socket")
    print(f"floor  (gRPC + lxml parse/serialise): {floor_s * 1e6:8.1f} us median round trip")
    print(f"hook   (launcher-hook serve):         {hook_s * 1e6:8.1f} us median round trip")
    verdict = "MET" if latency_ratio <= LATENCY_GOAL else "NOT MET"
    print(f"latency ratio: {latency_ratio:.2f}x the floor (goal <= {LATENCY_GOAL}x): {verdict}")
    print(f"RSS: hook {hook_rss / 1024:.1f} MiB after the run, idle Python gRPC server {idle_rss / 1024:.1f} MiB")
    verdict = "MET" if memory_ratio <= MEMORY_GOAL else "NOT MET"
    print(f"memory ratio: {memory_ratio:.2f}x the idle server (goal <= {MEMORY_GOAL}x): {verdict}")


if __name__ == "__main__":
    main()
