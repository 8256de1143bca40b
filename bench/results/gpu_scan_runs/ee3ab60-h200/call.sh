#!/usr/bin/env bash
# At ee3ab60, from the repository root with OUT set. First the Gluon GPU tests (the two 768-channel cases then run as
# on one multiprocessor, never yet on a GPU), on any card. Then, only on an H200 (issue 18 names it): the table of
# c1b0919-table/call.sh (1M rows at d = 128-1536 and 10M x 128, 4 bits), `gpu-scan --check` and `index-cuda-check` at
# d = 384 with 600 queries, the tree imported from a folder of links.
export PYTHONUNBUFFERED=1
ROOT=$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests.log" 2>&1
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_hopper_stage.py \
    -k "hopper or int8" >> "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/tests.log"
fi
echo "$GPU" | grep -q H200 || exit 0
OUT=$OUT bash "$ROOT/bench/results/gpu_scan_runs/c1b0919-table/call.sh"
