"""The DRA plugin (``serve --dra``'s pieces) against the kubelet DRA stand-in over real unix sockets:
registration, prepare (CDI spec checked against the CDI schema, metadata read back as the hook reads it),
unprepare, idempotence, plugin and kubelet restarts, refusals as per-claim errors."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from plugin.dra import cdi
from plugin.dra.claims import AllocatedDevice, ClaimRef
from plugin.dra.service import REGISTRATION_SOCKET, SOCKET_NAME
from plugin.inventory import Inventory
from schemas import dra_metadata
from schemas.dra import DRIVER_NAME
from schemas.generated.kubelet.pluginregistration.v1 import api_pb2 as reg
from schemas.generated.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from simkit.fixture_nodes import MIXED_NODE, NODE01
from simkit.kubelet_dra_standin import DraStandInError, KubeletDraStandIn, container_cdi_devices
from simkit.sysfs_fixture import Node
from tests.dra_support import DraPaths, dra_runner, load_cdi_spec, running_dra, write_claim
from tests.plugin_support import WAIT, build_tree, short_dir, wait_until

UID = "0f4c6a4e-2b7a-4c3e-9d2f-8a1b2c3d4e5f"
UID2 = "1a2b3c4d-0000-4000-8000-00000000abcd"
CLAIM = ClaimRef("vms", "gpu-claim", UID)
KEY = (CLAIM.namespace, CLAIM.name, CLAIM.uid)


def gpu(name: str, request: str = "gpu") -> AllocatedDevice:
    return AllocatedDevice(request, DRIVER_NAME, "node01", name)


@pytest.fixture
def node01() -> Iterator[DraPaths]:
    with short_dir() as base:
        yield DraPaths.under(base, build_tree(NODE01, base))


def paths_for(node: Node, base: Path) -> DraPaths:
    return DraPaths.under(base, build_tree(node, base))


def test_the_kubelet_registers_the_plugin_at_its_endpoint_with_v1_preferred(node01: DraPaths) -> None:
    with running_dra(dra_runner(node01)) as runner, KubeletDraStandIn(node01.registry) as kubelet:
        registration = kubelet.wait_for_registration(DRIVER_NAME)
        assert registration.socket == str(node01.registry / REGISTRATION_SOCKET)
        assert registration.endpoint == str(node01.plugin_dir / SOCKET_NAME)
        assert registration.service == "v1.DRAPlugin"
        assert runner.server.registration.wait_registered(WAIT)
        assert kubelet.refusals == []


def test_an_older_kubelet_gets_v1beta1(node01: DraPaths) -> None:
    write_claim(node01, CLAIM, [gpu("pci-0000-86-00-0")])
    with (
        running_dra(dra_runner(node01)),
        KubeletDraStandIn(node01.registry, services=("v1beta1.DRAPlugin",)) as kubelet,
    ):
        assert kubelet.wait_for_registration(DRIVER_NAME).service == "v1beta1.DRAPlugin"
        devices, error = kubelet.prepare(DRIVER_NAME, [KEY])[UID]
        assert error == "" and [d.device for d in devices] == ["pci-0000-86-00-0"]


def test_a_kubelet_that_speaks_neither_version_refuses_and_the_plugin_hears_why(node01: DraPaths) -> None:
    runner = dra_runner(node01)
    runner.reregister_after = 0.3
    with (
        running_dra(runner),
        KubeletDraStandIn(node01.registry, services=("v2.DRAPlugin",)) as kubelet,
    ):
        wait_until(lambda: runner.server.registration.status.calls >= 1, what="a refusal")
        assert runner.server.registration.status.registered is not True
        assert "none of services supported by the plugin" in runner.server.registration.status.error
        assert kubelet.registered(DRIVER_NAME) is None
        wait_until(lambda: len(kubelet.refusals) >= 2, what="the registration offered again after a refusal")


def test_prepare_and_unprepare_over_the_sockets(node01: DraPaths) -> None:
    write_claim(node01, CLAIM, [gpu("pci-0000-86-00-0"), gpu("pci-0000-af-00-0", request="second")])
    with running_dra(dra_runner(node01)), KubeletDraStandIn(node01.registry) as kubelet:
        kubelet.wait_for_registration(DRIVER_NAME)
        devices, error = kubelet.prepare(DRIVER_NAME, [KEY])[UID]
        assert error == ""
        assert [(d.request_names, d.pool, d.device) for d in devices] == [
            (("gpu",), "node01", "pci-0000-86-00-0"),
            (("second",), "node01", "pci-0000-af-00-0"),
        ]
        spec = load_cdi_spec(node01.cdi_dir / cdi.spec_file_name(UID))
        by_name = {device["name"]: device for device in spec["devices"]}
        for device in devices:
            (cdi_id,) = device.cdi_ids
            kind, _, name = cdi_id.partition("=")
            assert kind == spec["kind"] and name in by_name  # every ID the kubelet gets resolves in the spec
        (mount,) = by_name[f"{UID}-gpu"]["containerEdits"]["mounts"]
        found = dra_metadata.claimed_device(
            dra_metadata.parse_metadata(Path(mount["hostPath"]).read_bytes(), mount["hostPath"]), "gpu", "m"
        )
        assert (found.kind, found.id) == ("pci", "0000:86:00.0")
        assert kubelet.prepare(DRIVER_NAME, [KEY])[UID] == (devices, "")  # idempotent
        assert kubelet.unprepare(DRIVER_NAME, [KEY]) == {UID: ""}
        assert kubelet.unprepare(DRIVER_NAME, [KEY]) == {UID: ""}  # idempotent
        assert list(node01.cdi_dir.iterdir()) == []
        assert not Path(mount["hostPath"]).exists()


def test_refusals_are_per_claim_errors_and_other_claims_still_prepare(tmp_path: Path) -> None:
    with short_dir() as base:
        paths = paths_for(MIXED_NODE, base)
        good, bad, unknown = ClaimRef("vms", "good", UID), ClaimRef("vms", "bad", UID2), ClaimRef("vms", "nope", "u-3")
        other = ClaimRef("vms", "other-driver", "u-4")
        write_claim(paths, good, [gpu("pci-0000-3b-00-0")])
        write_claim(paths, bad, [gpu("pci-0000-86-00-0")])  # the RTX 3090 whose audio is on snd_hda_intel
        write_claim(paths, unknown, [gpu("pci-0000-99-00-0")])
        write_claim(paths, other, [AllocatedDevice("nic", "net.example.com", "node01", "eth0")])
        with running_dra(dra_runner(paths)), KubeletDraStandIn(paths.registry) as kubelet:
            kubelet.wait_for_registration(DRIVER_NAME)
            keys = [(c.namespace, c.name, c.uid) for c in (good, bad, unknown, other)]
            answers = kubelet.prepare(DRIVER_NAME, keys)
        assert answers[UID][1] == "" and len(answers[UID][0]) == 1
        assert "vms/bad" in answers[UID2][1] and "unhealthy" in answers[UID2][1]
        assert "snd_hda_intel" in answers[UID2][1]
        assert "pci-0000-99-00-0 (0000:99:00.0) is not on this node" in answers["u-3"][1]
        assert answers["u-4"] == ([], "")  # another driver's device: nothing of ours to prepare
        assert sorted(p.name for p in paths.cdi_dir.iterdir()) == [cdi.spec_file_name(UID)]


def test_a_plugin_restart_keeps_prepared_claims_without_preparing_again_or_leaking(node01: DraPaths) -> None:
    write_claim(node01, CLAIM, [gpu("pci-0000-86-00-0")])
    with KubeletDraStandIn(node01.registry) as kubelet:
        with running_dra(dra_runner(node01)):
            kubelet.wait_for_registration(DRIVER_NAME)
            first = kubelet.prepare(DRIVER_NAME, [KEY])[UID]
        kubelet.wait_for_deregistration(DRIVER_NAME)  # the plugin's stop removed its registration socket
        spec = node01.cdi_dir / cdi.spec_file_name(UID)
        assert spec.exists()  # a stopped plugin leaves prepared claims prepared
        mtime = spec.stat().st_mtime_ns
        (node01.claims_dir / "vms_gpu-claim.json").unlink()  # the claim object is not even readable now
        leaked = node01.cdi_dir / cdi.spec_file_name(UID2)
        leaked.write_text("{}")  # a crash between files and checkpoint
        with running_dra(dra_runner(node01)):
            kubelet.wait_for_registration(DRIVER_NAME, count=2)
            assert kubelet.prepare(DRIVER_NAME, [KEY])[UID] == first
            assert spec.stat().st_mtime_ns == mtime
            assert not leaked.exists()
            assert kubelet.unprepare(DRIVER_NAME, [KEY]) == {UID: ""}
        assert list(node01.cdi_dir.iterdir()) == []


def test_a_kubelet_restart_registers_the_plugin_again_and_re_prepare_is_the_same(node01: DraPaths) -> None:
    write_claim(node01, CLAIM, [gpu("pci-0000-86-00-0")])
    with running_dra(dra_runner(node01)), KubeletDraStandIn(node01.registry) as kubelet:
        kubelet.wait_for_registration(DRIVER_NAME)
        first = kubelet.prepare(DRIVER_NAME, [KEY])[UID]
        kubelet.restart()
        kubelet.wait_for_registration(DRIVER_NAME, count=2)
        assert kubelet.starts == 2
        assert kubelet.prepare(DRIVER_NAME, [KEY])[UID] == first


def test_a_registration_socket_removed_is_served_again_and_registered_again(node01: DraPaths) -> None:
    with running_dra(dra_runner(node01)), KubeletDraStandIn(node01.registry) as kubelet:
        kubelet.wait_for_registration(DRIVER_NAME)
        os.unlink(node01.registry / REGISTRATION_SOCKET)
        kubelet.wait_for_registration(DRIVER_NAME, count=2)


def test_the_inventory_seam_gets_each_new_inventory(node01: DraPaths) -> None:
    seen: list[Inventory] = []

    class Sink:
        fail = True

        def publish(self, inventory: Inventory) -> None:
            if self.fail:  # the first attempt fails: offered again at the next scan
                self.fail = False
                raise RuntimeError("API server down")
            seen.append(inventory)

    with running_dra(dra_runner(node01, sinks=[Sink()])) as runner:
        wait_until(lambda: len(seen) == 1, what="a published inventory")
        scans = runner.scans
        wait_until(lambda: runner.scans >= scans + 3, what="more scans")
        assert len(seen) == 1  # an unchanged inventory is not published again
        os.unlink(node01.root / "dev/vfio/74")
        wait_until(lambda: len(seen) == 2, what="the changed inventory")
    unhealthy = [d.id for r in seen[1].resources for d in r.devices if not d.healthy]
    assert unhealthy == ["0000:86:00.0"]


def test_a_claim_over_the_bounds_is_invalid_argument(node01: DraPaths) -> None:
    with running_dra(dra_runner(node01)), KubeletDraStandIn(node01.registry) as kubelet:
        kubelet.wait_for_registration(DRIVER_NAME)
        with pytest.raises(DraStandInError, match="INVALID_ARGUMENT: 257 claims"):
            kubelet.prepare(DRIVER_NAME, [("vms", f"c{i}", f"u-{i}") for i in range(257)])


def test_get_info_names_the_driver_and_the_type(node01: DraPaths) -> None:
    socket = f"unix:{node01.registry / REGISTRATION_SOCKET}"
    with running_dra(dra_runner(node01)), grpc.insecure_channel(socket) as channel:
        info = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=WAIT)
    assert (info.type, info.name, list(info.supported_versions)) == (
        "DRAPlugin",
        "gpu-passthrough.kubevirt.io",
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"],
    )


def test_a_second_plugin_for_the_same_sockets_is_refused(node01: DraPaths) -> None:
    with running_dra(dra_runner(node01)):
        second = dra_runner(dataclasses.replace(node01))
        with pytest.raises(Exception, match="another server is listening"):
            second.server.start()


def test_a_socket_path_too_long_is_a_readiness_problem_not_a_crash(node01: DraPaths) -> None:
    deep = dataclasses.replace(node01, registry=node01.base / ("r" * 100))
    runner = dra_runner(deep)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: "longer than 107 bytes" in (runner.readiness() or ""), what="the readiness problem")
        assert runner.liveness() is None  # the loop lives on and retries
    finally:
        runner.request_stop()
        thread.join(WAIT)
    assert not thread.is_alive()


def test_each_registration_the_kubelet_confirms_offers_the_sinks_the_inventory_again(node01: DraPaths) -> None:
    # A starting kubelet deletes every ResourceSlice of its node (and a driver's slices once no plugin of it has
    # been connected for a while); the plugin must not wait for its periodic resync to publish them again.
    seen: list[Inventory] = []

    class Sink:
        def publish(self, inventory: Inventory) -> None:
            seen.append(inventory)

    runner = dra_runner(node01, sinks=[Sink()])
    runner.registration_resync_delay = 0.5
    with running_dra(runner), KubeletDraStandIn(node01.registry) as kubelet:
        kubelet.wait_for_registration(DRIVER_NAME)
        wait_until(lambda: len(seen) >= 3, what="the inventory at start, at registration and once more after it")
        count, scans = len(seen), runner.scans
        wait_until(lambda: runner.scans >= scans + 3, what="more scans")
        assert len(seen) == count  # unchanged, and no registration since: not offered again
        kubelet.restart()
        kubelet.wait_for_registration(DRIVER_NAME, count=2)
        wait_until(lambda: len(seen) >= count + 2, what="the inventory again after the kubelet's restart")
    assert all(inventory == seen[0] for inventory in seen)


def test_a_container_asking_for_a_request_met_by_a_subrequest_gets_its_cdi_device(node01: DraPaths) -> None:
    # A prioritized-list request "gpu" is allocated as "gpu/<alternative>"; the container names "gpu", and the
    # kubelet matches that name exactly against the answer's request_names.
    write_claim(node01, CLAIM, [gpu("pci-0000-86-00-0", request="gpu/rtx")])
    with running_dra(dra_runner(node01)), KubeletDraStandIn(node01.registry) as kubelet:
        kubelet.wait_for_registration(DRIVER_NAME)
        devices, error = kubelet.prepare(DRIVER_NAME, [KEY])[UID]
        assert error == ""
        assert container_cdi_devices(devices, "gpu") == [f"{cdi.device_id(f'{UID}-gpu')}"]
        assert container_cdi_devices(devices, "other") == []
