"""The kernel's write effects over a fixture tree (:mod:`simkit.sysfs_fixture`), for the node agent's tests.

Plain files cannot react to a write, so the agent writes through a :class:`~node_agent.kernel.Kernel`;
:class:`SimKernel` is the one tests give it. Each write has the effect the kernel's would, on the same
files and links the agent then reads back:

- ``driver_override``: stored (``"\\n"`` clears it, the file then reads ``(null)`` as the kernel's does);
- ``drivers/<drv>/unbind``: the ``driver`` link and ``drivers/<drv>/<BDF>`` go; the last function of a group
  leaving a VFIO driver takes ``/dev/vfio/<N>`` with it; ``ENODEV`` if the function is not on ``<drv>``;
- ``drivers/<drv>/bind``: only onto a loaded driver, only a function with no driver (``EBUSY``), and a VFIO
  driver only with a matching ``driver_override`` (``ENODEV``: VFIO drivers match no device IDs);
- ``drivers_probe``: a function with no driver gets its ``driver_override`` driver, else its own host driver
  (the one it had in the fixture);
- ``mdev_supported_types/<type>/create`` (a UUID): a new mdev with its own IOMMU group and group node,
  ``available_instances`` one lower (``ENOSPC`` at 0, ``EEXIST`` for a UUID in use); ``remove``: the reverse;
- ``sriov_numvfs`` (PFs set up by :meth:`SimKernel.add_sriov_gpu`): VF functions appear with ``physfn``/
  ``virtfn<i>`` links, on the PF's driver, each in its own group; ``0`` removes them; another non-zero
  count while VFs exist is ``EBUSY``, above ``sriov_totalvfs`` ``ERANGE``;
- ``nvidia/current_vgpu_type`` on a VF: an ID listed in its ``creatable_vgpu_types`` creates the vGPU
  (``EINVAL`` otherwise, ``EBUSY`` while another type is set), ``0`` removes it; every VF's list is then
  recomputed from the types' capacities, and the VF's ``/dev/vfio/<N>`` comes and goes with its type
  (docs/node-agent.md has the shape and its sources).

- ``run`` (``nvidia-smi``) on GPUs made MIG-capable by :meth:`SimKernel.add_mig`: MIG mode set pending (refused
  while VFs are on, or, to turn off, while GPU instances exist) and made current by a GPU reset (``-r``: no
  VFs, no processes); GPU instances created at a profile's placements within its count, listed as ``mig -lgi``
  prints them, never destroyed under a vGPU; in MIG mode the VFs list only the MIG-backed types with a free
  instance, and a vGPU takes the lowest free instance of its profile (docs/node-agent.md, "MIG-backed vGPU").

A VM holding a group is :meth:`SimKernel.hold`: ``/dev/vfio/<N>`` then answers ``EBUSY`` and a fake
``/proc/<pid>/fd`` link names the holder. Writes that would make the real kernel wait for that holder
(unbinding or removing a held device) fail with ``EBUSY`` instead. The real kernel is
:class:`node_agent.kernel.RealKernel`; nothing here runs outside tests, benchmarks and ``xmlgen simulate``.
"""

from __future__ import annotations

import errno
import itertools
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.kernel import AgentError, CommandResult
from runtime.node import VFIO_DRIVERS

CREATABLE_HEADER = "ID    : vGPU Name"


class _SmiError(Exception):
    """A simulated nvidia-smi failure: its message (stderr) and exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class VgpuType:
    """A vGPU type an SR-IOV GPU offers: its ID, name (``NVIDIA L40S-1B``) and how many fit on one GPU."""

    type_id: int
    name: str
    max_instances: int


@dataclass(frozen=True, slots=True)
class MigVgpuType:
    """A MIG-backed vGPU type: its ID, name (``NVIDIA A100-1-5C``) and the GPU instance profile it runs on."""

    type_id: int
    name: str
    profile: str


@dataclass(frozen=True, slots=True)
class SimProfile:
    """A GPU instance profile as the simulated driver knows it (MIG user guide, "Supported MIG Profiles")."""

    profile_id: int
    name: str
    size: int
    starts: tuple[int, ...]
    most: int


def mig_profiles(one: int, two: int) -> tuple[SimProfile, ...]:
    """The A100/H100 GPU instance profiles, named by the memory of one and of two memory slices (GB)."""
    return (
        SimProfile(19, f"1g.{one}gb", 1, (0, 1, 2, 3, 4, 5, 6), 7),
        SimProfile(20, f"1g.{one}gb+me", 1, (0, 1, 2, 3, 4, 5, 6), 1),
        SimProfile(15, f"1g.{two}gb", 2, (0, 2, 4, 6), 4),
        SimProfile(14, f"2g.{two}gb", 2, (0, 2, 4), 3),
        SimProfile(9, f"3g.{2 * two}gb", 4, (0, 4), 2),
        SimProfile(5, f"4g.{2 * two}gb", 4, (0,), 1),
        SimProfile(0, f"7g.{4 * two}gb", 8, (0,), 1),
    )


A100_40GB_PROFILES = mig_profiles(5, 10)
GPU_80GB_PROFILES = mig_profiles(10, 20)


@dataclass
class _GpuInstance:
    gi_id: int
    profile: SimProfile
    start: int
    compute: bool = True


@dataclass
class _Mig:
    profiles: tuple[SimProfile, ...]
    types: tuple[MigVgpuType, ...]
    current: bool = False
    pending: bool = False
    instances: list[_GpuInstance] = field(default_factory=list)
    backing: dict[str, int] = field(default_factory=dict)
    """VF address → the GPU instance its MIG-backed vGPU runs on."""
    processes: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class _SriovGpu:
    address: str
    total_vfs: int
    vf_device: int
    types: tuple[VgpuType, ...]
    first_vf_offset: int
    homogeneous: bool
    vfs: list[str] = field(default_factory=list)
    mig: _Mig | None = None


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _unlink(path: Path) -> None:
    if os.path.lexists(path):
        path.unlink()


class SimKernel:
    """The kernel's side of the agent's writes over the fixture tree at ``root`` (see the module doc)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.writes = 0
        self.log: list[tuple[str, str]] = []
        """Every write as (path relative to the root, value), in order."""
        self.loaded: list[str] = []
        self.held: dict[int, list[int]] = {}
        """pid → the groups it holds."""
        self.native: dict[str, str] = {}
        """The host driver each function had in the fixture (where ``drivers_probe`` puts it back)."""
        self._sriov: dict[str, _SriovGpu] = {}
        self.commands: list[list[str]] = []
        """Every command run (``nvidia-smi`` …), in order."""
        self.smi_failures: list[str] = []
        """Words of nvidia-smi commands that fail once (``-cgi``: the next GPU instance creation), as a driver may."""
        for address in sorted(os.listdir(self.sys / "bus" / "pci" / "devices")):
            driver = self._driver(address)
            if driver is not None and driver not in VFIO_DRIVERS:
                self.native[address] = driver
        for driver_dir in (self.sys / "bus" / "pci" / "drivers").glob("*"):
            self._driver_files(driver_dir)
        self._attribute_files()

    # -- the Kernel protocol -------------------------------------------------------------------------------

    def write(self, path: Path, value: str) -> None:
        self.writes += 1
        relative = Path(os.path.relpath(path, self.root))
        self.log.append((str(relative), value))
        parts = relative.parts
        try:
            self._dispatch(parts, value.strip())
        except OSError as exc:
            raise AgentError(
                f"the kernel refused {value.strip()!r} written to {path}: {os.strerror(exc.errno or 0)}"
            ) from None

    def group_busy(self, node: Path) -> bool:
        return any(node.name == str(group) for groups in self.held.values() for group in groups)

    def load_module(self, module: str, root: Path) -> None:
        driver = "vfio-pci" if module == "vfio_pci" else module
        self.loaded.append(module)
        self._driver_files(self.sys / "bus" / "pci" / "drivers" / driver)

    def run(self, argv: list[str], timeout: float) -> CommandResult:
        """``nvidia-smi`` over the simulated GPUs (see :meth:`_nvidia_smi`); any other program is not found."""
        self.commands.append(list(argv))
        if not argv or os.path.basename(argv[0]) != "nvidia-smi":
            raise AgentError(f"cannot run {' '.join(argv)}: No such file or directory")
        failing = next((word for word in self.smi_failures if word in argv), None)
        if failing is not None:
            self.smi_failures.remove(failing)
            return CommandResult(255, "", f"Failed to run {' '.join(argv[1:])}: Unknown Error\n")
        try:
            return CommandResult(0, self._nvidia_smi(argv[1:]), "")
        except _SmiError as exc:
            return CommandResult(exc.code, "", str(exc) + "\n")
        finally:  # the VFs' creatable lists follow the GPU instances (a failed -cgi may have made some)
            for gpu in self._sriov.values():
                if gpu.mig is not None and gpu.vfs:
                    self._refresh_creatable(gpu)

    # -- test controls ------------------------------------------------------------------------------------

    def hold(self, group: int, pid: int = 4242, comm: str = "qemu-kvm", *, visible: bool = True) -> None:
        """A process (a VM) opens ``/dev/vfio/<group>``; ``visible=False``: from another PID namespace (only
        the group's EBUSY tells)."""
        self.held.setdefault(pid, []).append(group)
        if visible:
            self.hold_node(f"/dev/vfio/{group}", pid, comm)

    def hold_node(self, node: str, pid: int = 4243, comm: str = "Xorg") -> None:
        """A process has the device node ``node`` open (``/dev/dri/card0``…), as ``/proc/<pid>/fd`` shows."""
        fd_dir = self.root / "proc" / str(pid) / "fd"
        fd_dir.mkdir(parents=True, exist_ok=True)
        (self.root / "proc" / str(pid) / "comm").write_text(comm + "\n")
        number = 3 + len(os.listdir(fd_dir))
        (fd_dir / str(number)).symlink_to(node)

    def release(self, pid: int = 4242) -> None:
        self.held.pop(pid, None)
        proc = self.root / "proc" / str(pid)
        for entry in sorted(proc.rglob("*"), reverse=True) if proc.exists() else []:
            entry.rmdir() if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        if proc.exists():
            proc.rmdir()

    def add_sriov_gpu(
        self,
        address: str,
        total_vfs: int,
        vf_device: int,
        types: tuple[VgpuType, ...],
        *,
        first_vf_offset: int = 4,
        homogeneous: bool = True,
    ) -> None:
        """Make the fixture function ``address`` (an NVIDIA PF, on ``nvidia``) an SR-IOV vGPU GPU with VFs off."""
        gpu = _SriovGpu(address, total_vfs, vf_device, types, first_vf_offset, homogeneous)
        self._sriov[address] = gpu
        directory = self._device_dir(address)
        (directory / "sriov_totalvfs").write_text(f"{total_vfs}\n")
        (directory / "sriov_numvfs").write_text("0\n")
        (directory / "sriov_vf_device").write_text(f"{vf_device:x}\n")

    def add_mig(
        self, address: str, profiles: tuple[SimProfile, ...], types: tuple[MigVgpuType, ...], *, enabled: bool = False
    ) -> None:
        """Make the SR-IOV GPU ``address`` (:meth:`add_sriov_gpu`) MIG-capable: its GPU instance ``profiles`` and the
        MIG-backed vGPU ``types`` its VFs offer while MIG mode is on (then its time-sliced types are not offered)."""
        self._sriov[address].mig = _Mig(profiles, types, current=enabled, pending=enabled)

    def gpu_process(self, address: str, pid: int, name: str) -> None:
        """A compute process on the GPU (nvidia-smi lists it; MIG mode then cannot change)."""
        mig = self._sriov[address].mig
        assert mig is not None
        mig.processes.append((pid, name))

    def mig_layout(self, address: str) -> tuple[bool, list[tuple[str, int]]]:
        """MIG mode now and the GPU instances as (profile name, start), by start."""
        mig = self._sriov[address].mig
        assert mig is not None
        return mig.current, sorted(((gi.profile.name, gi.start) for gi in mig.instances), key=lambda item: item[1])

    # -- nvidia-smi -----------------------------------------------------------------------------------------

    def _mig_gpu(self, address: str) -> tuple[_SriovGpu, _Mig]:
        gpu = self._sriov.get(address)
        if gpu is None or gpu.mig is None:
            raise _SmiError(f"No MIG-capable GPU with PCI bus id {address}: Not Supported", 3)
        return gpu, gpu.mig

    def _nvidia_smi(self, args: list[str]) -> str:
        """The nvidia-smi commands the agent uses, with their effect on the simulated GPU: mode changes wait for
        no VFs and no processes and (as on A100/H100 in a hypervisor) take effect on a GPU reset; GPU instances
        go only where their profile may start, free, and never under a vGPU."""
        flags = dict(itertools.pairwise(args))
        address = flags.get("-i", "")
        if args and args[0].startswith("--query-gpu="):
            gpu, mig = self._mig_gpu(address)
            return f"{'Enabled' if mig.current else 'Disabled'}, {'Enabled' if mig.pending else 'Disabled'}\n"
        if args and args[0].startswith("--query-compute-apps="):
            gpu, mig = self._mig_gpu(address)
            return "".join(f"{pid}, {name}\n" for pid, name in mig.processes)
        if "-mig" in flags:
            gpu, mig = self._mig_gpu(address)
            wanted = flags["-mig"] == "1"
            if gpu.vfs or (not wanted and mig.instances):
                raise _SmiError(f"Unable to set MIG Mode for GPU {address}: In use by another client", 14)
            mig.pending = wanted
            return f"{'Enabled' if wanted else 'Disabled'} MIG Mode for GPU {address}.\nAll done.\n"
        if args[:1] == ["-r"]:
            gpu, mig = self._mig_gpu(address)
            if gpu.vfs or mig.processes:
                raise _SmiError(f"Unable to reset GPU {address}: In use by another client", 14)
            mig.current = mig.pending
            if not mig.current:
                mig.instances.clear()
            return f"GPU {address} was successfully reset.\nAll done.\n"
        if args[:1] == ["mig"]:
            gpu, mig = self._mig_gpu(address)
            if not mig.current:
                raise _SmiError(f"MIG mode is not enabled on GPU {address}: Not Supported", 3)
            if "-lgi" in args:
                return self._list_instances(mig)
            if "-cgi" in flags:
                return self._create_instances(mig, flags["-cgi"], address)
            if "-dci" in args or "-dgi" in args:
                gi_id = int(flags.get("-gi", "-1"))
                found = next((gi for gi in mig.instances if gi.gi_id == gi_id), None)
                if found is None:
                    raise _SmiError(f"Unable to find GPU instance ID {gi_id} on GPU {address}: Not Found", 6)
                if gi_id in mig.backing.values() or ("-dgi" in args and found.compute):
                    raise _SmiError(f"Unable to destroy GPU instance ID {gi_id}: In use by another client", 14)
                if "-dci" in args:
                    found.compute = False
                    return f"Successfully destroyed compute instances in GPU instance ID {gi_id}\n"
                mig.instances.remove(found)
                return f"Successfully destroyed GPU instance ID {gi_id} from GPU {address}\n"
        raise _SmiError(f"simulated nvidia-smi does not know {' '.join(args)!r}", 2)

    @staticmethod
    def _list_instances(mig: _Mig) -> str:
        if not mig.instances:
            raise _SmiError("No GPU instances found: Not Found", 6)
        lines = [
            "+-------------------------------------------------------+",
            "| GPU instances:                                        |",
            "| GPU   Name             Profile  Instance   Placement  |",
            "|                          ID       ID       Start:Size |",
            "|=======================================================|",
        ]
        for gi in sorted(mig.instances, key=lambda gi: gi.gi_id):
            lines.append(
                f"|   0  MIG {gi.profile.name:<13} {gi.profile.profile_id:>4} {gi.gi_id:>9} "
                f"{f'{gi.start}:{gi.profile.size}':>11}     |"
            )
        lines.append("+-------------------------------------------------------+")
        return "\n".join(lines) + "\n"

    @staticmethod
    def _create_instances(mig: _Mig, tuples: str, address: str) -> str:
        out = []
        for item in tuples.split(","):  # one after the other, as nvidia-smi does: a failure keeps the earlier ones
            number, _, start_text = item.partition(":")
            profile = next((p for p in mig.profiles if str(p.profile_id) == number), None)
            if profile is None:
                raise _SmiError(
                    f"Unable to create a GPU instance on GPU {address} using profile {number}: Not Found", 6
                )
            starts = [int(start_text)] if start_text else list(profile.starts)
            taken = {index for gi in mig.instances for index in range(gi.start, gi.start + gi.profile.size)}
            if sum(1 for gi in mig.instances if gi.profile is profile) >= profile.most:
                starts = []
            start = next(
                (s for s in starts if s in profile.starts and not taken & set(range(s, s + profile.size))), None
            )
            if start is None:
                raise _SmiError(
                    f"Unable to create a GPU instance on GPU {address} using profile {item}: Insufficient Resources", 9
                )
            gi_id = min(set(range(1, 15)) - {gi.gi_id for gi in mig.instances})
            mig.instances.append(_GpuInstance(gi_id, profile, start))
            out.append(
                f"Successfully created GPU instance ID {gi_id:>2} on GPU {address} using profile "
                f"MIG {profile.name} (ID {profile.profile_id})"
            )
            out.append(f"Successfully created compute instance ID  0 on GPU {address} GPU instance ID {gi_id:>2}")
        return "\n".join(out) + "\n"

    # -- effects ------------------------------------------------------------------------------------------

    def _dispatch(self, parts: tuple[str, ...], value: str) -> None:
        if parts[:3] == ("sys", "bus", "pci") and len(parts) == 4 and parts[3] == "drivers_probe":
            self._probe(value)
        elif parts[:4] == ("sys", "bus", "pci", "drivers") and len(parts) == 6 and parts[5] in ("bind", "unbind"):
            if not (self.sys / "bus" / "pci" / "drivers" / parts[4]).is_dir():
                raise OSError(errno.ENOENT, "no such driver")
            (self._bind if parts[5] == "bind" else self._unbind)(parts[4], value)
        elif parts[:4] == ("sys", "bus", "pci", "devices") and len(parts) == 6 and parts[5] == "driver_override":
            self._device_dir(parts[4])
            (self._device_dir(parts[4]) / "driver_override").write_text(f"{value or '(null)'}\n")
        elif parts[:4] == ("sys", "bus", "pci", "devices") and len(parts) == 6 and parts[5] == "sriov_numvfs":
            self._numvfs(parts[4], value)
        elif parts[:4] == ("sys", "bus", "pci", "devices") and parts[5:] == ("nvidia", "current_vgpu_type"):
            self._vgpu_type(parts[4], value)
        elif len(parts) > 3 and parts[-3] == "mdev_supported_types" and parts[-1] == "create":
            self._mdev_create(Path(os.path.realpath(self.root.joinpath(*parts[:-3]))), parts[-2], value)
        elif parts[:4] == ("sys", "bus", "mdev", "devices") and len(parts) == 6 and parts[5] == "remove":
            self._mdev_remove(parts[4])
        else:
            raise OSError(errno.EACCES, "not a writable attribute")

    def _device_dir(self, address: str) -> Path:
        link = self.sys / "bus" / "pci" / "devices" / address
        if not os.path.lexists(link):
            raise OSError(errno.ENODEV, "no such device")
        return Path(os.path.realpath(link))

    def _driver(self, address: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self.sys / "bus" / "pci" / "devices" / address / "driver"))
        except OSError:
            return None

    def _group(self, device_dir: Path) -> int | None:
        try:
            return int(os.path.basename(os.readlink(device_dir / "iommu_group")))
        except (OSError, ValueError):
            return None

    def _attribute_files(self) -> None:
        """The write-only attributes the kernel always has and a fixture tree leaves out: every PCI function's
        ``driver_override`` (``(null)``), ``bus/pci/drivers_probe``, each mdev type's ``create``. The agent
        writes only attributes that exist, as the kernel's are never created by a write."""
        for address in os.listdir(self.sys / "bus" / "pci" / "devices"):
            override = self._device_dir(address) / "driver_override"
            if not os.path.lexists(override):
                override.write_text("(null)\n")
        probe = self.sys / "bus" / "pci" / "drivers_probe"
        if not os.path.lexists(probe):
            probe.write_text("")
        for types in (self.sys / "class" / "mdev_bus").glob("*/mdev_supported_types/*"):
            if not os.path.lexists(types / "create"):
                (types / "create").write_text("")

    def _driver_files(self, driver_dir: Path) -> None:
        driver_dir.mkdir(parents=True, exist_ok=True)
        for name in ("bind", "unbind", "new_id", "remove_id"):
            if not (driver_dir / name).exists():
                (driver_dir / name).write_text("")

    def _group_on_vfio(self, group: int) -> bool:
        members = self.sys / "kernel" / "iommu_groups" / str(group) / "devices"
        for member in os.listdir(members):
            device = Path(os.path.realpath(members / member))
            try:
                if os.path.basename(os.readlink(device / "driver")) in VFIO_DRIVERS | {"vfio_mdev"}:
                    return True
            except OSError:
                continue
        return False

    def _attach(self, address: str, driver: str) -> None:
        device = self._device_dir(address)
        driver_dir = self.sys / "bus" / "pci" / "drivers" / driver
        _link(device / "driver", driver_dir)
        _link(driver_dir / address, device)
        group = self._group(device)
        if driver in VFIO_DRIVERS and group is not None:
            node = self.root / "dev" / "vfio" / str(group)
            node.parent.mkdir(parents=True, exist_ok=True)
            node.touch()

    def _bind(self, driver: str, address: str) -> None:
        device = self._device_dir(address)
        if self._driver(address) is not None:
            raise OSError(errno.EBUSY, "already bound")
        override = (device / "driver_override").read_text().strip() if (device / "driver_override").exists() else ""
        if override not in ("", "(null)") and override != driver:
            raise OSError(errno.ENODEV, "driver_override names another driver")
        if driver in VFIO_DRIVERS and override != driver:
            raise OSError(errno.ENODEV, "no ID match")
        self._attach(address, driver)

    def _unbind(self, driver: str, address: str) -> None:
        device = self._device_dir(address)
        if self._driver(address) != driver:
            raise OSError(errno.ENODEV, "not bound to this driver")
        group = self._group(device)
        if driver in VFIO_DRIVERS and group is not None and self.group_busy(Path(str(group))):
            raise OSError(errno.EBUSY, "the real kernel would wait for the group's holder")
        _unlink(device / "driver")
        _unlink(self.sys / "bus" / "pci" / "drivers" / driver / address)
        if group is not None and not self._group_on_vfio(group):
            _unlink(self.root / "dev" / "vfio" / str(group))

    def _probe(self, address: str) -> None:
        device = self._device_dir(address)
        if self._driver(address) is not None:
            return
        override = (device / "driver_override").read_text().strip() if (device / "driver_override").exists() else ""
        driver = override if override not in ("", "(null)") else self.native.get(address)
        if driver is None or not (self.sys / "bus" / "pci" / "drivers" / driver).is_dir():
            return
        self._attach(address, driver)

    # -- mdev ---------------------------------------------------------------------------------------------

    def _next_group(self) -> int:
        groups = [int(name) for name in os.listdir(self.sys / "kernel" / "iommu_groups") if name.isdigit()]
        return max(groups, default=-1) + 1

    def _mdev_create(self, parent_dir: Path, type_id: str, value: str) -> None:
        try:
            uid = str(uuid.UUID(value))
        except ValueError:
            raise OSError(errno.EINVAL, "not a UUID") from None
        type_dir = parent_dir / "mdev_supported_types" / type_id
        if not type_dir.is_dir():
            raise OSError(errno.ENOENT, "no such type")
        if os.path.lexists(self.sys / "bus" / "mdev" / "devices" / uid):
            raise OSError(errno.EEXIST, "UUID in use")
        available = int((type_dir / "available_instances").read_text())
        if available <= 0:
            raise OSError(errno.ENOSPC, "no instance available")
        (type_dir / "available_instances").write_text(f"{available - 1}\n")
        mdev_dir = parent_dir / uid
        mdev_dir.mkdir()
        _link(mdev_dir / "mdev_type", type_dir)
        _link(type_dir / "devices" / uid, mdev_dir)
        _link(self.sys / "bus" / "mdev" / "devices" / uid, mdev_dir)
        (mdev_dir / "remove").write_text("")
        group = self._next_group()
        group_dir = self.sys / "kernel" / "iommu_groups" / str(group)
        _link(mdev_dir / "iommu_group", group_dir)
        _link(group_dir / "devices" / uid, mdev_dir)
        driver_dir = self.sys / "bus" / "mdev" / "drivers" / "vfio_mdev"
        driver_dir.mkdir(parents=True, exist_ok=True)
        _link(mdev_dir / "driver", driver_dir)
        _link(driver_dir / uid, mdev_dir)
        (mdev_dir / "uevent").write_text(f"DRIVER=vfio_mdev\nMDEV_TYPE={type_id}\n")
        node = self.root / "dev" / "vfio" / str(group)
        node.parent.mkdir(parents=True, exist_ok=True)
        node.touch()

    def _mdev_remove(self, uid: str) -> None:
        link = self.sys / "bus" / "mdev" / "devices" / uid
        if not os.path.lexists(link):
            raise OSError(errno.ENODEV, "no such mdev")
        mdev_dir = Path(os.path.realpath(link))
        group = self._group(mdev_dir)
        if group is not None and self.group_busy(Path(str(group))):
            raise OSError(errno.EBUSY, "the real kernel would wait for the mdev's holder")
        type_dir = Path(os.path.realpath(mdev_dir / "mdev_type"))
        available = int((type_dir / "available_instances").read_text())
        (type_dir / "available_instances").write_text(f"{available + 1}\n")
        _unlink(type_dir / "devices" / uid)
        _unlink(link)
        _unlink(self.sys / "bus" / "mdev" / "drivers" / "vfio_mdev" / uid)
        if group is not None:
            group_dir = self.sys / "kernel" / "iommu_groups" / str(group)
            _unlink(group_dir / "devices" / uid)
            for entry in (group_dir / "devices", group_dir):
                if entry.exists() and not os.listdir(entry):
                    entry.rmdir()
            _unlink(self.root / "dev" / "vfio" / str(group))
        for entry in mdev_dir.iterdir():
            entry.unlink()
        mdev_dir.rmdir()

    # -- SR-IOV vGPU --------------------------------------------------------------------------------------

    def _vf_address(self, gpu: _SriovGpu, index: int) -> str:
        domain, bus, rest = gpu.address.split(":")
        slot, function = rest.split(".")
        devfn = (int(slot, 16) << 3 | int(function)) + gpu.first_vf_offset + index
        return f"{domain}:{int(bus, 16) + (devfn >> 8):02x}:{(devfn & 0xFF) >> 3:02x}.{devfn & 7}"

    def _numvfs(self, address: str, value: str) -> None:
        gpu = self._sriov.get(address)
        if gpu is None:
            raise OSError(errno.ENOENT, "not an SR-IOV device")
        try:
            count = int(value)
        except ValueError:
            raise OSError(errno.EINVAL, "not a number") from None
        if self._driver(address) is None:
            raise OSError(errno.ENOENT, "no driver to configure SR-IOV")
        if count == len(gpu.vfs):
            return
        if count > gpu.total_vfs or count < 0:
            raise OSError(errno.ERANGE, "above sriov_totalvfs")
        if count and gpu.vfs:
            raise OSError(errno.EBUSY, "VFs already enabled")
        if count == 0:
            for vf in gpu.vfs:
                group = self._group(self._device_dir(vf))
                if group is not None and self.group_busy(Path(str(group))):
                    raise OSError(errno.EBUSY, "the real kernel would wait for a VF's holder")
            for vf in list(gpu.vfs):
                self._remove_vf(gpu, vf)
            gpu.vfs.clear()
        else:
            for index in range(count):
                gpu.vfs.append(self._add_vf(gpu, index))
            self._refresh_creatable(gpu)
        (self._device_dir(address) / "sriov_numvfs").write_text(f"{count}\n")

    def _add_vf(self, gpu: _SriovGpu, index: int) -> str:
        pf_dir = self._device_dir(gpu.address)
        address = self._vf_address(gpu, index)
        vf_dir = pf_dir.parent / address
        vf_dir.mkdir()
        pf_class = (pf_dir / "class").read_text().strip()
        for name, text in (
            ("vendor", "0x10de"),
            ("device", f"0x{gpu.vf_device:04x}"),
            ("class", pf_class),
            ("subsystem_vendor", "0x10de"),
            ("subsystem_device", "0x0000"),
            ("numa_node", (pf_dir / "numa_node").read_text().strip() if (pf_dir / "numa_node").exists() else "-1"),
        ):
            (vf_dir / name).write_text(text + "\n")
        (vf_dir / "uevent").write_text(f"PCI_ID=10DE:{gpu.vf_device:04X}\nPCI_SLOT_NAME={address}\n")
        (vf_dir / "driver_override").write_text("(null)\n")
        _link(vf_dir / "physfn", pf_dir)
        _link(pf_dir / f"virtfn{index}", vf_dir)
        _link(vf_dir / "subsystem", self.sys / "bus" / "pci")
        _link(self.sys / "bus" / "pci" / "devices" / address, vf_dir)
        group = self._next_group()
        group_dir = self.sys / "kernel" / "iommu_groups" / str(group)
        _link(vf_dir / "iommu_group", group_dir)
        _link(group_dir / "devices" / address, vf_dir)
        (group_dir / "type").write_text("DMA\n")
        driver = self._driver(gpu.address)
        if driver is not None:
            self._attach(address, driver)
        (vf_dir / "nvidia").mkdir()
        (vf_dir / "nvidia" / "current_vgpu_type").write_text("0\n")
        return address

    def _remove_vf(self, gpu: _SriovGpu, address: str) -> None:
        if gpu.mig is not None:
            gpu.mig.backing.pop(address, None)
        vf_dir = self._device_dir(address)
        group = self._group(vf_dir)
        driver = self._driver(address)
        if driver is not None:
            _unlink(self.sys / "bus" / "pci" / "drivers" / driver / address)
        index = gpu.vfs.index(address)
        _unlink(self._device_dir(gpu.address) / f"virtfn{index}")
        _unlink(self.sys / "bus" / "pci" / "devices" / address)
        if group is not None:
            group_dir = self.sys / "kernel" / "iommu_groups" / str(group)
            _unlink(group_dir / "devices" / address)
            _unlink(group_dir / "type")
            (group_dir / "devices").rmdir()
            group_dir.rmdir()
        for entry in sorted(vf_dir.rglob("*"), reverse=True):
            entry.rmdir() if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        vf_dir.rmdir()

    def _current(self, address: str) -> int:
        return int((self._device_dir(address) / "nvidia" / "current_vgpu_type").read_text())

    def _free_instance(self, mig: _Mig, profile: str) -> int | None:
        """The lowest GPU instance of ``profile`` (with its compute instance) no vGPU runs on."""
        free = sorted(
            gi.gi_id
            for gi in mig.instances
            if gi.profile.name == profile and gi.compute and gi.gi_id not in mig.backing.values()
        )
        return free[0] if free else None

    def _refresh_creatable(self, gpu: _SriovGpu) -> None:
        used: dict[int, int] = {}
        for vf in gpu.vfs:
            current = self._current(vf)
            if current:
                used[current] = used.get(current, 0) + 1
        offered: list[VgpuType | MigVgpuType]
        if gpu.mig is not None and gpu.mig.current:  # a GPU in MIG mode offers only MIG-backed types
            mig = gpu.mig
            offered = [t for t in mig.types if self._free_instance(mig, t.profile) is not None]
        else:
            offered = [
                vgpu_type
                for vgpu_type in gpu.types
                if used.get(vgpu_type.type_id, 0) < vgpu_type.max_instances
                and not (gpu.homogeneous and used and vgpu_type.type_id not in used)
            ]
        for vf in gpu.vfs:
            lines = [CREATABLE_HEADER]
            if not self._current(vf):
                lines.extend(f"{t.type_id:<6}: {t.name}" for t in offered)
            (self._device_dir(vf) / "nvidia" / "creatable_vgpu_types").write_text("\n".join(lines) + "\n")

    def _vgpu_type(self, address: str, value: str) -> None:
        vf_dir = self._device_dir(address)
        physfn = vf_dir / "physfn"
        gpu = self._sriov.get(os.path.basename(os.readlink(physfn))) if os.path.lexists(physfn) else None
        if gpu is None:
            raise OSError(errno.ENOENT, "not an SR-IOV vGPU VF")
        try:
            wanted = int(value)
        except ValueError:
            raise OSError(errno.EINVAL, "not a number") from None
        current = self._current(address)
        if wanted == 0:
            group = self._group(vf_dir)
            if current and group is not None and self.group_busy(Path(str(group))):
                raise OSError(errno.EBUSY, "the vGPU is in use")
        elif current:
            raise OSError(errno.EBUSY, "a vGPU type is already set")
        else:
            listed = (vf_dir / "nvidia" / "creatable_vgpu_types").read_text().splitlines()[1:]
            if str(wanted) not in {line.partition(":")[0].strip() for line in listed}:
                raise OSError(errno.EINVAL, "not a creatable type")
        if gpu.mig is not None:  # a MIG-backed vGPU runs on a free GPU instance of its profile
            if wanted:
                backed = next((t for t in gpu.mig.types if t.type_id == wanted), None)
                if backed is not None:
                    gi_id = self._free_instance(gpu.mig, backed.profile)
                    assert gi_id is not None  # listed as creatable, so one is free
                    gpu.mig.backing[address] = gi_id
            else:
                gpu.mig.backing.pop(address, None)
        (vf_dir / "nvidia" / "current_vgpu_type").write_text(f"{wanted}\n")
        group = self._group(vf_dir)
        if group is not None:  # the vGPU's VFIO group node comes and goes with its type
            node = self.root / "dev" / "vfio" / str(group)
            if wanted:
                node.parent.mkdir(parents=True, exist_ok=True)
                node.touch()
            else:
                _unlink(node)
        self._refresh_creatable(gpu)
