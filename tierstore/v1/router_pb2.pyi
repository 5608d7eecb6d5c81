from tierstore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("layout", "token_ids", "keys", "num_tokens", "hosts", "session", "current_host", "loads", "preposition")
    class LoadsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.HostLoad
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.HostLoad, _Mapping]] = ...) -> None: ...
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CURRENT_HOST_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    PREPOSITION_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.Layout
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    keys: bytes
    num_tokens: int
    hosts: _containers.RepeatedScalarFieldContainer[str]
    session: str
    current_host: str
    loads: _containers.MessageMap[str, _common_pb2.HostLoad]
    preposition: bool
    def __init__(self, layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., keys: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., hosts: _Optional[_Iterable[str]] = ..., session: _Optional[str] = ..., current_host: _Optional[str] = ..., loads: _Optional[_Mapping[str, _common_pb2.HostLoad]] = ..., preposition: _Optional[bool] = ...) -> None: ...

class HostCost(_message.Message):
    __slots__ = ("host", "reachable", "error", "ttft_s", "queue_s", "load_s", "prefill_s", "hbm_blocks", "dram_blocks", "nvme_blocks", "peer_blocks", "held_blocks", "reused_tokens", "prefill_tokens", "source", "load")
    HOST_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    HBM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NVME_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    host: str
    reachable: bool
    error: str
    ttft_s: float
    queue_s: float
    load_s: float
    prefill_s: float
    hbm_blocks: int
    dram_blocks: int
    nvme_blocks: int
    peer_blocks: int
    held_blocks: int
    reused_tokens: int
    prefill_tokens: int
    source: str
    load: _common_pb2.HostLoad
    def __init__(self, host: _Optional[str] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., ttft_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., load_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., hbm_blocks: _Optional[int] = ..., dram_blocks: _Optional[int] = ..., nvme_blocks: _Optional[int] = ..., peer_blocks: _Optional[int] = ..., held_blocks: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., source: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.HostLoad, _Mapping]] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("hosts", "spill_host", "num_blocks", "num_tokens", "prepositioned_host")
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    SPILL_HOST_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREPOSITIONED_HOST_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostCost]
    spill_host: str
    num_blocks: int
    num_tokens: int
    prepositioned_host: str
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostCost, _Mapping]]] = ..., spill_host: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., prepositioned_host: _Optional[str] = ...) -> None: ...
