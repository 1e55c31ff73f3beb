"""gpu-node-agent bind / unbind / validate on fixture trees whose writes have the kernel's effect
(simkit.kernel_sim): what ends up bound, which writes were made, what is refused and how it is named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import node_agent.sysfs
from node_agent.bind import bind, bind_steps, driver_chooser, unbind
from node_agent.drivers import choose_module, parse_vfio_aliases
from node_agent.kernel import AgentError
from node_agent.sysfs import Sysfs, read_function
from simkit.kernel_sim import SimKernel
from tests.node_agent_support import MODULES_ALIAS, agent, build_node, passthrough_node, report

CARD = ["0000:86:00.0", "0000:86:00.1", "0000:86:00.2", "0000:86:00.3"]
OTHER_CARD = ["0000:af:00.0", "0000:af:00.1", "0000:af:00.2", "0000:af:00.3"]
GRACE = "0009:01:00.0"


@pytest.fixture
def sim(tmp_path: Path) -> SimKernel:
    return build_node(passthrough_node(), tmp_path / "root")


def driver(sim: SimKernel, address: str) -> str | None:
    return read_function(Sysfs(sim.root), address).driver


def test_modules_alias_picks_the_variant_driver_for_grace_and_vfio_pci_for_the_rest() -> None:
    aliases = parse_vfio_aliases(MODULES_ALIAS)
    assert [a.module for a in aliases] == ["nvgrace_gpu_vfio_pci", "nvgrace_gpu_vfio_pci", "vfio_pci"]
    grace = "pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00"
    assert choose_module(grace, aliases) == "nvgrace_gpu_vfio_pci"
    assert choose_module("pci:v000010DEd00001F08sv00000000sd00000000bc03sc00i00", aliases) == "vfio_pci"
    assert choose_module(grace, []) == "vfio_pci"  # no modules.alias: vfio-pci
    with pytest.raises(AgentError, match="not a PCI one"):
        choose_module("usb:v1234", aliases)


def test_bind_all_moves_each_gpu_and_its_whole_group_and_loads_the_drivers(sim: SimKernel) -> None:
    assert not (sim.root / "sys/bus/pci/drivers/vfio-pci").exists()
    result = agent(sim, "bind", "--all")
    assert result.exit_code == 0, result.output
    for address in CARD + OTHER_CARD:
        assert driver(sim, address) == "vfio-pci", address
    assert driver(sim, GRACE) == "nvgrace_gpu_vfio_pci"
    assert driver(sim, "0000:85:00.0") == "pcieport"  # the root port in the group keeps its driver
    assert sorted(sim.loaded) == ["nvgrace_gpu_vfio_pci", "vfio_pci"]
    group = os.readlink(sim.root / "sys/bus/pci/devices/0000:86:00.0/iommu_group").rpartition("/")[2]
    assert (sim.root / "dev/vfio" / group).exists()
    done = report(result)
    assert sorted(done["changed"]) == sorted([*CARD, *OTHER_CARD, GRACE])
    # nouveau → vfio-pci: override, unbind from nouveau, bind to vfio-pci; Grace had no driver: 2 writes.
    assert ("sys/bus/pci/devices/0000:86:00.0/driver_override", "vfio-pci") in sim.log
    assert ("sys/bus/pci/drivers/nouveau/unbind", "0000:86:00.0") in sim.log
    assert ("sys/bus/pci/drivers/vfio-pci/bind", "0000:86:00.0") in sim.log
    assert done["writes"] == 8 * 3 + 2
    state = json.loads((sim.root.parent / "state/state.json").read_text())
    assert state["bind"]["writes"] == done["writes"]


def test_a_second_bind_writes_nothing(sim: SimKernel) -> None:
    assert agent(sim, "bind", "--all").exit_code == 0
    before = sim.writes
    again = agent(sim, "bind", "--all")
    assert again.exit_code == 0, again.output
    assert sim.writes == before
    assert report(again)["changed"] == [] and report(again)["writes"] == 0


def test_selecting_one_address_still_takes_its_companions_and_leaves_other_cards(sim: SimKernel) -> None:
    result = agent(sim, "bind", "0000:86:00.0")
    assert result.exit_code == 0, result.output
    assert [driver(sim, a) for a in CARD] == ["vfio-pci"] * 4
    assert driver(sim, "0000:af:00.1") == "snd_hda_intel"
    assert driver(sim, GRACE) is None


def test_select_by_id_for_an_emulated_gpu(sim: SimKernel) -> None:
    result = agent(sim, "bind", "--select", "10de:2342")
    assert result.exit_code == 0, result.output
    assert driver(sim, GRACE) == "nvgrace_gpu_vfio_pci"
    assert driver(sim, "0000:86:00.0") == "nouveau"


def test_bind_is_refused_while_the_host_driver_is_in_use_and_names_the_holder(sim: SimKernel) -> None:
    card = sim.root / "sys/bus/pci/devices/0000:86:00.1/sound/card0"
    card.mkdir(parents=True)
    (card / "pcmC0D0p").mkdir()
    sim.hold_node("/dev/snd/pcmC0D0p", pid=777, comm="pipewire")
    result = agent(sim, "bind", "--all")
    assert result.exit_code == 1
    message = str(result.exception)
    assert "0000:86:00.1 (10de:10f9) is in use through its host driver snd_hda_intel" in message
    assert "pid 777 (pipewire) holds /dev/snd/pcmC0D0p" in message
    assert [driver(sim, a) for a in CARD] == ["nouveau", "snd_hda_intel", "xhci_hcd", "nvidia-gpu"]
    assert [driver(sim, a) for a in OTHER_CARD] == ["vfio-pci"] * 4  # the other group is still done
    assert report(result)["refused"] == [message]


def test_a_holder_scan_cut_short_counts_the_nodes_as_held(sim: SimKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its bound the scan cannot tell who holds what: the device is in use, not free (was: silently free)."""
    card = sim.root / "sys/bus/pci/devices/0000:86:00.1/sound/card0"
    card.mkdir(parents=True)
    (card / "pcmC0D0p").mkdir()
    for _ in range(3):
        sim.hold_node("/dev/null", pid=700, comm="busy")
    sim.hold_node("/dev/snd/pcmC0D0p", pid=777, comm="pipewire")
    monkeypatch.setattr(node_agent.sysfs, "MAX_PROC_ENTRIES", 2)
    result = agent(sim, "bind", "--all")
    assert result.exit_code == 1
    message = str(result.exception)
    assert "0000:86:00.1 (10de:10f9) is in use through its host driver snd_hda_intel" in message
    assert "more than 2 open files under" in message and "counted as held" in message
    assert [driver(sim, a) for a in CARD] == ["nouveau", "snd_hda_intel", "xhci_hcd", "nvidia-gpu"]

def test_unbind_back_clears_the_override_and_the_kernel_reprobes(sim: SimKernel) -> None:
    assert agent(sim, "bind", "--all").exit_code == 0
    result = agent(sim, "unbind", "--all")
    assert result.exit_code == 0, result.output
    assert [driver(sim, a) for a in CARD] == ["nouveau", "snd_hda_intel", "xhci_hcd", "nvidia-gpu"]
    assert driver(sim, GRACE) is None
    fs = Sysfs(sim.root)
    assert read_function(fs, "0000:86:00.0").driver_override is None
    assert (sim.root / "sys/bus/pci/devices/0000:86:00.0/driver_override").read_text() == "(null)\n"
    assert not any((sim.root / "dev/vfio").glob("[0-9]*"))
    before = sim.writes
    assert agent(sim, "unbind", "--all").exit_code == 0
    assert sim.writes == before


@pytest.mark.parametrize("visible", [True, False])
def test_unbind_of_a_group_a_vm_holds_is_refused_naming_it(sim: SimKernel, visible: bool) -> None:
    assert agent(sim, "bind", "--all").exit_code == 0
    group = int(os.readlink(sim.root / "sys/bus/pci/devices/0000:86:00.0/iommu_group").rpartition("/")[2])
    sim.hold(group, pid=4242, comm="qemu-kvm", visible=visible)
    before = sim.writes
    result = agent(sim, "unbind", "--all")
    assert result.exit_code == 1
    message = str(result.exception)
    assert f"IOMMU group {group} is in use by a VM" in message
    assert "0000:86:00.0 (10de:1f08, on vfio-pci)" in message
    if visible:
        assert "pid 4242 (qemu-kvm) holds /dev/vfio/" in message
    else:
        assert "answers EBUSY" in message
    assert [driver(sim, a) for a in CARD] == ["vfio-pci"] * 4
    assert [driver(sim, a) for a in OTHER_CARD] == ["nouveau", "snd_hda_intel", "xhci_hcd", "nvidia-gpu"]
    held_writes = [path for path, _ in sim.log[before:] if "0000:86:" in path]
    assert held_writes == []
    sim.release(4242)
    assert agent(sim, "unbind", "0000:86:00.0").exit_code == 0
    assert driver(sim, "0000:86:00.0") == "nouveau"


def test_a_held_group_on_a_host_driver_is_also_refused_when_rebinding(sim: SimKernel) -> None:
    # The GPU is on vfio-pci, held by a VM; its audio wants nvgrace (a made-up alias): nothing is unbound.
    alias = MODULES_ALIAS + "alias vfio_pci:v000010DEd000010F9sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci\n"
    (sim.root / "lib/modules" / os.uname().release / "modules.alias").write_text(alias)
    fs = Sysfs(sim.root)
    assert bind(fs, sim, ["0000:86:00.0"], lambda f: "vfio-pci").writes > 0
    group = read_function(fs, "0000:86:00.0").iommu_group
    assert group is not None
    sim.hold(group)
    result = agent(sim, "bind", "0000:86:00.0")
    assert result.exit_code == 1
    assert "0000:86:00.1 (10de:10f9, on vfio-pci)" in str(result.exception)


def test_stopping_changes_nothing_and_unbind_core_reports_drivers(sim: SimKernel) -> None:
    fs = Sysfs(sim.root)
    chooser = driver_chooser(fs, parse_vfio_aliases(MODULES_ALIAS))
    done = bind(fs, sim, [GRACE], chooser)
    assert done.changed == [GRACE] and done.drivers == {GRACE: "nvgrace_gpu_vfio_pci"}
    undone = unbind(fs, sim, [GRACE])
    assert undone.changed == [GRACE] and undone.drivers == {GRACE: ""}


def test_bind_steps_are_empty_for_a_bound_function_and_start_with_the_override(sim: SimKernel) -> None:
    fs = Sysfs(sim.root)
    function = read_function(fs, "0000:86:00.1")
    steps = bind_steps(fs, function, "vfio-pci")
    assert [(s.path.name, s.value) for s in steps] == [
        ("driver_override", "vfio-pci"),
        ("unbind", "0000:86:00.1"),
        ("bind", "0000:86:00.1"),
    ]
    assert bind(fs, sim, ["0000:86:00.1"], lambda f: "vfio-pci").writes == 4 * 3
    assert bind_steps(fs, read_function(fs, "0000:86:00.1"), "vfio-pci") == []


def test_errors_name_the_culprit(sim: SimKernel) -> None:
    missing = agent(sim, "bind", "0000:99:00.0")
    assert missing.exit_code == 1 and "no PCI function 0000:99:00.0" in str(missing.exception)
    bad = agent(sim, "bind", "--select", "10de")
    assert bad.exit_code == 1 and "selector '10de'" in str(bad.exception)
    none = agent(sim, "bind")
    assert none.exit_code == 2 and "name the GPUs" in none.output


def test_a_sysfs_link_leading_out_of_the_host_root_is_refused(sim: SimKernel, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = sim.root / "sys/bus/pci/devices/0000:99:00.0"
    link.symlink_to(outside)
    result = agent(sim, "bind", "0000:99:00.0")
    assert result.exit_code == 1 and "outside the host root" in str(result.exception)


def test_no_iommu_group_is_named(tmp_path: Path) -> None:
    from simkit.fixture_nodes import CLASS_VGA, NVIDIA
    from simkit.sysfs_fixture import Function, Node

    sim = build_node(
        Node("no-iommu", (Function("0000:01:00.0", NVIDIA, 0x1F08, CLASS_VGA, "nouveau"),)), tmp_path / "r"
    )
    result = agent(sim, "bind", "--all")
    assert result.exit_code == 1
    assert "0000:01:00.0 (10de:1f08) has no IOMMU group: the IOMMU is off" in str(result.exception)


def test_validate_passthrough_names_what_is_missing_and_keeps_the_readiness_file(sim: SimKernel) -> None:
    ready = sim.root.parent / "state/ready"
    result = agent(sim, "validate", "--all")
    assert result.exit_code == 1
    assert "0000:86:00.1 (10de:10f9, IOMMU group" in str(result.exception)
    assert "is on snd_hda_intel, not vfio-pci" in str(result.exception)
    assert not ready.exists()
    assert agent(sim, "bind", "--all").exit_code == 0
    ok = agent(sim, "validate", "--all", env={"GPU_NODE_AGENT_WORKLOAD": "vm-passthrough"})
    assert ok.exit_code == 0, ok.output
    assert report(ok) == {"workload": "vm-passthrough", "ready": True, "missing": []}
    assert ready.exists()
    fs = Sysfs(sim.root)
    unbind(fs, sim, ["0000:af:00.0"])
    assert agent(sim, "validate", "--all").exit_code == 1
    assert not ready.exists()
    assert agent(sim, "validate", "--workload", "container").exit_code == 0


def test_the_real_kernel_writer_names_the_file_and_the_refusal(tmp_path: Path) -> None:
    from node_agent.kernel import RealKernel

    kernel = RealKernel(Sysfs(tmp_path))
    with pytest.raises(AgentError, match=r"cannot open .*/nope to write 'x'"):
        kernel.write(tmp_path / "nope", "x")  # sysfs attributes exist; the writer never creates files
    attribute = tmp_path / "attr"
    attribute.write_text("")
    kernel.write(attribute, "vfio-pci")
    assert attribute.read_text() == "vfio-pci" and kernel.writes == 1  # the refused open wrote nothing
    assert kernel.group_busy(tmp_path / "no-such-group") is False


def test_the_real_kernel_loads_the_driver_with_the_images_modprobe_from_the_host_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the pod the host root holds only sys, dev/vfio, proc and lib/modules: no host modprobe to chroot
    into. The image's modprobe is run with ``-d <host-root>``; on the host itself, plain ``modprobe``."""
    from node_agent.kernel import RealKernel

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "modprobe"
    fake.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\ncase " $* " in *" broken "*) echo "FATAL: no module" >&2; exit 1;; esac\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    kernel = RealKernel(Sysfs(tmp_path))
    kernel.load_module("vfio_pci", Path("/host"))
    kernel.load_module("vfio_pci", Path("/"))
    assert calls.read_text().splitlines() == ["-d /host vfio_pci", "vfio_pci"]
    with pytest.raises(AgentError, match=r"modprobe broken failed \(exit 1\): FATAL: no module"):
        kernel.load_module("broken", Path("/"))


def test_prepare_follows_the_workload(sim: SimKernel, tmp_path: Path) -> None:
    nothing = agent(sim, "prepare", "--workload", "container")
    assert nothing.exit_code == 0 and sim.writes == 0
    result = agent(sim, "prepare", "--all", env={"GPU_NODE_AGENT_WORKLOAD": "vm-passthrough"})
    assert result.exit_code == 0, result.output
    done = report(result)
    assert done["ready"] is True and done["done"]["writes"] == 26
    assert (sim.root.parent / "state/ready").exists()
    assert [driver(sim, a) for a in CARD] == ["vfio-pci"] * 4


def test_a_stopped_agent_leaves_the_node_bound(sim: SimKernel, tmp_path: Path) -> None:
    """``bind --stay`` in its own process, stopped by SIGTERM: exit 0, and nothing written after the bind."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from simkit.kernel_sim import SimKernel\n"
        "from node_agent.cli import cli\n"
        "kernel = SimKernel(Path(sys.argv[1]))\n"
        "try:\n"
        "    cli.main(sys.argv[2:], prog_name='gpu-node-agent', obj=kernel, standalone_mode=False)\n"
        "finally:\n"
        "    Path(sys.argv[1], '..', 'writes').write_text(str(kernel.writes))\n"
    )
    argv = [sys.executable, "-c", script, str(sim.root), "bind", "--all", "--stay", "--host-root", str(sim.root)]
    argv += ["--state-dir", str(tmp_path / "state")]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[1])

    def catches_sigterm() -> bool:  # the agent waits (its handler is installed) once the bind is done
        status = Path(f"/proc/{process.pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        return bool(caught & (1 << (signal.SIGTERM - 1)))

    deadline = time.monotonic() + 60
    while process.poll() is None and not catches_sigterm() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None and catches_sigterm(), process.communicate(timeout=5)
    process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert (sim.root.parent / "writes").read_text() == "26"  # the bind's writes; none on SIGTERM
    assert [driver(sim, a) for a in CARD + OTHER_CARD] == ["vfio-pci"] * 8


def test_nothing_to_select_is_an_error_naming_where_it_looked(sim: SimKernel, tmp_path: Path) -> None:
    result = agent(sim, "bind", "--select", "1234:1111")
    assert result.exit_code == 1 and "no function 1234:1111 on this node" in str(result.exception)
    from click.testing import CliRunner

    from node_agent.cli import cli

    missing = CliRunner().invoke(cli, ["bind", "--all", "--host-root", str(tmp_path / "nowhere")], obj=sim)
    assert missing.exit_code == 1 and "sys/bus/pci/devices does not exist" in str(missing.exception)
