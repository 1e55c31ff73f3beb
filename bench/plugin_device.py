"""The device plugin process against its goals, each figure next to a floor measured in the same run.

Run: ``python -m bench.plugin_device [--rounds N] [--idle SECONDS]``. ``gpu-device-plugin serve`` runs as a
process on the node01 fixture tree (four TU106 GPUs) in a temp dir; the kubelet stand-in runs here and talks
to it over the unix sockets, as the kubelet would.

- start to registered: process start → the stand-in accepts ``Register`` (goal ≤ 1 s); floor: process start →
  an empty Python gRPC server (``bench/plugin_floor_server.py``) listening; both with their bytecode cached,
  as the image has it (see :func:`env`);
- Allocate round trip, median (goal ≤ 2 ms); floor: an empty unary call (``PreStartContainer``) to the same
  server over the same socket, interleaved;
- health loss to the kubelet: ``/dev/vfio/<group>`` removed → the stand-in sees the GPU ``Unhealthy`` (goal
  ≤ 1 s, the scan interval left at its 5 s default so only inotify can make it); floor: the same removal seen
  by an inotify watch in this process;
- idle CPU over ``--idle`` seconds with default settings (goal ≤ 1 % of a core), next to the idle floor
  server's over the same window;
- resident memory after all that (goal ≤ 1.3x an idle Python gRPC server's, issue 12).

Prints figures with MET / NOT MET and exits 0: a measurement, not a test.
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

from plugin.inotify import ENTRIES_CHANGED, DirectoryWatch
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from simkit.fixture_nodes import NODE01
from simkit.kubelet_standin import KubeletStandIn
from simkit.sysfs_fixture import build

ROOT = Path(__file__).resolve().parent.parent
FLOOR_SERVER = Path(__file__).resolve().parent / "plugin_floor_server.py"
RESOURCE = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
SOCKET = "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
GPUS = ["0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0"]
GROUP = 74  # 0000:86:00.0's IOMMU group
START_GOAL = 1.0
ALLOCATE_GOAL = 0.002
HEALTH_GOAL = 1.0
CPU_GOAL = 0.01
MEMORY_GOAL = 1.3


def verdict(met: bool) -> str:
    return "MET" if met else "NOT MET"


PYCACHE: list[Path] = []
"""Where the processes' bytecode is cached for the run (set by :func:`main`)."""


def env() -> dict[str, str]:
    """The processes' environment: the repository importable, and bytecode cached as in the image.

    The image's ``pip install`` compiles every module at build time; a shell (or CI) with
    ``PYTHONDONTWRITEBYTECODE`` set and no ``__pycache__`` would make every start compile the plugin's ~50
    modules from source (and the floor's few). Both processes get a bytecode cache under the run's temp dir,
    filled by one untimed start of each before the timed ones.
    """
    variables = {key: value for key, value in os.environ.items() if not key.startswith("GPU_PLUGIN_")}
    variables["PYTHONPATH"] = str(ROOT)
    if PYCACHE:
        variables.pop("PYTHONDONTWRITEBYTECODE", None)
        variables["PYTHONPYCACHEPREFIX"] = str(PYCACHE[0])
    return variables


def plugin_command(host_root: Path, kubelet_dir: Path) -> list[str]:
    code = "from plugin.cli import main; main()"
    return [sys.executable, "-c", code, "serve", "--host-root", str(host_root), "--kubelet-dir", str(kubelet_dir)]


@contextmanager
def process(command: list[str]) -> Iterator[subprocess.Popen[bytes]]:
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


def wait_for(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.001)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def start_to_registered(base: Path, host_root: Path, rounds: int) -> tuple[float, float]:
    """Median seconds: plugin process start → registered; floor process start → listening."""
    plugin_times, floor_times = [], []
    for index in range(-1, rounds):  # round -1 is untimed: it fills the bytecode cache (see env())
        kubelet_dir = base / f"s{index}"
        with KubeletStandIn(kubelet_dir) as kubelet:
            started = time.monotonic()
            with process(plugin_command(host_root, kubelet_dir)):
                registration = kubelet.wait_for_registration(RESOURCE, timeout=30)
                plugin_times.append(registration.time - started)
        socket = base / f"f{index}.sock"
        started = time.monotonic()
        with process([sys.executable, str(FLOOR_SERVER), "--socket", str(socket)]):
            wait_for(socket.is_socket)
            floor_times.append(time.monotonic() - started)
    return statistics.median(plugin_times[1:]), statistics.median(floor_times[1:])


def allocate_round_trips(kubelet: KubeletStandIn, kubelet_dir: Path, rounds: int) -> tuple[float, float]:
    """Median seconds of Allocate (via the stand-in, as the kubelet calls it) and of an empty unary call."""
    with grpc.insecure_channel(f"unix:{kubelet_dir / SOCKET}") as channel:
        empty = pb_grpc.DevicePluginStub(channel).PreStartContainer
        request = pb.PreStartContainerRequest()

        def allocate() -> None:
            kubelet.allocate(RESOURCE, GPUS[:2])

        def floor() -> None:
            empty(request, timeout=10)

        for _ in range(100):  # warm up both
            allocate()
            floor()
        allocates: list[float] = []
        floors: list[float] = []
        for _ in range(5):  # interleave so machine noise hits both alike
            for action, samples in ((floor, floors), (allocate, allocates)):
                for _ in range(rounds // 5):
                    start = time.perf_counter()
                    action()
                    samples.append(time.perf_counter() - start)
    return statistics.median(allocates), statistics.median(floors)


def health_loss(kubelet: KubeletStandIn, host_root: Path, rounds: int) -> tuple[float, float, float]:
    """Median and worst seconds from removing the group node to the stand-in seeing Unhealthy; inotify floor."""
    node = host_root / "dev" / "vfio" / str(GROUP)
    losses, floors = [], []
    with DirectoryWatch(node.parent, ENTRIES_CHANGED) as watch:
        for _ in range(rounds):
            kubelet.wait_for_devices(RESOURCE, lambda devices: devices.get(GPUS[2]) == "Healthy", timeout=30)
            watch.read(0)
            started = time.monotonic()
            node.unlink()
            watch.read(10)
            floors.append(time.monotonic() - started)
            kubelet.wait_for_devices(RESOURCE, lambda devices: devices.get(GPUS[2]) == "Unhealthy", timeout=30)
            losses.append(time.monotonic() - started)
            node.write_text("")
    return statistics.median(losses), max(losses), statistics.median(floors)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000, help="Allocate round trips (default: %(default)s)")
    parser.add_argument("--idle", type=float, default=10.0, help="idle CPU window in seconds (default: %(default)s)")
    parser.add_argument("--starts", type=int, default=5, help="process starts timed (default: %(default)s)")
    parser.add_argument("--losses", type=int, default=20, help="health losses timed (default: %(default)s)")
    options = parser.parse_args(argv)
    rounds = max(options.rounds, 50)
    starts, losses = max(options.starts, 1), max(options.losses, 1)
    base = Path(tempfile.mkdtemp(prefix="kpb", dir="/tmp"))
    PYCACHE[:] = [base / "pycache"]
    try:
        host_root = build(NODE01, base / "root")
        start_s, start_floor = start_to_registered(base, host_root, starts)
        kubelet_dir = base / "k"
        floor_socket = base / "idle.sock"
        with (
            KubeletStandIn(kubelet_dir) as kubelet,
            process(plugin_command(host_root, kubelet_dir)) as plugin,
            process([sys.executable, str(FLOOR_SERVER), "--socket", str(floor_socket)]) as idle,
        ):
            kubelet.wait_for_devices(RESOURCE, lambda devices: len(devices) == 4, timeout=30)
            wait_for(floor_socket.is_socket)
            allocate_s, allocate_floor = allocate_round_trips(kubelet, kubelet_dir, rounds)
            loss_s, loss_worst, loss_floor = health_loss(kubelet, host_root, losses)
            time.sleep(1)  # let the last change settle before measuring rest
            plugin_cpu, idle_cpu = cpu_seconds(plugin.pid), cpu_seconds(idle.pid)
            time.sleep(options.idle)
            plugin_cpu = (cpu_seconds(plugin.pid) - plugin_cpu) / options.idle
            idle_cpu = (cpu_seconds(idle.pid) - idle_cpu) / options.idle
            plugin_rss, idle_rss = rss_kib(plugin.pid), rss_kib(idle.pid)
            assert plugin.poll() is None, "the plugin exited"
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("device plugin on node01 (4 GPUs), kubelet stand-in over unix sockets, default --scan-interval 5")
    print(
        f"start to registered: {start_s * 1e3:7.1f} ms median of {starts} (floor: empty Python gRPC server listening "
        f"{start_floor * 1e3:.1f} ms); goal <= {START_GOAL * 1e3:.0f} ms: {verdict(start_s <= START_GOAL)}"
    )
    print(
        f"Allocate round trip: {allocate_s * 1e6:7.1f} us median of {rounds} (floor: empty unary call on the same "
        f"socket {allocate_floor * 1e6:.1f} us, {allocate_s / allocate_floor:.2f}x); goal <= "
        f"{ALLOCATE_GOAL * 1e3:.0f} ms: {verdict(allocate_s <= ALLOCATE_GOAL)}"
    )
    print(
        f"health loss to kubelet: {loss_s * 1e3:7.1f} ms median of {losses}, worst {loss_worst * 1e3:.1f} ms (floor: "
        f"inotify sees the removal {loss_floor * 1e3:.2f} ms); goal <= {HEALTH_GOAL * 1e3:.0f} ms: "
        f"{verdict(loss_worst <= HEALTH_GOAL)}"
    )
    print(
        f"idle CPU: {plugin_cpu * 100:.3f} % of a core over {options.idle:.0f} s (floor: idle Python gRPC server "
        f"{idle_cpu * 100:.3f} %); goal <= {CPU_GOAL * 100:.0f} %: {verdict(plugin_cpu <= CPU_GOAL)}"
    )
    ratio = plugin_rss / idle_rss
    print(
        f"RSS: plugin {plugin_rss / 1024:.1f} MiB after the run, idle Python gRPC server {idle_rss / 1024:.1f} MiB, "
        f"{ratio:.2f}x; goal <= {MEMORY_GOAL}x: {verdict(ratio <= MEMORY_GOAL)}"
    )


if __name__ == "__main__":
    main()
