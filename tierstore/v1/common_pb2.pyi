from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier
TIER_PEER: Tier
TIER_REMOTE: Tier

class Layout(_message.Message):
    __slots__ = ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens", "tp_rank", "tp_size", "tenant_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    tp_rank: int
    tp_size: int
    tenant_salt: str
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_tokens: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., tenant_salt: _Optional[str] = ...) -> None: ...

class TierStat(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "num_blocks", "hits", "misses", "bytes_in", "bytes_out", "evictions", "verify_failures", "write_failures", "read_failures")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    READ_FAILURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    bytes_in: int
    bytes_out: int
    evictions: int
    verify_failures: int
    write_failures: int
    read_failures: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., evictions: _Optional[int] = ..., verify_failures: _Optional[int] = ..., write_failures: _Optional[int] = ..., read_failures: _Optional[int] = ...) -> None: ...

class HostLoad(_message.Message):
    __slots__ = ("reported", "busy_slots", "slots", "queue_len", "wait_s", "prefill_tokens_per_s", "age_s")
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    BUSY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    reported: bool
    busy_slots: int
    slots: int
    queue_len: int
    wait_s: float
    prefill_tokens_per_s: float
    age_s: float
    def __init__(self, reported: _Optional[bool] = ..., busy_slots: _Optional[int] = ..., slots: _Optional[int] = ..., queue_len: _Optional[int] = ..., wait_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., age_s: _Optional[float] = ...) -> None: ...
