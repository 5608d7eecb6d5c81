#!/usr/bin/env bash
# Regenerate tierstore/v1/*_pb2*.py from proto/ (checked in; tests/unit/test_proto_sync.py
# fails when they drift). Needs grpcio-tools (pip install -e '.[test]').
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/tierstore/v1/*.proto
