from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoParams(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResult(_message.Message):
    __slots__ = ("name", "hookPoints", "versions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOOKPOINTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    hookPoints: _containers.RepeatedCompositeFieldContainer[HookPoint]
    versions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., hookPoints: _Optional[_Iterable[_Union[HookPoint, _Mapping]]] = ..., versions: _Optional[_Iterable[str]] = ...) -> None: ...

class HookPoint(_message.Message):
    __slots__ = ("name", "priority")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    priority: int
    def __init__(self, name: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...
