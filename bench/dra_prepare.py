"""The DRA plugin's prepare/unprepare round trip, next to an empty gRPC call measured in the same run.

Run: ``python -m bench.dra_prepare [--rounds N]``. ``gpu-device-plugin serve --dra`` runs as a process on a
fixture tree of eight passthrough GPUs (each alone in its IOMMU group, on vfio-pci) in a temp dir, claims read
from ``--claims-dir``; the kubelet DRA stand-in runs here and calls it over the unix sockets, as the kubelet
would.

- round trip: ``NodePrepareResources`` then ``NodeUnprepareResources`` of one claim, through the stand-in,
  for a claim of 1 GPU and of 8 GPUs (8 requests of one GPU each, as KubeVirt takes one device per request):
  each prepare reads the claim, re-checks the devices on the tree, writes the metadata files and the CDI spec
  and the checkpoint (flushed), each unprepare rewrites the checkpoint and deletes the files;
- floor: an empty ``NodePrepareResources`` (no claims) on the same socket, interleaved with the round trips
  so that machine noise hits both alike.

Prints the medians and the ratios and exits 0: a measurement, not a test (no goal is set). ``--cluster`` measures
the same prepare path on the real node instead (bench/dra_cluster.py).
"""

from __future__ import annotations

import argparse
import json
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

from plugin.dra.claims import AllocatedDevice, ClaimRef, claim_file_name, claim_object
from plugin.dra.service import REGISTRATION_SOCKET, SOCKET_NAME
from schemas.dra import DRIVER_NAME, device_name
from schemas.generated.kubelet.dra.v1 import api_pb2 as v1
from schemas.generated.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from schemas.kinds import ResourceKind
from simkit.fixture_nodes import A100_80GB_BARS, A100_80GB_PCIE, CLASS_3D, NVIDIA, PCI_IDS_EXCERPT
from simkit.kubelet_dra_standin import KubeletDraStandIn
from simkit.sysfs_fixture import Function, Node, build

ROOT = Path(__file__).resolve().parent.parent
POOL = "bench-node"
BUSES = (0x17, 0x3B, 0x5E, 0x86, 0xAF, 0xD8, 0xE1, 0xF0)
GPUS = tuple(f"0000:{bus:02x}:00.0" for bus in BUSES)
EIGHT_GPUS = Node(
    name=POOL,
    functions=tuple(
        Function(address, NVIDIA, A100_80GB_PCIE, CLASS_3D, "vfio-pci", 10 + index, index // 4, bars=A100_80GB_BARS)
        for index, address in enumerate(GPUS)
    ),
    pci_ids=PCI_IDS_EXCERPT,
)
"""Eight A100 80GB on vfio-pci, one per IOMMU group, on the root bus (four per NUMA node)."""


def claim(size: int, index: int) -> tuple[ClaimRef, list[AllocatedDevice]]:
    ref = ClaimRef("bench", f"gpus-{size}", f"00000000-0000-4000-8000-{size:04d}{index:08d}")
    devices = [
        AllocatedDevice(f"gpu{n}", DRIVER_NAME, POOL, device_name(ResourceKind.PCI, GPUS[n])) for n in range(size)
    ]
    return ref, devices


def env() -> dict[str, str]:
    variables = {key: value for key, value in os.environ.items() if not key.startswith("GPU_PLUGIN_")}
    variables["PYTHONPATH"] = str(ROOT)
    return variables


@contextmanager
def plugin(base: Path, host_root: Path) -> Iterator[subprocess.Popen[bytes]]:
    code = "from plugin.cli import main; main()"
    command = [sys.executable, "-c", code, "serve", "--dra", "--host-root", str(host_root)]
    command += ["--dra-plugin-dir", str(base / "p"), "--plugins-registry", str(base / "r")]
    command += ["--cdi-dir", str(base / "cdi"), "--claims-dir", str(base / "claims"), "--node-name", POOL]
    child = subprocess.Popen(command, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield child
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def median_pair(first: Callable[[], None], second: Callable[[], None], rounds: int) -> tuple[float, float]:
    """Medians of ``first`` and ``second``, warmed up and interleaved in five blocks."""
    for _ in range(min(rounds, 20)):
        first()
        second()
    a: list[float] = []
    b: list[float] = []
    for _ in range(5):
        for action, samples in ((second, b), (first, a)):
            for _ in range(max(rounds // 5, 1)):
                start = time.perf_counter()
                action()
                samples.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=None, help="round trips per claim size (default: 500; 10 with --cluster)"
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="the real kubelet's prepare path instead (bench/dra_cluster.py: claim to container start vs an empty pod)",
    )
    options = parser.parse_args(argv)
    if options.cluster:
        from bench.dra_cluster import run

        return run(max(options.rounds or 10, 3))
    options.rounds = options.rounds or 500
    rounds = max(options.rounds, 5)
    base = Path(tempfile.mkdtemp(prefix="drb", dir="/tmp"))
    figures: dict[int, tuple[float, float]] = {}
    try:
        host_root = build(EIGHT_GPUS, base / "root")
        (base / "claims").mkdir()
        (base / "cdi").mkdir()
        refs = {}
        for size in (1, 8):
            ref, devices = claim(size, 0)
            (base / "claims" / claim_file_name(ref.namespace, ref.name)).write_text(
                json.dumps(claim_object(ref, devices))
            )
            refs[size] = (ref.namespace, ref.name, ref.uid)
        with KubeletDraStandIn(base / "r") as kubelet, plugin(base, host_root) as process:
            kubelet.wait_for_registration(DRIVER_NAME, timeout=30)
            assert (base / "r" / REGISTRATION_SOCKET).is_socket()
            with grpc.insecure_channel(f"unix:{base / 'p' / SOCKET_NAME}") as channel:
                empty_call = v1_grpc.DRAPluginStub(channel).NodePrepareResources
                empty = v1.NodePrepareResourcesRequest()

                def floor() -> None:
                    empty_call(empty, timeout=10)

                for size, key in refs.items():

                    def round_trip(key: tuple[str, str, str] = key, size: int = size) -> None:
                        devices, error = kubelet.prepare(DRIVER_NAME, [key])[key[2]]
                        if error or len(devices) != size:
                            raise RuntimeError(f"prepare failed: {error or devices}")
                        if kubelet.unprepare(DRIVER_NAME, [key]) != {key[2]: ""}:
                            raise RuntimeError("unprepare failed")

                    figures[size] = median_pair(round_trip, floor, rounds)
            assert process.poll() is None, "the plugin exited"
            left = sorted(path.name for path in (base / "cdi").iterdir())
            assert left == [], f"CDI specs left behind: {left}"
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"serve --dra on {len(GPUS)} passthrough GPUs, kubelet DRA stand-in over unix sockets, {rounds} rounds")
    for size, (trip, floor_s) in figures.items():
        print(
            f"prepare+unprepare, claim of {size} GPU{'s' if size > 1 else ''}: {trip * 1e6:8.1f} us median "
            f"(floor: empty NodePrepareResources {floor_s * 1e6:.1f} us, {trip / floor_s:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
