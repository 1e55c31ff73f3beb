"""The VMI subset: what is read, what is ignored, and how bad JSON is refused."""

from __future__ import annotations

import json

import pytest

from schemas import InputError
from schemas.vmi import parse_vmi
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
