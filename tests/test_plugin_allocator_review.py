"""The Allocator (issue 12) attacked: a host root replaced under its kept descriptor, many requests racing a
rescan and a stop, restarts counted in descriptors, random changes to a node answered as a fresh ``allocate``.

A server keeps one :class:`~plugin.allocation.Allocator` per generation: a descriptor on the host root and a plan
per scanned resource. Neither may make it answer otherwise than :func:`~plugin.allocation.allocate`, which reads
everything afresh: not from an old plan (a companion or group member the current scan no longer has), not from
a directory that is no longer the host root, not under concurrency.

Each runs with the kernel resolving (``openat2``) and with the Python resolver.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest

from plugin.allocation import Allocation, Allocator, allocate
from plugin.config import PluginConfig
from plugin.health import UsabilityRule
from plugin.hostroot import HostRoot, SharedRoot
from plugin.inventory import Resource
from plugin.server import DevicePluginServicer, ResourceServer, ResourceState
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from simkit.fixture_nodes import MIXED_NODE, NODE01, VGPU_NODE
from simkit.sysfs_fixture import Node
from tests.discovery_support import build_node, discover
from tests.plugin_support import Refusal, build_tree, outcome, rebind, short_dir

RTX = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
COMPANIONS_ENV = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
GPU_3B, GPU_5E, GPU_86 = "0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0"


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def fresh(resource: Resource, ids: list[str], root: Path, rule: UsabilityRule) -> Allocation | Refusal:
    return outcome(lambda: allocate(resource, ids, root, rule))


# -- a host root replaced under the kept descriptor -----------------------------------------------------------------


def test_a_host_root_replaced_under_the_kept_descriptor_is_read_anew(tmp_path: Path, resolver: str) -> None:
    """The root directory deleted and made again (a fixture rebuilt, a mount replaced): the rescan reads the new
    one and calls the GPU healthy, so Allocate must answer from it too, not refuse from the deleted directory."""
    root = build_node(NODE01, tmp_path)
    with Allocator(root) as served:
        resource = discover(root).resource(RTX)
        assert isinstance(served.allocate(resource, [GPU_3B]), Allocation)  # the descriptor is open now
        shutil.rmtree(root)
        assert build_node(NODE01, tmp_path) == root
        rescanned = discover(root).resource(RTX)
        answer = outcome(lambda: served.allocate(rescanned, [GPU_3B]))
        assert answer == fresh(rescanned, [GPU_3B], root, served.rule)
        assert isinstance(answer, Allocation)
        assert isinstance(served.allocate(rescanned, [GPU_86]), Allocation)


def test_a_host_root_gone_is_refused_by_name_and_answered_again_when_back(tmp_path: Path, resolver: str) -> None:
    root = build_node(NODE01, tmp_path)
    descriptors = open_descriptors()
    with Allocator(root) as served:
        resource = discover(root).resource(RTX)
        assert isinstance(served.allocate(resource, [GPU_3B]), Allocation)
        shutil.rmtree(root)
        refused = outcome(lambda: served.allocate(resource, [GPU_3B]))
        assert refused == fresh(resource, [GPU_3B], root, served.rule)
        assert isinstance(refused, Refusal) and refused.kind == "DeviceUnavailable"
        assert f"{root}/sys/bus/pci/devices/{GPU_3B}/iommu_group is gone" in refused.message
        build_node(NODE01, tmp_path)
        for _ in range(3):
            assert isinstance(served.allocate(resource, [GPU_3B]), Allocation)
    assert open_descriptors() == descriptors


def test_a_replaced_root_still_lent_is_closed_when_given_back(tmp_path: Path, resolver: str) -> None:
    (tmp_path / "root").mkdir()
    shared = SharedRoot(str(tmp_path / "root"))
    descriptors = open_descriptors()
    old = shared.borrow()
    (tmp_path / "root").rename(tmp_path / "old")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "new").write_text("")
    kept = HostRoot.openat2 is not None  # the Python resolver keeps no descriptor: it reads the path
    assert shared.renew() is kept
    with shared.borrow() as new:
        assert new.exists("/new")
        assert old.exists("/new") is not kept  # a request under way finishes on the root it started with
    old.close()
    assert shared.renew() is False
    shared.close()
    assert open_descriptors() == descriptors


# -- concurrency: requests racing a rescan and a stop -----------------------------------------------------------------


def test_requests_racing_a_rescan_and_a_stop_answer_each_from_their_own_scan(tmp_path: Path, resolver: str) -> None:
    """Group 50 loses 0000:5e:00.2 between two scans. The host now matches the second scan: a request made
    with the first one is refused (its member is gone), one made with the second gets the companions the second
    scan has, never the one it lost, whichever plan another thread made last; the Allocator closes mid-way."""
    root = build_node(NODE01, tmp_path)
    rule = UsabilityRule.from_config(PluginConfig(host_root=str(root)))
    before = discover(root).resource(RTX)
    (root / "sys" / "kernel" / "iommu_groups" / "50" / "devices" / "0000:5e:00.2").unlink()
    after = discover(root).resource(RTX)
    requests = [[GPU_5E], [GPU_5E, GPU_3B], [GPU_3B], [GPU_86, GPU_5E]]
    expected = {
        (id(resource), tuple(ids)): fresh(resource, ids, root, rule) for resource in (before, after) for ids in requests
    }
    gone = expected[(id(after), (GPU_5E,))]
    assert isinstance(gone, Allocation) and "0000:5e:00.2" not in gone.envs[COMPANIONS_ENV]
    assert isinstance(expected[(id(before), (GPU_5E,))], Refusal)
    descriptors = open_descriptors()
    served = Allocator(root, rule)
    failures: list[str] = []
    half = threading.Barrier(9)

    def run(seed: int) -> None:
        chooser = random.Random(seed)
        for index in range(120):
            if index == 60:
                half.wait()
            resource = chooser.choice((before, after))
            ids = chooser.choice(requests)
            try:
                got = outcome(lambda: served.allocate(resource, ids))  # noqa: B023 (called at once)
            except Exception as exc:  # a traceback is the finding
                failures.append(f"{type(exc).__name__}: {exc}")
                return
            if got != expected[(id(resource), tuple(ids))]:
                failures.append(f"{ids} with the {'first' if resource is before else 'second'} scan: {got}")

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    half.wait()
    served.close()  # a stop with requests under way: they finish, later ones read through their own root
    for thread in threads:
        thread.join()
    assert failures == []
    assert open_descriptors() == descriptors


def _allocate_request(*ids: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))])


def test_many_generations_of_servicers_leak_no_descriptor(tmp_path: Path, resolver: str) -> None:
    """Each (re)start makes a servicer and its Allocator; stop closes it, whether or not it was used."""
    root = build_node(NODE01, tmp_path)
    state = ResourceState(discover(root).resource(RTX))
    rule = UsabilityRule.from_config(PluginConfig(host_root=str(root)))
    descriptors = open_descriptors()
    for generation in range(60):
        servicer = DevicePluginServicer(state, root, rule)
        if generation % 3:
            response = servicer.Allocate(_allocate_request(GPU_3B, GPU_86), context=None)  # type: ignore[arg-type]
            assert response.container_responses[0].envs[COMPANIONS_ENV].startswith(GPU_3B)
        if generation % 5 == 0:
            state.update(discover(root).resource(RTX))  # a rescan: a new resource, a new plan
        servicer.stop()
    assert open_descriptors() == descriptors


# -- random changes: the Allocator answers as a fresh allocate -----------------------------------------------------


def _functions(root: Path) -> list[str]:
    return sorted(os.listdir(root / "sys" / "bus" / "pci" / "devices"))


def _mutate(root: Path, chooser: random.Random) -> str:
    """One random change a node can go through between (or during) scans; what it was."""
    functions = _functions(root)
    groups = root / "sys" / "kernel" / "iommu_groups"
    vfio = root / "dev" / "vfio"
    change = chooser.randrange(9)
    if change == 7:
        container = vfio / "vfio"
        if container.exists():
            container.rename(vfio / "container-away")
            return "/dev/vfio/vfio away"
        (vfio / "container-away").rename(container)
        return "/dev/vfio/vfio back"
    if change == 8:
        device = (root / "sys" / "bus" / "pci" / "devices" / chooser.choice(functions)).resolve()
        link, hidden = device / "iommu_group", device / "iommu_group.away"
        if link.is_symlink():
            link.rename(hidden)
            return f"{device.name} loses its iommu_group link"
        if hidden.is_symlink():
            hidden.rename(link)
            return f"{device.name} gets its iommu_group link back"
        return "nothing"
    if change <= 2:
        address = chooser.choice(functions)
        driver = chooser.choice(["vfio-pci", None, "nvidia", "snd_hda_intel", "pci-stub", "xhci_hcd"])
        rebind(root, address, driver)
        return f"rebind {address} {driver}"
    if change == 3:
        names = sorted(name for name in os.listdir(vfio) if name.isdigit())
        if names:
            name = chooser.choice(names)
            (vfio / name).rename(vfio / f"away-{name}")
            return f"/dev/vfio/{name} away"
        return "nothing"
    if change == 4:
        away = sorted(name for name in os.listdir(vfio) if name.startswith("away-"))
        if away:
            name = chooser.choice(away)
            (vfio / name).rename(vfio / name.removeprefix("away-"))
            return f"/dev/vfio/{name} back"
        return "nothing"
    group = chooser.choice(sorted(os.listdir(groups)))
    members = groups / group / "devices"
    listed = sorted(os.listdir(members))
    if change == 5 and listed:
        name = chooser.choice(listed)
        (members / name).rename(members.parent / f"away-{name}")  # out of the listing, kept to come back
        return f"group {group} loses {name}"
    away = sorted(name for name in os.listdir(members.parent) if name.startswith("away-"))
    if away:
        name = chooser.choice(away)
        (members.parent / name).rename(members / name.removeprefix("away-"))
        return f"group {group} gets {name} back"
    return "nothing"


@pytest.mark.parametrize("node", [NODE01, MIXED_NODE, VGPU_NODE], ids=lambda node: node.name)
def test_random_changes_are_answered_as_a_fresh_allocate(tmp_path: Path, node: Node, resolver: str) -> None:
    """A fixed seed: 60 rounds of a random change, sometimes a rescan, and random requests (devices of the
    current and of the previous scan, unknown IDs, repeats), each answered by one Allocator for the whole run
    and by a fresh ``allocate``."""
    root = build_node(node, tmp_path)
    rule = UsabilityRule.from_config(PluginConfig(host_root=str(root)))
    chooser = random.Random(f"issue-12-{node.name}")
    scans = [discover(root).resources]
    answered = refused = 0
    with Allocator(root, rule) as served:
        for _ in range(60):
            change = _mutate(root, chooser)
            if chooser.random() < 0.4:
                scans.append(discover(root).resources)
            for resources in scans[-2:]:
                for resource in resources:
                    ids = [device.id for device in resource.devices]
                    size = chooser.randint(1, min(3, len(ids)))
                    request = chooser.sample(ids, size)
                    if chooser.random() < 0.1:
                        request.append(chooser.choice([request[0], "0000:00:00.0"]))
                    got = outcome(lambda: served.allocate(resource, request))  # noqa: B023 (called at once)
                    assert got == fresh(resource, request, root, rule), (change, resource.name, request)
                    answered += isinstance(got, Allocation)
                    refused += isinstance(got, Refusal)
    assert answered and refused  # both paths were exercised


# -- the memoised companion entries ----------------------------------------------------------------------------------


def test_companion_entries_stay_bounded_and_follow_every_driver_combination(tmp_path: Path, resolver: str) -> None:
    """A GPU's three companions flipped through every viable driver combination (4**3 = 64, more than the 16
    kept): each answer is a fresh allocate's, and the memo never holds more than its bound."""
    from plugin import allocation

    root = build_node(NODE01, tmp_path)
    rule = UsabilityRule.from_config(PluginConfig(host_root=str(root)))
    resource = discover(root).resource(RTX)
    companions = ["0000:86:00.1", "0000:86:00.2", "0000:86:00.3"]
    drivers = ["vfio-pci", None, "pci-stub", "nvgrace_gpu_vfio_pci"]
    chooser = random.Random("issue-12-entries")
    seen: set[str | None] = set()
    with Allocator(root, rule) as served:
        for _ in range(2):
            for combination in range(len(drivers) ** len(companions)):
                for position, address in enumerate(companions):
                    rebind(root, address, drivers[combination // len(drivers) ** position % len(drivers)])
                request = chooser.choice([[GPU_86], [GPU_86, GPU_3B], [GPU_3B, GPU_86]])
                got = outcome(lambda: served.allocate(resource, request))  # noqa: B023 (called at once)
                assert got == fresh(resource, request, root, rule)
                assert isinstance(got, Allocation)
                seen.add(got.envs.get(COMPANIONS_ENV))
                plan = served._plan
                assert plan is not None
                assert all(len(device.entries) <= allocation._ENTRIES_KEPT for device in plan._plans.values())
    assert len(seen) >= 8  # the variable followed the drivers


def test_borrowers_racing_root_replacements_and_a_close_never_read_a_closed_descriptor(
    tmp_path: Path, resolver: str
) -> None:
    """Eight threads borrow and read while another replaces the root and renews, then closes: no read fails
    on a descriptor closed under it (EBADF, or another file reusing its number), and none is left open."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "here").write_text("yes\n")
    shared = SharedRoot(str(root))
    descriptors = open_descriptors()
    failures: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                with shared.borrow() as fs:
                    text = fs.read("/here")
                    if text not in (None, "yes\n"):
                        failures.append(f"read {text!r}")
            except Exception as exc:  # a traceback is the finding
                failures.append(f"{type(exc).__name__}: {exc}")
                return

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for round_ in range(200):
        staged = tmp_path / f"new-{round_}"
        staged.mkdir()
        (staged / "here").write_text("yes\n")
        root.rename(tmp_path / f"old-{round_}")
        staged.rename(root)
        shared.renew()
        shutil.rmtree(tmp_path / f"old-{round_}")
        if round_ == 150:
            shared.close()
    stop.set()
    for thread in threads:
        thread.join()
    assert failures == []
    assert open_descriptors() == descriptors


# -- through the gRPC server: restarts and a rescan under load ------------------------------------------------------


def test_allocates_over_grpc_racing_restarts_and_a_rescan_never_give_a_lost_companion() -> None:
    """Clients call Allocate over the socket while the server restarts and a rescan drops 0000:5e:00.2 from
    group 50 (host first, then the served resource): every call is answered (OK, or refused while the
    resource is stale, or cut by a restart), never UNKNOWN; once the rescan is served, no answer names the
    companion it lost."""
    full = "0000:5e:00.0=0000:5e:00.1+0000:5e:00.2+0000:5e:00.3"
    without = "0000:5e:00.0=0000:5e:00.1+0000:5e:00.3"
    with short_dir() as base:
        root = build_tree(NODE01, base)
        (base / "kubelet").mkdir()
        server = ResourceServer(discover(root).resource(RTX), base / "kubelet", root)
        server.start()
        updated = threading.Event()
        stop = threading.Event()
        seen: list[tuple[bool, str]] = []
        failures: list[str] = []

        def client() -> None:
            while not stop.is_set():
                after_update = updated.is_set()
                channel = grpc.insecure_channel(f"unix:{server.socket_path}")
                try:
                    response = pb_grpc.DevicePluginStub(channel).Allocate(_allocate_request(GPU_5E), timeout=5)
                    seen.append((after_update, response.container_responses[0].envs[COMPANIONS_ENV]))
                except grpc.RpcError as error:
                    code = error.code()
                    if code not in (
                        grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.CANCELLED,
                    ):
                        failures.append(f"{code}: {error.details()}")
                finally:
                    channel.close()

        threads = [threading.Thread(target=client) for _ in range(4)]
        try:
            for thread in threads:
                thread.start()
            for restart in range(6):
                time.sleep(0.05)
                if restart == 2:
                    (root / "sys" / "kernel" / "iommu_groups" / "50" / "devices" / "0000:5e:00.2").unlink()
                    time.sleep(0.05)
                    server.update(discover(root).resource(RTX))
                    updated.set()
                server.restart()
            deadline = time.monotonic() + 10
            while not any(after for after, _ in seen) and time.monotonic() < deadline:
                time.sleep(0.05)  # the restarted server answers some calls made after the rescan
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            server.stop(grace=0)
    assert failures == []
    assert {value for after, value in seen if after} == {without}
    assert {value for after, value in seen if not after} <= {full, without}
