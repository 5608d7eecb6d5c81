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

class BlockOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_OP_UNSPECIFIED: _ClassVar[BlockOp]
    BLOCK_OP_ADD: _ClassVar[BlockOp]
    BLOCK_OP_REMOVE: _ClassVar[BlockOp]
    BLOCK_OP_RESET: _ClassVar[BlockOp]
    BLOCK_OP_SNAPSHOT: _ClassVar[BlockOp]
    BLOCK_OP_SYNCED: _ClassVar[BlockOp]
    BLOCK_OP_HEARTBEAT: _ClassVar[BlockOp]
COMPRESSION_NONE: Compression
COMPRESSION_ZSTD_BYTESPLIT: Compression
BLOCK_OP_UNSPECIFIED: BlockOp
BLOCK_OP_ADD: BlockOp
BLOCK_OP_REMOVE: BlockOp
BLOCK_OP_RESET: BlockOp
BLOCK_OP_SNAPSHOT: BlockOp
BLOCK_OP_SYNCED: BlockOp
BLOCK_OP_HEARTBEAT: BlockOp

class PeerKeysRequest(_message.Message):
    __slots__ = ("layout", "keys")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.Layout
    keys: bytes
    def __init__(self, layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., keys: _Optional[bytes] = ...) -> None: ...

class PrepositionReply(_message.Message):
    __slots__ = ("queued", "available_blocks")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    queued: bool
    available_blocks: int
    def __init__(self, queued: _Optional[bool] = ..., available_blocks: _Optional[int] = ...) -> None: ...

class PeerLookupReply(_message.Message):
    __slots__ = ("num_hits", "tiers", "load", "nvme_read_bytes_per_s", "peer_fetch_bytes_per_s")
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NVME_READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    tiers: bytes
    load: _common_pb2.HostLoad
    nvme_read_bytes_per_s: float
    peer_fetch_bytes_per_s: float
    def __init__(self, num_hits: _Optional[int] = ..., tiers: _Optional[bytes] = ..., load: _Optional[_Union[_common_pb2.HostLoad, _Mapping]] = ..., nvme_read_bytes_per_s: _Optional[float] = ..., peer_fetch_bytes_per_s: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("offered", "missing", "imported", "rejected", "import_s", "bytes", "tail_s")
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    IMPORTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    IMPORT_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TAIL_S_FIELD_NUMBER: _ClassVar[int]
    offered: int
    missing: int
    imported: int
    rejected: int
    import_s: float
    bytes: int
    tail_s: float
    def __init__(self, offered: _Optional[int] = ..., missing: _Optional[int] = ..., imported: _Optional[int] = ..., rejected: _Optional[int] = ..., import_s: _Optional[float] = ..., bytes: _Optional[int] = ..., tail_s: _Optional[float] = ...) -> None: ...

class PeerStatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerStatReply(_message.Message):
    __slots__ = ("group", "address", "tiers", "replica_bytes", "replica_budget_bytes", "layouts")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    group: str
    address: str
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierStat]
    replica_bytes: int
    replica_budget_bytes: int
    layouts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Layout]
    def __init__(self, group: _Optional[str] = ..., address: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierStat, _Mapping]]] = ..., replica_bytes: _Optional[int] = ..., replica_budget_bytes: _Optional[int] = ..., layouts: _Optional[_Iterable[_Union[_common_pb2.Layout, _Mapping]]] = ...) -> None: ...

class WatchBlocksRequest(_message.Message):
    __slots__ = ("epoch", "from_seq")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    from_seq: int
    def __init__(self, epoch: _Optional[int] = ..., from_seq: _Optional[int] = ...) -> None: ...

class BlockEvents(_message.Message):
    __slots__ = ("epoch", "seq", "op", "tier", "keys", "load")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seq: int
    op: BlockOp
    tier: _common_pb2.Tier
    keys: bytes
    load: _common_pb2.HostLoad
    def __init__(self, epoch: _Optional[int] = ..., seq: _Optional[int] = ..., op: _Optional[_Union[BlockOp, str]] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., keys: _Optional[bytes] = ..., load: _Optional[_Union[_common_pb2.HostLoad, _Mapping]] = ...) -> None: ...
