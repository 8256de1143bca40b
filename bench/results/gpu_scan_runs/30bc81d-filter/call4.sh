#!/usr/bin/env bash
# Fourth call (the filter's floor over 32 strips, its scratch at most the row's length rounded up): after an
# install the top-k GPU tests, then c1b0919-table/call.sh (the table of 1M rows at d = 128-1536 and of 10M x 128,
# `gpu-scan --check`, and `index-cuda-check` at d = 384 with 600 queries) on whatever card comes. From the repository
# root with OUT set.
export PYTHONUNBUFFERED=1
ROOT=$PWD
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests4.log" 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_topk_kernel.py >> "$OUT/tests4.log" 2>&1
echo "tests rc=$?"; tail -1 "$OUT/tests4.log"
OUT=$OUT bash "$ROOT/bench/results/gpu_scan_runs/c1b0919-table/call.sh"
