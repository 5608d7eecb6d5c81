#!/usr/bin/env bash
# The one-shot GPU device check (issue 17): install the carried wheels and the
# project in a virtual environment over the machine's packages, run the
# cuda-marked tests, then the GPU benchmark (bench/gpu/copy_path.py); report.json and
# the logs go to OUTDIR.
#
#   bash bench/gpu/wheels.sh               # first, here: fills bench/gpu_wheels/
#   bash bench/gpu_check.sh OUTDIR         # on the GPU machine (a dry run elsewhere)
#
# Ends within 6 minutes: the steps share a 330 s budget (GPU_CHECK_BUDGET_S)
# and this wrapper stops everything at 345 s (a kill 10 s later at worst).
# Without a GPU it runs end to end and reports every CUDA part as skipped,
# with why. See bench/gpu/check.py.
set -uo pipefail

OUT=${1:?usage: bash bench/gpu_check.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$(command -v python3 || command -v python)}
BUDGET_S=${GPU_CHECK_BUDGET_S:-330}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd) # before the cd below
echo "gpu_check: $PY ($("$PY" -V 2>&1)), budget ${BUDGET_S} s, report in $OUT"
cd "$ROOT" # the check runs as a module of the checkout: python -m bench.gpu.check
timeout --kill-after=10 345 "$PY" -m bench.gpu.check "$OUT" --budget-s "$BUDGET_S"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "gpu_check: stopped at the 6-minute limit; $OUT/report.json holds the steps that ended"
fi
exit "$rc"
