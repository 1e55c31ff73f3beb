"""The companion variable's format (schemas/companions.py): one format, a strict bounded parser."""

from __future__ import annotations

import pytest

from schemas import InputError, PciAddress
from schemas.companions import (
    MAX_GPUS,
    MAX_VALUE_CHARS,
    companions_env_var,
    companions_variable_for,
    format_companions,
    parse_companions,
)
from schemas.kinds import kind_of_variable

VAR = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
A = PciAddress.parse


def test_name_follows_the_resource_variable_and_is_no_allocation_variable() -> None:
    name = companions_env_var("nvidia.com/TU106_GEFORCE_RTX_2060_REV._A")
    assert name == "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
    assert companions_variable_for("PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A") == name
    assert companions_variable_for("MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q") is None
    assert companions_variable_for("PCI_RESOURCE_") is None
    assert kind_of_variable(name) is None


def test_format_then_parse_round_trips() -> None:
    pairs = [(A("0000:86:00.0"), [A("0000:86:00.3"), A("0000:86:00.1")]), (A("0000:af:00.0"), [A("0000:af:00.1")])]
    value = format_companions(pairs)
    assert value == "0000:86:00.0=0000:86:00.1+0000:86:00.3,0000:af:00.0=0000:af:00.1"
    assert parse_companions(VAR, value) == {
        A("0000:86:00.0"): (A("0000:86:00.1"), A("0000:86:00.3")),
        A("0000:af:00.0"): (A("0000:af:00.1"),),
    }
    assert format_companions([(A("0000:86:00.0"), [])]) is None
    assert parse_companions(VAR, "") == {}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0000:86:00.0", "is not GPU=COMPANION"),
        ("0000:86:00.0=", "is not GPU=COMPANION"),
        ("0000:86:00.0=0000:86:00.1,", "entry 2"),
        ("0000:86:0.0=0000:86:00.1", "malformed PCI address"),
        ("0000:86:00.0=0000:86:00.9", "function 9 is above 7"),
        ("0000:86:00.0=0000:87:00.1", "is not another function of GPU 0000:86:00.0's bus and slot"),
        ("0000:86:00.0=0000:86:01.1", "is not another function"),
        ("0000:86:00.0=0000:86:00.0", "is not another function"),
        ("0000:86:00.0=0000:86:00.1+0000:86:00.1", "lists 0000:86:00.1 twice"),
        ("0000:86:00.0=0000:86:00.1,0000:86:00.0=0000:86:00.2", "listed twice"),
        ("0000:86:00.0=" + "+".join(f"0000:86:00.{f}" for f in (1, 2, 3, 4, 5, 6, 7, 1)), "over the limit of 7"),
        (",".join(f"0000:{b:02x}:00.0=0000:{b:02x}:00.1" for b in range(MAX_GPUS + 1)), f"limit of {MAX_GPUS}"),
        ("x" * (MAX_VALUE_CHARS + 1), "characters long"),
    ],
)
def test_parser_refuses_and_names_the_variable(value: str, says: str) -> None:
    with pytest.raises(InputError) as refused:
        parse_companions(VAR, value)
    assert VAR in str(refused.value)
    assert says in str(refused.value)


def test_format_refuses_what_the_parser_would() -> None:
    with pytest.raises(ValueError, match="not another function"):
        format_companions([(A("0000:86:00.0"), [A("0000:87:00.1")])])
    with pytest.raises(ValueError, match="twice"):
        format_companions([(A("0000:86:00.0"), [A("0000:86:00.1")])] * 2)


def test_the_largest_value_formatted_is_parsed() -> None:
    pairs = [
        (A(f"10000:{bus:02x}:1f.0"), [A(f"10000:{bus:02x}:1f.{function}") for function in range(1, 8)])
        for bus in range(MAX_GPUS)
    ]
    value = format_companions(pairs)
    assert value is not None and len(value) <= MAX_VALUE_CHARS
    assert len(parse_companions(VAR, value)) == MAX_GPUS
