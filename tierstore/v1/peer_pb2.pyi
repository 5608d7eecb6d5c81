from tierstore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_ZSTD_BYTESPLIT: _ClassVar[Compression]
COMPRESSION_NONE: Compression
COMPRESSION_ZSTD_BYTESPLIT: Compression

class PeerKeysRequest(_message.Message):
    __slots__ = ("layout", "keys")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.Layout
    keys: bytes
    def __init__(self, layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., keys: _Optional[bytes] = ...) -> None: ...

class PeerLookupReply(_message.Message):
    __slots__ = ("num_hits", "tiers")
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    tiers: bytes
    def __init__(self, num_hits: _Optional[int] = ..., tiers: _Optional[bytes] = ...) -> None: ...

class OpenFetchRequest(_message.Message):
    __slots__ = ("layout", "keys", "compression")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.Layout
    keys: bytes
    compression: Compression
    def __init__(self, layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., keys: _Optional[bytes] = ..., compression: _Optional[_Union[Compression, str]] = ...) -> None: ...

class OpenFetchReply(_message.Message):
    __slots__ = ("ticket", "data_address", "num_blocks", "tls")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    data_address: str
    num_blocks: int
    tls: bool
    def __init__(self, ticket: _Optional[bytes] = ..., data_address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., tls: _Optional[bool] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("layout", "keys", "source", "session", "deadline_s")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.Layout
    keys: bytes
    source: str
    session: str
    deadline_s: float
    def __init__(self, layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., keys: _Optional[bytes] = ..., source: _Optional[str] = ..., session: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class ReplicateReply(_message.Message):
    __slots__ = ("offered", "missing", "imported", "rejected", "import_s", "bytes")
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    IMPORTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    IMPORT_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    offered: int
    missing: int
    imported: int
    rejected: int
    import_s: float
    bytes: int
    def __init__(self, offered: _Optional[int] = ..., missing: _Optional[int] = ..., imported: _Optional[int] = ..., rejected: _Optional[int] = ..., import_s: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class PeerStatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerStatReply(_message.Message):
    __slots__ = ("group", "address", "tiers", "replica_bytes", "replica_budget_bytes")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    group: str
    address: str
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierStat]
    replica_bytes: int
    replica_budget_bytes: int
    def __init__(self, group: _Optional[str] = ..., address: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierStat, _Mapping]]] = ..., replica_bytes: _Optional[int] = ..., replica_budget_bytes: _Optional[int] = ...) -> None: ...
