from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class OnDefineDomainParams(_message.Message):
    __slots__ = ("domainXML", "vmi")
    DOMAINXML_FIELD_NUMBER: _ClassVar[int]
    VMI_FIELD_NUMBER: _ClassVar[int]
    domainXML: bytes
    vmi: bytes
    def __init__(self, domainXML: _Optional[bytes] = ..., vmi: _Optional[bytes] = ...) -> None: ...

class OnDefineDomainResult(_message.Message):
    __slots__ = ("domainXML",)
    DOMAINXML_FIELD_NUMBER: _ClassVar[int]
    domainXML: bytes
    def __init__(self, domainXML: _Optional[bytes] = ...) -> None: ...

class PreCloudInitIsoParams(_message.Message):
    __slots__ = ("cloudInitNoCloudSource", "vmi", "cloudInitData")
    CLOUDINITNOCLOUDSOURCE_FIELD_NUMBER: _ClassVar[int]
    VMI_FIELD_NUMBER: _ClassVar[int]
    CLOUDINITDATA_FIELD_NUMBER: _ClassVar[int]
    cloudInitNoCloudSource: bytes
    vmi: bytes
    cloudInitData: bytes
    def __init__(self, cloudInitNoCloudSource: _Optional[bytes] = ..., vmi: _Optional[bytes] = ..., cloudInitData: _Optional[bytes] = ...) -> None: ...

class PreCloudInitIsoResult(_message.Message):
    __slots__ = ("cloudInitNoCloudSource", "cloudInitData")
    CLOUDINITNOCLOUDSOURCE_FIELD_NUMBER: _ClassVar[int]
    CLOUDINITDATA_FIELD_NUMBER: _ClassVar[int]
    cloudInitNoCloudSource: bytes
    cloudInitData: bytes
    def __init__(self, cloudInitNoCloudSource: _Optional[bytes] = ..., cloudInitData: _Optional[bytes] = ...) -> None: ...
