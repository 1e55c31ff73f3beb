from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeContext(_message.Message):
    __slots__ = ("node_name",)
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    def __init__(self, node_name: _Optional[str] = ...) -> None: ...

class ExecuteNodeHookRequest(_message.Message):
    __slots__ = ("hookPoint", "vmi", "node_context")
    HOOKPOINT_FIELD_NUMBER: _ClassVar[int]
    VMI_FIELD_NUMBER: _ClassVar[int]
    NODE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    hookPoint: str
    vmi: bytes
    node_context: NodeContext
    def __init__(self, hookPoint: _Optional[str] = ..., vmi: _Optional[bytes] = ..., node_context: _Optional[_Union[NodeContext, _Mapping]] = ...) -> None: ...

class ExecuteNodeHookResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SidecarContext(_message.Message):
    __slots__ = ("invocation_context",)
    INVOCATION_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    invocation_context: str
    def __init__(self, invocation_context: _Optional[str] = ...) -> None: ...

class MutateDomainRequest(_message.Message):
    __slots__ = ("domain_type", "domain", "vmi", "sidecar_context")
    DOMAIN_TYPE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    VMI_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    domain_type: str
    domain: bytes
    vmi: bytes
    sidecar_context: SidecarContext
    def __init__(self, domain_type: _Optional[str] = ..., domain: _Optional[bytes] = ..., vmi: _Optional[bytes] = ..., sidecar_context: _Optional[_Union[SidecarContext, _Mapping]] = ...) -> None: ...

class MutateDomainResponse(_message.Message):
    __slots__ = ("domain",)
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    domain: bytes
    def __init__(self, domain: _Optional[bytes] = ...) -> None: ...
