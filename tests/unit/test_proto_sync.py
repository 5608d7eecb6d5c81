"""The checked-in generated code must match proto/ (regenerate: proto/generate.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

REPO = Path(__file__).resolve().parents[2]
PROTOS = sorted((REPO / "proto" / "tierstore" / "v1").glob("*.proto"))


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_generated_code_matches_proto(proto: Path, tmp_path: Path) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path / "set.pb"
    rel = proto.relative_to(REPO / "proto")
    assert (
        protoc.main(["protoc", f"-I{REPO / 'proto'}", f"--descriptor_set_out={out}", str(rel)]) == 0
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    module = __import__(f"tierstore.v1.{proto.stem}_pb2", fromlist=["DESCRIPTOR"])
    checked_in = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    for message in fresh.message_type:  # protoc adds derived json names the Python code omits
        _clear_json_names(message)
    assert checked_in == fresh, f"tierstore/v1/{proto.stem}_pb2.py is stale: regenerate it"


def _clear_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _clear_json_names(nested)
