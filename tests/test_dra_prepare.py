"""plugin.dra.prepare: claims prepared on fixture nodes into CDI specs (checked against the CDI schema) and
KEP 5304 metadata files (read back with the hook's parser), checkpointed so restarts neither leak nor
prepare twice."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from plugin.dra import cdi, checkpoint, prepare
from plugin.dra.claims import AllocatedDevice, ClaimRef, StaticClaims
from plugin.dra.prepare import PrepareCore
from schemas import dra_metadata
from schemas.dra import CDI_KIND, DRIVER_NAME, device_name
from schemas.errors import InputError
from schemas.kinds import ResourceKind
from simkit.fixture_nodes import MIXED_NODE, NODE01, SRIOV_VGPU_NODE, T4_2Q, VGPU_NODE
from simkit.sysfs_fixture import Node
from tests.discovery_support import build_node, discover
from tests.dra_support import load_cdi_spec

GPU_86, GPU_AF, GPU_3B = "0000:86:00.0", "0000:af:00.0", "0000:3b:00.0"
UID = "0f4c6a4e-2b7a-4c3e-9d2f-8a1b2c3d4e5f"
UID2 = "1a2b3c4d-0000-4000-8000-00000000abcd"
CLAIM = ClaimRef("vms", "gpu-claim", UID)


def gpu(name: str, request: str = "gpu", pool: str = "node01", **kw: Any) -> AllocatedDevice:
    return AllocatedDevice(request, DRIVER_NAME, pool, name, **kw)


@dataclasses.dataclass
class Setup:
    root: Path
    state: Path
    cdi_dir: Path
    claims: dict[ClaimRef, list[AllocatedDevice]]

    def core(self, node_root: Path | None = None) -> PrepareCore:
        root = node_root or self.root
        core = PrepareCore(StaticClaims.from_results(self.claims), root, self.state, self.cdi_dir, pool="node01")
        core.update_inventory(discover(root))
        core.start()
        return core


def setup(tmp_path: Path, node: Node = NODE01, **claims: list[AllocatedDevice]) -> Setup:
    root = build_node(node, tmp_path)
    return Setup(root, tmp_path / "state", tmp_path / "cdi", {})


def test_a_claim_gets_a_cdi_device_per_request_with_its_vfio_nodes_and_metadata_mount(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0"), gpu("pci-0000-af-00-0", request="second")]
    answer = s.core().prepare([CLAIM])[UID]
    assert answer.error == ""
    ids = {device.device: device.cdi_ids for device in answer.devices}
    assert ids == {
        "pci-0000-86-00-0": (f"gpu-passthrough.kubevirt.io/claim={UID}-gpu",),
        "pci-0000-af-00-0": (f"gpu-passthrough.kubevirt.io/claim={UID}-second",),
    }
    assert [device.requests for device in answer.devices] == [("gpu",), ("second",)]
    spec = load_cdi_spec(s.cdi_dir / f"gpu-passthrough.kubevirt.io-claim_{UID}.json")
    assert spec["kind"] == "gpu-passthrough.kubevirt.io/claim"
    first, second = spec["devices"]
    assert first["name"] == f"{UID}-gpu"
    assert [node["path"] for node in first["containerEdits"]["deviceNodes"]] == ["/dev/vfio/vfio", "/dev/vfio/74"]
    assert [node["path"] for node in second["containerEdits"]["deviceNodes"]] == ["/dev/vfio/vfio", "/dev/vfio/96"]
    (mount,) = first["containerEdits"]["mounts"]
    assert mount["containerPath"] == (
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/gpu-claim/gpu/{DRIVER_NAME}-metadata.json"
    )
    assert "ro" in mount["options"] and "bind" in mount["options"]
    metadata = dra_metadata.parse_metadata(Path(mount["hostPath"]).read_bytes(), mount["hostPath"])
    assert (metadata.claim_name, metadata.namespace, metadata.uid) == ("gpu-claim", "vms", UID)
    found = dra_metadata.claimed_device(metadata, "gpu", mount["hostPath"])
    assert (found.kind, found.id) == ("pci", GPU_86)


def test_a_template_claim_mounts_its_metadata_under_the_pods_claim_name(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0", pod_claim_name="my-gpu")]
    s.core().prepare([CLAIM])
    spec = load_cdi_spec(s.cdi_dir / cdi.spec_file_name(UID))
    (mount,) = spec["devices"][0]["containerEdits"]["mounts"]
    assert "/resourceclaimtemplates/my-gpu/gpu/" in mount["containerPath"]
    assert dra_metadata.parse_metadata(Path(mount["hostPath"]).read_bytes(), "m").pod_claim_name == "my-gpu"


def test_mdevs_are_named_by_uuid_in_metadata(tmp_path: Path) -> None:
    s = setup(tmp_path, VGPU_NODE)
    s.claims[CLAIM] = [gpu(f"mdev-{T4_2Q}")]
    answer = s.core().prepare([CLAIM])[UID]
    assert answer.error == ""
    spec = load_cdi_spec(s.cdi_dir / cdi.spec_file_name(UID))
    (mount,) = spec["devices"][0]["containerEdits"]["mounts"]
    found = dra_metadata.claimed_device(
        dra_metadata.parse_metadata(Path(mount["hostPath"]).read_bytes(), "m"), "gpu", "m"
    )
    assert (found.kind, found.id) == ("mdev", T4_2Q)


def test_iommufd_nodes_are_given_where_present(tmp_path: Path) -> None:
    s = setup(tmp_path, dataclasses.replace(NODE01, iommufd=True))
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    s.core().prepare([CLAIM])
    spec = load_cdi_spec(s.cdi_dir / cdi.spec_file_name(UID))
    paths = [node["path"] for node in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert paths[:3] == ["/dev/vfio/vfio", "/dev/vfio/74", "/dev/iommu"]
    assert len(paths) == 4 and paths[3].startswith("/dev/vfio/devices/vfio")


def test_prepare_twice_answers_the_same_and_writes_nothing_new(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    core = s.core()
    first = core.prepare([CLAIM])
    spec = s.cdi_dir / cdi.spec_file_name(UID)
    before = spec.stat().st_mtime_ns
    s.claims[CLAIM] = [gpu("pci-0000-af-00-0")]  # a changed allocation cannot change a prepared claim
    assert core.prepare([CLAIM]) == first
    assert spec.stat().st_mtime_ns == before


def test_unprepare_removes_every_file_and_is_idempotent(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    core = s.core()
    core.prepare([CLAIM])
    assert core.unprepare([CLAIM]) == {UID: ""}
    assert core.unprepare([CLAIM]) == {UID: ""}
    assert core.unprepare([ClaimRef("x", "never", "../../etc")]) == {"../../etc": ""}
    assert list(s.cdi_dir.iterdir()) == []
    assert list((s.state / "metadata").iterdir()) == []
    assert json.loads((s.state / "checkpoint.json").read_text())["claims"] == {}


def test_a_restart_reports_prepared_claims_without_redoing_them(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    first = s.core().prepare([CLAIM])
    s.claims.clear()  # the allocation is not even readable any more: the checkpoint answers
    again = s.core()
    assert again.prepare([CLAIM]) == first
    assert set(again.prepared()) == {UID}


def test_a_restart_removes_files_no_claim_owns_and_restores_missing_ones(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    core = s.core()
    core.prepare([CLAIM])
    orphan = s.cdi_dir / cdi.spec_file_name(UID2)
    orphan.write_text("{}")
    (s.state / "metadata" / UID2 / "gpu").mkdir(parents=True)
    temporary = s.cdi_dir / f".{cdi.spec_file_name(UID2)}.123.tmp"
    temporary.write_text("")
    other_vendor = s.cdi_dir / "nvidia.com-gpu.json"
    other_vendor.write_text("{}")
    spec = s.cdi_dir / cdi.spec_file_name(UID)
    text = spec.read_text()
    spec.unlink()  # /var/run emptied by a reboot
    s.core()
    assert not orphan.exists() and not temporary.exists() and not (s.state / "metadata" / UID2).exists()
    assert other_vendor.exists()
    assert spec.read_text() == text


def test_a_tampered_checkpoint_is_set_aside_and_ownership_rebuilt_from_our_files(tmp_path: Path) -> None:
    # tests/test_dra_checkpoint_damage.py: the quarantine in full (issue 22, finding 6)
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    s.core().prepare([CLAIM])
    (s.state / "checkpoint.json").write_text('{"version": 1, "claims": {"x": {"files": {"/etc/passwd": ""}}}}')
    core = s.core()
    assert set(core.prepared()) == {UID}
    assert list(s.state.glob("checkpoint.json.damaged-*"))
    assert [path.name for path in s.cdi_dir.iterdir()] == [cdi.spec_file_name(UID)]
    assert Path("/etc/passwd").exists()


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([gpu("pci-0000-99-00-0")], "pci-0000-99-00-0 (0000:99:00.0) is not on this node"),
        ([gpu("not-ours")], "is not a device name of DRA driver"),
        ([gpu("pci-0000-86-00-0", pool="node02")], "from pool 'node02', not 'node01'"),
        ([gpu("pci-0000-86-00-0"), gpu("pci-0000-86-00-0", request="b")], "allocated twice"),
        ([gpu("pci-0000-86-00-0", request="Bad_Request")], "is not a request name"),
    ],
)
def test_refusals_are_the_claims_own_error_naming_it(
    tmp_path: Path, devices: list[AllocatedDevice], message: str
) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = devices
    answer = s.core().prepare([CLAIM])[UID]
    assert answer.devices == () and message in answer.error and "vms/gpu-claim" in answer.error
    assert not s.cdi_dir.exists() or list(s.cdi_dir.iterdir()) == []


def test_an_unhealthy_device_is_refused_with_the_device_plugins_reason(tmp_path: Path) -> None:
    s = setup(tmp_path, MIXED_NODE)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    answer = s.core().prepare([CLAIM])[UID]
    assert "0000:86:00.0 is unhealthy" in answer.error and "snd_hda_intel" in answer.error


def test_a_group_node_removed_after_the_scan_is_refused(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    core = s.core()
    os.unlink(s.root / "dev/vfio/74")
    assert "/dev/vfio/74 is missing" in core.prepare([CLAIM])[UID].error


def test_a_device_prepared_for_another_claim_is_refused(tmp_path: Path) -> None:
    s = setup(tmp_path)
    other = ClaimRef("vms", "other", UID2)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    s.claims[other] = [gpu("pci-0000-86-00-0")]
    core = s.core()
    assert core.prepare([CLAIM])[UID].error == ""
    assert "prepared for claim vms/gpu-claim" in core.prepare([other])[UID2].error


def test_admin_access_is_refused_and_does_not_take_the_device(tmp_path: Path) -> None:
    # The scheduler gives a device with adminAccess whether or not another claim holds it, and never counts it
    # as in use: prepared, it would take the VFIO device from the claim the scheduler did give it to.
    s = setup(tmp_path)
    monitor = ClaimRef("monitoring", "watch-gpu", UID2)
    s.claims[monitor] = [gpu("pci-0000-86-00-0", admin_access=True)]
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    core = s.core()
    error = core.prepare([monitor])[UID2].error
    assert "monitoring/watch-gpu" in error and "pci-0000-86-00-0 is allocated with adminAccess" in error
    assert core.prepared() == {} and (not s.cdi_dir.exists() or list(s.cdi_dir.iterdir()) == [])
    assert core.prepare([CLAIM])[UID].error == ""


def test_other_drivers_devices_are_left_alone(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [AllocatedDevice("nic", "net.example.com", "node01", "eth0"), gpu("pci-0000-86-00-0")]
    answer = s.core().prepare([CLAIM])[UID]
    assert [device.device for device in answer.devices] == ["pci-0000-86-00-0"]
    assert [d["name"] for d in load_cdi_spec(s.cdi_dir / cdi.spec_file_name(UID))["devices"]] == [f"{UID}-gpu"]


def test_a_claim_of_only_other_drivers_is_prepared_empty(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [AllocatedDevice("nic", "net.example.com", "node01", "eth0")]
    answer = s.core().prepare([CLAIM])[UID]
    assert answer.error == "" and answer.devices == ()
    assert not s.cdi_dir.exists() or list(s.cdi_dir.iterdir()) == []


def test_unknown_and_malformed_claims_are_refused(tmp_path: Path) -> None:
    s = setup(tmp_path)
    core = s.core()
    assert "not known" in core.prepare([CLAIM])[UID].error
    assert "not a plain UID" in core.prepare([ClaimRef("vms", "c", "a/b")])["a/b"].error
    assert "not a DNS label" in core.prepare([ClaimRef("../x", "c", UID)])[UID].error


def test_the_checkpoint_bounds_prepared_claims(tmp_path: Path) -> None:
    s = setup(tmp_path)
    other = ClaimRef("vms", "other", UID2)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    s.claims[other] = [gpu("pci-0000-af-00-0")]
    core = PrepareCore(StaticClaims.from_results(s.claims), s.root, s.state, s.cdi_dir, max_claims=1)
    core.update_inventory(discover(s.root))
    core.start()
    assert core.prepare([CLAIM])[UID].error == ""
    assert "the limit is 1" in core.prepare([other])[UID2].error


def test_a_checkpoint_naming_files_elsewhere_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "checkpoint.json").write_text(
        json.dumps(
            {"version": 1, "claims": {UID: {"namespace": "a", "name": "b", "devices": [], "files": {"/etc/x": ""}}}}
        )
    )
    with pytest.raises(Exception, match="outside the plugin's directories"):
        checkpoint.load(state, [tmp_path / "cdi"])


def test_a_claim_source_that_breaks_fails_only_that_claim(tmp_path: Path) -> None:
    s = setup(tmp_path)
    other = ClaimRef("vms", "other", UID2)
    s.claims[other] = [gpu("pci-0000-af-00-0")]
    static = StaticClaims.from_results(s.claims)

    class Flaky:
        def allocated(self, claim: ClaimRef, until: float | None = None) -> list[AllocatedDevice]:
            if claim == CLAIM:
                raise ConnectionResetError("API server went away")
            return static.allocated(claim)

    core = PrepareCore(Flaky(), s.root, s.state, s.cdi_dir)
    core.update_inventory(discover(s.root))
    core.start()
    answers = core.prepare([CLAIM, other])
    assert "reading its allocation failed: ConnectionResetError: API server went away" in answers[UID].error
    assert answers[UID2].error == "" and len(answers[UID2].devices) == 1


def test_files_that_cannot_be_written_fail_the_claim_and_leave_nothing(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    core = s.core()
    s.cdi_dir.write_text("not a directory")
    answer = core.prepare([CLAIM])[UID]
    assert "cannot write its files" in answer.error and "vms/gpu-claim" in answer.error
    assert core.prepared() == {}
    assert list((s.state / "metadata").iterdir()) == []


def test_a_request_of_two_gpus_is_one_cdi_device_with_both_groups(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0"), gpu("pci-0000-af-00-0")]
    answer = s.core().prepare([CLAIM])[UID]
    assert [device.cdi_ids for device in answer.devices] == [(f"{CDI_KIND}={UID}-gpu",)] * 2
    (device,) = load_cdi_spec(s.cdi_dir / cdi.spec_file_name(UID))["devices"]
    paths = [node["path"] for node in device["containerEdits"]["deviceNodes"]]
    assert paths == ["/dev/vfio/vfio", "/dev/vfio/74", "/dev/vfio/96"]


def test_a_subrequest_result_is_filed_under_its_request(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0", request="gpu/rtx")]
    answer = s.core().prepare([CLAIM])[UID]
    assert answer.devices[0].requests == ("gpu",)  # the kubelet matches the container's "gpu" exactly
    (device,) = load_cdi_spec(s.cdi_dir / cdi.spec_file_name(UID))["devices"]
    (mount,) = device["containerEdits"]["mounts"]
    assert device["name"] == f"{UID}-gpu" and "/resourceclaims/gpu-claim/gpu/" in mount["containerPath"]
    metadata = dra_metadata.parse_metadata(Path(mount["hostPath"]).read_bytes(), "m")
    assert [request.name for request in metadata.requests] == ["gpu/rtx"]  # the full name inside (Kubernetes)
    assert dra_metadata.claimed_device(metadata, "gpu/rtx", "m").id == GPU_86


def test_an_sriov_vgpu_vf_is_named_by_its_pci_address(tmp_path: Path) -> None:
    s = setup(tmp_path, SRIOV_VGPU_NODE)
    inventory = discover(s.root)
    vf = next(d for r in inventory.resources if r.kind is ResourceKind.SRIOV_VGPU for d in r.devices if d.healthy)
    s.claims[CLAIM] = [gpu(device_name(ResourceKind.SRIOV_VGPU, vf.id))]
    answer = s.core().prepare([CLAIM])[UID]
    assert answer.error == ""
    (device,) = load_cdi_spec(s.cdi_dir / cdi.spec_file_name(UID))["devices"]
    (mount,) = device["containerEdits"]["mounts"]
    found = dra_metadata.claimed_device(
        dra_metadata.parse_metadata(Path(mount["hostPath"]).read_bytes(), "m"), "gpu", "m"
    )
    assert (found.kind, found.id) == ("pci", vf.id)
    assert f"/dev/vfio/{vf.iommu_group}" in [node["path"] for node in device["containerEdits"]["deviceNodes"]]


def test_two_concurrent_prepares_of_one_claim_prepare_it_once(tmp_path: Path) -> None:
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    static = StaticClaims.from_results(s.claims)
    both_reading = threading.Barrier(2)

    class Slow:
        def allocated(self, claim: ClaimRef, until: float | None = None) -> list[AllocatedDevice]:
            both_reading.wait(5)  # both calls are past the first look and read the claim at once
            return static.allocated(claim)

    outcomes: list[str] = []
    core = PrepareCore(Slow(), s.root, s.state, s.cdi_dir, on_outcome=lambda op, result: outcomes.append(result))
    core.update_inventory(discover(s.root))
    core.start()
    answers: list[object] = []
    threads = [threading.Thread(target=lambda: answers.append(core.prepare([CLAIM])[UID])) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(answers) == 2 and answers[0] == answers[1] and outcomes == ["ok", "ok"]
    assert list(core.prepared()) == [UID]


def test_an_unprepare_while_the_claim_is_read_wins_and_nothing_is_left_prepared(tmp_path: Path) -> None:
    # The kubelet gives up on a slow prepare (45 s), and once the pod is gone unprepares the claim, while the
    # first call is still reading it: the unprepare is answered "done", so the late prepare must not record the
    # claim (its devices would be held for a claim the kubelet never unprepares again).
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    static = StaticClaims.from_results(s.claims)
    reading, release = threading.Event(), threading.Event()

    class Slow:
        def allocated(self, claim: ClaimRef, until: float | None = None) -> list[AllocatedDevice]:
            reading.set()
            assert release.wait(10)
            return static.allocated(claim)

    core = PrepareCore(Slow(), s.root, s.state, s.cdi_dir)
    core.update_inventory(discover(s.root))
    core.start()
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.append(core.prepare([CLAIM])[UID]))
    thread.start()
    assert reading.wait(10)
    assert core.unprepare([CLAIM]) == {UID: ""}
    release.set()
    thread.join(10)
    assert "unprepared while it was being prepared" in answers[0].error
    assert core.prepared() == {}
    assert not s.cdi_dir.exists() or list(s.cdi_dir.iterdir()) == []
    reading.clear()
    release.set()
    assert core.prepare([CLAIM])[UID].error == ""  # asked again later, it is prepared


def test_a_re_prepare_whose_missing_file_cannot_be_written_again_fails_the_claim(tmp_path: Path) -> None:
    # The runtime resolves the answer's CDI IDs from the spec file: answering "prepared" without it fails the
    # container later with an unresolvable CDI device, where a claim error makes the kubelet ask again.
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    core = s.core()
    first = core.prepare([CLAIM])[UID]
    assert first.error == ""
    shutil.rmtree(s.cdi_dir)
    s.cdi_dir.write_text("not a directory")
    error = core.prepare([CLAIM])[UID].error
    assert "vms/gpu-claim" in error and cdi.spec_file_name(UID) in error and "cannot be written again" in error
    assert list(core.prepared()) == [UID]  # still recorded: the unprepare to come removes it
    s.cdi_dir.unlink()
    assert core.prepare([CLAIM])[UID] == first
    assert (s.cdi_dir / cdi.spec_file_name(UID)).is_file()


def test_a_second_plugin_process_on_the_same_state_is_refused_at_start(tmp_path: Path) -> None:
    # Two processes on one checkpoint: the second would reconcile under the first's feet and later serve from a
    # stale record. The lock is per process (POSIX), so cores of one process (the restarts above) share it.
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(s.state / prepare.LOCK_FILE)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(InputError, match=r"another DRA plugin process holds .*state/lock"):
            s.core()
        assert not s.cdi_dir.exists()
    finally:
        holder.kill()
        holder.wait(10)
    assert s.core().prepare([CLAIM])[UID].error == ""


_HOLD_LOCK = """
import fcntl, os, sys, time
os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_a_re_prepare_after_the_iommu_groups_changed_is_refused(tmp_path: Path) -> None:
    # After a reboot the recorded spec is written again from the record; if the groups were renumbered at boot
    # it would give the container another device's /dev/vfio/<group>.
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0"), gpu("pci-0000-af-00-0", request="second")]
    core = s.core()
    first = core.prepare([CLAIM])[UID]
    assert first.error == ""
    assert core.prepare([CLAIM])[UID] == first  # unchanged groups: the recorded answer
    inventory = discover(s.root)
    renumbered = dataclasses.replace(
        inventory,
        resources=tuple(
            dataclasses.replace(
                resource,
                devices=tuple(
                    dataclasses.replace(device, iommu_group=96 if device.id == GPU_86 else 74)
                    if device.id in (GPU_86, GPU_AF)
                    else device
                    for device in resource.devices
                ),
            )
            for resource in inventory.resources
        ),
    )
    core.update_inventory(renumbered)
    error = core.prepare([CLAIM])[UID].error
    # sysfs (unchanged here) disagrees with the renumbered scan: the re-check refuses, naming the group
    assert "vms/gpu-claim" in error and "IOMMU group changed from 96 to 74" in error
    core.update_inventory(inventory)
    assert core.prepare([CLAIM])[UID] == first


def test_a_re_prepare_after_the_vfio_cdev_was_renumbered_is_refused(tmp_path: Path) -> None:
    # /dev/vfio/devices/vfioN is numbered at each bind to vfio-pci: a rebind (or a reboot) gives the device
    # another number, and the old one may be another device's now.
    s = setup(tmp_path, dataclasses.replace(NODE01, iommufd=True))
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    core = s.core()
    first = core.prepare([CLAIM])[UID]
    assert first.error == ""
    spec = load_cdi_spec(s.cdi_dir / cdi.spec_file_name(UID))
    (old,) = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"] if "/devices/" in n["path"]]
    sysfs = s.root / "sys/bus/pci/devices" / GPU_86 / "vfio-dev"
    (entry,) = list(sysfs.iterdir())
    assert old.endswith("/" + entry.name)
    entry.rename(sysfs / "vfio99")
    (s.root / old.lstrip("/")).rename(s.root / "dev/vfio/devices/vfio99")
    error = core.prepare([CLAIM])[UID].error
    assert "VFIO nodes changed" in error and old in error and "/dev/vfio/devices/vfio99" in error


def test_claim_outcomes_are_counted_on_the_plugins_metrics(tmp_path: Path) -> None:
    from plugin.dra.serve import claim_counter
    from plugin.metrics import PluginMetrics

    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    metrics = PluginMetrics()
    core = PrepareCore(
        StaticClaims.from_results(s.claims), s.root, s.state, s.cdi_dir, on_outcome=claim_counter(metrics)
    )
    core.update_inventory(discover(s.root))
    core.start()
    core.prepare([CLAIM, ClaimRef("vms", "unknown", UID2)])
    core.unprepare([CLAIM])
    text = metrics.exposition().decode()
    assert 'gpu_device_plugin_dra_claims_total{operation="prepare",result="ok"} 1.0' in text
    assert 'gpu_device_plugin_dra_claims_total{operation="prepare",result="error"} 1.0' in text
    assert 'gpu_device_plugin_dra_claims_total{operation="unprepare",result="ok"} 1.0' in text
    assert 'gpu_device_plugin_dra_claims_total{operation="unprepare",result="error"} 0.0' in text


def test_a_checkpoint_naming_another_vendors_cdi_spec_is_damaged_and_that_spec_survives(tmp_path: Path) -> None:
    # /var/run/cdi holds every vendor's specs: a record naming one (inside the CDI directory, but not a file a
    # prepare writes) must never make an unprepare delete it.
    s = setup(tmp_path)
    s.claims[CLAIM] = [gpu("pci-0000-86-00-0")]
    assert s.core().prepare([CLAIM])[UID].error == ""
    foreign = s.cdi_dir.absolute() / "nvidia.com-gpu.json"
    foreign.write_text('{"cdiVersion": "0.5.0"}')
    path = s.state / checkpoint.FILE_NAME
    obj = json.loads(path.read_text())
    obj["claims"][UID]["files"][str(foreign)] = "replaced"
    path.write_text(json.dumps(obj))
    core = s.core()
    assert set(core.prepared()) == {UID}  # rebuilt from its own files, never from the record naming another's
    assert list(s.state.glob("checkpoint.json.damaged-*"))
    core.unprepare([CLAIM])
    assert foreign.read_text() == '{"cdiVersion": "0.5.0"}'
    assert not (s.cdi_dir / cdi.spec_file_name(UID)).exists()


@pytest.mark.parametrize(
    "text", ['{"version": 1, "claims": ' + "[" * 100_000 + "]" * 100_000 + "}", '{"version": true, "claims": {}}']
)
def test_a_checkpoint_nested_too_deep_or_of_no_version_is_set_aside(tmp_path: Path, text: str) -> None:
    s = setup(tmp_path)
    s.state.mkdir()
    (s.state / checkpoint.FILE_NAME).write_text(text)
    assert s.core().prepared() == {}
    assert list(s.state.glob("checkpoint.json.damaged-*"))
