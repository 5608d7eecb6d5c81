#!/usr/bin/env bash
# Fill bench/gpu_wheels/ with the wheels bench/gpu_check.sh installs on the
# GPU machine, which has Python 3.12, torch, transformers, grpcio, protobuf,
# prometheus-client and numpy, but nothing else and no network.
#
#   bash bench/gpu/wheels.sh [DEST]     # here, with network; DEST: bench/gpu_wheels
#
# cp312 manylinux x86_64 wheels (or pure-Python ones), no dependencies pulled
# in: each name below is listed on purpose. Versions are the ones this
# machine's environment tests with (pip's view of it), so the GPU runs what
# CI runs; a package not installed here is taken at its newest version.
# grpcio and protobuf are carried too: the check installs them only where the
# GPU machine's own are older than pyproject.toml requires. The folder is
# ignored by git; the device tool carries it (carry: bench/gpu_wheels), and it
# must stay under 64 MiB with the rest of what is carried.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${1:-$ROOT/bench/gpu_wheels}
PY=${PYTHON:-python3}
LIMIT_BYTES=$((48 << 20)) # leaves room under the 64 MiB carry for the tree itself

# the project's runtime needs the GPU machine lacks, then what the check runs
PACKAGES=(blake3 lmdb zstandard grpcio-health-checking grpcio protobuf
  pytest pluggy iniconfig pygments pytest-timeout packaging setuptools)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name")
  spec=$name${version:+==$version}
  echo "gpu_wheels: $spec"
  "$PY" -m pip download --quiet --only-binary=:all: --no-deps \
    --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any \
    -d "$DEST" "$spec"
done

total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
ls -l "$DEST"/*.whl
(cd "$DEST" && sha256sum ./*.whl >SHA256SUMS)
echo "gpu_wheels: ${#PACKAGES[@]} wheels, $((total >> 10)) KiB in $DEST"
if ((total > LIMIT_BYTES)); then
  echo "gpu_wheels: $total bytes exceed $LIMIT_BYTES: the device carry is 64 MiB in all" >&2
  exit 1
fi
