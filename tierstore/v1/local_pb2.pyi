from tierstore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESERVE_OK: _ClassVar[ReserveStatus]
    RESERVE_EXISTS: _ClassVar[ReserveStatus]
    RESERVE_FULL: _ClassVar[ReserveStatus]

class PrefetchPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_BEST_EFFORT: _ClassVar[PrefetchPolicy]
    PREFETCH_WAIT: _ClassVar[PrefetchPolicy]
    PREFETCH_TIMEOUT: _ClassVar[PrefetchPolicy]

class PrefetchOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_STARTED: _ClassVar[PrefetchOutcome]
    PREFETCH_DONE: _ClassVar[PrefetchOutcome]
    PREFETCH_LATE: _ClassVar[PrefetchOutcome]
    PREFETCH_CANCELLED: _ClassVar[PrefetchOutcome]
RESERVE_OK: ReserveStatus
RESERVE_EXISTS: ReserveStatus
RESERVE_FULL: ReserveStatus
PREFETCH_BEST_EFFORT: PrefetchPolicy
PREFETCH_WAIT: PrefetchPolicy
PREFETCH_TIMEOUT: PrefetchPolicy
PREFETCH_STARTED: PrefetchOutcome
PREFETCH_DONE: PrefetchOutcome
PREFETCH_LATE: PrefetchOutcome
PREFETCH_CANCELLED: PrefetchOutcome

class AttachRequest(_message.Message):
    __slots__ = ("client_name", "pid")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("client_id", "arena_path", "arena_bytes", "server_version", "max_batch_keys")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    arena_path: str
    arena_bytes: int
    server_version: str
    max_batch_keys: int
    def __init__(self, client_id: _Optional[int] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., server_version: _Optional[str] = ..., max_batch_keys: _Optional[int] = ...) -> None: ...

class RegisterLayoutRequest(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.Layout
    def __init__(self, layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ...) -> None: ...

class RegisterLayoutReply(_message.Message):
    __slots__ = ("layout_id", "block_bytes")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    block_bytes: int
    def __init__(self, layout_id: _Optional[bytes] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("client_id", "layout_id", "keys", "include_peers", "deadline_s", "session")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PEERS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    layout_id: bytes
    keys: bytes
    include_peers: bool
    deadline_s: float
    session: str
    def __init__(self, client_id: _Optional[int] = ..., layout_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., include_peers: _Optional[bool] = ..., deadline_s: _Optional[float] = ..., session: _Optional[str] = ...) -> None: ...

class EndTurnRequest(_message.Message):
    __slots__ = ("client_id", "layout_id", "session", "keys", "num_tokens", "wait", "replica_target", "durable", "durable_timeout_s")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_TARGET_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    DURABLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    layout_id: bytes
    session: str
    keys: bytes
    num_tokens: int
    wait: bool
    replica_target: str
    durable: bool
    durable_timeout_s: float
    def __init__(self, client_id: _Optional[int] = ..., layout_id: _Optional[bytes] = ..., session: _Optional[str] = ..., keys: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., wait: _Optional[bool] = ..., replica_target: _Optional[str] = ..., durable: _Optional[bool] = ..., durable_timeout_s: _Optional[float] = ...) -> None: ...

class EndTurnReply(_message.Message):
    __slots__ = ("replica_target", "replicating", "pushed", "push_s", "push_tail_s", "durable_blocks", "durable", "durable_wait_s", "not_durable_reason")
    REPLICA_TARGET_FIELD_NUMBER: _ClassVar[int]
    REPLICATING_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    PUSH_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_TAIL_S_FIELD_NUMBER: _ClassVar[int]
    DURABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    DURABLE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NOT_DURABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    replica_target: str
    replicating: bool
    pushed: int
    push_s: float
    push_tail_s: float
    durable_blocks: int
    durable: bool
    durable_wait_s: float
    not_durable_reason: str
    def __init__(self, replica_target: _Optional[str] = ..., replicating: _Optional[bool] = ..., pushed: _Optional[int] = ..., push_s: _Optional[float] = ..., push_tail_s: _Optional[float] = ..., durable_blocks: _Optional[int] = ..., durable: _Optional[bool] = ..., durable_wait_s: _Optional[float] = ..., not_durable_reason: _Optional[str] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("statuses", "offsets")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    statuses: bytes
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, statuses: _Optional[bytes] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class FlagsReply(_message.Message):
    __slots__ = ("flags",)
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    flags: bytes
    def __init__(self, flags: _Optional[bytes] = ...) -> None: ...

class CountReply(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("num_hits", "tiers")
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    tiers: bytes
    def __init__(self, num_hits: _Optional[int] = ..., tiers: _Optional[bytes] = ...) -> None: ...

class AcquireReply(_message.Message):
    __slots__ = ("offsets", "tiers")
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    tiers: bytes
    def __init__(self, offsets: _Optional[_Iterable[int]] = ..., tiers: _Optional[bytes] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("client_id", "layout_id", "keys", "policy", "timeout_s")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    layout_id: bytes
    keys: bytes
    policy: PrefetchPolicy
    timeout_s: float
    def __init__(self, client_id: _Optional[int] = ..., layout_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., policy: _Optional[_Union[PrefetchPolicy, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ("outcome", "ready_blocks", "available_blocks")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    outcome: PrefetchOutcome
    ready_blocks: int
    available_blocks: int
    def __init__(self, outcome: _Optional[_Union[PrefetchOutcome, str]] = ..., ready_blocks: _Optional[int] = ..., available_blocks: _Optional[int] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClientInfo(_message.Message):
    __slots__ = ("client_id", "name", "pid", "connected_s", "pins")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_S_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    name: str
    pid: int
    connected_s: float
    pins: int
    def __init__(self, client_id: _Optional[int] = ..., name: _Optional[str] = ..., pid: _Optional[int] = ..., connected_s: _Optional[float] = ..., pins: _Optional[int] = ...) -> None: ...

class ReportLoadRequest(_message.Message):
    __slots__ = ("client_id", "busy_slots", "slots", "queue_len", "wait_s", "prefill_tokens_per_s")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    BUSY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    busy_slots: int
    slots: int
    queue_len: int
    wait_s: float
    prefill_tokens_per_s: float
    def __init__(self, client_id: _Optional[int] = ..., busy_slots: _Optional[int] = ..., slots: _Optional[int] = ..., queue_len: _Optional[int] = ..., wait_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class ReportLoadReply(_message.Message):
    __slots__ = ("host",)
    HOST_FIELD_NUMBER: _ClassVar[int]
    host: _common_pb2.HostLoad
    def __init__(self, host: _Optional[_Union[_common_pb2.HostLoad, _Mapping]] = ...) -> None: ...

class ReportTiersRequest(_message.Message):
    __slots__ = ("client_id", "tiers")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierStat]
    def __init__(self, client_id: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierStat, _Mapping]]] = ...) -> None: ...

class ReportTiersReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatReply(_message.Message):
    __slots__ = ("tiers", "counters", "clients", "version", "uptime_s", "socket_path", "nvme_dir", "load", "failed_workers", "info")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    NVME_DIR_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    FAILED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierStat]
    counters: _containers.ScalarMap[str, int]
    clients: _containers.RepeatedCompositeFieldContainer[ClientInfo]
    version: str
    uptime_s: float
    socket_path: str
    nvme_dir: str
    load: _common_pb2.HostLoad
    failed_workers: _containers.RepeatedScalarFieldContainer[str]
    info: _containers.ScalarMap[str, str]
    def __init__(self, tiers: _Optional[_Iterable[_Union[_common_pb2.TierStat, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., clients: _Optional[_Iterable[_Union[ClientInfo, _Mapping]]] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., socket_path: _Optional[str] = ..., nvme_dir: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.HostLoad, _Mapping]] = ..., failed_workers: _Optional[_Iterable[str]] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...
