"""Soak: the device plugin process through kubelet restarts, device flapping and Allocate load (issue 7).

Every test runs the real ``gpu-device-plugin serve`` process against the kubelet stand-in over unix sockets,
on fixture trees in short temp dirs, and prints its figures (``make soak`` runs pytest with ``-s``). The
default test run does a short version of each; ``--soak`` (``make soak``) runs the issue's full counts:

- 100 kubelet restarts in a row: each followed by exactly one re-registration of every resource, long before
  the 60 s scan would have noticed (only the inotify watch can do it), and no growth in the plugin process's
  open descriptors or resident memory, nor in the sockets of the kubelet directory;
- 100 flapping cycles on each of node01's 4 GPUs (vfio group node removed/restored, the whole card rebound
  from vfio-pci to the host drivers and back) while Allocate calls run: no Allocate ever hands out a device
  that was not healthy during the call, refusals are INVALID_ARGUMENT/FAILED_PRECONDITION naming the ID, and
  the final ListAndWatch state is the tree's;
- 1,000 Allocate calls from 8 threads, every answer checked; p50/p99 latency.

Waits are bounded but generous (the machine is shared). Nothing a busy machine changes is asserted: no
latency, no thread count; the latencies are printed, and their goals are measured by ``bench/`` against a floor
taken in the same run (issue 22).
"""

from __future__ import annotations

import functools
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest

from schemas.companions import parse_companions
from schemas.pci import PciAddress
from simkit.fixture_nodes import NODE01
from simkit.kubelet_standin import KubeletStandIn
from simkit.sysfs_fixture import Node
from tests.conftest import scaled
from tests.plugin_support import (
    build_tree,
    rebind,
    remove_group_node,
    restore_group_node,
    serve_process,
    short_dir,
    sockets,
)

pytestmark = pytest.mark.soak

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
TU106_SOCKET = "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
TU106_ENV = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
TU106_COMPANIONS = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"


def _expected_env(ids: list[str]) -> dict[str, str]:
    """Allocate's env for ``ids`` of node01's TU106 cards: the IDs, and each card's audio, USB and UCSI."""
    companions = ",".join(f"{gpu}={'+'.join(gpu[:-1] + str(function) for function in (1, 2, 3))}" for gpu in ids)
    return {TU106_ENV: ",".join(ids), TU106_COMPANIONS: companions}


def _companions_within(env: dict[str, str], ids: list[str]) -> bool:
    """While functions flap, a companion caught between two drivers (no driver: the group stays viable) is
    left out of the companion variable; what is listed is still the card's own functions."""
    listed = parse_companions(TU106_COMPANIONS, env.get(TU106_COMPANIONS, ""))
    full = {PciAddress.parse(gpu): {PciAddress.parse(gpu[:-1] + str(f)) for f in (1, 2, 3)} for gpu in ids}
    return set(env) <= {TU106_ENV, TU106_COMPANIONS} and all(
        gpu in full and set(functions) <= full[gpu] for gpu, functions in listed.items()
    )


T4 = "nvidia.com/TU104GL_TESLA_T4"
T4_SOCKET = "kubevirt-TU104GL_TESLA_T4.sock"
GROUPS = {"0000:3b:00.0": 30, "0000:5e:00.0": 50, "0000:86:00.0": 74, "0000:af:00.0": 96}
"""node01's four TU106 GPUs and their IOMMU groups."""
NUMA = {"0000:3b:00.0": 0, "0000:5e:00.0": 0, "0000:86:00.0": 1, "0000:af:00.0": 1}
GPUS = tuple(GROUPS)
HOST_DRIVERS = {0: "nvidia", 1: "snd_hda_intel", 2: "xhci_hcd", 3: "nvidia-gpu"}
"""What the host binds each function of a TU106 card to (VGA, audio, USB, UCSI) when it takes the card back."""
NOT_OFFERED = ("0000:d8:00.0", "0000:3b:00.1", "0000:ff:00.0")
"""IDs the resource never has: the T4 left on nvidia, a companion function, an address that does not exist."""
WAIT = 15.0
"""Bound for waits, far below the 60 s scan interval the restart test sets: a registration within it came from
the inotify watch, not from a scan."""
REREGISTRATION_GOAL = 1.0
"""Printed beside the measured re-registration times; ``bench/plugin_device`` judges it against its floor."""
FD_SLACK = 3
"""Allowed growth after all cycles: gRPC opens and closes a descriptor on its own, a moment late."""
RSS_SLACK = 8 * 2**20
"""Allowed growth of the plugin's resident memory after all restarts (measured: about 0.5 MiB over 20). It
catches only a large per-restart leak; the descriptor count is the finer check, since every server, channel
and stream a restart kept holds a descriptor."""


@pytest.fixture
def base() -> Iterator[Path]:
    with short_dir() as directory:
        yield directory


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of ``values`` (``fraction`` in (0, 1])."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _counts(pid: int) -> tuple[int, int]:
    """Open descriptors and resident memory in bytes (``VmRSS``) of process ``pid``."""
    rss = next(
        int(line.split()[1]) * 1024
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    return len(os.listdir(f"/proc/{pid}/fd")), rss


def _all_healthy(devices: dict[str, str]) -> bool:
    return bool(devices) and set(devices.values()) == {"Healthy"}


# -- 1. kubelet restarts ---------------------------------------------------------------------------------


def test_kubelet_restarts_re_register_within_a_second_and_leak_nothing(base: Path, soak: bool) -> None:
    """N kubelet restarts in a row against the plugin process (node01 plus a T4 on vfio-pci: two resources).

    Each restart is the stand-in's: stop (streams end), delete every unix socket in the directory, serve a new
    ``kubelet.sock``. The time from the new ``kubelet.sock`` to each resource's ``Register`` must be ≤ 1 s (the
    scan interval is 60 s: only the inotify watch on the kubelet directory can do it); afterwards both device
    lists are whole and Healthy on fresh streams and the directory holds exactly ``kubelet.sock`` and the two
    plugin sockets. The time from the new socket to ``Register`` is printed (goal ≤ 1 s, judged in ``bench/``);
    asserted is that it came within :data:`WAIT`, far below the scan interval. Descriptors and resident memory
    of the plugin process (``/proc/<pid>``), taken after a few warm-up restarts, must not grow beyond a small
    constant.
    """
    restarts = scaled(100, soak, 20)
    warmup = 3
    functions = tuple(
        replace(function, driver="vfio-pci") if function.address == "0000:d8:00.0" else function
        for function in NODE01.functions
    )
    root = build_tree(Node(name="node01-t4", functions=functions, pci_ids=NODE01.pci_ids), base)
    kubelet_dir = base / "kubelet"
    resources = (T4, TU106)
    expected_sockets = sorted(["kubelet.sock", T4_SOCKET, TU106_SOCKET])
    latencies: list[float] = []
    healthy_again: list[float] = []
    samples: list[tuple[int, int]] = []
    kubelet = KubeletStandIn(kubelet_dir)
    kubelet.start()
    try:
        with serve_process(root, kubelet_dir, "--scan-interval", "60", log=base / "plugin.log") as process:
            for resource in resources:
                kubelet.wait_for_registration(resource, timeout=WAIT)
                kubelet.wait_for_devices(resource, _all_healthy, timeout=WAIT)
            baseline: tuple[int, int] | None = None
            for cycle in range(1, warmup + restarts + 1):
                kubelet.stop()
                kubelet.delete_sockets()
                served_at = time.monotonic()
                kubelet.start()  # stop + delete_sockets + start = KubeletStandIn.restart(), timed from the new socket
                slowest = 0.0
                for resource in resources:
                    registration = kubelet.wait_for_registration(resource, cycle + 1, timeout=WAIT)
                    slowest = max(slowest, registration.time - served_at)
                for resource in resources:
                    kubelet.wait_for_devices(resource, _all_healthy, timeout=WAIT)
                    assert kubelet.stream_open(resource), f"restart {cycle}: {resource} has no open ListAndWatch"
                healthy_at = time.monotonic() - served_at
                assert process.poll() is None, f"restart {cycle}: the plugin exited ({process.returncode})"
                assert sockets(kubelet_dir) == expected_sockets, f"restart {cycle}"
                assert len(kubelet.threads()) == len(resources)
                if cycle <= warmup:
                    sample = _counts(process.pid)
                    baseline = (
                        sample if baseline is None else (max(baseline[0], sample[0]), max(baseline[1], sample[1]))
                    )
                    continue
                latencies.append(slowest)
                healthy_again.append(healthy_at)
                samples.append(_counts(process.pid))
            assert baseline is not None
            after = _settled_counts(process.pid, baseline)
            assert kubelet.refusals == []
            for resource in resources:
                assert kubelet.registration_count(resource) == warmup + restarts + 1  # one per kubelet start
    finally:
        kubelet.stop()
    print(
        f"\nkubelet restarts: {restarts} (after {warmup} warm-up); re-registration of {len(resources)} resources "
        f"max {ms(max(latencies))} p99 {ms(percentile(latencies, 0.99))} p50 {ms(percentile(latencies, 0.5))} "
        f"(goal {ms(REREGISTRATION_GOAL)}); devices Healthy again max {ms(max(healthy_again))}"
    )
    print(
        f"plugin process: fds {baseline[0]} before -> {after[0]} after (max {max(s[0] for s in samples)} during), "
        f"RSS {baseline[1] / 2**20:.1f} MiB before -> {after[1] / 2**20:.1f} MiB after; "
        f"sockets after each restart: {expected_sockets}"
    )
    assert after[0] <= baseline[0] + FD_SLACK, f"descriptors grew: {baseline[0]} -> {after[0]}"
    assert after[1] <= baseline[1] + RSS_SLACK, f"resident memory grew: {baseline[1]} -> {after[1]} bytes"


def _settled_counts(pid: int, baseline: tuple[int, int], settle: float = 30.0) -> tuple[int, int]:
    """The process's counts once its descriptors are back within the slack of ``baseline`` (gRPC closes some
    pieces a moment late, later the busier the machine), or the last sample after ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while True:
        fds, rss = _counts(pid)
        if fds <= baseline[0] + FD_SLACK or time.monotonic() > deadline:
            return fds, rss
        time.sleep(0.05)


# -- 2. device flapping ----------------------------------------------------------------------------------


@dataclass
class _Flaps:
    """Per GPU, the closed time intervals during which it was certainly unhealthy in the tree, and why."""

    down: dict[str, list[tuple[float, float, str]]] = field(default_factory=lambda: {gpu: [] for gpu in GPUS})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, gpu: str, start: float, end: float, fault: str) -> None:
        with self.lock:
            self.down[gpu].append((start, end, fault))

    def unhealthy_throughout(self, gpu: str, start: float, end: float) -> str | None:
        """The fault that held throughout [start, end], or None if the GPU may have been healthy at some point."""
        with self.lock:
            held = [(down, fault) for down, up, fault in self.down[gpu] if down <= start and end <= up]
        return max(held)[1] if held else None  # nested faults: name the innermost


@dataclass
class _Call:
    ids: list[str]
    start: float
    end: float
    env: dict[str, str] | None = None
    specs: list[tuple[str, str, str]] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""


def _flap(root: Path, gpu: str, cycles: int, flaps: _Flaps, offline: threading.Semaphore, seed: int) -> None:
    """``cycles`` times: remove and restore the GPU's group node; rebind its card to the host drivers and back.

    Each fault is recorded as the interval from just after the step that broke the device to just before the
    step that restores it: the device is certainly unhealthy throughout (conservative at both ends). Faults on
    one GPU are nested (functions 3, 2, 1, 0 go to the host, then 0, 1, 2, 3 come back), never interleaved.
    """
    rng = random.Random(seed)
    group = GROUPS[gpu]
    functions = [f"{gpu[:-1]}{index}" for index in range(4)]

    def hold() -> None:
        time.sleep(rng.uniform(0.002, 0.03))

    for _ in range(cycles):
        remove_group_node(root, group)
        broken = time.monotonic()
        hold()
        restoring = time.monotonic()
        restore_group_node(root, group)
        flaps.record(gpu, broken, restoring, f"/dev/vfio/{group} removed")
        hold()
        rebind(root, functions[3], HOST_DRIVERS[3])  # a companion on a host driver: the group is not viable
        broken = time.monotonic()
        for index in (2, 1):
            hold()
            rebind(root, functions[index], HOST_DRIVERS[index])
        hold()
        with offline:  # at most 3 of 4 GPUs withdrawn at once: the resource (and its registration) stays
            rebind(root, functions[0], HOST_DRIVERS[0])
            withdrawn = time.monotonic()
            hold()
            returning = time.monotonic()
            rebind(root, functions[0], "vfio-pci")
            flaps.record(gpu, withdrawn, returning, f"{gpu} on {HOST_DRIVERS[0]}")
        for index in (1, 2):
            hold()
            rebind(root, functions[index], "vfio-pci")
        hold()
        restoring = time.monotonic()
        rebind(root, functions[3], "vfio-pci")
        flaps.record(gpu, broken, restoring, f"{functions[3]} on {HOST_DRIVERS[3]} (card rebound to the host)")
        time.sleep(rng.uniform(0.01, 0.06))  # healthy for a while: Allocate calls that must succeed


def _allocator(kubelet: KubeletStandIn, stop: threading.Event, calls: list[_Call], seed: int) -> None:
    """Allocate 1 or 2 random GPUs (sometimes with an ID the resource never has) until ``stop``."""
    rng = random.Random(seed)
    while not stop.is_set():
        ids = rng.sample(GPUS, rng.choice((1, 1, 2)))
        if rng.random() < 0.1:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(NOT_OFFERED))
        call = _Call(ids, time.monotonic(), 0.0)
        try:
            response = kubelet.allocate(TU106, ids, timeout=WAIT)
        except grpc.RpcError as error:
            call.end = time.monotonic()
            if not isinstance(error, grpc.Call):
                raise
            call.code, call.details = error.code(), error.details() or ""
        else:
            call.end = time.monotonic()
            container = response.container_responses[0]
            call.env = dict(container.envs)
            call.specs = [(spec.container_path, spec.host_path, spec.permissions) for spec in container.devices]
        calls.append(call)
        time.sleep(rng.uniform(0, 0.004))


def _expected_specs(ids: list[str]) -> list[tuple[str, str, str]]:
    nodes = ["/dev/vfio/vfio", *dict.fromkeys(f"/dev/vfio/{GROUPS[device]}" for device in ids)]
    return [(node, node, "mrw") for node in nodes]


def test_flapping_devices_never_allocate_an_unhealthy_device(base: Path, soak: bool) -> None:
    """Flap node01's 4 GPUs (one thread each) while two threads call Allocate; check every answer.

    The invariant, per successful Allocate call spanning [start, end] (monotonic, taken around the RPC): each
    device in its env was healthy in the tree at some instant in [start, end]. The flapping threads record,
    per GPU, the intervals during which it was *certainly* unhealthy (from just after the breaking step to just
    before the restoring one); a success is a violation only if [start, end] lies inside one of them. That is
    sound even though the plugin's re-check reads several files one after another (not atomically): one
    GPU's faults are nested, so during an unhealthy stretch the outermost fault holds throughout, and no mix of
    reads can see every condition met. The plugin must therefore re-check everything that makes a device
    healthy (group node, its driver, its companions' drivers) when it answers, not trust its last scan (the
    scan interval here is 0.5 s, far longer than most faults).

    Refusals must be INVALID_ARGUMENT or FAILED_PRECONDITION and name a requested ID; an ID the resource never
    had is never allocated. At the end every fault is undone: the kubelet's view must be exactly the tree's
    four GPUs (IDs, NUMA nodes), all Healthy, on the first registration's stream.
    """
    cycles = scaled(100, soak, 10)
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    flaps = _Flaps()
    calls: list[list[_Call]] = [[], []]
    offline = threading.Semaphore(3)
    stop = threading.Event()
    failures: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # reported by the test
                failures.append(exc)
                stop.set()

        return run

    started = time.monotonic()
    with KubeletStandIn(kubelet_dir) as kubelet, serve_process(root, kubelet_dir, "--scan-interval", "0.5"):
        kubelet.wait_for_registration(TU106, timeout=WAIT)
        kubelet.wait_for_devices(TU106, lambda devices: devices == dict.fromkeys(GPUS, "Healthy"), timeout=WAIT)
        flappers = [
            threading.Thread(
                target=guarded(functools.partial(_flap, root, gpu, cycles, flaps, offline, seed)),
                name=f"flap-{gpu}",
            )
            for seed, gpu in enumerate(GPUS)
        ]
        allocators = [
            threading.Thread(
                target=guarded(functools.partial(_allocator, kubelet, stop, calls[seed], 100 + seed)),
                name=f"allocate-{seed}",
            )
            for seed in range(len(calls))
        ]
        for thread in (*flappers, *allocators):
            thread.start()
        for thread in flappers:
            thread.join(WAIT + cycles * 4.0)
        stop.set()
        for thread in allocators:
            thread.join(WAIT)
        assert not any(thread.is_alive() for thread in (*flappers, *allocators)), "a test thread hangs"
        assert failures == [], failures
        flapped = time.monotonic() - started
        for gpu, group in GROUPS.items():  # the tree is whole again
            assert (root / "dev" / "vfio" / str(group)).exists()
            for index in range(4):
                driver = root / "sys" / "bus" / "pci" / "devices" / f"{gpu[:-1]}{index}" / "driver"
                assert driver.resolve().name == "vfio-pci"
        settle_start = time.monotonic()
        final = kubelet.wait_for_devices(TU106, lambda devices: devices == dict.fromkeys(GPUS, "Healthy"), timeout=WAIT)
        settled = time.monotonic() - settle_start
        messages = {
            device.ID: (device.health, [node.ID for node in device.topology.nodes])
            for device in kubelet.device_messages(TU106)
        }
        assert messages == {gpu: ("Healthy", [NUMA[gpu]]) for gpu in GPUS}
        assert final == dict.fromkeys(GPUS, "Healthy")
        assert kubelet.stream_open(TU106)
        assert kubelet.registration_count(TU106) == 1
        assert kubelet.refusals == []
        updates = kubelet.updates(TU106)

    every = [call for per_thread in calls for call in per_thread]
    ok = [call for call in every if call.env is not None]
    refused: dict[str, int] = {}
    violations: list[str] = []
    for call in ok:
        assert call.env is not None and call.env[TU106_ENV] == ",".join(call.ids), call
        assert _companions_within(call.env, call.ids), call
        assert call.specs == _expected_specs(call.ids), call
        for device in call.ids:
            if device not in GROUPS:
                violations.append(f"{call.ids}: {device} is not a device of the resource, yet allocated")
            elif (fault := flaps.unhealthy_throughout(device, call.start, call.end)) is not None:
                violations.append(
                    f"{call.ids}: {device} allocated while unhealthy in the tree throughout the call "
                    f"[{call.start:.4f}, {call.end:.4f}]: {fault}"
                )
    for call in every:
        if call.env is not None:
            continue
        assert call.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), call
        assert any(device in call.details for device in call.ids), call
        assert call.code is not None
        refused[call.code.name] = refused.get(call.code.name, 0) + 1
    kinds: dict[str, int] = {}
    for _, _, fault in (interval for intervals in flaps.down.values() for interval in intervals):
        kind = "group node removed" if "removed" in fault else "GPU on nvidia" if "00.0 on" in fault else "card rebound"
        kinds[kind] = kinds.get(kind, 0) + 1
    print(
        f"\ndevice flapping: {cycles} cycles on each of {len(GPUS)} GPUs in {flapped:.1f} s, faults {kinds} (card "
        f"rebound: vfio-pci -> host drivers -> vfio-pci function by function); Allocate calls {len(every)}: "
        f"ok {len(ok)}, refused {dict(sorted(refused.items()))}; violations {len(violations)}; "
        f"ListAndWatch updates {updates}; final state {len(final)} x Healthy (settled in {ms(settled)})"
    )
    assert violations == [], "\n".join(violations[:20])
    assert ok, "no Allocate succeeded: the check proved nothing"
    assert refused, "no Allocate was refused: the flapping was never seen"


# -- 3. Allocate load ------------------------------------------------------------------------------------


def test_allocate_load_from_eight_threads(base: Path, soak: bool) -> None:
    """N Allocate calls from 8 threads over the plugin's unix socket: every answer exactly right; p50/p99 printed.

    Each call asks for 1 to 4 of node01's GPUs in a random order; the env must list exactly those IDs in that
    order, and the device specs must be ``/dev/vfio/vfio`` then each GPU's group node once, in request order,
    same path inside and out, ``mrw``.
    """
    total = scaled(1000, soak, 300)
    workers = 8
    root = build_tree(NODE01, base)
    kubelet_dir = base / "kubelet"
    latencies: list[list[float]] = [[] for _ in range(workers)]
    failures: list[BaseException] = []
    per_worker = [total // workers + (1 if index < total % workers else 0) for index in range(workers)]

    def work(index: int) -> None:
        rng = random.Random(index)
        try:
            for _ in range(per_worker[index]):
                ids = rng.sample(GPUS, rng.randint(1, len(GPUS)))
                began = time.perf_counter()
                response = kubelet.allocate(TU106, ids, timeout=WAIT)
                latencies[index].append(time.perf_counter() - began)
                container = response.container_responses[0]
                assert dict(container.envs) == _expected_env(ids)
                assert [(s.container_path, s.host_path, s.permissions) for s in container.devices] == _expected_specs(
                    ids
                )
                assert list(container.mounts) == [] and dict(container.annotations) == {}
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    with KubeletStandIn(kubelet_dir) as kubelet, serve_process(root, kubelet_dir, "--scan-interval", "5"):
        kubelet.wait_for_registration(TU106, timeout=WAIT)
        kubelet.wait_for_devices(TU106, lambda devices: devices == dict.fromkeys(GPUS, "Healthy"), timeout=WAIT)
        kubelet.allocate(TU106, [GPUS[0]], timeout=WAIT)  # the channel is connected before timing
        threads = [threading.Thread(target=work, args=(index,), name=f"load-{index}") for index in range(workers)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT + total * 0.1)
        elapsed = time.perf_counter() - began
        assert not any(thread.is_alive() for thread in threads), "a load thread hangs"
    assert failures == [], failures[:3]
    every = [latency for per_thread in latencies for latency in per_thread]
    assert len(every) == total
    print(
        f"\nAllocate load: {total} calls from {workers} threads, all correct, in {elapsed:.2f} s "
        f"({total / elapsed:.0f}/s); latency p50 {ms(percentile(every, 0.5))} p99 {ms(percentile(every, 0.99))} "
        f"max {ms(max(every))}"
    )
