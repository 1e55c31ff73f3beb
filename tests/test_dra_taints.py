"""Device taints on unhealthy devices (KEP 5055, ``DRADeviceTaints``, beta and on by default in Kubernetes 1.36).

An unhealthy device stays published (with ``healthy: false``, for 1.34/1.35 API servers that drop the field)
and carries one ``NoSchedule`` taint in our domain whose value names the problem, with a ``timeAdded`` that
stays put while the taint does (docs/dra.md, "Device taints"). Checked here: the shape against Kubernetes'
validation (label name and value, effect, count; 64 devices per slice with taints), strict schema validation
for 1.36, the publisher seeing a taint come and go as a change and never rewriting an unchanged one (also after
a restart, and against an API server that drops taints), the fake API server's admission of taints, and the
scheduler stand-in keeping a tainted device from a claim that does not tolerate it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugin.dra.kube import KubeApi, KubeError, SlicePublisher
from plugin.dra.slices import (
    MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    TAINT_EFFECT,
    TAINT_KEY,
    TaintTimes,
    build_slices,
    format_time,
)
from plugin.health import PROBLEM_CODES, UNKNOWN_PROBLEM, UsabilityRule, problem_code
from plugin.inventory import Device, Inventory, Resource
from schemas.dra import DRIVER_NAME, device_name
from schemas.kinds import ResourceKind
from simkit.dra_scheduler import AllocationError, Scheduler, tolerates
from simkit.fake_apiserver import FakeApiServer, label_name_problem, label_value_problem, running, taint_problems
from simkit.fixture_nodes import MIXED_NODE
from tests.dra_cluster_support import NEWEST_KUBERNETES, many_gpus, node_inventory, validate_strictly

NODE = "node01"
NODE_UID = "7c0b2f40-0000-4000-8000-000000000001"
KUBERNETES_1_36 = "1.36"


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def with_health(inventory: Inventory, sick: dict[str, str | None]) -> Inventory:
    """``inventory`` with the devices named in ``sick`` (device ID → reason; None: healthy again) changed."""
    resources = []
    for resource in inventory.resources:
        devices = tuple(
            Device(**{**{f: getattr(d, f) for f in d.__slots__}, "healthy": sick[d.id] is None, "reason": sick[d.id]})
            if d.id in sick
            else d
            for d in resource.devices
        )
        resources.append(Resource(resource.name, resource.kind, devices, resource.selectors))
    return Inventory(tuple(resources), inventory.ignored, inventory.warnings, inventory.pci_ids_path)


def devices_by_name(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {device["name"]: device for obj in slices for device in obj["spec"]["devices"]}


GROUP_NOT_VIABLE = "IOMMU group 5 is not viable: 0000:86:00.1 (10DE:10F9 audio) is bound to snd_hda_intel (bind it)"


# -- the shape -----------------------------------------------------------------------------------------------


def test_an_unhealthy_device_carries_one_valid_no_schedule_taint_and_keeps_healthy_false(tmp_path: Path) -> None:
    inventory, _ = node_inventory(MIXED_NODE, tmp_path)
    slices = build_slices(inventory, "mixed", taint_times={"pci-0000-86-00-0": "2027-01-15T08:00:00Z"})
    devices = devices_by_name(slices)
    sick = devices["pci-0000-86-00-0"]  # its audio function is on snd_hda_intel
    assert sick["attributes"]["healthy"] == {"bool": False}
    assert sick["taints"] == [
        {"key": TAINT_KEY, "value": "IOMMUGroupNotViable", "effect": "NoSchedule", "timeAdded": "2027-01-15T08:00:00Z"}
    ]
    assert TAINT_KEY == "gpu-passthrough.kubevirt.io/unhealthy" and TAINT_EFFECT == "NoSchedule"
    assert "taints" not in devices["pci-0000-3b-00-0"]  # healthy: no taint at all
    for obj in slices:
        assert taint_problems(obj["spec"]) == []
        validate_strictly(obj, KUBERNETES_1_36)
        validate_strictly(obj, NEWEST_KUBERNETES)


def test_without_a_time_the_taint_leaves_time_added_to_the_api_server() -> None:
    (obj,) = build_slices(many_gpus(2, healthy=False), "n")
    assert [device["taints"] for device in obj["spec"]["devices"]] == [
        [{"key": TAINT_KEY, "value": UNKNOWN_PROBLEM, "effect": "NoSchedule"}]
    ] * 2


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        ("no IOMMU group (is the IOMMU on? intel_iommu=on or amd_iommu=on)", "NoIOMMUGroup"),
        (GROUP_NOT_VIABLE, "IOMMUGroupNotViable"),
        (
            "IOMMU group 7 is shared with GPU 0000:87:00.0: GPUs of one group cannot go to different VMs",
            "IOMMUGroupShared",
        ),
        ("/dev/vfio/12 is missing", "VFIOGroupNodeMissing"),
        ("/dev/vfio/vfio is missing (is the vfio module loaded?)", "VFIOContainerMissing"),
        ("/dev/vfio/12 is missing; /dev/vfio/vfio is missing (is the vfio module loaded?)", "VFIOGroupNodeMissing"),
        (f"{GROUP_NOT_VIABLE}; /dev/vfio/5 is missing", "IOMMUGroupNotViable"),
        ("something new", UNKNOWN_PROBLEM),
        (None, UNKNOWN_PROBLEM),
    ],
)
def test_the_taint_value_names_the_first_problem_and_is_a_label_value(reason: str | None, code: str) -> None:
    assert problem_code(reason) == code
    assert label_value_problem(code) is None


def test_every_problem_the_rule_words_has_its_own_code() -> None:
    """The codes follow the rule's words: each problem the rule can report maps to a code of its own."""
    rule = UsabilityRule(("vfio-pci",), frozenset(), lambda vendor, device, pci_class: True)
    words = [
        *rule.vfio_problems(None, False, False),
        *rule.vfio_problems(3, False, True),
    ]
    codes = [problem_code(problem) for problem in words] + [problem_code(GROUP_NOT_VIABLE)]
    assert UNKNOWN_PROBLEM not in codes and len(set(codes)) == len(codes)
    assert {code for code, _ in PROBLEM_CODES} >= set(codes)


def test_a_pool_with_a_taint_is_split_into_slices_of_at_most_64() -> None:
    inventory = with_health(many_gpus(130), {"0000:01:05.0": "/dev/vfio/37 is missing"})
    slices = build_slices(inventory, "node-big", taint_times=TaintTimes(Clock()).observe(inventory))
    assert [len(obj["spec"]["devices"]) for obj in slices] == [64, 64, 2]
    assert all(obj["spec"]["pool"]["resourceSliceCount"] == 3 for obj in slices)
    for obj in slices:
        assert taint_problems(obj["spec"]) == []
        validate_strictly(obj, KUBERNETES_1_36)
    assert [len(obj["spec"]["devices"]) for obj in build_slices(many_gpus(130), "node-big")] == [128, 2]
    over = copy.deepcopy(slices[0])
    over["spec"]["devices"] += copy.deepcopy(slices[2]["spec"]["devices"])
    assert taint_problems(over["spec"]) == ["spec.devices: Too many: 66: must have at most 64 items"]
    assert MAX_DEVICES_PER_SLICE_WITH_TAINTS == 64


@pytest.mark.parametrize(
    ("key", "valid"),
    [
        (TAINT_KEY, True),
        ("example.com/a.b_c-d", True),
        ("plain", True),
        ("Example.com/x", False),  # the prefix is a DNS subdomain: lower case
        ("example.com/", False),
        ("/x", False),
        ("example.com/-x", False),
        ("example.com/" + "x" * 64, False),
        ("x" * 254 + "/y", False),
        ("", False),
    ],
)
def test_the_label_name_rule_of_the_fake_api_server(key: str, valid: bool) -> None:
    assert (label_name_problem(key) is None) is valid


@pytest.mark.parametrize(
    ("value", "valid"),
    [("", True), ("IOMMUGroupNotViable", True), ("a-b_c.d", True), ("-a", False), ("a b", False), ("x" * 64, False)],
)
def test_the_label_value_rule_of_the_fake_api_server(value: str, valid: bool) -> None:
    assert (label_value_problem(value) is None) is valid


# -- timeAdded -----------------------------------------------------------------------------------------------


def test_time_added_is_when_the_device_was_first_seen_unhealthy_and_stays() -> None:
    clock = Clock()
    times = TaintTimes(clock)
    healthy = many_gpus(3)
    sick = with_health(healthy, {"0000:01:01.0": "/dev/vfio/1 is missing"})
    name = device_name(ResourceKind.PCI, "0000:01:01.0")
    assert times.observe(healthy) == {}
    first = times.observe(sick)
    assert first == {name: format_time(clock.now)} and TaintTimes.__doc__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", first[name])
    clock.now += 3600
    other_reason = with_health(healthy, {"0000:01:01.0": "/dev/vfio/vfio is missing"})
    assert times.observe(other_reason) == first  # still the same taint (key, effect): the first time stays
    assert times.observe(healthy) == {}
    clock.now += 60
    assert times.observe(sick) == {name: format_time(clock.now)}  # a new problem is a new taint


def test_a_restart_keeps_the_time_the_server_already_has() -> None:
    times = TaintTimes(Clock(1_900_000_000.0))
    sick = with_health(many_gpus(2), {"0000:01:00.0": "/dev/vfio/0 is missing", "0000:01:01.0": "x"})
    times.observe(sick)
    published = build_slices(sick, "n", taint_times={"pci-0000-01-00-0": "2027-01-01T00:00:00Z"})
    published[0]["spec"]["devices"][1]["taints"][0]["timeAdded"] = "not a time"
    adopted = times.adopt(published)
    assert adopted["pci-0000-01-00-0"] == "2027-01-01T00:00:00Z"
    assert adopted["pci-0000-01-01-0"] == format_time(1_900_000_000.0)  # an unreadable time is not taken


# -- the publisher -------------------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with running() as fake:
        fake.add_node(NODE, NODE_UID)
        yield fake


@pytest.fixture
def api(server: FakeApiServer) -> Iterator[KubeApi]:
    client = KubeApi.for_host(server.url, timeout=(2.0, 5.0))
    yield client
    client.close()


def writes(server: FakeApiServer) -> list[str]:
    return [request.method for request in server.requests() if request.method != "GET"]


def published(server: FakeApiServer) -> dict[str, dict[str, Any]]:
    return devices_by_name([obj for obj in server.slices() if obj["spec"]["nodeName"] == NODE])


def test_a_device_turning_unhealthy_is_published_with_a_taint_that_then_stays_put(
    server: FakeApiServer, api: KubeApi
) -> None:
    clock = Clock()
    publisher = SlicePublisher(api, NODE, taint_times=TaintTimes(clock))
    healthy = many_gpus(3)
    publisher.sync(healthy)
    assert all("taints" not in device for device in published(server).values())
    sick = with_health(healthy, {"0000:01:01.0": GROUP_NOT_VIABLE})
    result = publisher.sync(sick)
    assert (result.generation, result.updated) == (2, 1)
    taints = published(server)["pci-0000-01-01-0"]["taints"]
    assert taints == [
        {"key": TAINT_KEY, "value": "IOMMUGroupNotViable", "effect": "NoSchedule", "timeAdded": format_time(clock.now)}
    ]
    server.clear_requests()
    clock.now += 600
    for _ in range(3):  # later syncs, the resync among them: nothing to write, the time unchanged
        assert not publisher.sync(sick).changed
    assert writes(server) == []
    assert published(server)["pci-0000-01-01-0"]["taints"] == taints
    restarted = SlicePublisher(api, NODE, taint_times=TaintTimes(Clock(clock.now + 600)))
    assert not restarted.sync(sick).changed  # a restarted plugin keeps the taint's time: no write
    assert writes(server) == []
    assert publisher.sync(healthy).updated == 1  # healthy again: the taint goes
    assert "taints" not in published(server)["pci-0000-01-01-0"]
    assert published(server)["pci-0000-01-01-0"]["attributes"]["healthy"] == {"bool": True}


def test_a_taint_without_time_would_be_stamped_by_the_server() -> None:
    """The fake API server defaults ``timeAdded`` as Kubernetes does, so a publisher that left it out would
    differ from the server at every sync: the test above means something."""
    with running() as fake:
        obj = build_slices(many_gpus(1, healthy=False), NODE)[0]
        stored = fake.add_slice(obj)
        (taint,) = stored["spec"]["devices"][0]["taints"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", taint["timeAdded"])


def test_the_fake_api_server_refuses_taints_kubernetes_refuses(server: FakeApiServer, api: KubeApi) -> None:
    obj = build_slices(many_gpus(1, healthy=False), NODE)[0]
    obj["spec"]["devices"][0]["taints"][0].update(key="Bad Key", effect="PreferNoSchedule")
    with pytest.raises(KubeError, match=r"HTTP 422 .*taints\[0\]\.key: Invalid value.*effect: Unsupported value"):
        api.create_slice(obj)


def test_an_api_server_that_drops_taints_is_not_rewritten_at_every_sync() -> None:
    """1.34/1.35 with ``DRADeviceTaints`` off drop the field; ``healthy: false`` still tells, and the
    publisher, having seen its taints dropped, compares without them (no write, no new generation)."""
    with running(device_taints=False) as fake:
        fake.add_node(NODE, NODE_UID)
        client = KubeApi.for_host(fake.url, timeout=(2.0, 5.0))
        try:
            publisher = SlicePublisher(client, NODE)
            sick = with_health(many_gpus(2), {"0000:01:00.0": "/dev/vfio/0 is missing"})
            assert publisher.sync(sick).created == 1
            stored = devices_by_name(fake.slices())["pci-0000-01-00-0"]
            assert "taints" not in stored and stored["attributes"]["healthy"] == {"bool": False}
            fake.clear_requests()
            assert not publisher.sync(sick).changed
            assert writes(fake) == []
            assert publisher.sync(many_gpus(2)).updated == 1  # healthy again is still a change
        finally:
            client.close()


# -- the scheduler stand-in ----------------------------------------------------------------------------------

ANY_GPU_CLASS = {
    "any": {
        "metadata": {"name": "any"},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER_NAME}"'}}]},
    }
}


def tainted_pool() -> list[dict[str, Any]]:
    inventory = with_health(many_gpus(2), {"0000:01:00.0": "/dev/vfio/0 is missing"})
    return build_slices(inventory, "n", taint_times={"pci-0000-01-00-0": "2027-01-01T00:00:00Z"})


def claim(request: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "c", "namespace": "ns"}, "spec": {"devices": {"requests": [request]}}}


def test_the_scheduler_does_not_give_a_tainted_device_to_a_claim_that_does_not_tolerate_it() -> None:
    scheduler = Scheduler("n", tainted_pool(), classes=ANY_GPU_CLASS)
    got = scheduler.allocate(claim({"name": "g", "exactly": {"deviceClassName": "any", "allocationMode": "All"}}))
    assert [device.name for _, device in got.results] == ["pci-0000-01-01-0"]
    with pytest.raises(AllocationError, match="request 'g' wants 1"):
        scheduler.allocate(claim({"name": "g", "exactly": {"deviceClassName": "any"}}))


@pytest.mark.parametrize(
    "toleration",
    [
        {"key": TAINT_KEY, "operator": "Exists"},
        {"key": TAINT_KEY, "operator": "Equal", "value": "VFIOGroupNodeMissing", "effect": "NoSchedule"},
        {"key": TAINT_KEY, "value": "VFIOGroupNodeMissing"},  # Equal is the default
        {"operator": "Exists"},
    ],
)
def test_a_tolerating_request_may_get_the_tainted_device(toleration: dict[str, Any]) -> None:
    scheduler = Scheduler("n", tainted_pool(), classes=ANY_GPU_CLASS)
    spec = {"deviceClassName": "any", "count": 2, "tolerations": [toleration]}
    got = scheduler.allocate(claim({"name": "g", "exactly": spec}))
    assert sorted(device.name for _, device in got.results) == ["pci-0000-01-00-0", "pci-0000-01-01-0"]
    first = Scheduler("n", tainted_pool(), classes=ANY_GPU_CLASS).allocate(
        claim({"name": "g", "firstAvailable": [{"name": "two", **spec}]})
    )
    assert len(first.results) == 2


@pytest.mark.parametrize(
    "toleration",
    [
        {"key": TAINT_KEY, "value": "NoIOMMUGroup"},
        {"key": TAINT_KEY, "operator": "Exists", "effect": "NoExecute"},
        {"key": "example.com/other", "operator": "Exists"},
    ],
)
def test_a_toleration_that_does_not_match_does_not_help(toleration: dict[str, Any]) -> None:
    scheduler = Scheduler("n", tainted_pool(), classes=ANY_GPU_CLASS)
    spec = {"deviceClassName": "any", "count": 2, "tolerations": [toleration]}
    with pytest.raises(AllocationError):
        scheduler.allocate(claim({"name": "g", "exactly": spec}))


def test_a_none_effect_taint_never_blocks_and_the_shipped_classes_still_want_healthy() -> None:
    slices = tainted_pool()
    slices[0]["spec"]["devices"][0]["taints"][0]["effect"] = "None"
    scheduler = Scheduler("n", slices, classes=ANY_GPU_CLASS)
    assert len(scheduler.allocate(claim({"name": "g", "exactly": {"deviceClassName": "any", "count": 2}})).results) == 2
    # the shipped DeviceClass selects healthy: tolerating the taint does not get an unhealthy GPU from it
    shipped = Scheduler("n", tainted_pool())
    spec = {
        "deviceClassName": "passthrough.gpu-passthrough.kubevirt.io",
        "count": 2,
        "tolerations": [{"operator": "Exists"}],
    }
    with pytest.raises(AllocationError):
        shipped.allocate(claim({"name": "g", "exactly": spec}))
    assert tolerates({"operator": "Exists"}, {"key": "k", "effect": "NoExecute"})


def test_a_taint_the_server_still_has_from_before_a_healing_this_process_saw_is_not_adopted() -> None:
    """Healthy again, the taint goes and a later problem is a new taint, also when the write that removed the
    taint failed (API server down) and the server still shows the old one when the device breaks again."""
    clock = Clock()
    times = TaintTimes(clock)
    healthy = many_gpus(2)
    sick = with_health(healthy, {"0000:01:00.0": "/dev/vfio/0 is missing"})
    name = device_name(ResourceKind.PCI, "0000:01:00.0")
    first = times.observe(sick)
    on_server = build_slices(sick, NODE, taint_times=first)  # published with the first time
    assert times.adopt(on_server) == first
    clock.now += 600
    assert times.observe(healthy) == {}  # healed; the write removing the taint fails: the server keeps it
    clock.now += 600
    times.observe(sick)  # broken again
    assert times.adopt(on_server) == {name: format_time(clock.now)}  # a new taint, not the old one's time


def test_a_restarted_plugin_adopts_the_server_time_only_for_what_it_has_not_seen_healthy() -> None:
    clock = Clock()
    sick = with_health(many_gpus(2), {"0000:01:00.0": "/dev/vfio/0 is missing"})
    earlier = {device_name(ResourceKind.PCI, "0000:01:00.0"): format_time(clock.now - 3600)}
    on_server = build_slices(sick, NODE, taint_times=earlier)
    restarted = TaintTimes(clock)
    restarted.observe(sick)
    assert restarted.adopt(on_server) == earlier  # unhealthy since before the restart: the time stays
    clock.now += 60
    restarted.observe(sick)
    assert restarted.adopt(on_server) == earlier


def test_an_api_server_that_starts_keeping_taints_gets_them_without_a_plugin_restart() -> None:
    """The control plane is upgraded first (1.35 → 1.36, ``DRADeviceTaints`` now on) while the node's plugin runs:
    its device, unhealthy since before, must get its taint without waiting for a restart or a change of health.
    The check is a dry-run update: against a server that still drops taints it writes nothing."""
    with running(device_taints=False) as fake:
        fake.add_node(NODE, NODE_UID)
        client = KubeApi.for_host(fake.url, timeout=(2.0, 5.0))
        try:
            publisher = SlicePublisher(client, NODE)
            publisher.taints_recheck_after = 0.0  # every sync looks again (default: hourly)
            sick = with_health(many_gpus(2), {"0000:01:00.0": "/dev/vfio/0 is missing"})
            assert publisher.sync(sick).created == 1
            (before,) = fake.slices()
            for _ in range(2):  # still dropped: nothing written, no new generation
                assert not publisher.sync(sick).changed
            (after,) = fake.slices()
            assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
            assert after["spec"]["pool"]["generation"] == before["spec"]["pool"]["generation"]
            fake.device_taints = True  # the API server is upgraded
            assert publisher.sync(sick).updated == 1
            taints = devices_by_name(fake.slices())["pci-0000-01-00-0"]["taints"]
            assert [(t["key"], t["value"]) for t in taints] == [(TAINT_KEY, "VFIOGroupNodeMissing")]
            fake.clear_requests()
            assert not publisher.sync(sick).changed  # and then stays put
            assert writes(fake) == []
        finally:
            client.close()
