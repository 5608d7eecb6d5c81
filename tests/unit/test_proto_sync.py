"""The checked-in generated code must match proto/ (regenerate: proto/generate.sh).

Both halves are checked: the messages (``*_pb2.py``, by descriptor) and the
services (``*_pb2_grpc.py``, by the stubs and server handlers they build, and
byte for byte when the installed grpcio-tools is the one that generated them).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

REPO = Path(__file__).resolve().parents[2]
PROTOS = sorted((REPO / "proto" / "tierstore" / "v1").glob("*.proto"))
_GENERATED_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '([^']*)'$", re.MULTILINE)


def _protoc(*args: str) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    assert protoc.main(["protoc", f"-I{REPO / 'proto'}", *args]) == 0


def _fresh_descriptor(proto: Path, tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    out = tmp_path / "set.pb"
    _protoc(f"--descriptor_set_out={out}", str(proto.relative_to(REPO / "proto")))
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_generated_code_matches_proto(proto: Path, tmp_path: Path) -> None:
    fresh = _fresh_descriptor(proto, tmp_path)
    module = importlib.import_module(f"tierstore.v1.{proto.stem}_pb2")
    checked_in = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    for message in fresh.message_type:  # protoc adds derived json names the Python code omits
        _clear_json_names(message)
    assert checked_in == fresh, f"tierstore/v1/{proto.stem}_pb2.py is stale: regenerate it"


def _clear_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _clear_json_names(nested)


class _RecordingChannel:
    """Stands in for a grpc.Channel: records what a generated Stub asks of it."""

    def __init__(self) -> None:
        self.methods: dict[str, tuple[bool, bool, str]] = {}

    def _record(self, streams: tuple[bool, bool]) -> Any:
        def make(path: str, *, response_deserializer: Any, **_: Any) -> None:
            self.methods[path] = (*streams, _message_name(response_deserializer))

        return make

    def __getattr__(self, name: str) -> Any:
        kinds = {
            "unary_unary": (False, False),
            "unary_stream": (False, True),
            "stream_unary": (True, False),
            "stream_stream": (True, True),
        }
        if name not in kinds:
            raise AttributeError(name)
        return self._record(kinds[name])


class _RecordingServer:
    """Stands in for a grpc.Server: records the handlers a generated
    ``add_*Servicer_to_server`` registers."""

    def __init__(self) -> None:
        self.methods: dict[str, tuple[bool, bool, str]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, h in handlers.items():
            self.methods[f"/{service}/{name}"] = (
                h.request_streaming,
                h.response_streaming,
                _message_name(h.request_deserializer),
            )


def _message_name(from_string: Any) -> str:
    """The full proto name of the message class whose ``FromString`` this is."""
    return str(from_string.__self__.DESCRIPTOR.full_name)


def _services(fresh: descriptor_pb2.FileDescriptorProto) -> dict[str, dict[str, Any]]:
    def full(type_name: str) -> str:
        return type_name.lstrip(".")

    return {
        service.name: {
            f"/{fresh.package}.{service.name}/{m.name}": (
                m.client_streaming,
                m.server_streaming,
                full(m.input_type),
                full(m.output_type),
            )
            for m in service.method
        }
        for service in fresh.service
    }


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_generated_services_match_proto(proto: Path, tmp_path: Path) -> None:
    """Every rpc of the .proto, with its streaming kinds and message types,
    is what the checked-in stub calls and the checked-in server registers;
    no more, no fewer."""
    fresh = _fresh_descriptor(proto, tmp_path)
    grpc_module = importlib.import_module(f"tierstore.v1.{proto.stem}_pb2_grpc")
    stale = f"tierstore/v1/{proto.stem}_pb2_grpc.py is stale: regenerate it"
    declared = _services(fresh)
    generated = {n[: -len("Servicer")] for n in dir(grpc_module) if n.endswith("Servicer")}
    assert generated == set(declared), stale
    for service, methods in declared.items():
        channel, server = _RecordingChannel(), _RecordingServer()
        getattr(grpc_module, f"{service}Stub")(channel)
        servicer = getattr(grpc_module, f"{service}Servicer")()
        getattr(grpc_module, f"add_{service}Servicer_to_server")(servicer, server)
        want_client = {p: (cs, ss, out) for p, (cs, ss, _, out) in methods.items()}
        want_server = {p: (cs, ss, inp) for p, (cs, ss, inp, _) in methods.items()}
        assert channel.methods == want_client, stale
        assert server.methods == want_server, stale


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_generated_grpc_file_is_what_protoc_writes(proto: Path, tmp_path: Path) -> None:
    """Byte for byte, when this grpcio-tools is the version that wrote the file
    (other versions lay the same code out differently)."""
    _protoc(f"--grpc_python_out={tmp_path}", str(proto.relative_to(REPO / "proto")))
    name = f"tierstore/v1/{proto.stem}_pb2_grpc.py"
    fresh, checked_in = (tmp_path / name).read_text(), (REPO / name).read_text()
    fresh_version = _GENERATED_VERSION.search(fresh)
    checked_in_version = _GENERATED_VERSION.search(checked_in)
    if fresh_version and checked_in_version and fresh_version[1] != checked_in_version[1]:
        pytest.skip(
            f"{name} was generated by grpcio-tools {checked_in_version[1]}, "
            f"this one is {fresh_version[1]}"
        )
    assert checked_in == fresh, f"{name} is stale: regenerate it"
