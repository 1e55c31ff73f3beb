"""The hook benchmark's floors (bench/hook_floor_server.py): the plain floor answers the call's own domain,
the answer floor parses the call's domain but answers the document it was given."""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest
from lxml import etree

from bench.hook_floor_server import FloorCallbacks
from schemas.generated.kubevirt.hooks import v1alpha3_pb2

CALL = b"<domain type='kvm'><name>a</name><devices/></domain>"
ANSWER = b"<domain type='kvm'><name>a</name><devices><hostdev mode='subsystem'/></devices></domain>"
CONTEXT = cast(grpc.ServicerContext, None)


def define(callbacks: FloorCallbacks, domain: bytes) -> bytes:
    result: Any = callbacks.OnDefineDomain(v1alpha3_pb2.OnDefineDomainParams(domainXML=domain), CONTEXT)
    return bytes(result.domainXML)


def test_the_floor_answers_the_calls_domain_and_the_answer_floor_its_answer() -> None:
    plain = define(FloorCallbacks(), CALL)
    assert etree.tostring(etree.fromstring(plain)) == etree.tostring(etree.fromstring(CALL))
    answered = define(FloorCallbacks(answer=ANSWER), CALL)
    assert b'<hostdev mode="subsystem"/>' in answered
    assert define(FloorCallbacks(answer=ANSWER), CALL) == answered  # the same bytes on every call


def test_the_answer_floor_still_parses_the_call() -> None:
    with pytest.raises(etree.XMLSyntaxError):
        define(FloorCallbacks(answer=ANSWER), b"<domain>")
