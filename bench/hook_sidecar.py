"""The hook sidecar against its floor on every path a user takes, at 1, 4, 16 and 32 GPUs, and resident memory.

Run: ``python -m bench.hook_sidecar [--rounds N] [--cold N] [--sizes 1,4,16,32] [--paths add,merge,…]``. Every
server runs in its own process on a unix socket, as in a pod, and one client here calls them in turn. The paths:

- ``add``: the hook adds the GPUs to a domain without them (allocation from its env);
- ``merge``: the hook merges with the GPUs virt-launcher already rendered (``type="pci"`` to drop on each source
  address, ``mode=`` to add);
- ``companions-env``: ``add`` with the plugin's ``PCI_COMPANIONS_*`` variable: each GPU (a TU106 card) gets its
  audio, USB and UCSI functions in its guest slot, behind a new root port;
- ``companions-sysfs``: as deployed with PodResources: the allocation from a kubelet PodResources stand-in (its
  own process; ``Get`` for the hook's pod), virt-launcher's rendered GPUs, the companions read from a sysfs tree;
- ``companions-domain``: the deployed default: the allocation read from the domain itself (``DomainSource``),
  companions from the sysfs tree;
- ``efi-window``: ``add`` for an OVMF guest whose GPUs' 128 GiB BARs (read from the sysfs tree) need the 64-bit
  PCI window: ``-fw_cfg opt/ovmf/X-PciMmio64Mb`` is written;
- ``dra``: every GPU from a DRA claim (KEP 5304 metadata files under ``--dra-metadata-root``), companions from
  the sysfs tree;
- ``cliques``: ``add`` on a sysfs tree where every two GPUs sit below one PCIe switch: each pair gets a GPUDirect
  clique through ``<qemu:override>`` (docs/p2p.md).

Each case (path, size) gets its own ``launcher-hook serve``; it is measured against a gRPC server that only
parses and serialises the same domain with lxml (``bench/hook_floor_server.py``), interleaved in the same run;
goal: median round trip at most 1.3x the floor's on every case. A path that reads files (sysfs, DRA metadata) or
asks the kubelet (PodResources) is also measured against a second floor that does the same reads the simplest
way (``--reads``: the files the rule needs, unconfined and unbounded, nothing decided), to show what the reads
themselves cost beside what the hook does with them; the goal stays the first floor. (That floor reads on every
call; in the steady state the hook reads no sysfs file, opens no DRA file and asks the kubelet nothing, so it
does less I/O than that floor.) Every case is also measured against a floor that parses the call's domain and
serialises the hook's own answer to it (``--answer``): what any hook giving that answer pays on this transport
(the companion paths answer several times the call's bytes), printed as its ratio to the goal's floor and the
hook's ratio to it, to tell the answer's size from the hook's own work. The marginal cost of a
GPU, ((hook - floor) at 32 - (hook - floor) at 16) / 16, at most 15 us.

The round trips above are the steady state: each server is called 100 times before it is timed. A hook server
keeps what it read of its pod's devices for its life (``launcher_hook/service.py``), so on the paths that read
the host these are the calls after the first, what KubeVirt's second and third ``OnDefineDomain`` of a VM start
cost. The first calls are measured apart (``--cold N``, default 5; 0: not at all): on each of those paths N fresh
hook servers and N fresh floor servers (and N of ``--compare``'s hook), started in turn, each called twice once
its channel is ready (50 ms apart, as virt-launcher defines the domain in between); the medians of the first
calls (what a VM start's first ``OnDefineDomain`` costs, the process's own warm-up included) and of the second
(KubeVirt's next call) are printed beside the steady figures, each against the fresh floors' same call. Memory:
the largest RSS of the hook servers after their runs against an idle Python gRPC server's; goal at most 1.3x.
Prints figures and ratios (and ``os.getloadavg()``) and exits 0; a measurement, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.hook_floor_server import Reads
from bench.workloads import (
    CARD_COMPANIONS_VARIABLE,
    CARD_RESOURCE,
    CARD_VARIABLE,
    companions_value,
    efi_domain,
    gpu_addresses,
    gpu_vmi,
    kubevirt_sized_domain,
    median_seconds,
    rendered_domain,
)
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc

LATENCY_GOAL = 1.3
MEMORY_GOAL = 1.3
MARGINAL_GOAL_US = 15.0
ROOT = Path(__file__).resolve().parent.parent
FLOOR_SERVER = Path(__file__).resolve().parent / "hook_floor_server.py"
KUBELET_SERVER = Path(__file__).resolve().parent / "hook_kubelet_server.py"
PATHS = ("add", "merge", "companions-env", "companions-sysfs", "companions-domain", "efi-window", "dra", "cliques")
SIZES = (1, 4, 16, 32)
POD = ("ml", "virt-launcher-big-abcde")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


@contextmanager
def server(
    command: list[str], socket_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[int]:
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
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


def hook_command(socket_path: Path, *options: str) -> list[str]:
    code = "from launcher_hook.cli import main; main()"
    return [sys.executable, "-c", code, "serve", "--socket", str(socket_path), *options]


def floor_command(socket_path: Path, mode: str) -> list[str]:
    return [sys.executable, str(FLOOR_SERVER), "--socket", str(socket_path), "--mode", mode]


Call = Callable[[v1alpha3_pb2.OnDefineDomainParams], object]


def measure(calls: list[Call], params: v1alpha3_pb2.OnDefineDomainParams, rounds: int) -> list[float]:
    """The median round trip of each of ``calls`` in seconds, interleaved so machine noise hits them alike."""
    for _ in range(100):  # warm up
        for call in calls:
            call(params)
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(5):
        for call, found in zip(calls, samples, strict=True):
            found.append(median_seconds(lambda call=call: call(params), max(rounds // 5, 1)))  # type: ignore[misc]
    return [statistics.median(found) for found in samples]


# ---- the fixtures --------------------------------------------------------------------------------------


def sysfs_tree(directory: Path, count: int) -> Path:
    """:func:`build_sysfs_tree`, built once per run and size."""
    sys_dir = directory / f"node{count}" / "sys"
    return sys_dir if sys_dir.is_dir() else build_sysfs_tree(directory, count)


def build_sysfs_tree(directory: Path, count: int) -> Path:
    """A node's sysfs with ``count`` cards on vfio-pci: function 0 a display function with an A100's 128 GiB
    BAR1, functions 1-3 a TU106's audio, USB and UCSI, the four in one IOMMU group."""
    from simkit.fixture_nodes import (
        A100_80GB_BARS,
        CLASS_AUDIO,
        CLASS_SERIAL_BUS,
        CLASS_USB_XHCI,
        CLASS_VGA,
        NVIDIA,
        PCI_IDS_EXCERPT,
    )
    from simkit.sysfs_fixture import BarSpec, Function, Node, build

    functions = []
    for index, address in enumerate(gpu_addresses(count)):
        parts: tuple[tuple[int, int, tuple[BarSpec, ...]], ...] = (
            (0x1F08, CLASS_VGA, A100_80GB_BARS),
            (0x10F9, CLASS_AUDIO, ()),
            (0x1ADA, CLASS_USB_XHCI, ()),
            (0x1ADB, CLASS_SERIAL_BUS, ()),
        )
        for number, (device, pci_class, bars) in enumerate(parts):
            name = f"{address[:-1]}{number}"
            functions.append(Function(name, NVIDIA, device, pci_class, "vfio-pci", 100 + index, 0, bars=bars))
    node = Node(name="bench", functions=tuple(functions), pci_ids=PCI_IDS_EXCERPT)
    return build(node, directory / f"node{count}") / "sys"


def switched_tree(directory: Path, count: int) -> Path:
    """A node's sysfs with ``count`` display functions on vfio-pci, every two below one PCIe switch (a root port,
    the switch's upstream port, a downstream port per GPU): the GPUDirect cliques of docs/p2p.md."""
    sys_dir = directory / f"switched{count}" / "sys"
    if sys_dir.is_dir():
        return sys_dir
    from simkit.fixture_nodes import A100_80GB_BARS, CLASS_PCI_BRIDGE, CLASS_VGA, INTEL, NVIDIA, PCI_IDS_EXCERPT, PLX
    from simkit.sysfs_fixture import Function, Node, build

    functions = []
    for index, address in enumerate(gpu_addresses(count)):
        pair, member = divmod(index, 2)
        root_port, upstream = f"0000:00:{pair + 1:02x}.0", f"0000:{0xC0 + pair:02x}:00.0"
        downstream = f"0000:{0xC0 + pair:02x}:{member + 1:02x}.0"
        if member == 0:
            functions.append(Function(root_port, INTEL, 0x1901, CLASS_PCI_BRIDGE, "pcieport", 1000 + pair, 0))
            functions.append(
                Function(upstream, PLX, 0x8747, CLASS_PCI_BRIDGE, "pcieport", 2000 + pair, 0, parent=root_port)
            )
        functions.append(
            Function(downstream, PLX, 0x8747, CLASS_PCI_BRIDGE, "pcieport", 3000 + index, 0, parent=upstream)
        )
        functions.append(
            Function(
                address, NVIDIA, 0x1F08, CLASS_VGA, "vfio-pci", 100 + index, 0, parent=downstream, bars=A100_80GB_BARS
            )
        )
    node = Node(name="bench-switched", functions=tuple(functions), pci_ids=PCI_IDS_EXCERPT)
    return build(node, directory / f"switched{count}") / "sys"


def dra_tree(directory: Path, count: int) -> Path:
    """The KEP 5304 metadata files of :func:`gpu_vmi` ``(count, dra=True)``'s claims, each naming one GPU."""
    from schemas.vmi import parse_vmi
    from simkit.dra_files import write_vmi_tree

    root = directory / f"dra{count}"
    vmi = parse_vmi(gpu_vmi(count, dra=True))
    devices = {(f"c{i}", "gpu"): address for i, address in enumerate(gpu_addresses(count))}
    write_vmi_tree(root, vmi, devices, pod_name=POD[1])
    return root


def companions_reads(sys_dir: Path, addresses: list[str]) -> Reads:
    """What the companion rule must read for ``addresses``, at the least: ``bus/pci/devices`` listed, each GPU's
    ``driver``, ``physfn`` and ``class``, and the ``iommu_group`` and ``driver`` links of every function of its
    slot that is there."""
    devices = f"{sys_dir}/bus/pci/devices"
    present = set(os.listdir(devices))
    reads = Reads(listdir=[devices])
    for address in addresses:
        reads.lstat.append(f"{devices}/{address}/physfn")
        reads.read.append(f"{devices}/{address}/class")
        for function in range(8):
            name = f"{address[:-1]}{function}"
            if name in present:
                reads.readlink += [f"{devices}/{name}/iommu_group", f"{devices}/{name}/driver"]
    return reads


@dataclass
class Case:
    """One path at one size: what the hook server gets, what the call sends, what the output must hold."""

    path: str
    size: int
    domain: bytes
    vmi: bytes
    env: dict[str, str] = field(default_factory=dict)
    options: list[str] = field(default_factory=list)
    kubelet: list[str] | None = None
    hostdevs: int = 0
    must_hold: bytes = b""
    reads: Reads | None = None
    """The file work the path must do on each call (for the second floor, ``floor + reads``); None: none."""


def case(path: str, size: int, directory: Path) -> Case:
    addresses = gpu_addresses(size)
    allocation = {CARD_VARIABLE: ",".join(addresses)}
    vmi = gpu_vmi(size)
    plain = kubevirt_sized_domain()
    rendered = rendered_domain(addresses)
    with_companions = 4 * size
    if path == "add":
        return Case(path, size, plain, vmi, allocation, hostdevs=size)
    if path == "merge":
        return Case(path, size, rendered, vmi, allocation, hostdevs=size)
    if path == "companions-env":
        env = {**allocation, CARD_COMPANIONS_VARIABLE: companions_value(addresses)}
        return Case(path, size, plain, vmi, env, hostdevs=with_companions, must_hold=b"pcie-root-port")
    sys_dir = sysfs_tree(directory, size)
    sysfs = ["--sysfs-root", str(sys_dir)]
    companion_reads = companions_reads(sys_dir, addresses)
    if path == "companions-sysfs":
        socket_path = directory / f"kubelet{size}.sock"
        kubelet = [sys.executable, str(KUBELET_SERVER), "--socket", str(socket_path), "--pod", "/".join(POD)]
        kubelet += ["--resource", CARD_RESOURCE, "--devices", ",".join(reversed(addresses))]
        options = ["--pod-resources-socket", str(socket_path), *sysfs]
        env = {"POD_NAMESPACE": POD[0], "POD_NAME": POD[1]}
        companion_reads.pod_resources = [str(socket_path), *POD]
        return Case(
            path, size, rendered, vmi, env, options, kubelet, with_companions, b"pcie-root-port", companion_reads
        )
    if path == "companions-domain":
        return Case(path, size, rendered, vmi, {}, sysfs, None, with_companions, b"pcie-root-port", companion_reads)
    if path == "efi-window":
        reads = Reads(read=[f"{sys_dir}/bus/pci/devices/{address}/resource" for address in addresses])
        return Case(path, size, efi_domain(), vmi, allocation, sysfs, None, size, b"X-PciMmio64Mb", reads)
    if path == "dra":
        metadata = dra_tree(directory, size)
        options = [*sysfs, "--dra-metadata-root", str(metadata)]
        files = sorted(metadata.rglob("*.json"))
        companion_reads.listdir += sorted({str(file.parent) for file in files})
        companion_reads.json = [str(file) for file in files]
        dra_vmi = gpu_vmi(size, dra=True)
        return Case(path, size, plain, dra_vmi, {}, options, None, with_companions, b"ua-gpu0-fn1", companion_reads)
    if path == "cliques":
        options = ["--sysfs-root", str(switched_tree(directory, size))]
        return Case(
            path, size, plain, vmi, allocation, options, None, size, b"x-nv-gpudirect-clique" if size > 1 else b""
        )
    raise ValueError(f"unknown path {path!r}")


# ---- the run -------------------------------------------------------------------------------------------


def server_env() -> dict[str, str]:
    """This process's environment without what would change a server's allocation or options (a case's own
    :attr:`Case.env` goes on top), with this checkout importable."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PCI_RESOURCE", "MDEV_PCI_RESOURCE", "PCI_COMPANIONS", "LAUNCHER_HOOK_", "POD_"))
    }
    env["PYTHONPATH"] = str(ROOT)
    return env


def check_answer(current: Case, produced: bytes) -> None:
    """Fail unless ``produced``, the hook's answer for ``current``, is what the path must give: its hostdevs, no
    ``type=`` left on a source address, :attr:`Case.must_hold`."""
    label = f"{current.path} x{current.size}"
    assert produced.count(b"<hostdev ") == current.hostdevs, f"{label}: {produced.count(b'<hostdev ')} hostdevs"
    assert not re.search(rb"<source>\s*<address type=", produced), f"{label}: type= left on a source address"
    assert current.must_hold in produced, f"{label}: no {current.must_hold!r} in the output"


@dataclass
class Figure:
    case: Case
    hook_s: float
    floor_s: float
    size_out: int
    rss_kib: int
    other_s: float | None = None
    """The round trip of the hook of ``--compare``'s tree, measured interleaved with the others."""
    reads_floor_s: float | None = None
    """The round trip of the floor that also does the path's reads (:class:`Case` ``reads``)."""
    answer_floor_s: float | None = None
    """The round trip of the floor that parses the call's domain and serialises the hook's answer."""
    cold_hook_s: float | None = None
    """The median first call of a fresh hook server (``--cold``; the paths that read the host)."""
    cold_floor_s: float | None = None
    """The median first call of a fresh floor server, measured in turn with :attr:`cold_hook_s`'s."""
    second_hook_s: float | None = None
    """The median second call of those fresh hook servers."""
    second_floor_s: float | None = None
    """The median second call of those fresh floor servers."""
    cold_other_s: float | None = None
    """The median first call of fresh servers of ``--compare``'s hook."""

    @property
    def ratio(self) -> float:
        return self.hook_s / self.floor_s

    @property
    def cold_ratio(self) -> float | None:
        """The first call of a fresh hook server over a fresh floor's; None when not measured."""
        if self.cold_hook_s is None or self.cold_floor_s is None:
            return None
        return self.cold_hook_s / self.cold_floor_s


def _stub(stack: ExitStack, socket_path: Path) -> Call:
    channel = stack.enter_context(grpc.insecure_channel(f"unix:{socket_path}"))
    stub = v1alpha3_pb2_grpc.CallbacksStub(channel).OnDefineDomain

    def call(params: v1alpha3_pb2.OnDefineDomainParams) -> object:
        return stub(params, timeout=60)

    return call


def first_calls(
    command: list[str],
    socket_path: Path,
    env: dict[str, str],
    cwd: Path | None,
    params: v1alpha3_pb2.OnDefineDomainParams,
) -> tuple[float, float]:
    """The round trips of the first and second ``OnDefineDomain`` of a server started now, timed once its channel
    is ready."""
    with (
        server(command, socket_path, env, cwd=cwd),
        grpc.insecure_channel(f"unix:{socket_path}") as channel,
    ):
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = v1alpha3_pb2_grpc.CallbacksStub(channel).OnDefineDomain
        times: list[float] = []
        for call in range(2):
            if call:
                time.sleep(0.05)  # virt-launcher defines the domain in libvirt between two calls
            started = time.perf_counter()
            stub(params, timeout=60)
            times.append(time.perf_counter() - started)
        return times[0], times[1]


def cold_calls(
    current: Case,
    directory: Path,
    env: dict[str, str],
    base_env: dict[str, str],
    times: int,
    compare: Path | None,
) -> tuple[float, float, float, float, float | None]:
    """The medians of the first and second calls of ``times`` fresh hook servers and as many fresh floor servers
    (hook first, floor first, hook second, floor second), and of the first calls of ``--compare``'s, in turn."""
    params = v1alpha3_pb2.OnDefineDomainParams(domainXML=current.domain, vmi=current.vmi)
    hook: list[tuple[float, float]] = []
    floor: list[tuple[float, float]] = []
    other: list[float] = []
    label = f"{current.path}-{current.size}"
    for index in range(times):
        hook_socket = directory / f"cold-{label}-{index}.sock"
        hook.append(first_calls(hook_command(hook_socket, *current.options), hook_socket, env, ROOT, params))
        floor_socket = directory / f"coldfloor-{label}-{index}.sock"
        floor.append(first_calls(floor_command(floor_socket, "floor"), floor_socket, base_env, None, params))
        if compare is not None:
            other_socket = directory / f"coldother-{label}-{index}.sock"
            other_env = {**env, "PYTHONPATH": str(compare)}
            command = hook_command(other_socket, *current.options)
            other.append(first_calls(command, other_socket, other_env, compare, params)[0])
    return (
        statistics.median(first for first, _ in hook),
        statistics.median(first for first, _ in floor),
        statistics.median(second for _, second in hook),
        statistics.median(second for _, second in floor),
        statistics.median(other) if other else None,
    )


def run_case(
    current: Case,
    floor: Call,
    directory: Path,
    base_env: dict[str, str],
    rounds: int,
    compare: Path | None,
    cold: int = 0,
) -> Figure:
    socket_path = directory / f"hook-{current.path}-{current.size}.sock"
    env = {**base_env, **current.env}
    with ExitStack() as stack:
        if current.kubelet is not None:
            stack.enter_context(server(current.kubelet, Path(current.kubelet[current.kubelet.index("--socket") + 1])))
        pid = stack.enter_context(server(hook_command(socket_path, *current.options), socket_path, env, cwd=ROOT))
        stub = v1alpha3_pb2_grpc.CallbacksStub(stack.enter_context(grpc.insecure_channel(f"unix:{socket_path}")))
        hook = _stub(stack, socket_path)
        other = None
        if compare is not None:
            other_socket = directory / f"other-{current.path}-{current.size}.sock"
            other_env = {**env, "PYTHONPATH": str(compare)}
            command = hook_command(other_socket, *current.options)
            stack.enter_context(server(command, other_socket, other_env, cwd=compare))
            other = _stub(stack, other_socket)

        reads_floor = None
        if current.reads is not None:
            reads_file = directory / f"reads-{current.path}-{current.size}.json"
            reads_file.write_text(json.dumps(dataclasses.asdict(current.reads)))
            reads_socket = directory / f"floor-{current.path}-{current.size}.sock"
            command = [*floor_command(reads_socket, "floor"), "--reads", str(reads_file)]
            stack.enter_context(server(command, reads_socket, base_env))
            reads_floor = _stub(stack, reads_socket)

        params = v1alpha3_pb2.OnDefineDomainParams(domainXML=current.domain, vmi=current.vmi)
        produced: bytes = stub.OnDefineDomain(params, timeout=60).domainXML
        check_answer(current, produced)
        label = f"{current.path} x{current.size}"
        again_params = v1alpha3_pb2.OnDefineDomainParams(domainXML=produced, vmi=current.vmi)
        assert stub.OnDefineDomain(again_params, timeout=60).domainXML == produced, f"{label}: not idempotent"
        answer_file = directory / f"answer-{current.path}-{current.size}.xml"
        answer_file.write_bytes(produced)
        answer_socket = directory / f"answerfloor-{current.path}-{current.size}.sock"
        command = [*floor_command(answer_socket, "floor"), "--answer", str(answer_file)]
        stack.enter_context(server(command, answer_socket, base_env))
        answer_floor = _stub(stack, answer_socket)
        extra = [call for call in (other, reads_floor) if call is not None]
        hook_s, floor_s, answer_s, *more = measure([hook, floor, answer_floor, *extra], params, rounds)
        other_s = more.pop(0) if other is not None else None
        reads_s = more.pop(0) if reads_floor is not None else None
        figure = Figure(current, hook_s, floor_s, len(produced), rss_kib(pid), other_s, reads_s, answer_s)
        if cold and current.reads is not None:
            found = cold_calls(current, directory, env, base_env, cold, compare)
            figure.cold_hook_s, figure.cold_floor_s, figure.second_hook_s, figure.second_floor_s = found[:4]
            figure.cold_other_s = found[4]
        return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000, help="round trips per server and case (default: 1000)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="GPUs per VM (default: 1,4,16,32)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"default: {','.join(PATHS)}")
    parser.add_argument(
        "--cold",
        type=int,
        default=5,
        help="fresh servers whose first call is timed, per path that reads the host and size (default: 5; 0: none)",
    )
    parser.add_argument(
        "--compare", type=Path, help="another checkout whose launcher-hook is measured too, interleaved (A/B)"
    )
    options = parser.parse_args()
    rounds = max(options.rounds, 10)
    sizes = [int(size) for size in options.sizes.split(",")]
    paths = [path for path in options.paths.split(",") if path]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown paths: {', '.join(unknown)}")
    directory = Path(tempfile.mkdtemp(prefix="hkbench", dir="/tmp"))
    base_env = server_env()
    figures: list[Figure] = []
    loads = [os.getloadavg()[0]]
    try:
        floor_socket, idle_socket = directory / "floor.sock", directory / "idle.sock"
        with (
            server(floor_command(floor_socket, "floor"), floor_socket, base_env),
            grpc.insecure_channel(f"unix:{floor_socket}") as floor_channel,
        ):
            floor_stub = v1alpha3_pb2_grpc.CallbacksStub(floor_channel).OnDefineDomain

            def floor(params: v1alpha3_pb2.OnDefineDomainParams) -> object:
                return floor_stub(params, timeout=60)

            for path in paths:
                for size in sizes:
                    figure = run_case(
                        case(path, size, directory), floor, directory, base_env, rounds, options.compare, options.cold
                    )
                    figures.append(figure)
                    loads.append(os.getloadavg()[0])
                    print(describe(figure), flush=True)
        with server(floor_command(idle_socket, "idle"), idle_socket, base_env) as idle_pid:
            time.sleep(0.5)
            idle_rss = rss_kib(idle_pid)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report(figures, idle_rss, rounds, loads)


def describe(figure: Figure) -> str:
    head = f"{figure.case.path:17} x{figure.case.size:<3}"
    times = f"floor {figure.floor_s * 1e6:7.1f} us, hook {figure.hook_s * 1e6:7.1f} us: {figure.ratio:.2f}x"
    other = (
        f"; --compare {figure.other_s * 1e6:7.1f} us: {figure.other_s / figure.floor_s:.2f}x" if figure.other_s else ""
    )
    reads = (
        f"; floor + reads {figure.reads_floor_s * 1e6:7.1f} us: {figure.hook_s / figure.reads_floor_s:.2f}x"
        if figure.reads_floor_s
        else ""
    )
    if figure.answer_floor_s:
        over_floor, hook_over = figure.answer_floor_s / figure.floor_s, figure.hook_s / figure.answer_floor_s
        reads += (
            f"; floor giving the hook's answer {figure.answer_floor_s * 1e6:7.1f} us "
            f"({over_floor:.2f}x the floor; hook {hook_over:.2f}x it)"
        )
    cold = ""
    if figure.cold_hook_s is not None and figure.cold_floor_s is not None:
        cold = (
            f"; first call {figure.cold_hook_s * 1e6:7.1f} us vs a fresh floor's {figure.cold_floor_s * 1e6:7.1f} "
            f"us: {figure.cold_ratio:.2f}x"
        )
        if figure.cold_other_s is not None:
            cold += (
                f" (--compare {figure.cold_other_s * 1e6:7.1f} us: {figure.cold_other_s / figure.cold_floor_s:.2f}x)"
            )
        if figure.second_hook_s is not None and figure.second_floor_s is not None:
            cold += (
                f"; second call {figure.second_hook_s * 1e6:7.1f} us vs {figure.second_floor_s * 1e6:7.1f} us: "
                f"{figure.second_hook_s / figure.second_floor_s:.2f}x"
            )
    return f"{head} {times}{other}{reads}{cold}  ({len(figure.case.domain)} bytes in, {figure.size_out} out)"


def report(figures: list[Figure], idle_rss: int, rounds: int, loads: list[float]) -> None:
    print(f"\n{rounds} round trips per server and case, unix socket; 1-minute load {min(loads):.2f}-{max(loads):.2f}")
    print("steady state (each server called 100 times first: a hook server keeps what it read of the host)")
    met = [figure for figure in figures if figure.ratio <= LATENCY_GOAL]
    print(f"latency: {len(met)} of {len(figures)} cases within {LATENCY_GOAL}x the floor")
    worst = max(figures, key=lambda figure: figure.ratio)
    print(f"         worst {worst.case.path} x{worst.case.size}: {worst.ratio:.2f}x")
    reading = [figure for figure in figures if figure.reads_floor_s]
    if reading:
        within = [f for f in reading if f.reads_floor_s and f.hook_s / f.reads_floor_s <= LATENCY_GOAL]
        print(
            f"the {len(reading)} cases that read files or ask the kubelet: {len(within)} within {LATENCY_GOAL}x a "
            "floor that does the same reads (not the goal: the goal's floor reads nothing)"
        )
    by_case = {(figure.case.path, figure.case.size): figure for figure in figures}
    for path in dict.fromkeys(figure.case.path for figure in figures):
        high, low = by_case.get((path, 32)), by_case.get((path, 16))
        if high is None or low is None:
            continue
        marginal = ((high.hook_s - high.floor_s) - (low.hook_s - low.floor_s)) / 16 * 1e6
        verdict = "MET" if marginal <= MARGINAL_GOAL_US else "NOT MET"
        print(f"marginal cost per GPU, {path}: {marginal:.1f} us (goal <= {MARGINAL_GOAL_US:.0f} us): {verdict}")
    hook_rss = max(figure.rss_kib for figure in figures)
    memory_ratio = hook_rss / idle_rss
    print(
        f"RSS: hook at most {hook_rss / 1024:.1f} MiB after its runs, idle Python gRPC server {idle_rss / 1024:.1f} MiB"
    )
    verdict = "MET" if memory_ratio <= MEMORY_GOAL else "NOT MET"
    print(f"memory ratio: {memory_ratio:.2f}x the idle server (goal <= {MEMORY_GOAL}x): {verdict}")
    cold = {f"first call {f.case.path} x{f.case.size}": f.cold_ratio for f in figures if f.cold_ratio is not None}
    if cold:
        cold_within = [ratio for ratio in cold.values() if ratio is not None and ratio <= LATENCY_GOAL]
        print(f"first call of a fresh server: {len(cold_within)} of {len(cold)} within {LATENCY_GOAL}x a fresh floor's")
    print(json.dumps({f"{f.case.path} x{f.case.size}": round(f.ratio, 3) for f in figures}))
    answering = {
        f"answer floor {f.case.path} x{f.case.size}": round(f.answer_floor_s / f.floor_s, 3)
        for f in figures
        if f.answer_floor_s
    }
    print(json.dumps(answering))
    if cold:
        print(json.dumps({name: round(ratio, 3) for name, ratio in cold.items() if ratio is not None}))
        second = {
            f"second call {f.case.path} x{f.case.size}": round(f.second_hook_s / f.second_floor_s, 3)
            for f in figures
            if f.second_hook_s is not None and f.second_floor_s is not None
        }
        print(json.dumps(second))


if __name__ == "__main__":
    main()
