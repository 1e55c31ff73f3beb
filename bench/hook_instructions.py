"""The hook sidecar against its floor in CPU instructions, which the machine's load does not change: every path.

Run: ``python -m bench.hook_instructions [--paths add,merge,…] [--sizes 1,4,16,32] [--calls N]`` (needs
valgrind; all 7 paths at 4 sizes take about half an hour, more on a busy machine). Every case of
``bench/hook_sidecar.py`` (:data:`~bench.hook_sidecar.PATHS` at :data:`~bench.hook_sidecar.SIZES`, built by its
``case()``: the sysfs trees, the DRA metadata files, the kubelet PodResources stand-in of ``companions-sysfs``,
which runs outside valgrind as the kubelet is another process) gets its own ``launcher-hook serve`` under
valgrind's callgrind, and the gRPC + lxml parse/serialise floor (``bench/hook_floor_server.py``) is run the same
way on the same request (once per distinct request: several paths send the same domain and VMI). Each server is
called 20 times first (its first answer checked as ``hook_sidecar`` checks it), so the counts are the steady
state: a hook server keeps its pod's host facts after its first call, as in ``hook_sidecar``'s round trips.
Callgrind is then told to dump (``callgrind_control -d``), the server is called N more times (default 100),
and dumped again: that dump's ``summary`` (every thread of the server process: gRPC, the handler, the log
writer; about 50 k of it is what an idle server does while the dump is asked for) divided by N is what one
``OnDefineDomain`` call costs there. The client is the same for both servers and is not counted; the servers
run with ``PYTHONHASHSEED=0``.

Prints, per case, the hook's and the floor's instructions per call and their ratio, then per path the
marginal instructions of a GPU, ((hook - floor) at 32 - (hook - floor) at 16) / 16, and the ratios as JSON.
Exits 0; a measurement, not a test (``make bench`` does not run it).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.hook_sidecar import PATHS, ROOT, SIZES, Case, case, check_answer, floor_command, hook_command, server
from bench.hook_sidecar import server_env as sidecar_env
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc

WARM_UP = 20
CALLS = 100
START_SECONDS = 180.0
CALL_SECONDS = 120.0
DUMP_SECONDS = 60.0
MARGINAL_SIZES = (16, 32)


@dataclass(frozen=True)
class Options:
    paths: list[str]
    sizes: list[int]
    calls: int


def parse_options(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--paths", default=",".join(PATHS), help=f"default: {','.join(PATHS)}")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="GPUs per VM (default: 1,4,16,32)")
    parser.add_argument(
        "--calls",
        type=int,
        default=CALLS,
        help=f"calls counted per server and case, after {WARM_UP} (default: {CALLS})",
    )
    options = parser.parse_args(argv)
    paths = list(dict.fromkeys(path for path in options.paths.split(",") if path))
    unknown = sorted(set(paths) - set(PATHS))
    if unknown or not paths:
        parser.error(f"unknown paths: {', '.join(unknown)}" if unknown else "no path given")
    try:
        sizes = list(dict.fromkeys(int(size) for size in options.sizes.split(",") if size))
    except ValueError:
        parser.error(f"--sizes: not a list of numbers: {options.sizes!r}")
    if not sizes or not all(1 <= size <= 200 for size in sizes):
        parser.error(f"--sizes: each from 1 to 200 GPUs (gpu_addresses), got {options.sizes!r}")
    if options.calls < 1:
        parser.error(f"--calls: at least 1, got {options.calls}")
    return Options(paths, sizes, options.calls)


# ---- the counting -------------------------------------------------------------------------------------


def dump_summary(path: Path) -> int | None:
    """The ``summary:`` of a callgrind dump (the events since the previous dump; here only ``Ir``); None while
    the dump is not fully written."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    if "\ntotals:" not in text:  # callgrind writes it last
        return None
    found = re.search(r"^summary:\s*(\d+)", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def per_call(summary: int, calls: int) -> float:
    """The instructions of one call in a dump of ``calls`` calls."""
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    return summary / calls


class Callgrind:
    """A server process under callgrind whose counts are dumped on request (``callgrind_control -d``)."""

    def __init__(self, process: subprocess.Popen[bytes], out_file: Path) -> None:
        self.process = process
        self.out_file = out_file
        self.dumps = 0

    def dump(self) -> int:
        """Dump the counts since the previous dump (or the start) and return their summary."""
        self.dumps += 1
        done = subprocess.run(
            ["callgrind_control", "-d", str(self.process.pid)],
            capture_output=True,
            text=True,
            timeout=DUMP_SECONDS,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"callgrind_control -d {self.process.pid} failed: {done.stdout}{done.stderr}")
        path = self.out_file.with_name(f"{self.out_file.name}.{self.dumps}")
        deadline = time.monotonic() + DUMP_SECONDS
        while (summary := dump_summary(path)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"callgrind wrote no dump {path} for pid {self.process.pid}")
            time.sleep(0.1)
        return summary


@contextmanager
def under_callgrind(
    command: list[str], socket_path: Path, env: dict[str, str], cwd: Path | None = None
) -> Iterator[Callgrind]:
    """``command`` (a server that listens on ``socket_path``) run under callgrind until the block ends."""
    out_file = socket_path.with_name(f"{socket_path.stem}.callgrind")
    errors = socket_path.with_name(f"{socket_path.stem}.stderr")  # a file: a pipe nobody reads would fill
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", *command]
    with errors.open("wb") as stderr:
        process = subprocess.Popen(valgrind, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + START_SECONDS
        while not socket_path.is_socket():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = errors.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{command[:3]} did not start under valgrind (exit {process.poll()}):\n{tail}")
            time.sleep(0.2)
        yield Callgrind(process, out_file)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=START_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def count(
    command: list[str],
    socket_path: Path,
    env: dict[str, str],
    params: v1alpha3_pb2.OnDefineDomainParams,
    calls: int,
    check: Case | None = None,
    cwd: Path | None = None,
) -> float:
    """The instructions per ``OnDefineDomain`` call of the server ``command`` in its steady state: called
    :data:`WARM_UP` times (the first answer checked against ``check``), then ``calls`` times counted."""
    with (
        under_callgrind(command, socket_path, env, cwd) as counted,
        grpc.insecure_channel(f"unix:{socket_path}") as channel,
    ):
        # The socket's file appears at bind(), and under valgrind listen() can come a while later.
        grpc.channel_ready_future(channel).result(timeout=START_SECONDS)
        call = v1alpha3_pb2_grpc.CallbacksStub(channel).OnDefineDomain
        for index in range(WARM_UP):
            produced = call(params, timeout=CALL_SECONDS).domainXML
            if index == 0 and check is not None:
                check_answer(check, produced)
        counted.dump()  # the start and the warm-up
        for _ in range(calls):
            call(params, timeout=CALL_SECONDS)
        return per_call(counted.dump(), calls)


# ---- the run ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    path: str
    size: int
    hook: float
    """Instructions per call in the hook server."""
    floor: float
    """Instructions per call in the floor server, on the same request."""

    @property
    def ratio(self) -> float:
        return self.hook / self.floor

    @property
    def over_floor(self) -> float:
        return self.hook - self.floor


def marginal(figures: Sequence[Figure]) -> dict[str, float]:
    """Per path with both sizes of :data:`MARGINAL_SIZES`: the instructions a GPU adds over the floor,
    ((hook - floor) at 32 - (hook - floor) at 16) / 16."""
    low_size, high_size = MARGINAL_SIZES
    by_case = {(figure.path, figure.size): figure for figure in figures}
    found: dict[str, float] = {}
    for path in dict.fromkeys(figure.path for figure in figures):
        low, high = by_case.get((path, low_size)), by_case.get((path, high_size))
        if low is not None and high is not None:
            found[path] = (high.over_floor - low.over_floor) / (high_size - low_size)
    return found


def describe(figure: Figure) -> str:
    return (
        f"{figure.path:17} x{figure.size:<3} hook {figure.hook / 1e6:6.2f} M, floor {figure.floor / 1e6:6.2f} M: "
        f"{figure.ratio:.2f}x (hook - floor {figure.over_floor / 1e6:+.2f} M)"
    )


def report(figures: Sequence[Figure], calls: int) -> list[str]:
    lines = [
        f"\ninstructions per OnDefineDomain in the server process, steady state ({WARM_UP} calls, then {calls} counted)"
    ]
    lines += [describe(figure) for figure in figures]
    for path, instructions in marginal(figures).items():
        lines.append(
            f"marginal per GPU, {path}: {instructions / 1e3:.1f} k instructions ((hook - floor) at 32 - at 16) / 16"
        )
    lines.append(json.dumps({f"{figure.path} x{figure.size}": round(figure.ratio, 3) for figure in figures}))
    return lines


def measure_case(
    current: Case, directory: Path, base_env: dict[str, str], calls: int, floors: dict[bytes, float]
) -> Figure:
    """The hook's and the floor's instructions per call on ``current``; the floor's looked up in ``floors`` (by
    request) and counted only when not there yet."""
    params = v1alpha3_pb2.OnDefineDomainParams(domainXML=current.domain, vmi=current.vmi)
    label = f"{current.path}-{current.size}"
    with ExitStack() as stack:
        if current.kubelet is not None:  # the kubelet is its own process, not counted
            stack.enter_context(server(current.kubelet, Path(current.kubelet[current.kubelet.index("--socket") + 1])))
        socket_path = directory / f"hook-{label}.sock"
        command = hook_command(socket_path, *current.options)
        hook = count(command, socket_path, {**base_env, **current.env}, params, calls, current, ROOT)
    request = params.SerializeToString(deterministic=True)
    if request not in floors:
        socket_path = directory / f"floor-{label}.sock"
        floors[request] = count(floor_command(socket_path, "floor"), socket_path, base_env, params, calls)
    return Figure(current.path, current.size, hook, floors[request])


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_options(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (with callgrind_control) is not installed")
    base_env = {**sidecar_env(), "PYTHONHASHSEED": "0"}
    directory = Path(tempfile.mkdtemp(prefix="hkinstr", dir="/tmp"))
    figures: list[Figure] = []
    floors: dict[bytes, float] = {}
    try:
        for path in options.paths:
            for size in options.sizes:
                figure = measure_case(case(path, size, directory), directory, base_env, options.calls, floors)
                figures.append(figure)
                print(describe(figure), flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print("\n".join(report(figures, options.calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
