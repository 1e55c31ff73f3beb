"""Reading the device plugin's allocation variables and environ files."""

from __future__ import annotations

import pytest

from launcher_hook.allocation import allocation_from_env, parse_environ, parse_pool
from schemas import InputError, PciAddress, ResourceKind

PCI = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
MDEV = "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q"


def test_pci_variable_keeps_allocate_order_and_drops_one_trailing_comma() -> None:
    pool = parse_pool(PCI, "0000:AF:00.0,0000:86:00.0,")
    assert pool.kind is ResourceKind.PCI
    assert pool.ids == (PciAddress.parse("0000:af:00.0"), PciAddress.parse("0000:86:00.0"))


def test_mdev_variable_holds_canonical_uuids() -> None:
    pool = parse_pool(MDEV, "E3F0A6B2-58C4-4F6B-8E9D-2B1C0D9E8F7A")
    assert pool.kind is ResourceKind.MDEV
    assert pool.ids == ("e3f0a6b2-58c4-4f6b-8e9d-2b1c0d9e8f7a",)


def test_empty_value_is_an_empty_pool() -> None:
    assert parse_pool(PCI, "").ids == ()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (PCI, "0000:86:00.0,,0000:af:00.0", "entry 2 is empty"),
        (PCI, "0000:86:00.0,,", "entry 2 is empty"),
        (PCI, "0000:86:00.0,0000:86:00.0", "'0000:86:00.0' is listed twice"),
        (PCI, "0000:86:00.0,86:00.0", "malformed PCI address '86:00.0'"),
        (PCI, "4b20d080-1b54-4048-85b3-a6a62d165c01", "malformed PCI address"),
        (MDEV, "0000:86:00.0", "malformed mdev UUID '0000:86:00.0'"),
    ],
)
def test_bad_values_name_the_variable_and_value(variable: str, value: str, message: str) -> None:
    with pytest.raises(InputError, match=variable) as error:
        parse_pool(variable, value)
    assert message in str(error.value)


def test_only_allocation_variables_are_taken() -> None:
    allocation = allocation_from_env(
        {PCI: "0000:86:00.0", MDEV: "4b20d080-1b54-4048-85b3-a6a62d165c01", "PATH": "/bin", "PCI_RESOURCES": "x"}
    )
    assert list(allocation.pools) == [MDEV, PCI]


def test_environ_file_in_proc_format() -> None:
    data = f"PATH=/bin\0{PCI}=0000:86:00.0,0000:af:00.0\0EMPTY=\0WITH_EQUALS=a=b\0".encode()
    assert parse_environ(data) == {"PATH": "/bin", PCI: "0000:86:00.0,0000:af:00.0", "EMPTY": "", "WITH_EQUALS": "a=b"}


def test_environ_file_in_line_format() -> None:
    data = f"# a comment\n\n{PCI}=0000:86:00.0\r\nHOME=/root\n".encode()
    assert parse_environ(data) == {PCI: "0000:86:00.0", "HOME": "/root"}


@pytest.mark.parametrize(
    ("data", "message"), [(b"A=1\nnot a pair\n", "line 2"), (b"A=1\0=x\0", "entry 2"), (b"\xff=1", "UTF-8")]
)
def test_bad_environ_file_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(InputError, match=message):
        parse_environ(data)


def test_the_last_allocation_is_reused_only_for_the_same_variables_and_a_bad_env_fails_every_time() -> None:
    env = {PCI: "0000:86:00.0", "PATH": "/bin"}
    first = allocation_from_env(env)
    assert allocation_from_env({**env, "PATH": "/usr/bin"}) is first  # other variables do not matter
    changed = allocation_from_env({PCI: "0000:af:00.0"})
    assert changed is not first
    assert changed.pools[PCI].ids == (PciAddress.parse("0000:af:00.0"),)
    assert allocation_from_env({PCI: "0000:86:00.0", "USB_RESOURCE_X": "1:2"}).usb_variables == {"USB_RESOURCE_X"}
    for _ in range(2):
        with pytest.raises(InputError, match=f"{PCI}: malformed PCI address 'zz'"):
            allocation_from_env({PCI: "zz"})
    with pytest.raises(TypeError):
        first.pools[PCI] = first.pools[PCI]  # type: ignore[index]  # shared between calls: read-only
