#!/usr/bin/env bash
# The filtered group choice (topk.filtered_topk_kernel) at 30bc81d, from the repository root with OUT set, the tree
# imported from a folder of links: whole searches with it (`filter`), with the passes of topk_kernel as before
# (`passes`), and with it also beyond 1,000 queries, where torch.topk chose the groups (`filter_all`); then the
# topk GPU tests; then, only on an H200, c1b0919-table/call.sh (the table and its checks).
export PYTHONUNBUFFERED=1
ROOT=$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU"
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
(cd /tmp && PYTHONPATH=/tmp/p timeout 300 python3 -m tqvec.bench.kernel_ab --out "$OUT/ab.jsonl" \
  --shapes 128x100 384x100 1536x100 128x10000 384x10000 \
  --variant filter --variant passes topk.FILTER_MIN_ROWS=1000000000 \
  --variant filter_all settings.triton_topk_max_queries=1000000 > "$OUT/ab.log" 2>&1; echo "ab rc=$?")
grep -h 'same_ids\|"search_ms"' "$OUT/ab.jsonl" | cut -c1-200
PYTHONPATH=/tmp/p timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_topk_kernel.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -2 "$OUT/tests.log"
echo "$GPU" | grep -q H200 || exit 0
OUT=$OUT bash "$ROOT/bench/results/gpu_scan_runs/c1b0919-table/call.sh"
