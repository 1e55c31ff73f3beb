"""Allocation sources: the PodResources API (Get, the List fallback, the container choice) against a stand-in
kubelet on a unix socket, the environ file, and the end-to-end path through the hook server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from launcher_hook.cli import make_source
from launcher_hook.service import HookService
from launcher_hook.sources import (
    EnvironFileSource,
    PodIdentity,
    PodResourcesSource,
    ProcessEnvSource,
    SourceUnavailable,
    env_from_devices,
    launcher_pod_pattern,
)
from schemas import InputError
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc
from simkit.podresources_standin import Container, FakeKubelet, Pod, fake_kubelet
from tests.hook_support import (
    RTX,
    RTX_VAR,
    SEED_PCI,
    launcher_pod,
    running_hook,
    seed_case,
    short_dir,
    unix_channel,
)
from tests.test_hook_server import hostdevs

GPUS = ["0000:af:00.0", "0000:86:00.0"]  # the kubelet's order is arbitrary
POD = launcher_pod(GPUS)
T4 = "nvidia.com/GRID_T4-1Q"
MDEV = "4B20D080-1B54-4048-85B3-A6A62D165C01"


@pytest.fixture
def directory() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def vmi_json(namespace: str = "cxl", name: str = "vm-with-gpu") -> bytes:
    return json.dumps({"metadata": {"namespace": namespace, "name": name}, "spec": {}}).encode()


def test_env_from_devices_tells_pci_from_mdev_sorts_and_skips_other_ids() -> None:
    env = env_from_devices(
        [
            ("devices.kubevirt.io/kvm", ["kvm0"]),
            (RTX, ["0000:af:00.0", "0000:86:00.0"]),
            (T4, [MDEV, "1f2e3d4c-0000-4000-8000-000000000001"]),
            ("devices.kubevirt.io/vhost-net", ["1"]),
        ]
    )
    assert env == {
        RTX_VAR: "0000:86:00.0,0000:af:00.0",
        "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q": f"1f2e3d4c-0000-4000-8000-000000000001,{MDEV}",
    }


def test_get_reads_the_named_pods_compute_container(directory: Path) -> None:
    kubelet = FakeKubelet([launcher_pod(["0000:01:00.0"], vmi="other"), POD])
    with fake_kubelet(kubelet, directory / "kubelet.sock") as socket_path:
        source = PodResourcesSource(socket_path, pod_name=POD.name, pod_namespace="cxl")
        loaded = source.load(None)
        source.close()
    assert loaded.env == {RTX_VAR: "0000:86:00.0,0000:af:00.0"}
    assert loaded.source == f"PodResources Get {socket_path} pod cxl/{POD.name} container compute"
    assert kubelet.calls == ["Get"]


@pytest.mark.parametrize("get", ["disabled", "unimplemented"])
def test_a_kubelet_without_get_falls_back_to_list_and_remembers(directory: Path, get: str) -> None:
    kubelet = FakeKubelet([POD], get=get)
    with fake_kubelet(kubelet, directory / "kubelet.sock") as socket_path:
        source = PodResourcesSource(socket_path, pod_name=POD.name, pod_namespace="cxl", keep_answer=False)
        first, second = source.load(None), source.load(None)
        source.close()
    assert first.env == second.env == {RTX_VAR: "0000:86:00.0,0000:af:00.0"}
    assert "PodResources List" in first.source
    assert kubelet.calls == ["Get", "List", "List"]


def test_the_container_option_chooses_whose_devices(directory: Path) -> None:
    pod = Pod("cxl", "virt-launcher-vm-with-gpu-abcde", [Container("compute"), Container("gpu-holder", [(RTX, GPUS)])])
    with fake_kubelet(FakeKubelet([pod]), directory / "kubelet.sock") as socket_path:
        compute = PodResourcesSource(socket_path, pod_name=pod.name, pod_namespace="cxl")
        holder = PodResourcesSource(socket_path, container="gpu-holder", pod_name=pod.name, pod_namespace="cxl")
        missing = PodResourcesSource(socket_path, container="nope", pod_name=pod.name, pod_namespace="cxl")
        assert compute.load(None).env == {}
        assert holder.load(None).env == {RTX_VAR: "0000:86:00.0,0000:af:00.0"}
        with pytest.raises(SourceUnavailable, match=r"has no container 'nope' \(it has: compute, gpu-holder\)"):
            missing.load(None)
        for source in (compute, holder, missing):
            source.close()


def test_an_unknown_pod_names_get_and_list(directory: Path) -> None:
    with fake_kubelet(FakeKubelet([POD]), directory / "kubelet.sock") as socket_path:
        source = PodResourcesSource(socket_path, pod_name="virt-launcher-gone-zzzzz", pod_namespace="cxl")
        with pytest.raises(SourceUnavailable) as caught:
            source.load(None)
        source.close()
    message = str(caught.value)
    assert "pod cxl/virt-launcher-gone-zzzzz not found" in message
    assert "Get said UNKNOWN" in message
    assert "List has 1 pods" in message


def test_an_unreachable_socket_is_named(directory: Path) -> None:
    source = PodResourcesSource(directory / "absent.sock", pod_name="p", pod_namespace="ns", timeout=2)
    with pytest.raises(SourceUnavailable) as caught:
        source.load(None)
    source.close()
    assert str(directory / "absent.sock") in str(caught.value)
    assert "UNAVAILABLE" in str(caught.value)


def test_without_pod_name_the_hooks_own_launcher_pod_is_found_by_list(directory: Path) -> None:
    pods = [launcher_pod(["0000:01:00.0"], vmi="vm-with-gpu-2"), POD, launcher_pod(["0000:02:00.0"], namespace="x")]
    kubelet = FakeKubelet(pods)
    with fake_kubelet(kubelet, directory / "kubelet.sock") as socket_path:
        identity = PodIdentity(hostname="vm-with-gpu", namespace="cxl")
        source = PodResourcesSource(socket_path, identity=identity, keep_answer=False)
        loaded = source.load(vmi_json())
        assert source.load(b'{"spec": {}}').env == loaded.env  # no metadata to check: still only our own pod
        with pytest.raises(SourceUnavailable, match="is not the one this hook's pod cxl/virt-launcher-vm-with-gpu-"):
            source.load(vmi_json(name="vm-with-gpu-2"))
        with pytest.raises(InputError, match="VMI JSON"):
            source.load(b"[]")
        source.close()
    assert loaded.env == {RTX_VAR: "0000:86:00.0,0000:af:00.0"}
    assert kubelet.calls == ["List", "Get", "Get"]  # found once by List, then asked for by name


@pytest.mark.parametrize("named", [True, False])
def test_the_first_answer_with_devices_is_kept_for_the_pods_life(directory: Path, named: bool) -> None:
    kubelet = FakeKubelet([POD])
    identity = (
        PodIdentity(name=POD.name, namespace="cxl", namespace_from="POD_NAMESPACE")
        if named
        else PodIdentity(hostname="vm-with-gpu", namespace="cxl")
    )
    with fake_kubelet(kubelet, directory / "kubelet.sock") as socket_path:
        source = PodResourcesSource(socket_path, identity=identity)
        first = source.load(vmi_json())
        kubelet.set_pods([launcher_pod(["0000:01:00.0"])])  # what no kubelet does to a running pod
        second, third = source.load(vmi_json()), source.load(None)
        with pytest.raises(SourceUnavailable, match="is not the one this hook's pod cxl/virt-launcher-vm-with-gpu-"):
            source.load(vmi_json(name="vm-with-gpu-2"))  # the caller's VMI is still checked against the kept pod
        source.close()
    assert first.env == second.env == third.env == {RTX_VAR: "0000:86:00.0,0000:af:00.0"}
    assert second.source == first.source
    assert kubelet.calls == (["Get"] if named else ["List"])


def test_an_answer_without_devices_or_an_error_is_not_kept(directory: Path) -> None:
    empty = Pod(POD.namespace, POD.name, [Container("compute")])
    kubelet = FakeKubelet([empty])
    with fake_kubelet(kubelet, directory / "kubelet.sock") as socket_path:
        source = PodResourcesSource(socket_path, pod_name=POD.name, pod_namespace="cxl")
        assert source.load(None).env == {}
        kubelet.set_pods([])
        with pytest.raises(SourceUnavailable, match="not found"):
            source.load(None)
        kubelet.set_pods([POD])
        assert source.load(None).env == source.load(None).env == {RTX_VAR: "0000:86:00.0,0000:af:00.0"}
        source.close()
    assert kubelet.calls == ["Get", "Get", "List", "Get"]


def test_the_launcher_pod_pattern_follows_generate_name() -> None:
    assert launcher_pod_pattern("vm").fullmatch("virt-launcher-vm-x7k2p")
    assert not launcher_pod_pattern("vm").fullmatch("virt-launcher-vm-2-x7k2p")
    long_name = "a" * 60
    assert launcher_pod_pattern(long_name).fullmatch(("virt-launcher-" + long_name)[:58] + "bcd2f")


def test_several_matching_pods_are_refused(directory: Path) -> None:
    twin = Pod("cxl", "virt-launcher-vm-with-gpu-qqqqq", POD.containers)
    with fake_kubelet(FakeKubelet([POD, twin]), directory / "kubelet.sock") as socket_path:
        source = PodResourcesSource(socket_path, identity=PodIdentity(hostname="vm-with-gpu", namespace="cxl"))
        with pytest.raises(SourceUnavailable, match="several pods could be this hook's own"):
            source.load(vmi_json())
        source.close()


def test_the_hook_server_uses_podresources_end_to_end(directory: Path) -> None:
    domain, vmi, _ = seed_case()
    with fake_kubelet(FakeKubelet([POD], get="disabled"), directory / "kubelet.sock") as kubelet_socket:
        source = make_source(kubelet_socket, None, "compute", {"POD_NAME": POD.name, "POD_NAMESPACE": "cxl"})
        with running_hook(HookService(source), directory / "hook.sock"), unix_channel(directory / "hook.sock") as ch:
            stub = v1alpha3_pb2_grpc.CallbacksStub(ch)
            result = stub.OnDefineDomain(v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60)
            assert hostdevs(result.domainXML) == SEED_PCI
            gone = make_source(directory / "none.sock", None, "compute", {"POD_NAME": "p", "POD_NAMESPACE": "n"})
            with (
                running_hook(HookService(gone), directory / "hook2.sock"),
                unix_channel(directory / "hook2.sock") as c2,
                pytest.raises(grpc.RpcError) as caught,
            ):
                v1alpha3_pb2_grpc.CallbacksStub(c2).OnDefineDomain(
                    v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60
                )
            error = caught.value
            assert isinstance(error, grpc.Call)
            assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert str(directory / "none.sock") in (error.details() or "")
        source.close()
        gone.close()


def test_make_source_precedence(directory: Path) -> None:
    environ = directory / "environ"
    pod_socket = directory / "kubelet.sock"
    chosen = make_source(pod_socket, environ, "compute", {})
    assert isinstance(chosen, PodResourcesSource)
    chosen.close()
    assert isinstance(make_source(None, environ, "compute", {}), EnvironFileSource)
    assert isinstance(make_source(None, None, "compute", {RTX_VAR: GPUS[0]}), ProcessEnvSource)


@pytest.mark.parametrize(
    "content",
    [
        f"HOSTNAME=x\0{RTX_VAR}=0000:86:00.0,0000:af:00.0\0".encode(),
        f"# a copy\nHOSTNAME=x\n{RTX_VAR}=0000:86:00.0,0000:af:00.0\n".encode(),
    ],
    ids=["proc-environ", "key-value-lines"],
)
def test_environ_file_is_read_on_each_call(directory: Path, content: bytes) -> None:
    path = directory / "environ"
    source = EnvironFileSource(path)
    with pytest.raises(SourceUnavailable, match="cannot be read"):
        source.load(None)
    path.write_bytes(content)
    loaded = source.load(None)
    assert loaded.env[RTX_VAR] == "0000:86:00.0,0000:af:00.0"
    assert loaded.source == f"environ file {path}"
    path.write_bytes(b"not a key value line\n")
    with pytest.raises(SourceUnavailable, match="not KEY=VALUE"):
        source.load(None)
