"""Runs INSIDE the guest node (``python -m tests.realnode.inguest SCENARIO``), with the project's own programs.

Each scenario drives the real kernel (sysfs writes, ``/dev/vfio``, VFIO ioctls, mdev create/remove) and the
project's programs (``xmlgen discover``/``doctor``/``render``, ``gpu-device-plugin serve`` against the kubelet
stand-in), and records what it saw in ``/tmp/realnode/observations.json``; the host-side tests assert on
that record. A step that raises is recorded under ``errors`` and the scenario goes on, so one boot answers
every question it can. Devices are found by ``VENDOR:DEVICE``, never by address.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

RESULTS = Path("/tmp/realnode")
PCI = Path("/sys/bus/pci/devices")
KUBELET_DIR = Path("/tmp/kubelet")
RESOURCE = "nvidia.com/QEMU_BOCHS_DISPLAY"
ENV_VAR = "PCI_RESOURCE_NVIDIA_COM_QEMU_BOCHS_DISPLAY"
CONFIG = """pci_selectors: ["1234:1111"]
name_overrides: {"1234:1111": QEMU_BOCHS_DISPLAY}
"""
"""The plugin's configuration WITHOUT the mdev opt-in (the plugin itself runs with ``plugin.yaml``, which adds
``mdev_parent_selectors: [mtty]``): discover with it still names the mtty mdev "not offered"."""
MDEV_PARENT = "mtty"
MDEV_TYPE = "mtty-2"
MDEV_RESOURCE = "nvidia.com/Dual_port_serial"
MDEV_ENV_VAR = "MDEV_PCI_RESOURCE_NVIDIA_COM_DUAL_PORT_SERIAL"
GPU_ID = "1234:1111"
AUDIO_ID = "8086:293e"
EDU_ID = "1234:11e8"
TESTDEV_ID = "1b36:0005"

# linux/vfio.h (6.1): _IO(';', 100 + n)
VFIO_GET_API_VERSION = 0x3B64
VFIO_CHECK_EXTENSION = 0x3B65
VFIO_SET_IOMMU = 0x3B66
VFIO_GROUP_GET_STATUS = 0x3B67
VFIO_GROUP_SET_CONTAINER = 0x3B68
VFIO_GROUP_UNSET_CONTAINER = 0x3B69
VFIO_GROUP_GET_DEVICE_FD = 0x3B6A
VFIO_DEVICE_GET_INFO = 0x3B6B
VFIO_TYPE1V2_IOMMU = 3
VFIO_GROUP_FLAGS_VIABLE = 1
VFIO_DEVICE_FLAGS_PCI = 1 << 1


class Recorder:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {"errors": {}, "timeline": []}
        self.started = time.monotonic()
        # The guest's uptime when the scenario's Python got here (kernel, init, cmd.sh and interpreter start-up).
        self.data["uptime_at_start"] = float((read(Path("/proc/uptime")) or "0 0").split()[0])

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def note(self, message: str) -> None:
        self.data["timeline"].append(f"{time.monotonic() - self.started:7.2f} {message}")
        print(f"{time.monotonic() - self.started:7.2f} {message}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.note(f"step {name}")
        try:
            yield
        except Exception:
            self.data["errors"][name] = traceback.format_exc()
            self.note(f"step {name} FAILED")
        finally:
            self.save()

    def save(self) -> None:
        (RESULTS / "observations.json").write_text(json.dumps(self.data, indent=2, sort_keys=True, default=str))


# -- the node, as the guest's kernel shows it -----------------------------------------------------------------


def read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def link_name(path: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def functions(vendor_device: str) -> list[str]:
    vendor, device = (f"0x{part.lower()}" for part in vendor_device.split(":"))
    return sorted(
        entry.name for entry in PCI.iterdir() if read(entry / "vendor") == vendor and read(entry / "device") == device
    )


def one_function(vendor_device: str) -> str:
    found = functions(vendor_device)
    if len(found) != 1:
        raise RuntimeError(f"expected one {vendor_device} function, found {found}")
    return found[0]


def function_state(address: str) -> dict[str, Any]:
    directory = PCI / address
    group = link_name(directory / "iommu_group")
    return {
        "address": address,
        "driver": link_name(directory / "driver"),
        "iommu_group": None if group is None else int(group),
        "real_path": os.path.realpath(directory),
        "group_members": sorted(os.listdir(f"/sys/kernel/iommu_groups/{group}/devices")) if group else [],
        "driver_override": read(directory / "driver_override"),
    }


def dev_vfio() -> list[str]:
    try:
        return sorted(os.listdir("/dev/vfio"))
    except OSError:
        return []


def uevent_identities() -> dict[str, dict[str, Any]]:
    """Each PCI function's (vendor, device, class) from its three files and as the plugin's scan parses its
    ``uevent`` (plugin.node_scan.parse_pci_uevent): the kernel's format the scan relies on, seen on a real kernel."""
    from plugin.node_scan import parse_pci_uevent

    found: dict[str, dict[str, Any]] = {}
    for entry in sorted(PCI.iterdir()):
        files = [read(entry / name) for name in ("vendor", "device", "class")]
        try:
            text: str | None = (entry / "uevent").read_text()
        except OSError:
            text = None
        parsed = None if text is None else parse_pci_uevent(text)
        found[entry.name] = {
            "files": None if None in files else [int(value, 16) for value in files if value is not None],
            "uevent": None if parsed is None else list(parsed),
            "text": text,
        }
    return found


def node_facts() -> dict[str, Any]:
    return {
        "uevent_identities": uevent_identities(),
        "uname": os.uname().release,
        "cmdline": read(Path("/proc/cmdline")),
        "iommu_groups": sorted(os.listdir("/sys/kernel/iommu_groups")),
        "dev_vfio": dev_vfio(),
        "functions": {vd: [function_state(a) for a in functions(vd)] for vd in (GPU_ID, AUDIO_ID, EDU_ID, TESTDEV_ID)},
        "mdev_bus": sorted(os.listdir("/sys/class/mdev_bus")) if os.path.isdir("/sys/class/mdev_bus") else [],
    }


# -- binding, as an admin (or the node agent) does it -----------------------------------------------------------


def write(path: Path | str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def bind_vfio(address: str) -> None:
    """driver_override + drivers_probe: the kernel's documented way to hand one function to vfio-pci."""
    directory = PCI / address
    if link_name(directory / "driver") == "vfio-pci":
        return
    if (directory / "driver").exists():
        write(directory / "driver" / "unbind", address)
    write(directory / "driver_override", "vfio-pci")
    write("/sys/bus/pci/drivers_probe", address)


def unbind(address: str, clear_override: bool = True) -> None:
    directory = PCI / address
    if (directory / "driver").exists():
        write(directory / "driver" / "unbind", address)
    if clear_override:
        write(directory / "driver_override", "\n")


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.005) -> float | None:
    """Seconds until ``predicate`` held, or None after ``timeout``."""
    started = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            return None
        time.sleep(interval)


# -- the project's programs ---------------------------------------------------------------------------------


def xmlgen(*args: str, config: bool | Path = True) -> dict[str, Any]:
    """``xmlgen ARGS`` in this process (the real click command): one Python start-up under TCG, not one per call.

    ``config``: True adds ``--config plugin.yaml`` (the plugin's), a path that file, False none."""
    from click.testing import CliRunner

    from xmlgen.cli import cli

    path = RESULTS / "plugin.yaml" if config is True else config
    argv = [*args, "--config", str(path)] if isinstance(path, Path) else list(args)
    started = time.monotonic()
    outcome = CliRunner().invoke(cli, argv, prog_name="xmlgen")
    result: dict[str, Any] = {
        "argv": ["xmlgen", *argv],
        "rc": outcome.exit_code,
        "stdout": outcome.stdout,
        "stderr": outcome.stderr[-4000:],
        "seconds": round(time.monotonic() - started, 2),
    }
    if outcome.exception is not None and not isinstance(outcome.exception, SystemExit):
        result["exception"] = "".join(traceback.format_exception(outcome.exception))
    with contextlib.suppress(ValueError):
        result["json"] = json.loads(outcome.stdout)
    return result


def discover_and_doctor(record: Recorder, label: str) -> None:
    with record.step(f"discover {label}"):
        record[f"discover_{label}"] = xmlgen("discover", "--json")
    with record.step(f"doctor {label}"):
        record[f"doctor_{label}"] = xmlgen("doctor", "--json", "--kubelet-dir", str(KUBELET_DIR))


# -- VFIO, as QEMU opens it -----------------------------------------------------------------------------------


def vfio_open(group_node: str, address: str, other_address: str | None) -> dict[str, Any]:
    """Open the container and the group, check viability, attach type1v2 and get the device's fd."""
    seen: dict[str, Any] = {}
    container = os.open("/dev/vfio/vfio", os.O_RDWR | os.O_CLOEXEC)
    try:
        seen["api_version"] = fcntl.ioctl(container, VFIO_GET_API_VERSION)
        seen["type1v2"] = fcntl.ioctl(container, VFIO_CHECK_EXTENSION, VFIO_TYPE1V2_IOMMU)
        group = os.open(group_node, os.O_RDWR | os.O_CLOEXEC)
        try:
            status = bytearray(struct.pack("II", 8, 0))
            fcntl.ioctl(group, VFIO_GROUP_GET_STATUS, status, True)
            flags = struct.unpack("II", status)[1]
            seen["group_flags"] = flags
            seen["viable"] = bool(flags & VFIO_GROUP_FLAGS_VIABLE)
            fcntl.ioctl(group, VFIO_GROUP_SET_CONTAINER, array.array("i", [container]), True)
            seen["set_iommu"] = fcntl.ioctl(container, VFIO_SET_IOMMU, VFIO_TYPE1V2_IOMMU)
            name = bytearray(address.encode() + b"\0")
            device = fcntl.ioctl(group, VFIO_GROUP_GET_DEVICE_FD, name, True)
            seen["device_fd"] = device
            try:
                info = bytearray(struct.pack("IIII", 16, 0, 0, 0))
                fcntl.ioctl(device, VFIO_DEVICE_GET_INFO, info, True)
                _, device_flags, regions, irqs = struct.unpack("IIII", info)
                seen["device_is_pci"] = bool(device_flags & VFIO_DEVICE_FLAGS_PCI)
                seen["num_regions"] = regions
                seen["num_irqs"] = irqs
                seen["device_fd_link"] = os.readlink(f"/proc/self/fd/{device}")
            finally:
                os.close(device)
            if other_address is not None:
                try:
                    fcntl.ioctl(group, VFIO_GROUP_GET_DEVICE_FD, bytearray(other_address.encode() + b"\0"), True)
                    seen["other_device"] = "opened"
                except OSError as exc:
                    seen["other_device"] = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            fcntl.ioctl(group, VFIO_GROUP_UNSET_CONTAINER)
        finally:
            os.close(group)
    finally:
        os.close(container)
    return seen


def group_status(group_node: str) -> dict[str, Any]:
    """Just VFIO_GROUP_GET_STATUS (no container): is the group viable as the kernel sees it?"""
    group = os.open(group_node, os.O_RDWR | os.O_CLOEXEC)
    try:
        status = bytearray(struct.pack("II", 8, 0))
        fcntl.ioctl(group, VFIO_GROUP_GET_STATUS, status, True)
        flags = struct.unpack("II", status)[1]
        return {"flags": flags, "viable": bool(flags & VFIO_GROUP_FLAGS_VIABLE)}
    finally:
        os.close(group)


# -- an inner QEMU, as libvirt would start it -------------------------------------------------------------------


def qmp(path: str, commands: list[dict[str, Any]], timeout: float = 20) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(path)
            break
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    answers: list[Any] = []
    with sock, sock.makefile("rwb") as stream:
        greeting = json.loads(stream.readline())
        answers.append(greeting)
        for command in commands:
            stream.write(json.dumps(command).encode() + b"\n")
            stream.flush()
            while True:
                line = stream.readline()
                if not line:
                    answers.append({"eof": True})
                    break
                reply = json.loads(line)
                if "event" in reply:
                    continue
                answers.append(reply)
                break
    return answers


def _bridges_numbered(answer: list[Any]) -> bool:
    """Whether firmware has given every bridge in a ``query-pci`` answer its secondary bus number."""
    if len(answer) < 3 or "return" not in answer[2]:
        return False
    bridges = [d for bus in answer[2]["return"] for d in walk_pci(bus["devices"]) if "pci_bridge" in d]
    return all(d["pci_bridge"]["bus"]["secondary"] != 0 for d in bridges)


def inner_qemu(device_args: list[dict[str, Any]], firmware_timeout: float = 120) -> dict[str, Any]:
    """Start QEMU with ``device_args`` (libvirt's ``-device`` objects for the hook's hostdevs), wait for its
    firmware to number the PCI buses, ask QMP for ``query-pci``, quit.

    The inner machine has only ``pcie.0``: the one root port the hostdevs name as their ``bus`` (the port the
    hook added for a GPU and its companions) is created under the same ``id``, and their ``addr`` and
    ``multifunction`` are kept, so the guest slot and functions are libvirt's. ``query-pci`` lists a bridge's
    devices only once firmware (SeaBIOS here, no boot disk) has given the bridge a bus number, so QEMU runs
    until it has (under TCG inside TCG: seconds). Devices on several buses (not what the hook writes) lose
    ``bus``/``addr`` instead, and QEMU stays paused.
    """
    qmp_path = "/tmp/inner-qmp.sock"
    buses = {device.get("bus") for device in device_args}
    argv = [
        "qemu-system-x86_64", "-M", "q35,accel=tcg", "-m", "64", "-nodefaults", "-no-user-config",
        "-display", "none", "-qmp", f"unix:{qmp_path},server=on,wait=off",
    ]  # fmt: skip
    (bus,) = buses if len(buses) == 1 else (None,)
    behind_port = isinstance(bus, str) and bus != "pcie.0"
    if behind_port:
        argv += ["-device", f"pcie-root-port,id={bus},chassis=1,port=0x8,bus=pcie.0,addr=0x2"]
        kept = device_args
    else:
        argv.insert(1, "-S")
        kept = [{key: value for key, value in d.items() if key not in ("bus", "addr")} for d in device_args]
    for device in kept:
        argv += ["-device", json.dumps(device, separators=(",", ":"))]
    seen: dict[str, Any] = {"argv": argv}
    started = time.monotonic()
    query = [{"execute": "qmp_capabilities"}, {"execute": "query-pci"}]
    with open("/tmp/inner-qemu.log", "wb") as log:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        if behind_port:
            polls = 0
            while not _bridges_numbered(qmp(qmp_path, query)):
                polls += 1
                if time.monotonic() - started > firmware_timeout or process.poll() is not None:
                    seen["firmware"] = f"no bus number for {bus} after {polls} polls"
                    break
                time.sleep(0.5)
            seen["firmware_seconds"] = round(time.monotonic() - started, 2)
        seen["qmp"] = qmp(qmp_path, [*query, {"execute": "quit"}])
        seen["exit"] = process.wait(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        seen["log"] = Path("/tmp/inner-qemu.log").read_text(errors="replace")[-3000:]
        seen["seconds"] = round(time.monotonic() - started, 2)
    return seen


# -- scenarios ------------------------------------------------------------------------------------------------


def scenario_iommu_off(record: Recorder) -> None:
    record["facts"] = node_facts()
    discover_and_doctor(record, "off")
    gpu = one_function(GPU_ID)
    with record.step("bind without an IOMMU"):
        try:
            bind_vfio(gpu)
            record["bind_off"] = {"error": None}
        except OSError as exc:
            record["bind_off"] = {"error": errno.errorcode.get(exc.errno or 0, str(exc.errno))}
        record["bind_off"] |= {"state": function_state(gpu), "dev_vfio": dev_vfio()}
    discover_and_doctor(record, "off_bound")


def scenario_node(record: Recorder) -> None:
    """IOMMU on: discover/doctor, binding, the plugin with the stand-in, health flips, mdevs, VFIO, inner QEMU."""
    record["facts"] = node_facts()
    gpu, audio = one_function(GPU_ID), one_function(AUDIO_ID)
    record["gpu"], record["audio"] = gpu, audio
    # The plugin starts first (its Python start-up under TCG takes seconds) and finds nothing to offer yet.
    with running_plugin(record) as standin:
        discover_and_doctor(record, "before_bind")
        with record.step("bind gpu only"):
            bind_vfio(gpu)
            group = function_state(gpu)["iommu_group"]
            record["bind_gpu_only"] = {
                "gpu": function_state(gpu),
                "audio": function_state(audio),
                "dev_vfio": dev_vfio(),
                "status": group_status(f"/dev/vfio/{group}"),
            }
        discover_and_doctor(record, "gpu_only")
        with record.step("plugin sees the GPU"):
            standin.wait_for_registration(RESOURCE, timeout=90)
            record["plugin_gpu_only"] = standin.wait_for_devices(RESOURCE, bool, timeout=30)
        with record.step("bind audio"):
            t0 = time.monotonic()
            bind_vfio(audio)
            healthy = wait_for(lambda: standin.healthy(RESOURCE) == [gpu], 12, 0.01)
            record["bind_both"] = {
                "gpu": function_state(gpu),
                "audio": function_state(audio),
                "dev_vfio": dev_vfio(),
                "status": group_status(f"/dev/vfio/{group}"),
                "healthy_after": None if healthy is None else round(time.monotonic() - t0, 3),
            }
        discover_and_doctor(record, "bound")
        with record.step("plugin"):
            plugin_steps(record, standin, gpu, audio)
    with record.step("unbind back"):
        unbind(gpu)
        unbind(audio)
        write("/sys/bus/pci/drivers_probe", audio)
        record["unbound"] = {"gpu": function_state(gpu), "audio": function_state(audio), "dev_vfio": dev_vfio()}
    discover_and_doctor(record, "after_unbind")
    agent_steps(record, gpu, audio)


# -- the node agent (gpu-node-agent) on the real kernel ------------------------------------------------------------

AGENT_STATE = RESULTS / "agent-state"
AGENT_VGPU_CONFIG = """version: v1
vgpu-configs:
  two:
    - devices: all
      vgpu-devices: {mtty-2: 2}
  one:
    - devices: all
      vgpu-devices: {"Dual port serial": 1}
  none:
    - devices: all
      vgpu-devices: {}
"""


def agent(*args: str) -> dict[str, Any]:
    """``gpu-node-agent ARGS`` in this process (the real click command and the real kernel writer)."""
    from click.testing import CliRunner

    from node_agent.cli import cli

    words = [arg for arg in args if arg in ("bind", "unbind", "validate", "vgpu", "apply")]
    argv = [*words, "--host-root", "/", "--state-dir", str(AGENT_STATE), *args[len(words) :]]
    started = time.monotonic()
    outcome = CliRunner().invoke(cli, argv, prog_name="gpu-node-agent")
    result: dict[str, Any] = {
        "argv": ["gpu-node-agent", *argv],
        "rc": outcome.exit_code,
        "stdout": outcome.stdout[-4000:],
        "stderr": outcome.stderr[-4000:],
        "error": None if outcome.exception is None else str(outcome.exception),
        "seconds": round(time.monotonic() - started, 2),
    }
    with contextlib.suppress(ValueError):
        result["json"] = json.loads(outcome.stdout)
    return result


def mtty_mdevs() -> dict[str, Any]:
    type_dir = Path(f"/sys/class/mdev_bus/{MDEV_PARENT}/mdev_supported_types/{MDEV_TYPE}")
    devices = sorted(os.listdir(type_dir / "devices"))
    return {
        "devices": devices,
        "available_instances": read(type_dir / "available_instances"),
        "bus_links": sorted(d for d in devices if os.path.exists(f"/sys/bus/mdev/devices/{d}")),
    }


def agent_steps(record: Recorder, gpu: str, audio: str) -> None:
    """bind/unbind/validate of the emulated GPU and its companion, and vgpu apply with mtty configs."""
    seen: dict[str, Any] = {}
    record["agent"] = seen
    with record.step("agent bind"):
        seen["bind"] = agent("bind", "--select", GPU_ID)
        group = function_state(gpu)["iommu_group"]
        seen["after_bind"] = {
            "gpu": function_state(gpu),
            "audio": function_state(audio),
            "dev_vfio": dev_vfio(),
            "status": group_status(f"/dev/vfio/{group}"),
        }
        seen["state"] = json.loads((AGENT_STATE / "state.json").read_text())
    with record.step("agent bind again"):
        seen["bind_again"] = agent("bind", "--select", GPU_ID)
    with record.step("agent validate"):
        seen["validate"] = agent("validate", "--select", GPU_ID)
        seen["ready_file"] = (AGENT_STATE / "ready").exists()
    with record.step("agent unbind refused while held"):
        holder = os.open(f"/dev/vfio/{group}", os.O_RDWR | os.O_CLOEXEC)
        try:
            seen["held_pid"] = os.getpid()
            seen["unbind_held"] = agent("unbind", "--select", GPU_ID)
            seen["after_unbind_held"] = {"gpu": function_state(gpu), "audio": function_state(audio)}
        finally:
            os.close(holder)
    with record.step("agent unbind"):
        seen["unbind"] = agent("unbind", "--select", GPU_ID)
        seen["after_unbind"] = {"gpu": function_state(gpu), "audio": function_state(audio), "dev_vfio": dev_vfio()}
        seen["unbind_again"] = agent("unbind", "--select", GPU_ID)
        seen["validate_unbound"] = agent("validate", "--select", GPU_ID)
        seen["ready_file_unbound"] = (AGENT_STATE / "ready").exists()
    config = RESULTS / "agent-vgpu.yaml"
    config.write_text(AGENT_VGPU_CONFIG)

    def apply(name: str) -> dict[str, Any]:
        return agent("vgpu", "apply", "--config", str(config), "--select", name, "--parent", MDEV_PARENT)

    with record.step("agent vgpu apply"):
        seen["mtty_before"] = mtty_mdevs()
        seen["apply_two"] = apply("two")
        seen["mtty_two"] = mtty_mdevs()
        seen["apply_two_again"] = apply("two")
        seen["apply_one"] = apply("one")
        seen["mtty_one"] = mtty_mdevs()
        seen["apply_one_again"] = apply("one")
    with record.step("agent vgpu remove refused while held"):
        (kept,) = mtty_mdevs()["devices"]
        mdev_group = link_name(Path(f"/sys/bus/mdev/devices/{kept}/iommu_group"))
        holder = os.open(f"/dev/vfio/{mdev_group}", os.O_RDWR | os.O_CLOEXEC)
        try:
            seen["apply_none_held"] = apply("none")
            seen["mtty_held"] = mtty_mdevs()
        finally:
            os.close(holder)
        seen["apply_none"] = apply("none")
        seen["mtty_none"] = mtty_mdevs()


class ForkedPlugin:
    """``gpu-device-plugin serve`` in a child forked from this process once its imports are done.

    Under TCG each Python start-up re-imports grpc, pydantic and the project (~17 s of CPU per process); the
    child inherits them and only runs ``plugin.cli.main``. The fork happens before this process starts any
    thread (the stand-in's gRPC server comes after). Same surface as ``subprocess.Popen``: terminate, wait, kill.
    """

    def __init__(self, argv: list[str], log_path: Path) -> None:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            code = 1
            try:
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(log)
                sys.argv = argv
                from plugin.cli import main as plugin_main

                plugin_main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(log)
        self.returncode: int | None = None

    def terminate(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, 15)

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, 9)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["gpu-device-plugin", "serve"], timeout)
            time.sleep(0.02)
        return self.returncode


@contextlib.contextmanager
def running_plugin(record: Recorder) -> Iterator[Any]:
    """``gpu-device-plugin serve`` in its own (forked) process against the kubelet stand-in in this one."""
    # Every import once, before the fork: the CLI's (xmlgen runs in this process), the plugin's, the stand-in's.
    import importlib

    for module in ("xmlgen.cli", "plugin.cli"):
        importlib.import_module(module)
    from simkit.kubelet_standin import KubeletStandIn

    record.note("imports done")
    KUBELET_DIR.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS / "plugin.log"
    argv = [
        "gpu-device-plugin", "serve", "--kubelet-dir", str(KUBELET_DIR),
        "--config", str(RESULTS / "plugin.yaml"), "--log-format", "text",
    ]  # fmt: skip
    plugin = ForkedPlugin(argv, log_path)
    standin = KubeletStandIn(KUBELET_DIR)
    standin.start()
    try:
        yield standin
    finally:
        plugin.terminate()
        try:
            record["plugin_exit"] = plugin.wait(timeout=20)
        except subprocess.TimeoutExpired:
            plugin.kill()
            plugin.wait(timeout=10)
            record["plugin_exit"] = "killed"
        standin.stop()
        record["plugin_sockets_left"] = sorted(p.name for p in KUBELET_DIR.iterdir() if p.name != "kubelet.sock")
        record["plugin_log"] = log_path.read_text(errors="replace")[-12000:]


def plugin_steps(record: Recorder, standin: Any, gpu: str, audio: str) -> None:
    group = function_state(gpu)["iommu_group"]
    group_node = f"/dev/vfio/{group}"
    record["listandwatch"] = {
        "devices": standin.devices(RESOURCE),
        "messages": [{"id": d.ID, "health": d.health} for d in standin.device_messages(RESOURCE)],
    }
    with record.step("allocate"):
        response = standin.allocate(RESOURCE, [gpu]).container_responses[0]
        specs = [
            {"host_path": s.host_path, "container_path": s.container_path, "permissions": s.permissions}
            for s in response.devices
        ]
        record["allocate"] = {
            "envs": dict(response.envs),
            "devices": specs,
            "char_device": {
                s["host_path"]: os.path.exists(s["host_path"])
                and (os.stat(s["host_path"]).st_mode & 0o170000) == 0o020000
                for s in specs
            },
            "group": group,
        }
    with record.step("vfio ioctls"):
        record["vfio"] = vfio_open(group_node, gpu, one_function(EDU_ID))
    with record.step("inner qemu"):
        record["inner_qemu"] = inner_qemu_steps(record, dict(response.envs))

    with record.step("health: whole group leaves vfio-pci"):
        t0 = time.monotonic()
        unbind(gpu, clear_override=False)
        unbind(audio, clear_override=False)
        gone = wait_for(lambda: not os.path.exists(group_node), 5)
        unhealthy = wait_for(lambda: standin.allocatable(RESOURCE) == 0, 10, 0.01)
        record["flip_group_off"] = {
            "group_node_gone_after": gone,
            "unhealthy_after": None if unhealthy is None else round(time.monotonic() - t0, 3),
            "devices": standin.devices(RESOURCE),
            "dev_vfio": dev_vfio(),
        }
    with record.step("health: group back on vfio-pci"):
        t0 = time.monotonic()
        write("/sys/bus/pci/drivers_probe", gpu)
        write("/sys/bus/pci/drivers_probe", audio)
        back = wait_for(lambda: os.path.exists(group_node), 5)
        healthy = wait_for(lambda: standin.healthy(RESOURCE) == [gpu], 10, 0.01)
        record["flip_group_on"] = {
            "group_node_back_after": back,
            "healthy_after": None if healthy is None else round(time.monotonic() - t0, 3),
            "devices": standin.devices(RESOURCE),
        }
    with record.step("health: only the GPU leaves vfio-pci"):
        t0 = time.monotonic()
        unbind(gpu, clear_override=False)
        unhealthy = wait_for(lambda: standin.allocatable(RESOURCE) == 0, 12, 0.01)
        record["flip_gpu_off"] = {
            "group_node_still_there": os.path.exists(group_node),
            "unhealthy_after": None if unhealthy is None else round(time.monotonic() - t0, 3),
            "devices": standin.devices(RESOURCE),
        }
        t0 = time.monotonic()
        write("/sys/bus/pci/drivers_probe", gpu)
        healthy = wait_for(lambda: standin.healthy(RESOURCE) == [gpu], 12, 0.01)
        record["flip_gpu_on"] = {"healthy_after": None if healthy is None else round(time.monotonic() - t0, 3)}
    with record.step("mdev"):
        record["mdev"] = mdev_steps(record, standin)


def walk_pci(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every device of a ``query-pci`` bus, those behind bridges (root ports) too."""
    found: list[dict[str, Any]] = []
    for device in devices:
        found.append(device)
        found.extend(walk_pci(device.get("pci_bridge", {}).get("devices", [])))
    return found


def inner_qemu_steps(record: Recorder, envs: dict[str, str]) -> dict[str, Any]:
    """Render the domain with the hook's builder from the allocation's ``envs`` (the GPU's variable and its
    companions'), have libvirt on the host turn it into QEMU's argv, run QEMU with the hook's devices."""
    env_file = RESULTS / "compute.env"
    env_file.write_text("".join(f"{name}={value}\n" for name, value in sorted(envs.items())))
    rendered = xmlgen(
        "render", "--domain", str(RESULTS / "base-domain.xml"), "--environ-file", str(env_file), config=False
    )
    if rendered["rc"] != 0:
        return {"render": rendered}
    (RESULTS / "domain.xml").write_text(rendered["stdout"])
    # Written under another name and renamed: the host acts on (and removes) the request once it exists.
    (RESULTS / "request-native.tmp").write_text("domain.xml\n")
    (RESULTS / "request-native.tmp").rename(RESULTS / "request-native")
    answered = wait_for(lambda: (RESULTS / "native.json").exists() or (RESULTS / "native.error").exists(), 60, 0.05)
    if answered is None or not (RESULTS / "native.json").exists():
        return {"render": rendered, "native_error": read(RESULTS / "native.error") or "no answer from the host"}
    devices = json.loads((RESULTS / "native.json").read_text())
    # The base domain has no hostdev of its own: every vfio device in libvirt's argv is one the hook wrote.
    ours = [d for d in devices if d.get("driver") == "vfio-pci"]
    if not any(d.get("id") == "ua-gpu0" for d in ours):
        return {"render": rendered, "native": devices}
    return {"render_rc": rendered["rc"], "native": devices, "run": inner_qemu(ours)}


def mdev_steps(record: Recorder, standin: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for parent in ("mtty", "mdpy", "mbochs"):
        types_dir = Path(f"/sys/class/mdev_bus/{parent}/mdev_supported_types")
        seen[parent] = {
            "types": {
                t.name: {
                    "name": read(t / "name"),
                    "available_instances": read(t / "available_instances"),
                    "device_api": read(t / "device_api"),
                }
                for t in sorted(types_dir.iterdir())
            }
            if types_dir.is_dir()
            else None
        }
    mdev_type = Path(f"/sys/class/mdev_bus/{MDEV_PARENT}/mdev_supported_types/{MDEV_TYPE}")
    uid = str(uuid.uuid4())
    t0 = time.monotonic()
    write(mdev_type / "create", uid)
    created_at = time.monotonic()
    link = Path(f"/sys/bus/mdev/devices/{uid}")
    group = link_name(link / "iommu_group")
    seen["created"] = {
        "uuid": uid,
        "type": mdev_type.name,
        "real_path": os.path.realpath(link),
        "mdev_type_link": os.path.realpath(link / "mdev_type"),
        "driver": link_name(link / "driver"),
        "iommu_group": group,
        "group_members": sorted(os.listdir(f"/sys/kernel/iommu_groups/{group}/devices")) if group else [],
        "group_node_exists": group is not None and os.path.exists(f"/dev/vfio/{group}"),
        "parent_has_vendor": os.path.exists(os.path.join(os.path.dirname(os.path.realpath(link)), "vendor")),
        "dev_vfio": dev_vfio(),
    }
    # The mdev's `add` uevent makes the plugin (opted in by mdev_parent_selectors) rescan and register it.
    advertised = wait_for(lambda: standin.healthy(MDEV_RESOURCE) == [uid], 15, 0.01)
    seen["advertised_after"] = None if advertised is None else round(time.monotonic() - created_at, 3)
    seen["plugin_resources_with_mdev"] = _resources(standin)
    seen["listandwatch"] = {
        "devices": standin.devices(MDEV_RESOURCE),
        "topology": [d.HasField("topology") for d in standin.device_messages(MDEV_RESOURCE)],
    }
    with contextlib.suppress(Exception):  # recorded as missing: the host-side test names it
        response = standin.allocate(MDEV_RESOURCE, [uid]).container_responses[0]
        specs = [
            {"host_path": d.host_path, "container_path": d.container_path, "permissions": d.permissions}
            for d in response.devices
        ]
        seen["allocate"] = {
            "envs": dict(response.envs),
            "devices": specs,
            "char_device": {
                d["host_path"]: os.path.exists(d["host_path"])
                and (os.stat(d["host_path"]).st_mode & 0o170000) == 0o020000
                for d in specs
            },
        }
    if group is not None:
        try:
            seen["vfio"] = vfio_open(f"/dev/vfio/{group}", uid, None)
        except OSError as exc:
            seen["vfio"] = {"error": f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc}"}
    seen["discover_with_mdev"] = xmlgen("discover", "--json")
    (RESULTS / "plugin-no-mdev.yaml").write_text(CONFIG)
    seen["discover_not_opted_in"] = xmlgen("discover", "--json", config=RESULTS / "plugin-no-mdev.yaml")
    seen["discover_table_not_opted_in"] = xmlgen("discover", config=RESULTS / "plugin-no-mdev.yaml")
    removed_at = time.monotonic()
    write(link / "remove", "1")
    socket = KUBELET_DIR / f"kubevirt-{MDEV_RESOURCE.rpartition('/')[2]}.sock"
    withdrawn = wait_for(
        lambda: (
            not standin.stream_open(MDEV_RESOURCE) and standin.allocatable(MDEV_RESOURCE) == 0 and not socket.exists()
        ),
        15,
        0.01,
    )
    seen["removed"] = {
        "link_exists": link.exists(),
        "group_node_exists": group is not None and os.path.exists(f"/dev/vfio/{group}"),
        "seconds": round(time.monotonic() - t0, 2),
        "withdrawn_after": None if withdrawn is None else round(time.monotonic() - removed_at, 3),
        "stream_open": standin.stream_open(MDEV_RESOURCE),
        "devices": standin.devices(MDEV_RESOURCE),
        "socket_left": socket.exists(),
    }
    seen["plugin_resources_after_remove"] = {name: standin.stream_open(name) for name in _resources(standin)}
    seen["discover_after_remove"] = xmlgen("discover", "--json")
    return seen


def _resources(standin: Any) -> dict[str, dict[str, str]]:
    names = sorted({r.resource_name for r in standin.registrations})
    return {name: standin.devices(name) for name in names}


def scenario_simulate(record: Recorder) -> None:
    """The whole path on a real kernel, told step by step on stderr; the final domain on stdout."""

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    facts = node_facts()
    gpu, audio = one_function(GPU_ID), one_function(AUDIO_ID)
    state = function_state(gpu)
    say(f"node: Linux {facts['uname']}, {len(facts['iommu_groups'])} IOMMU groups, mdev parents {facts['mdev_bus']}")
    say(
        f"node: GPU {gpu} ({GPU_ID}, QEMU's bochs-display standing in for an NVIDIA card) in IOMMU group "
        f"{state['iommu_group']} with {', '.join(m for m in state['group_members'] if m != gpu)}; "
        f"drivers: GPU {state['driver']}, audio {function_state(audio)['driver']}"
    )
    with running_plugin(record) as standin:
        for address in (gpu, audio):
            bind_vfio(address)
        group = function_state(gpu)["iommu_group"]
        say(f"bind: {gpu} and {audio} to vfio-pci (driver_override + drivers_probe); /dev/vfio: {dev_vfio()}")
        say(f"kernel: VFIO_GROUP_GET_STATUS on /dev/vfio/{group}: {group_status(f'/dev/vfio/{group}')}")
        registration = standin.wait_for_registration(RESOURCE, timeout=120)
        devices = standin.wait_for_devices(RESOURCE, lambda d: d.get(gpu) == "Healthy", timeout=30)
        say(f"plugin: registered {registration.resource_name} ({registration.endpoint}); ListAndWatch: {devices}")
        say(f"kubelet: capacity {standin.capacity(RESOURCE)}, allocatable {standin.allocatable(RESOURCE)}")
        with contextlib.suppress(Exception):
            say(f"kubelet: GetPreferredAllocation -> {standin.preferred_allocation(RESOURCE, [gpu], [], 1)}")
        response = standin.allocate(RESOURCE, [gpu]).container_responses[0]
        say(f"kubelet: Allocate -> env {dict(response.envs)}, devices {[d.host_path for d in response.devices]}")
        say(f"kernel: those nodes exist: {all(os.path.exists(d.host_path) for d in response.devices)}")
        vfio = vfio_open(f"/dev/vfio/{group}", gpu, None)
        say(
            f"kernel: opened as QEMU does: group viable {vfio['viable']}, device fd for {gpu} "
            f"({vfio['num_regions']} regions, {vfio['num_irqs']} IRQ types)"
        )
        inner = inner_qemu_steps(record, dict(response.envs))
        if "run" not in inner:
            say(f"error: libvirt's argv: {inner.get('native_error') or inner}")
            raise SystemExit(1)
        for device in inner["native"]:
            say(f"hook: xmlgen render wrote the domain; libvirt (on the host) gives QEMU -device {device}")
        found = [
            d
            for bus in inner["run"]["qmp"][2]["return"]
            for d in walk_pci(bus["devices"])
            if str(d.get("qdev_id", "")).startswith("ua-gpu0")
        ]
        say(f"qemu: started paused in the node with {' '.join(inner['run']['argv'][-4:])}; QMP query-pci shows:")
        for d in found:
            say(
                f"qemu:   {d['qdev_id']} at bus {d['bus']} slot {d['slot']} function {d['function']}: "
                f"{d['id']['vendor']:04x}:{d['id']['device']:04x} {d['class_info'].get('desc')}"
            )
        say("qemu: quit")
        sys.stdout.write((RESULTS / "domain.xml").read_text())


SCENARIOS: dict[str, Callable[[Recorder], None]] = {
    "node": scenario_node,
    "iommu_off": scenario_iommu_off,
    "simulate": scenario_simulate,
}


def main() -> int:
    record = Recorder()
    name = sys.argv[1]
    record["scenario"] = name
    try:
        SCENARIOS[name](record)
    except Exception:
        record.data["errors"]["scenario"] = traceback.format_exc()
    record["seconds"] = round(time.monotonic() - record.started, 2)
    record.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
