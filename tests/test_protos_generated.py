"""The committed stubs in ``schemas/generated`` are exactly what ``python -m schemas.genproto`` writes today,
and the ``.proto`` files keep the wire names and field numbers of docs/protocols.md (kubelet and KubeVirt hooks
sections)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor, descriptor_pb2

from schemas import genproto
from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from schemas.generated.kubelet.dra.v1 import api_pb2 as dra_v1
from schemas.generated.kubelet.dra.v1beta1 import api_pb2 as dra_v1beta1
from schemas.generated.kubelet.dra_health.v1alpha1 import api_pb2 as dra_health
from schemas.generated.kubelet.pluginregistration.v1 import api_pb2 as reg
from schemas.generated.kubelet.podresources.v1 import api_pb2 as pr
from schemas.generated.kubevirt.hooks import info_pb2, v1alpha1_pb2, v1alpha2_pb2, v1alpha3_pb2
from schemas.generated.kubevirt.hooks.plugins.v1alpha1 import api_pb2 as plugins


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    genproto.generate(tmp_path / "generated")
    fresh = _tree(tmp_path / "generated")
    committed = _tree(genproto.GENERATED_ROOT)
    assert sorted(fresh) == sorted(committed), "run `python -m schemas.genproto`: the set of generated files changed"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated stubs (run `python -m schemas.genproto`): {stale}"


def test_every_proto_is_generated() -> None:
    names = {str(path) for path in genproto.proto_files()}
    assert names == {
        "kubelet/deviceplugin/v1beta1/api.proto",
        "kubelet/dra/v1/api.proto",
        "kubelet/dra/v1beta1/api.proto",
        "kubelet/dra_health/v1alpha1/api.proto",
        "kubelet/pluginregistration/v1/api.proto",
        "kubelet/podresources/v1/api.proto",
        "kubevirt/hooks/info.proto",
        "kubevirt/hooks/plugins/v1alpha1/api.proto",
        "kubevirt/hooks/v1alpha1.proto",
        "kubevirt/hooks/v1alpha2.proto",
        "kubevirt/hooks/v1alpha3.proto",
    }


def _methods(service: descriptor.ServiceDescriptor) -> dict[str, tuple[str, str, bool]]:
    return {
        method.name: (method.input_type.full_name, method.output_type.full_name, method.server_streaming)
        for method in service.methods
    }


def _fields(message: Any) -> dict[str, tuple[int, int, bool]]:
    # Any: protobuf's stubs type DESCRIPTOR as a union of the pure-Python and upb descriptor classes.
    return {field.name: (field.number, field.type, field.is_repeated) for field in message.fields}


B = descriptor.FieldDescriptor
S, BY, M, I32, I64, BO = B.TYPE_STRING, B.TYPE_BYTES, B.TYPE_MESSAGE, B.TYPE_INT32, B.TYPE_INT64, B.TYPE_BOOL


def test_hook_services_match_facts() -> None:
    info = info_pb2.DESCRIPTOR.services_by_name["Info"]
    assert info.full_name == "kubevirt.hooks.info.Info"
    assert _methods(info) == {"Info": ("kubevirt.hooks.info.InfoParams", "kubevirt.hooks.info.InfoResult", False)}
    assert _fields(info_pb2.InfoResult.DESCRIPTOR) == {
        "name": (1, S, False),
        "hookPoints": (3, M, True),
        "versions": (4, S, True),
    }
    assert _fields(info_pb2.HookPoint.DESCRIPTOR) == {"name": (1, S, False), "priority": (2, I32, False)}
    expected_methods = {
        v1alpha1_pb2: {"OnDefineDomain"},
        v1alpha2_pb2: {"OnDefineDomain", "PreCloudInitIso"},
        v1alpha3_pb2: {"OnDefineDomain", "PreCloudInitIso", "Shutdown"},
    }
    for module, methods in expected_methods.items():
        package = module.DESCRIPTOR.package
        service = module.DESCRIPTOR.services_by_name["Callbacks"]
        assert service.full_name == f"{package}.Callbacks"
        assert set(_methods(service)) == methods
        assert _fields(module.OnDefineDomainParams.DESCRIPTOR) == {"domainXML": (1, BY, False), "vmi": (2, BY, False)}
        assert _fields(module.OnDefineDomainResult.DESCRIPTOR) == {"domainXML": (1, BY, False)}
    assert [m.DESCRIPTOR.package for m in expected_methods] == [
        "kubevirt.hooks.v1alpha1",
        "kubevirt.hooks.v1alpha2",
        "kubevirt.hooks.v1alpha3",
    ]
    for module in (v1alpha2_pb2, v1alpha3_pb2):
        assert _fields(module.PreCloudInitIsoParams.DESCRIPTOR) == {
            "cloudInitNoCloudSource": (1, BY, False),
            "vmi": (2, BY, False),
            "cloudInitData": (3, BY, False),
        }
        assert _fields(module.PreCloudInitIsoResult.DESCRIPTOR) == {
            "cloudInitNoCloudSource": (1, BY, False),
            "cloudInitData": (3, BY, False),
        }


PLUGIN_FIELDS: dict[str, dict[str, tuple[int, int, bool]]] = {
    "NodeContext": {"node_name": (1, S, False)},
    "ExecuteNodeHookRequest": {"hookPoint": (1, S, False), "vmi": (2, BY, False), "node_context": (3, M, False)},
    "ExecuteNodeHookResponse": {},
    "SidecarContext": {"invocation_context": (1, S, False)},
    "MutateDomainRequest": {
        "domain_type": (1, S, False),
        "domain": (2, BY, False),
        "vmi": (3, BY, False),
        "sidecar_context": (4, M, False),
    },
    "MutateDomainResponse": {"domain": (1, BY, False)},
}


def test_plugin_api_matches_kubevirt() -> None:
    """KubeVirt's pkg/hooks/plugins/v1alpha1/api.proto (docs/protocols.md, "KubeVirt plugin API")."""
    package = "kubevirt.hooks.plugins.v1alpha1"
    assert plugins.DESCRIPTOR.package == package
    domain = plugins.DESCRIPTOR.services_by_name["DomainHookService"]
    assert domain.full_name == f"{package}.DomainHookService"
    assert _methods(domain) == {
        "MutateDomain": (f"{package}.MutateDomainRequest", f"{package}.MutateDomainResponse", False)
    }
    node = plugins.DESCRIPTOR.services_by_name["NodeHookService"]
    assert _methods(node) == {
        "ExecuteNodeHook": (f"{package}.ExecuteNodeHookRequest", f"{package}.ExecuteNodeHookResponse", False)
    }
    for name, fields in PLUGIN_FIELDS.items():
        assert _fields(plugins.DESCRIPTOR.message_types_by_name[name]) == fields, name
    assert set(plugins.DESCRIPTOR.message_types_by_name) == set(PLUGIN_FIELDS)
    file = descriptor_pb2.FileDescriptorProto.FromString(plugins.DESCRIPTOR.serialized_pb)
    (sidecar_context,) = [message for message in file.message_type if message.name == "SidecarContext"]
    assert [(r.start, r.end) for r in sidecar_context.reserved_range] == [(2, 3)]  # field 2 reserved, as KubeVirt's
    assert plugins.MutateDomainRequest.DESCRIPTOR.fields_by_name["sidecar_context"].message_type is (
        plugins.SidecarContext.DESCRIPTOR
    )


def test_pod_resources_matches_facts() -> None:
    assert pr.DESCRIPTOR.package == "v1"
    service = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert _methods(service) == {
        "List": ("v1.ListPodResourcesRequest", "v1.ListPodResourcesResponse", False),
        "GetAllocatableResources": ("v1.AllocatableResourcesRequest", "v1.AllocatableResourcesResponse", False),
        "Get": ("v1.GetPodResourcesRequest", "v1.GetPodResourcesResponse", False),
    }
    assert _fields(pr.ListPodResourcesResponse.DESCRIPTOR) == {"pod_resources": (1, M, True)}
    assert _fields(pr.GetPodResourcesRequest.DESCRIPTOR) == {"pod_name": (1, S, False), "pod_namespace": (2, S, False)}
    assert _fields(pr.GetPodResourcesResponse.DESCRIPTOR) == {"pod_resources": (1, M, False)}
    assert _fields(pr.PodResources.DESCRIPTOR) == {
        "name": (1, S, False),
        "namespace": (2, S, False),
        "containers": (3, M, True),
    }
    container = _fields(pr.ContainerResources.DESCRIPTOR)
    assert {k: container[k] for k in ("name", "devices", "cpu_ids")} == {
        "name": (1, S, False),
        "devices": (2, M, True),
        "cpu_ids": (3, I64, True),
    }
    assert _fields(pr.ContainerDevices.DESCRIPTOR) == {
        "resource_name": (1, S, False),
        "device_ids": (2, S, True),
        "topology": (3, M, False),
    }
    assert _fields(pr.NUMANode.DESCRIPTOR) == {"ID": (1, I64, False)}


DEVICE_PLUGIN_FIELDS: dict[str, dict[str, tuple[int, int, bool]]] = {
    "DevicePluginOptions": {"pre_start_required": (1, BO, False), "get_preferred_allocation_available": (2, BO, False)},
    "RegisterRequest": {
        "version": (1, S, False),
        "endpoint": (2, S, False),
        "resource_name": (3, S, False),
        "options": (4, M, False),
    },
    "Empty": {},
    "ListAndWatchResponse": {"devices": (1, M, True)},
    "Device": {"ID": (1, S, False), "health": (2, S, False), "topology": (3, M, False)},
    "TopologyInfo": {"nodes": (1, M, True)},
    "NUMANode": {"ID": (1, I64, False)},
    "PreferredAllocationRequest": {"container_requests": (1, M, True)},
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": (1, S, True),
        "must_include_deviceIDs": (2, S, True),
        "allocation_size": (3, I32, False),
    },
    "PreferredAllocationResponse": {"container_responses": (1, M, True)},
    "ContainerPreferredAllocationResponse": {"deviceIDs": (1, S, True)},
    "AllocateRequest": {"container_requests": (1, M, True)},
    "ContainerAllocateRequest": {"devices_ids": (1, S, True)},
    "AllocateResponse": {"container_responses": (1, M, True)},
    "ContainerAllocateResponse": {
        "envs": (1, M, True),
        "mounts": (2, M, True),
        "devices": (3, M, True),
        "annotations": (4, M, True),
        "cdi_devices": (5, M, True),
    },
    "Mount": {"container_path": (1, S, False), "host_path": (2, S, False), "read_only": (3, BO, False)},
    "DeviceSpec": {"container_path": (1, S, False), "host_path": (2, S, False), "permissions": (3, S, False)},
    "CDIDevice": {"name": (1, S, False)},
    "PreStartContainerRequest": {"devices_ids": (1, S, True)},
    "PreStartContainerResponse": {},
}


def test_device_plugin_api_matches_facts() -> None:
    assert dp.DESCRIPTOR.package == "v1beta1"
    registration = dp.DESCRIPTOR.services_by_name["Registration"]
    assert _methods(registration) == {"Register": ("v1beta1.RegisterRequest", "v1beta1.Empty", False)}
    plugin = dp.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert plugin.full_name == "v1beta1.DevicePlugin"
    assert _methods(plugin) == {
        "GetDevicePluginOptions": ("v1beta1.Empty", "v1beta1.DevicePluginOptions", False),
        "ListAndWatch": ("v1beta1.Empty", "v1beta1.ListAndWatchResponse", True),
        "GetPreferredAllocation": ("v1beta1.PreferredAllocationRequest", "v1beta1.PreferredAllocationResponse", False),
        "Allocate": ("v1beta1.AllocateRequest", "v1beta1.AllocateResponse", False),
        "PreStartContainer": ("v1beta1.PreStartContainerRequest", "v1beta1.PreStartContainerResponse", False),
    }
    for name, fields in DEVICE_PLUGIN_FIELDS.items():
        assert _fields(dp.DESCRIPTOR.message_types_by_name[name]) == fields, name
    assert set(dp.DESCRIPTOR.message_types_by_name) == set(DEVICE_PLUGIN_FIELDS)


@pytest.mark.parametrize("module", [info_pb2, v1alpha1_pb2, v1alpha2_pb2, v1alpha3_pb2, plugins, pr, dp, dra_health])
def test_generated_modules_import_as_a_package(module: object) -> None:
    assert getattr(module, "__name__", "").startswith("schemas.generated.")


def test_plugin_registration_matches_kubernetes() -> None:
    """staging/src/k8s.io/kubelet/pkg/apis/pluginregistration/v1/api.proto (docs/dra.md, "Node side")."""
    assert reg.DESCRIPTOR.package == "pluginregistration"
    service = reg.DESCRIPTOR.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    assert _methods(service) == {
        "GetInfo": ("pluginregistration.InfoRequest", "pluginregistration.PluginInfo", False),
        "NotifyRegistrationStatus": (
            "pluginregistration.RegistrationStatus",
            "pluginregistration.RegistrationStatusResponse",
            False,
        ),
    }
    assert _fields(reg.PluginInfo.DESCRIPTOR) == {
        "type": (1, S, False),
        "name": (2, S, False),
        "endpoint": (3, S, False),
        "supported_versions": (4, S, True),
    }
    assert _fields(reg.RegistrationStatus.DESCRIPTOR) == {"plugin_registered": (1, BO, False), "error": (2, S, False)}
    assert _fields(reg.RegistrationStatusResponse.DESCRIPTOR) == {}
    assert _fields(reg.InfoRequest.DESCRIPTOR) == {}


@pytest.mark.parametrize(("module", "version"), [(dra_v1, "v1"), (dra_v1beta1, "v1beta1")])
def test_dra_plugin_api_matches_kubernetes(module: Any, version: str) -> None:
    """staging/src/k8s.io/kubelet/pkg/apis/dra/{v1,v1beta1}/api.proto: one shape, two packages."""
    package = f"k8s.io.kubelet.pkg.apis.dra.{version}"
    assert module.DESCRIPTOR.package == package
    service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert service.full_name == f"{package}.DRAPlugin"
    assert _methods(service) == {
        "NodePrepareResources": (
            f"{package}.NodePrepareResourcesRequest",
            f"{package}.NodePrepareResourcesResponse",
            False,
        ),
        "NodeUnprepareResources": (
            f"{package}.NodeUnprepareResourcesRequest",
            f"{package}.NodeUnprepareResourcesResponse",
            False,
        ),
    }
    assert _fields(module.Claim.DESCRIPTOR) == {"namespace": (1, S, False), "uid": (2, S, False), "name": (3, S, False)}
    assert _fields(module.NodePrepareResourcesRequest.DESCRIPTOR) == {"claims": (1, M, True)}
    assert _fields(module.NodeUnprepareResourcesRequest.DESCRIPTOR) == {"claims": (1, M, True)}
    assert _fields(module.NodePrepareResourcesResponse.DESCRIPTOR) == {"claims": (1, M, True)}
    assert module.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"].message_type.GetOptions().map_entry
    assert _fields(module.NodeUnprepareResourcesResponse.DESCRIPTOR) == {"claims": (1, M, True)}
    assert _fields(module.NodePrepareResourceResponse.DESCRIPTOR) == {"devices": (1, M, True), "error": (2, S, False)}
    assert _fields(module.NodeUnprepareResourceResponse.DESCRIPTOR) == {"error": (1, S, False)}
    assert _fields(module.Device.DESCRIPTOR) == {
        "request_names": (1, S, True),
        "pool_name": (2, S, False),
        "device_name": (3, S, False),
        "cdi_device_ids": (4, S, True),
    }


def test_dra_health_api_matches_kubernetes() -> None:
    """staging/src/k8s.io/kubelet/pkg/apis/dra-health/v1alpha1/api.proto (docs/dra.md, "Health stream"): the
    kubelet calls ``/v1alpha1.DRAResourceHealth/NodeWatchResources``, a server stream."""
    assert dra_health.DESCRIPTOR.package == "v1alpha1"
    service = dra_health.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert service.full_name == "v1alpha1.DRAResourceHealth"
    assert _methods(service) == {
        "NodeWatchResources": ("v1alpha1.NodeWatchResourcesRequest", "v1alpha1.NodeWatchResourcesResponse", True)
    }
    assert _fields(dra_health.NodeWatchResourcesRequest.DESCRIPTOR) == {}
    assert _fields(dra_health.NodeWatchResourcesResponse.DESCRIPTOR) == {"devices": (1, M, True)}
    assert _fields(dra_health.DeviceIdentifier.DESCRIPTOR) == {"pool_name": (1, S, False), "device_name": (2, S, False)}
    assert _fields(dra_health.DeviceHealth.DESCRIPTOR) == {
        "device": (1, M, False),
        "health": (2, B.TYPE_ENUM, False),
        "last_updated_time": (3, I64, False),
        "health_check_timeout_seconds": (4, I64, False),
        "message": (5, S, False),
    }
    assert {value.name: value.number for value in dra_health.DESCRIPTOR.enum_types_by_name["HealthStatus"].values} == {
        "UNKNOWN": 0,
        "HEALTHY": 1,
        "UNHEALTHY": 2,
    }
