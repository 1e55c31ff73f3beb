"""A damaged DRA checkpoint quarantines instead of reconciling (issue 22, finding 6).

Before: a torn ``checkpoint.json`` counted as empty, so the next start removed the running claim's CDI spec
and metadata, and then prepared the same GPU for a second claim. Now the damaged file is kept aside (bounded),
ownership is rebuilt from the files prepares wrote, nothing of a running claim is removed, the GPU is refused
to another claim, and readiness says the plugin is quarantined until the operator removes the kept copies.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from plugin.dra import cdi, checkpoint, prepare
from plugin.dra.claims import AllocatedDevice, ClaimRef, StaticClaims
from plugin.dra.prepare import PrepareCore
from schemas.dra import DRIVER_NAME
from simkit.fixture_nodes import NODE01
from simkit.kubelet_dra_standin import KubeletDraStandIn
from tests.discovery_support import build_node, discover
from tests.dra_support import DraPaths, dra_runner, running_dra, write_claim
from tests.plugin_support import build_tree, short_dir, wait_until

UID = "0f4c6a4e-2b7a-4c3e-9d2f-8a1b2c3d4e5f"
UID2 = "1a2b3c4d-0000-4000-8000-00000000abcd"
RUNNING = ClaimRef("vms", "running", UID)
SECOND = ClaimRef("vms", "second", UID2)


def gpu(name: str, request: str = "gpu") -> AllocatedDevice:
    return AllocatedDevice(request, DRIVER_NAME, "node01", name)


class Node:
    def __init__(self, tmp_path: Path) -> None:
        self.root = build_node(NODE01, tmp_path)
        self.state, self.cdi_dir = tmp_path / "state", tmp_path / "cdi"
        self.claims = {
            RUNNING: [gpu("pci-0000-86-00-0"), gpu("pci-0000-af-00-0", request="second")],
            SECOND: [gpu("pci-0000-86-00-0")],  # a stale or forged allocation of the running claim's GPU
        }

    def core(self) -> PrepareCore:
        core = PrepareCore(StaticClaims.from_results(self.claims), self.root, self.state, self.cdi_dir, pool="node01")
        core.update_inventory(discover(self.root))
        core.start()
        return core

    def files(self) -> dict[str, str]:
        found = [*self.cdi_dir.rglob("*"), *(self.state / "metadata").rglob("*")]
        return {str(path): path.read_text() for path in found if path.is_file()}

    def tear(self) -> None:
        path = self.state / checkpoint.FILE_NAME
        text = path.read_text()
        path.write_text(text[: len(text) // 2])  # a write cut short (no fsync, a full disk, a crash)

    def kept(self) -> list[Path]:
        return sorted(self.state.glob(checkpoint.FILE_NAME + ".damaged-*"))


def test_a_torn_checkpoint_keeps_the_running_claims_files_and_its_gpu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(tmp_path)
    first = node.core().prepare([RUNNING])[UID]
    assert first.error == ""
    before = node.files()
    node.tear()
    torn = (node.state / checkpoint.FILE_NAME).read_text()
    with caplog.at_level(logging.INFO):
        core = node.core()
    assert node.files() == before  # nothing of the running claim removed
    assert core.prepared()[UID].devices == first.devices  # ownership rebuilt from its files
    refused = core.prepare([SECOND])[UID2]
    assert "device pci-0000-86-00-0 is prepared for claim vms/running" in refused.error  # no GPU given twice
    assert core.prepare([RUNNING])[UID].devices == first.devices  # the kubelet's re-prepare: the same answer
    (kept,) = node.kept()
    assert kept.read_text() == torn  # the damaged file kept for the operator, as it was
    damaged = [json.loads(r.getMessage()) for r in caplog.records if '"dra_checkpoint_damaged"' in r.getMessage()]
    assert damaged and damaged[0]["kept_as"] == str(kept) and damaged[0]["rebuilt"] == [UID]
    problem = core.quarantine()
    assert problem is not None and "quarantined" in problem and str(kept) in problem


def test_the_rebuilt_claim_unprepares_and_the_quarantine_ends_when_the_copies_go(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    node.tear()
    core = node.core()
    assert core.unprepare([RUNNING]) == {UID: ""}
    assert node.files() == {}
    assert core.prepare([SECOND])[UID2].error == ""  # its GPU is free again
    for kept in node.kept():
        kept.unlink()
    assert core.quarantine() is None
    assert node.core().quarantine() is None and set(node.core().prepared()) == {UID2}


def test_while_a_damaged_copy_is_kept_no_start_removes_files(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    node.tear()
    node.core()
    stray = node.cdi_dir / cdi.spec_file_name("9f9f9f9f-0000-4000-8000-000000000009")
    stray.write_text(
        json.dumps(
            {
                "cdiVersion": "0.5.0",
                "kind": "x/y",
                "devices": [
                    {
                        "name": "d",
                        "containerEdits": {"deviceNodes": [{"path": "/dev/vfio/96"}, {"path": "/dev/vfio/vfio"}]},
                    }
                ],
            }
        )
    )
    third = ClaimRef("vms", "third", "2b2b2b2b-0000-4000-8000-000000000002")
    node.claims[third] = [gpu("pci-0000-af-00-0")]  # /dev/vfio/96: named by the spec no claim owns
    node.core().unprepare([RUNNING])  # the running claim's own GPU 0000:af:00.0 is free again
    core = node.core()  # a later start: the checkpoint reads, but a damaged copy is still kept
    assert stray.exists()
    refused = core.prepare([third])[third.uid].error
    assert "device node /dev/vfio/96 is given by CDI spec" in refused and str(stray) in refused


def test_a_spec_of_ours_without_metadata_is_left_and_its_gpu_refused(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    for path in (node.state / "metadata" / UID).rglob("*metadata.json"):
        path.write_text("{torn")
    node.tear()
    core = node.core()
    assert UID not in core.prepared()
    assert (node.cdi_dir / cdi.spec_file_name(UID)).exists()  # not removed: whose it is, is unknown
    refused = core.prepare([SECOND])[UID2].error
    assert "not prepared" in refused and "cannot be read after a damaged checkpoint" in refused
    problem = core.quarantine()
    assert problem is not None and str(node.state / "metadata" / UID) in problem


def test_damaged_copies_are_bounded(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    for _ in range(prepare.MAX_DAMAGED_KEPT + 2):
        node.tear()
        node.core()
    assert len(node.kept()) == prepare.MAX_DAMAGED_KEPT
    assert set(node.core().prepared()) == {UID}


def test_readiness_tells_of_the_quarantine_and_the_kubelet_still_gets_answers(tmp_path: Path) -> None:
    with short_dir() as base:
        paths = DraPaths.under(base, build_tree(NODE01, base))
        write_claim(paths, RUNNING, [gpu("pci-0000-86-00-0")])
        key = (RUNNING.namespace, RUNNING.name, RUNNING.uid)
        with running_dra(dra_runner(paths)) as runner, KubeletDraStandIn(paths.registry) as kubelet:
            kubelet.wait_for_registration(DRIVER_NAME)
            devices, error = kubelet.prepare(DRIVER_NAME, [key])[UID]
            assert error == ""
            wait_until(lambda: runner.readiness() is None, what="ready")
        (paths.plugin_dir / checkpoint.FILE_NAME).write_text('{"version": 1, "claims": {')
        with running_dra(dra_runner(paths)) as runner, KubeletDraStandIn(paths.registry) as kubelet:
            kubelet.wait_for_registration(DRIVER_NAME)
            wait_until(
                lambda: (runner.readiness() or "").startswith("quarantined: a damaged DRA checkpoint"),
                what="readiness naming the quarantine",
            )
            assert kubelet.prepare(DRIVER_NAME, [key])[UID] == (devices, "")  # the running claim: its own answer


@pytest.mark.parametrize("spec_text", ["[]", '{"devices": 3}', "[" * 100_000, '{"devices": [{"name": 1}]}'])
def test_a_spec_of_ours_of_any_shape_never_stops_the_start(tmp_path: Path, spec_text: str) -> None:
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    (node.cdi_dir / cdi.spec_file_name(UID)).write_text(spec_text)
    node.tear()
    core = node.core()  # no exception: the claim is not rebuilt, its files are left, new claims refused
    assert UID not in core.prepared() and (node.cdi_dir / cdi.spec_file_name(UID)).exists()
    assert "cannot be read after a damaged checkpoint" in core.prepare([SECOND])[UID2].error


def test_files_that_give_one_gpu_to_two_claims_are_not_rebuilt_into_a_checkpoint_that_cannot_load(
    tmp_path: Path,
) -> None:
    """A second claim's metadata (forged, or left by a bug) names the running claim's GPU. Rebuilding both would
    record one device for two claims, a checkpoint :func:`checkpoint.load` refuses: every later start would
    quarantine again and push the first damaged copy out. Neither is trusted; both keep their files."""
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    source = node.state / "metadata" / UID / "gpu"
    forged = node.state / "metadata" / UID2 / "gpu"
    forged.mkdir(parents=True)
    for path in source.iterdir():
        (forged / path.name).write_text(path.read_text().replace(UID, UID2).replace('"running"', '"second"'))
    node.tear()
    core = node.core()
    owners = [uid for uid, claim in core.prepared().items() if "pci-0000-86-00-0" in {d.device for d in claim.devices}]
    assert len(owners) <= 1  # never one GPU for two claims
    assert forged.exists() and (node.state / "metadata" / UID).exists()  # nothing removed
    kept = node.kept()
    checkpoint.load(node.state, (node.cdi_dir, node.state / "metadata"))  # the rebuilt record reads back
    node.core()
    assert node.kept() == kept  # a later start is not quarantined anew
