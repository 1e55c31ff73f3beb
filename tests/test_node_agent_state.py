"""The node agent's state file as the plugin reads it (issue 14): one format (schemas.node_agent_state) for the
agent's writer and the plugin's reader, SR-IOV vGPU types named from it when no creatable_vgpu_types list names
them, a broken file costing a warning only, and a rescan as soon as the agent replaces the file."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from plugin.config import PluginConfig
from schemas.errors import InputError
from schemas.node_agent_state import (
    DEFAULT_STATE_PATH,
    MAX_STATE_BYTES,
    encode_state,
    encode_type_names,
    new_state,
    parse_state,
    type_names,
)
from simkit.fixture_nodes import SRIOV_VGPU_NODE
from simkit.kubelet_standin import KubeletStandIn
from simkit.sysfs_fixture import Node, build
from tests.discovery_support import discover
from tests.node_agent_support import agent
from tests.plugin_support import build_tree, manager_for, running, short_dir, wait_until
from tests.test_node_agent_vgpu import L40S, sriov_sim, vf_types

PF_A, VF_A0, VF_A1 = "0000:3b:00.0", "0000:3b:00.4", "0000:3b:00.5"
ONE_Q = "nvidia.com/NVIDIA_L40S-1Q"
STATE_IN_ROOT = DEFAULT_STATE_PATH.lstrip("/")


def full_first_gpu() -> Node:
    """The first L40S full (its VFs list no types), the second listing only 1B: nothing on the node names 1Q."""
    first, second = SRIOV_VGPU_NODE.sriov_vgpus
    return dataclasses.replace(SRIOV_VGPU_NODE, sriov_vgpus=(dataclasses.replace(first, full=True), second))


def agent_state(names: dict[str, dict[int, str]]) -> str:
    state = new_state()
    state["vgpu"] = {"status": "success", "type_names": encode_type_names(names), "vgpus": {}}
    return encode_state(state)


def write_state(root: Path, text: str | bytes) -> Path:
    path = root / STATE_IN_ROOT
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(".state.json.tmp")
    temporary.write_bytes(text.encode() if isinstance(text, str) else text)
    temporary.replace(path)  # as the agent writes it: a whole new file renamed over the old one
    return path


# -- the format ------------------------------------------------------------------------------------------------


def test_what_the_writer_encodes_the_reader_parses_back() -> None:
    names = {PF_A: {1147: "NVIDIA L40S-1Q", 1145: "NVIDIA L40S-1B"}}
    state = parse_state(agent_state(names), "state.json")
    assert type_names(state) == names
    assert json.loads(agent_state(names))["vgpu"]["type_names"] == {
        PF_A: {"1145": "NVIDIA L40S-1B", "1147": "NVIDIA L40S-1Q"}
    }


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{", "is not JSON"),
        ("[1]", "is not a JSON object"),
        ('{"version": 2}', "is not a version-1 state object"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"version": 1, "n": ' + "9" * 5000 + "}", "is not JSON"),
    ],
)
def test_a_broken_state_is_an_error_naming_the_file(text: str, reason: str) -> None:
    with pytest.raises(InputError, match=reason) as caught:
        parse_state(text, "/run/x/state.json")
    assert "/run/x/state.json" in str(caught.value)


def test_type_names_keeps_only_well_formed_entries() -> None:
    state = {
        "version": 1,
        "vgpu": {
            "type_names": {
                PF_A: {"1147": " NVIDIA L40S-1Q ", "x": "a", "1234567890": "too long an ID", "12": 5, "13": ""},
                "0000:d8:00.0": ["not", "a", "table"],
                "0000:af:00.0": {"14": "N" * 257, "15": "bad\nname"},
            },
            "unknown": {"ignored": True},
        },
    }
    assert type_names(state) == {PF_A: {1147: "NVIDIA L40S-1Q"}}
    assert type_names({"version": 1, "vgpu": {"type_names": "nope"}}) == {}
    assert type_names({"version": 1, "vgpu": []}) == {}


# -- the plugin names SR-IOV vGPU types from it --------------------------------------------------------------


def test_a_type_no_list_names_is_named_from_the_agents_state(tmp_path: Path) -> None:
    root = build(full_first_gpu(), tmp_path / "node")
    before = discover(root)
    assert ONE_Q not in before.resource_names
    reason = {item.id: item.reason for item in before.ignored}[VF_A0]
    assert f"nor by the node agent's {root}/{STATE_IN_ROOT}" in reason

    write_state(root, agent_state({PF_A: {1147: "NVIDIA L40S-1Q"}, "0000:99:00.0": {1: "elsewhere"}}))
    after = discover(root)
    assert [(d.id, d.mdev_type) for d in after.resource(ONE_Q).devices] == [(VF_A0, "1147"), (VF_A1, "1147")]
    assert after.warnings == before.warnings

    # Another GPU's names are not borrowed (type IDs are per model, and the file is per GPU address).
    write_state(root, agent_state({"0000:d8:00.0": {1147: "NVIDIA L40S-1Q"}}))
    assert ONE_Q not in discover(root).resource_names
    # Switched off, the file is not read.
    write_state(root, agent_state({PF_A: {1147: "NVIDIA L40S-1Q"}}))
    assert ONE_Q not in discover(root, node_agent_state="").resource_names


def test_a_listed_name_wins_over_the_state(tmp_path: Path) -> None:
    root = build(SRIOV_VGPU_NODE, tmp_path / "node")
    write_state(root, agent_state({PF_A: {1147: "Stale Name"}}))
    assert ONE_Q in discover(root).resource_names


@pytest.mark.parametrize("kind", ["fifo", "huge", "garbage", "directory", "escaping-link"])
def test_a_broken_state_file_is_a_warning_and_the_rest_of_the_scan_stands(tmp_path: Path, kind: str) -> None:
    root = build(full_first_gpu(), tmp_path / "node")
    path = root / STATE_IN_ROOT
    path.parent.mkdir(parents=True)
    outside = tmp_path / "outside.json"
    outside.write_text(agent_state({PF_A: {1147: "NVIDIA L40S-1Q"}}))
    if kind == "fifo":
        os.mkfifo(path)  # opened without blocking: the scan does not hang on it
    elif kind == "huge":
        path.write_text(agent_state({PF_A: {1147: "NVIDIA L40S-1Q"}}) + " " * MAX_STATE_BYTES)
    elif kind == "garbage":
        path.write_bytes(b"\xff\x00{not json")
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(outside)  # an absolute link is resolved inside the host root: not found there
    inventory = discover(root)
    assert ONE_Q not in inventory.resource_names
    assert [d.id for d in inventory.resource("nvidia.com/NVIDIA_L40S-1B").devices] == ["0000:d8:00.4"]
    state_warnings = [w for w in inventory.warnings if "node agent's state file" in w]
    if kind == "escaping-link":
        assert state_warnings == []  # nothing there inside the root: as if the agent never ran
        return
    assert len(state_warnings) == 1, inventory.warnings
    assert str(path) in state_warnings[0]


def test_the_config_key_is_a_file_path_or_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    from plugin.config import load_config

    assert PluginConfig().node_agent_state == DEFAULT_STATE_PATH
    assert load_config(env={"GPU_PLUGIN_NODE_AGENT_STATE": ""}).node_agent_state == ""
    assert load_config(env={"GPU_PLUGIN_NODE_AGENT_STATE": "/var/run/agent/state.json"}).node_agent_state == (
        "/var/run/agent/state.json"
    )
    for bad in ("relative/state.json", "/run/../etc/shadow", "/run/agent/", "/x\0y"):
        with pytest.raises(InputError, match="node_agent_state"):
            load_config(env={"GPU_PLUGIN_NODE_AGENT_STATE": bad})


# -- the agent's writer and the plugin's reader agree ---------------------------------------------------------


def test_the_plugin_names_vgpus_of_a_full_gpu_from_what_the_agent_wrote(tmp_path: Path) -> None:
    sim = sriov_sim(tmp_path / "root")
    state_dir = sim.root / STATE_IN_ROOT.rpartition("/")[0]
    result = agent(sim, "vgpu", "apply", "--config", str(tmp_path / "vgpu.yaml"), "--select", "l40s-full",
                   state_dir=state_dir)  # fmt: skip
    assert result.exit_code == 0, result.exception
    assert sorted(vf_types(sim).values()) == [557] * 4  # every VF taken: no VF lists a creatable type
    inventory = discover(sim.root)
    devices = inventory.resource("nvidia.com/NVIDIA_L40S-1B").devices
    assert [(d.id, str(d.parent), d.mdev_type) for d in devices] == [(vf, L40S, "557") for vf in sorted(vf_types(sim))]
    without = discover(sim.root, node_agent_state="")
    assert "nvidia.com/NVIDIA_L40S-1B" not in without.resource_names


# -- the plugin rescans when the agent replaces the file -----------------------------------------------------


def test_the_plugin_rescans_as_soon_as_the_agent_replaces_its_state() -> None:
    with short_dir() as base:
        root = build_tree(full_first_gpu(), base)
        (root / STATE_IN_ROOT).parent.mkdir(parents=True)
        kubelet_dir = base / "kubelet"
        # A minute between scans: only the watch on the state directory can make this happen in time.
        with KubeletStandIn(kubelet_dir) as kubelet, running(manager_for(root, kubelet_dir, scan_interval=60)):
            kubelet.wait_for_devices("nvidia.com/NVIDIA_L40S-1B", lambda devices: len(devices) == 1)
            assert kubelet.registration_count(ONE_Q) == 0
            write_state(root, agent_state({PF_A: {1147: "NVIDIA L40S-1Q"}}))
            seen = kubelet.wait_for_devices(ONE_Q, lambda devices: len(devices) == 2, timeout=10)
            assert seen == {VF_A0: "Healthy", VF_A1: "Healthy"}


def test_a_state_directory_made_after_the_start_is_watched_from_the_next_rescan() -> None:
    with short_dir() as base:
        root = build_tree(full_first_gpu(), base)
        kubelet_dir = base / "kubelet"
        with (
            KubeletStandIn(kubelet_dir) as kubelet,
            running(manager_for(root, kubelet_dir, scan_interval=60)) as manager,
        ):
            kubelet.wait_for_devices("nvidia.com/NVIDIA_L40S-1B", lambda devices: len(devices) == 1)
            (root / STATE_IN_ROOT).parent.mkdir(parents=True)  # the agent's first run makes it
            scans = manager.scans
            (root / "dev" / "vfio" / "33").unlink()  # any rescan (here: a free VF's group node going) opens the watch
            wait_until(lambda: manager.scans > scans, what="a rescan after /dev/vfio changed")
            write_state(root, agent_state({PF_A: {1147: "NVIDIA L40S-1Q"}}))
            seen = kubelet.wait_for_devices(ONE_Q, lambda devices: len(devices) == 2, timeout=10)
            assert seen == {VF_A0: "Healthy", VF_A1: "Healthy"}
