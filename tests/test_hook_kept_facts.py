"""What a hook service keeps of the host for its life: the sysfs facts of its pod's devices, the DRA metadata.

One ``launcher-hook serve`` serves one virt-launcher pod, and KubeVirt calls ``OnDefineDomain`` two or three
times per VM start with the same devices; the devices a pod holds do not change their IOMMU group, driver,
slot or BARs while it holds them (runtime/sysfs_paths.py, docs/kubevirt-hostdevs.md). So a service's readers
keep what they read: a second call on the same devices makes no system call for them (the DRA metadata
included) and gives the same bytes as a service that reads every
time; a device not seen before is read; an error is never kept; each store holds at most its bound; two
services share nothing. System calls are counted by wrapping the ``os`` functions and the ``openat2`` loaders the
readers use, so a read that slipped past the store is seen whatever path it takes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.hook_sidecar import build_sysfs_tree, dra_tree
from bench.workloads import efi_domain, gpu_addresses, gpu_vmi, kubevirt_sized_domain, rendered_domain
from launcher_hook import BuildOptions
from launcher_hook.dra import MetadataFiles
from launcher_hook.service import HookService
from launcher_hook.sources import AllocationSource, DomainSource, ProcessEnvSource
from runtime.hostroot import HostRoot
from runtime.pci_bars import SysfsBars
from runtime.pci_companions import SysfsCompanions
from runtime.sysfs_paths import MAX_KEPT, KeptFacts, _Kernel
from schemas import InputError
from schemas.pci import PciAddress
from schemas.vmi import parse_vmi
from simkit.dra_files import write_vmi_tree
from tests.hook_support import RTX_VAR

SIZE = 4
ADDRESSES = gpu_addresses(SIZE)
COUNTED = ("open", "stat", "lstat", "readlink", "listdir", "scandir", "fstat")


class Calls:
    """The system calls the readers make, by name, while :attr:`made` is being filled."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list[str] = []
        for name in COUNTED:
            monkeypatch.setattr(os, name, self._counting(name, getattr(os, name)))
        for owner in (_Kernel, HostRoot):
            if owner.openat2 is not None:
                monkeypatch.setattr(owner, "openat2", self._counting("openat2", owner.openat2))

    def _counting(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.made.append(name)
            return real(*args, **kwargs)

        return call

    def during(self, action: Callable[[], Any]) -> tuple[Any, list[str]]:
        self.made.clear()
        result = action()
        made, self.made = self.made, []
        return result, made


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    return Calls(monkeypatch)


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A node with SIZE cards (a GPU with a 128 GiB BAR and three companions each) and the DRA files naming them."""
    directory = tmp_path_factory.mktemp("kept")
    return build_sysfs_tree(directory, SIZE), dra_tree(directory, SIZE)


def _options(trees: tuple[Path, Path]) -> BuildOptions:
    sys_dir, metadata = trees
    return BuildOptions(
        bars=SysfsBars(sys_dir), claims=MetadataFiles(metadata), companion_reader=SysfsCompanions(sys_dir)
    )


def _call(path: str) -> tuple[AllocationSource, bytes, bytes]:
    """The source, domain and VMI of one of the paths that read the host (as bench/hook_sidecar.py has them)."""
    if path == "companions-domain":
        return DomainSource(), rendered_domain(ADDRESSES), gpu_vmi(SIZE)
    if path == "efi-window":
        return ProcessEnvSource({RTX_VAR: ",".join(ADDRESSES)}), efi_domain(), gpu_vmi(SIZE)
    return ProcessEnvSource({}), kubevirt_sized_domain(), gpu_vmi(SIZE, dra=True)


@pytest.mark.parametrize("path", ["companions-domain", "efi-window", "dra"])
def test_a_second_call_on_the_same_devices_reads_nothing_and_gives_the_same_bytes(
    path: str, trees: tuple[Path, Path], calls: Calls
) -> None:
    source, domain, vmi = _call(path)
    service = HookService(source, _options(trees))
    reading = HookService(source, _options(trees), keep_host_facts=False)
    first, first_calls = calls.during(lambda: service.define_domain(domain, vmi, via="test").domain_xml)
    second, second_calls = calls.during(lambda: service.define_domain(domain, vmi, via="test").domain_xml)
    again, _ = calls.during(lambda: service.define_domain(second, vmi, via="test").domain_xml)
    assert first_calls.count("openat2") + first_calls.count("open") >= SIZE  # the first call did read the host
    assert second == first == reading.define_domain(domain, vmi, via="test").domain_xml
    assert again == reading.define_domain(second, vmi, via="test").domain_xml  # KubeVirt's next define
    assert (b"X-PciMmio64Mb" if path == "efi-window" else b"ua-gpu0-fn1") in first
    assert second_calls == []


def test_two_services_keep_apart(trees: tuple[Path, Path], calls: Calls) -> None:
    source, domain, vmi = _call("companions-domain")
    options = _options(trees)
    one, other = HookService(source, options), HookService(source, options)
    one.define_domain(domain, vmi, via="test")
    _, made = calls.during(lambda: other.define_domain(domain, vmi, via="test"))
    assert made  # the other service read the host itself
    plain = HookService(source, options, keep_host_facts=False)
    _, made = calls.during(lambda: plain.define_domain(domain, vmi, via="test"))
    assert made
    assert isinstance(options.companion_reader, SysfsCompanions) and options.companion_reader.kept is None


def test_a_gpu_not_seen_before_is_read_and_the_kept_ones_are_not(trees: tuple[Path, Path], calls: Calls) -> None:
    sys_dir, _ = trees
    gpus = [PciAddress.parse(address) for address in ADDRESSES]
    reader, plain = SysfsCompanions(sys_dir).keeping(), SysfsCompanions(sys_dir)
    assert reader.kept is not None
    assert reader.read_all(gpus[:1], gpus) == plain.read_all(gpus[:1], gpus)
    assert reader.kept.reads == 1
    found, made = calls.during(lambda: reader.read_all(gpus, gpus))
    assert found == plain.read_all(gpus, gpus) and all(len(each) == 3 for each in found)
    assert reader.kept.reads == SIZE and made  # the three new GPUs, read through one view
    _, made = calls.during(lambda: reader.read_all(gpus, gpus[:1]))  # another set of the VM's GPUs: the rule reruns
    assert made == [] and reader.read_all(gpus, gpus[:1]) == plain.read_all(gpus, gpus[:1])
    audio = PciAddress(gpus[0].domain, gpus[0].bus, gpus[0].slot, 1)  # the VM gets a companion as a GPU of its own
    found, made = calls.during(lambda: reader.read_all(gpus, {*gpus, audio}))
    assert made == [] and found == plain.read_all(gpus, {*gpus, audio})
    assert audio not in found[0] and len(found[0]) == 2 and len(found[1]) == 3

    bars, plain_bars = SysfsBars(sys_dir).keeping(), SysfsBars(sys_dir)
    assert bars.kept is not None
    assert bars.read_all(gpus[:2]) == plain_bars.read_all(gpus[:2])
    found, made = calls.during(lambda: bars.read_all(gpus))
    assert found == plain_bars.read_all(gpus) and made and bars.kept.reads == SIZE
    _, made = calls.during(lambda: bars.read_all(list(reversed(gpus))))
    assert made == [] and bars.read_all(list(reversed(gpus))) == plain_bars.read_all(list(reversed(gpus)))


def test_an_error_is_not_kept(tmp_path: Path) -> None:
    sys_dir = build_sysfs_tree(tmp_path, 1)
    gpu = PciAddress.parse(ADDRESSES[0])
    class_file = sys_dir / "bus" / "pci" / "devices" / str(gpu) / "class"
    text = class_file.read_text()
    class_file.write_text("garbage\n")
    reader = SysfsCompanions(sys_dir).keeping()
    (found,) = reader.read_all([gpu])
    assert isinstance(found, InputError) and "class" in str(found)
    class_file.write_text(text)
    (repaired,) = reader.read_all([gpu])
    assert isinstance(repaired, tuple) and len(repaired) == 3

    resource = sys_dir / "bus" / "pci" / "devices" / str(gpu) / "resource"
    content = resource.read_bytes()
    resource.write_bytes(b"\xff\n")
    bars = SysfsBars(sys_dir).keeping()
    with pytest.raises(InputError, match=r"PCI device 0000:.*resource.* is not ASCII"):
        bars.read_all([gpu])
    resource.write_bytes(content)
    assert bars.read_all([gpu]) == SysfsBars(sys_dir).read_all([gpu])
    assert bars.kept is not None and bars.kept.reads == 1


def test_a_service_reads_again_after_a_warning(tmp_path: Path) -> None:
    """A GPU whose companions could not be read (a warning, placed alone) is read again by the next call."""
    sys_dir = build_sysfs_tree(tmp_path, SIZE)
    class_file = sys_dir / "bus" / "pci" / "devices" / ADDRESSES[0] / "class"
    text = class_file.read_text()
    class_file.write_text("garbage\n")
    source, domain, vmi = _call("companions-domain")
    service = HookService(source, BuildOptions(companion_reader=SysfsCompanions(sys_dir)))
    damaged = service.define_domain(domain, vmi, via="test")
    assert any("placed alone" in warning for warning in damaged.result.warnings)
    class_file.write_text(text)
    repaired = service.define_domain(domain, vmi, via="test")
    assert not repaired.result.warnings and b"ua-gpu0-fn1" in repaired.domain_xml


def test_each_store_holds_at_most_its_bound(trees: tuple[Path, Path], calls: Calls) -> None:
    sys_dir, _ = trees
    gpus = [PciAddress.parse(address) for address in ADDRESSES]
    bars = SysfsBars(sys_dir).keeping(bound=2)
    assert bars.kept is not None
    bars.read_all(gpus[:3])
    assert len(bars.kept) == 2 and bars.kept.keys() == gpus[1:3]  # the oldest went
    _, made = calls.during(lambda: bars.read_all(gpus[:1]))
    assert made and bars.kept.keys() == [gpus[2], gpus[0]] and bars.kept.reads == 4
    companions = SysfsCompanions(sys_dir).keeping(bound=1)
    assert companions.kept is not None
    companions.read_all(gpus)
    assert companions.kept.keys() == gpus[-1:]
    assert SysfsBars(sys_dir).keeping().kept is not None and MAX_KEPT == 256
    assert SysfsBars(sys_dir).keeping().kept.bound == MAX_KEPT  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="keeps nothing"):
        KeptFacts[str, int](0)


def _dra(root: Path, devices: list[str]) -> None:
    vmi = parse_vmi(gpu_vmi(len(devices), dra=True))
    write_vmi_tree(root, vmi, {(f"c{i}", "gpu"): address for i, address in enumerate(devices)}, pod_name="p")


def test_dra_metadata_is_kept_for_the_readers_life_and_only_a_device_is_kept(tmp_path: Path, calls: Calls) -> None:
    """A claim's device is fixed while the pod holds the claim (docs/dra.md, "Kept for the pod's life"): once
    read, it is used again with no system call, even after the file changed; a missing file or a refusal is
    never kept, so a file that appears or is mended later is read."""
    vmi = parse_vmi(gpu_vmi(2, dra=True))
    reader = MetadataFiles(tmp_path / "root").keeping()
    assert reader.kept is not None
    missing = reader.resolve(vmi)
    assert all(outcome.source is None for outcome in missing.values()) and not reader.kept  # no file: not kept
    _dra(tmp_path / "root", ADDRESSES[:2])
    first = reader.resolve(vmi)
    assert [str(outcome.source) for outcome in first.values()] == ADDRESSES[:2] and reader.kept.reads == 2
    again, made = calls.during(lambda: reader.resolve(vmi))
    assert again == first and made == []

    _dra(tmp_path / "root", [ADDRESSES[2], ADDRESSES[1]])  # what no driver does while the pod holds the claim
    assert reader.resolve(vmi) == first
    fresh = MetadataFiles(tmp_path / "root").resolve(vmi)  # (a new pod's reader reads the files as they are)
    assert [str(outcome.source) for outcome in fresh.values()] == [ADDRESSES[2], ADDRESSES[1]]

    files = sorted((tmp_path / "root").rglob("*-metadata.json"))
    extra = files[0].with_name("other.example-metadata.json")
    extra.write_bytes(files[0].read_bytes())  # a second driver's file beside the first: virt-launcher refuses
    with pytest.raises(InputError, match="2 metadata files"):
        MetadataFiles(tmp_path / "root").keeping().resolve(vmi)
    extra.unlink()
    files[0].write_text("{")  # malformed: refused by a reader that has not kept the claim, and not kept
    other = MetadataFiles(tmp_path / "root").keeping()
    for _ in range(2):
        with pytest.raises(InputError, match="c0"):
            other.resolve(vmi)
    assert other.kept is not None and not other.kept
    assert reader.resolve(vmi) == first  # (the reader that kept both claims reads neither file)
