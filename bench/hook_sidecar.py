"""The hook sidecar against its floors: OnDefineDomain round trip for a 16-GPU VM, and resident memory.

Run: ``python -m bench.hook_sidecar [--rounds N]`` or ``python bench/hook_sidecar.py``. Every server runs in
its own process on a unix socket, as in a pod, and one client here calls them in turn:

- latency, two cases: the hook adds the 16 hostdevs to a domain without them ("add"), and the hook merges
  with the 16 hostdevs virt-launcher already rendered ("merge": ``type="pci"`` to drop on each source
  address). ``launcher-hook serve`` (allocation from its env, one JSON log line per call) is measured against
  a gRPC server that only parses and serialises the same domain with lxml (``bench/hook_floor_server.py``),
  interleaved in the same run; goal: median round trip at most 1.3x the floor's, in each case;
- memory: the hook's RSS after the latency runs against an idle Python gRPC server's; goal at most 1.3x (issue 12:
  the VMI is read without pydantic, and the serve path imports no YAML).

Prints figures and ratios and exits 0; a measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.workloads import kubevirt_rendered_domain, kubevirt_sized_domain, median_seconds, sixteen_gpus
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc

LATENCY_GOAL = 1.3
MEMORY_GOAL = 1.3
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


Call = Callable[[v1alpha3_pb2.OnDefineDomainParams], object]


def measure(hook: Call, floor: Call, params: v1alpha3_pb2.OnDefineDomainParams, rounds: int) -> tuple[float, float]:
    """Median round trips (hook, floor) in seconds, interleaved so machine noise hits both alike."""
    for _ in range(100):  # warm up both
        hook(params)
        floor(params)
    hooks, floors = [], []
    for _ in range(5):
        floors.append(median_seconds(lambda: floor(params), rounds // 5))
        hooks.append(median_seconds(lambda: hook(params), rounds // 5))
    return statistics.median(hooks), statistics.median(floors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000, help="round trips per server and case (default: 1000)")
    rounds = max(parser.parse_args().rounds, 10)
    vmi, allocation = sixteen_gpus()
    cases = {"add": kubevirt_sized_domain(), "merge": kubevirt_rendered_domain()}
    directory = Path(tempfile.mkdtemp(prefix="hkbench", dir="/tmp"))
    env = {key: value for key, value in os.environ.items() if not key.startswith("PCI_RESOURCE")}
    env.update(allocation)
    env["PYTHONPATH"] = str(ROOT)
    results: dict[str, tuple[float, float, int, int]] = {}
    try:
        hook_socket, floor_socket, idle_socket = (directory / name for name in ("hook.sock", "floor.sock", "idle.sock"))
        with (
            server(hook_command(hook_socket), hook_socket, env) as hook_pid,
            server(floor_command(floor_socket, "floor"), floor_socket, env),
            grpc.insecure_channel(f"unix:{hook_socket}") as hook_channel,
            grpc.insecure_channel(f"unix:{floor_socket}") as floor_channel,
        ):
            hook_stub = v1alpha3_pb2_grpc.CallbacksStub(hook_channel).OnDefineDomain
            floor_stub = v1alpha3_pb2_grpc.CallbacksStub(floor_channel).OnDefineDomain

            def hook(params: v1alpha3_pb2.OnDefineDomainParams) -> object:
                return hook_stub(params, timeout=60)

            def floor(params: v1alpha3_pb2.OnDefineDomainParams) -> object:
                return floor_stub(params, timeout=60)

            for name, domain in cases.items():
                params = v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi)
                produced = hook_stub(params, timeout=60).domainXML
                assert produced.count(b"<hostdev ") == 16, f"{name}: the hook did not give 16 GPUs"
                assert b'<address type="pci" domain' not in produced, f"{name}: type= left on a source address"
                hook_s, floor_s = measure(hook, floor, params, rounds)
                results[name] = (hook_s, floor_s, len(domain), len(produced))
            hook_rss = rss_kib(hook_pid)
        with server(floor_command(idle_socket, "idle"), idle_socket, env) as idle_pid:
            time.sleep(0.5)
            idle_rss = rss_kib(idle_pid)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"16 GPUs, {rounds} round trips per server and case, unix socket")
    for name, (hook_s, floor_s, size_in, size_out) in results.items():
        ratio = hook_s / floor_s
        verdict = "MET" if ratio <= LATENCY_GOAL else "NOT MET"
        print(f"{name:5}: domain {size_in} bytes in, {size_out} out")
        print(f"       floor (gRPC + lxml parse/serialise) {floor_s * 1e6:8.1f} us median round trip")
        print(f"       hook  (launcher-hook serve)         {hook_s * 1e6:8.1f} us median round trip")
        print(f"       latency ratio: {ratio:.2f}x the floor (goal <= {LATENCY_GOAL}x): {verdict}")
    memory_ratio = hook_rss / idle_rss
    print(f"RSS: hook {hook_rss / 1024:.1f} MiB after the runs, idle Python gRPC server {idle_rss / 1024:.1f} MiB")
    verdict = "MET" if memory_ratio <= MEMORY_GOAL else "NOT MET"
    print(f"memory ratio: {memory_ratio:.2f}x the idle server (goal <= {MEMORY_GOAL}x): {verdict}")


if __name__ == "__main__":
    main()
