"""The hook sidecar against its floor in CPU instructions, which the machine's load does not change.

Run: ``python -m bench.hook_instructions [--calls N]`` (needs valgrind; takes a few minutes). The servers of
``bench/hook_sidecar.py`` (``launcher-hook serve`` and the gRPC + lxml parse/serialise floor) each run under
valgrind's callgrind, one at a time, and are called 20 + N times and 20 times; the difference of the
instructions counted in the server process (every thread: gRPC, the handler, the log writer), divided by
N, is what one ``OnDefineDomain`` call costs there. Both cases of ``hook_sidecar`` (add, merge). The client
is the same for both and is not counted. Prints figures and ratios and exits 0; a measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.hook_sidecar import ROOT, floor_command, hook_command
from bench.workloads import kubevirt_rendered_domain, kubevirt_sized_domain, sixteen_gpus
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc

WARM_UP = 20
START_SECONDS = 120.0
CALL_SECONDS = 120.0


def instructions(command: list[str], params: v1alpha3_pb2.OnDefineDomainParams, calls: int, env: dict[str, str]) -> int:
    """Instructions callgrind counts in the server run by ``command`` over its life, called WARM_UP + calls times."""
    directory = Path(tempfile.mkdtemp(prefix="hkinstr", dir="/tmp"))
    try:
        socket_path = directory / "s.sock"
        process = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={directory / 'out'}", *command, str(socket_path)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + START_SECONDS
            while not socket_path.is_socket():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{command[:3]} did not start under valgrind (exit {process.poll()})")
                time.sleep(0.2)
            with grpc.insecure_channel(f"unix:{socket_path}") as channel:
                call = v1alpha3_pb2_grpc.CallbacksStub(channel).OnDefineDomain
                for _ in range(WARM_UP + calls):
                    call(params, timeout=CALL_SECONDS)
            process.send_signal(signal.SIGTERM)
            _, errors = process.communicate(timeout=START_SECONDS)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        counted = [int(number) for number in re.findall(r"Collected : (\d+)", errors.decode(errors="replace"))]
        if not counted:
            raise RuntimeError(f"callgrind reported no count for {command[:3]}")
        return sum(counted)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls counted per server and case (default: 200)")
    calls = max(parser.parse_args().calls, 10)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    vmi, allocation = sixteen_gpus()
    env = {key: value for key, value in os.environ.items() if not key.startswith("PCI_RESOURCE")}
    env.update(allocation)
    env["PYTHONPATH"] = str(ROOT)
    # The commands end with their socket option; instructions() appends the path.
    servers = {
        "hook": hook_command(Path("/unused"))[:-1],
        "floor": [*floor_command(Path("/unused"), "floor")[:2], "--mode", "floor", "--socket"],
    }
    print(f"16 GPUs, instructions per OnDefineDomain call in the server process ({calls} calls counted)")
    for name, domain in (("add", kubevirt_sized_domain()), ("merge", kubevirt_rendered_domain())):
        params = v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi)
        per_call = {
            server: (instructions(command, params, calls, env) - instructions(command, params, 0, env)) / calls
            for server, command in servers.items()
        }
        print(
            f"{name:5}: floor {per_call['floor'] / 1e6:6.2f} M, hook {per_call['hook'] / 1e6:6.2f} M: "
            f"{per_call['hook'] / per_call['floor']:.2f}x"
        )


if __name__ == "__main__":
    main()
