#!/usr/bin/env bash
# Second call, at the commit that also takes the filtered group choice beyond 1,000 queries: its block and cap, and
# 8-32 queries (the fewest rows it serves, one program per row), beside the passes of topk_kernel; then, after an
# install, the top-k and search GPU tests. From the repository root with OUT set.
export PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
(cd /tmp && PYTHONPATH=/tmp/p timeout 300 python3 -m tqvec.bench.kernel_ab --out "$OUT/ab2.jsonl" \
  --shapes 128x100 384x100 128x8 384x16 384x32 1536x32 128x10000 \
  --variant filter --variant passes topk.FILTER_MIN_ROWS=1000000000 --variant b2048 topk.FILTER_BLOCK=2048 \
  --variant b8192 topk.FILTER_BLOCK=8192 --variant cap256 topk.FILTER_CAP=256 --variant cap1024 topk.FILTER_CAP=1024 \
  > "$OUT/ab2.log" 2>&1; echo "ab rc=$?")
grep -h 'same_ids' "$OUT/ab2.jsonl" | cut -c1-200
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests2.log" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_topk_kernel.py tests/test_kernels.py -k "topk or search" \
  >> "$OUT/tests2.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/tests2.log"
