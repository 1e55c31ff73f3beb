"""The VMI subset: what is read, what is ignored, and how bad JSON is refused."""

from __future__ import annotations

import json

import pytest

from schemas import InputError
from schemas.vmi import ResourceClaim, parse_vmi
from tests.conftest import EXAMPLES


def test_seed_vmi_is_read() -> None:
    vmi = parse_vmi((EXAMPLES / "seed-node01" / "vmi.json").read_bytes())
    assert vmi.display_name == "cxl/vm-with-gpu"
    assert [(gpu.name, gpu.device_name) for gpu in vmi.spec.domain.devices.gpus] == [
        ("gpu0", "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"),
        ("gpu1", "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"),
    ]


def test_virtual_machine_template_is_accepted() -> None:
    vm = {
        "kind": "VirtualMachine",
        "metadata": {"name": "vm", "namespace": "ns"},
        "spec": {
            "template": {"spec": {"domain": {"devices": {"gpus": [{"name": "g", "deviceName": "nvidia.com/X"}]}}}}
        },
    }
    vmi = parse_vmi(json.dumps(vm).encode())
    assert vmi.display_name == "ns/vm"
    assert vmi.spec.domain.devices.gpus[0].device_name == "nvidia.com/X"


def test_display_options_are_read() -> None:
    vmi = parse_vmi(
        b'{"spec": {"domain": {"devices": {"gpus": [{"name": "g", "deviceName": "d", '
        b'"virtualGPUOptions": {"display": {"enabled": true, "ramFB": {"enabled": false}}}}]}}}}'
    )
    options = vmi.spec.domain.devices.gpus[0].virtual_gpu_options
    assert options is not None and options.display is not None
    assert options.display.enabled is True
    assert options.display.ram_fb is not None and options.display.ram_fb.enabled is False


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"<domain/>", "not valid JSON"),
        (b"[]", "must be an object"),
        (b"null", "must be an object"),
        (b"{}", "spec: Field required"),
        (b'{"spec": {"domain": {"devices": {"gpus": [{"deviceName": "x"}]}}}}', "gpus.0.name: Field required"),
        (b'{"spec": {"domain": {"devices": {"gpus": {"name": "x"}}}}}', "spec.domain.devices.gpus"),
        (b'{"spec": {"domain": {"devices": {"gpus": [{"name": 7}]}}}}', "gpus.0.name"),
        (
            b'{"spec": {"domain": {"devices": {"gpus": [{"name": "g", '
            b'"virtualGPUOptions": {"display": {"enabled": "yes"}}}]}}}}',
            "display.enabled",
        ),
        (b'{"kind": "VirtualMachine", "spec": {}}', "no spec.template"),
        (b"\xff\xfe{}", "not valid UTF-8: byte 0"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_bad_vmi_json_is_refused_with_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(InputError, match="VMI JSON") as error:
        parse_vmi(data)
    assert message in str(error.value)


def test_oversized_vmi_is_refused_before_parsing() -> None:
    with pytest.raises(InputError, match="over the 100-byte limit"):
        parse_vmi(b'{"spec": {}}' + b" " * 100, max_bytes=100)


_SHAPES: list[object] = [
    {"spec": {}},
    {"spec": {"domain": {}}},
    {"spec": {"domain": {"devices": {}}}, "metadata": {}},
    {"spec": {"domain": {"devices": {"gpus": [], "hostDevices": []}}}, "metadata": {"name": "n"}},
    {
        "metadata": {"name": "vm", "namespace": "ns", "labels": {"a": "b"}},
        "spec": {
            "domain": {
                "devices": {
                    "gpus": [
                        {"name": "g0", "deviceName": "nvidia.com/X"},
                        {"name": "g1"},
                        {"name": "g2", "deviceName": None, "virtualGPUOptions": None},
                        {"name": "g3", "deviceName": "d", "virtualGPUOptions": {}},
                        {"name": "g4", "deviceName": "d", "virtualGPUOptions": {"display": None}},
                        {"name": "g5", "deviceName": "d", "virtualGPUOptions": {"display": {}}},
                        {"name": "g6", "virtualGPUOptions": {"display": {"enabled": False, "ramFB": None}}},
                        {"name": "g7", "virtualGPUOptions": {"display": {"enabled": None, "ramFB": {}}}},
                        {"name": "g8", "virtualGPUOptions": {"display": {"ramFB": {"enabled": True}}}},
                    ],
                    "hostDevices": [{"name": "h0", "deviceName": "intel.com/Y"}, {"name": "h1", "deviceName": None}],
                    "disks": [{"name": "ignored"}],
                }
            }
        },
    },
    {
        "spec": {
            "resourceClaims": [
                {"name": "c0", "resourceClaimName": "claim-a"},
                {"name": "c1", "resourceClaimTemplateName": "tpl", "resourceClaimName": None},
                {"name": "c2", "x": 1},
            ],
            "domain": {
                "devices": {
                    "gpus": [
                        {"name": "g0", "claimName": "c0", "requestName": "gpu"},
                        {"name": "g1", "claimName": "c1", "requestName": None, "virtualGPUOptions": {"display": {}}},
                        {"name": "g2", "deviceName": "d", "claimName": "c0", "requestName": "gpu"},
                    ],
                    "hostDevices": [{"name": "h0", "claimName": "c1", "requestName": "r"}, {"name": "h1"}],
                }
            },
        }
    },
]


def test_dra_fields_are_read_and_an_entry_is_dra_as_kubevirt_decides() -> None:
    vmi = parse_vmi(json.dumps(_SHAPES[-1]).encode())
    gpus, hosts = vmi.spec.domain.devices.gpus, vmi.spec.domain.devices.host_devices
    assert (gpus[0].claim_name, gpus[0].request_name, gpus[0].is_dra) == ("c0", "gpu", True)
    assert (gpus[1].request_name, gpus[1].is_dra) == (None, True)  # incomplete: the hook refuses it, naming it
    assert gpus[2].is_dra is False  # deviceName wins, as in virt-launcher (KubeVirt's admission refuses both)
    assert (hosts[0].claim_name, hosts[0].is_dra, hosts[1].is_dra) == ("c1", True, False)
    claims = vmi.spec.resource_claims
    assert claims[0] == ResourceClaim("c0", "claim-a", None)
    assert claims[1] == ResourceClaim("c1", None, "tpl")
    assert vmi.spec.resource_claim("c1") is claims[1] and vmi.spec.resource_claim("nope") is None


@pytest.mark.parametrize("shape", _SHAPES)
def test_the_one_pass_reader_gives_what_the_checking_reader_gives(shape: object) -> None:
    """The usual VMI is read in one pass (``_fast_vmi``); the reader that names every problem must agree."""
    from schemas.vmi import _fast_vmi, _Reader

    assert isinstance(shape, dict)
    fast = _fast_vmi(shape)
    reader = _Reader()
    checked = reader.vmi(shape)
    assert reader.problems == []
    assert fast == checked


_RAMFB_Y = {"ramFB": {"enabled": "y"}}


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"spec": None},
        {"spec": {"domain": None}},
        {"spec": {"domain": {"devices": None}}},
        {"spec": {"domain": {"devices": {"gpus": {}}}}},
        {"spec": {"domain": {"devices": {"gpus": [1]}}}},
        {"spec": {"domain": {"devices": {"gpus": [{"deviceName": "d"}]}}}},
        {"spec": {"domain": {"devices": {"gpus": [{"name": None}]}}}},
        {"spec": {"domain": {"devices": {"gpus": [{"name": "g", "deviceName": 3}]}}}},
        {"spec": {"domain": {"devices": {"gpus": [{"name": "g", "virtualGPUOptions": []}]}}}},
        {"spec": {"domain": {"devices": {"gpus": [{"name": "g", "virtualGPUOptions": {"display": 1}}]}}}},
        {"spec": {"domain": {"devices": {"gpus": [{"name": "g", "virtualGPUOptions": {"display": {"enabled": 1}}}]}}}},
        {"spec": {"domain": {"devices": {"gpus": [{"name": "g", "virtualGPUOptions": {"display": {"ramFB": 1}}}]}}}},
        {"spec": {"domain": {"devices": {"gpus": [{"name": "g", "virtualGPUOptions": {"display": _RAMFB_Y}}]}}}},
        {"spec": {"domain": {"devices": {"hostDevices": [{"name": 1}]}}}},
        {"spec": {}, "metadata": None},
        {"spec": {}, "metadata": {"name": None}},
        {"spec": {}, "metadata": {"namespace": 5}},
        {"spec": {"domain": {"devices": {"gpus": [{"name": "g", "claimName": 1}]}}}},
        {"spec": {"domain": {"devices": {"hostDevices": [{"name": "h", "requestName": []}]}}}},
        {"spec": {"resourceClaims": {}}},
        {"spec": {"resourceClaims": [1]}},
        {"spec": {"resourceClaims": [{"resourceClaimName": "a"}]}},
        {"spec": {"resourceClaims": [{"name": "c", "resourceClaimTemplateName": 2}]}},
    ],
)
def test_a_wrong_shape_leaves_the_one_pass_reader_for_the_checking_one(shape: dict[str, object]) -> None:
    from schemas.vmi import _fast_vmi

    assert _fast_vmi(shape) is None
    with pytest.raises(InputError, match="does not have the expected shape"):
        parse_vmi(json.dumps(shape).encode())
