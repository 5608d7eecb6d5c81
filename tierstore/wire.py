"""Conversions between tierstore's types and their protobuf messages, shared
by the local, peer and router services and their clients."""

from __future__ import annotations

from tierstore.keys import KVLayout
from tierstore.loadboard import HostLoadView
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


def host_load_proto(view: HostLoadView) -> common_pb2.HostLoad:
    return common_pb2.HostLoad(
        reported=view.reported, busy_slots=view.busy_slots, slots=view.slots,
        queue_len=view.queue_len, wait_s=view.wait_s,
        prefill_tokens_per_s=view.prefill_tokens_per_s, age_s=view.age_s,
    )  # fmt: skip


def layout_to_proto(layout: KVLayout) -> common_pb2.Layout:
    return common_pb2.Layout(**layout.to_dict())


def load_from_proto(m: common_pb2.HostLoad) -> HostLoadView:
    return HostLoadView(
        reported=m.reported,
        busy_slots=m.busy_slots,
        slots=m.slots,
        queue_len=m.queue_len,
        wait_s=m.wait_s,
        prefill_tokens_per_s=m.prefill_tokens_per_s,
        age_s=m.age_s,
    )
