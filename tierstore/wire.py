"""Conversions between tierstore's types and their protobuf messages, shared
by the local, peer and router services and their clients."""

from __future__ import annotations

import dataclasses

from tierstore.keys import KVLayout
from tierstore.load import HostLoadView
from tierstore.v1 import common_pb2


def layout_from_proto(msg: common_pb2.Layout) -> KVLayout:
    return KVLayout(
        model=msg.model,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        block_tokens=msg.block_tokens,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
        tenant_salt=msg.tenant_salt,
    )


# HostLoadView and the HostLoad message have the same fields (names, meaning).
_HOST_LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(HostLoadView))


def host_load_proto(view: HostLoadView) -> common_pb2.HostLoad:
    return common_pb2.HostLoad(**{name: getattr(view, name) for name in _HOST_LOAD_FIELDS})


def layout_to_proto(layout: KVLayout) -> common_pb2.Layout:
    return common_pb2.Layout(**layout.to_dict())


def load_from_proto(m: common_pb2.HostLoad) -> HostLoadView:
    return HostLoadView(**{name: getattr(m, name) for name in _HOST_LOAD_FIELDS})
