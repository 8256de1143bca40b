#!/usr/bin/env bash
# Third call: the floor as the k-th largest of 128 strip maxima (`filter`), of 32 or 64 strips, with fewer passed
# candidates kept (`cap128`, `cap256`: slower if more pass), beside the passes of topk_kernel. From the repository
# root with OUT set, the tree imported from a folder of links.
export PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
cd /tmp || exit 1
PYTHONPATH=/tmp/p timeout 300 python3 -m tqvec.bench.kernel_ab --out "$OUT/ab3.jsonl" \
  --shapes 128x100 384x100 128x8 384x32 128x10000 384x10000 \
  --variant filter --variant passes topk.FILTER_MIN_ROWS=1000000000 --variant strips32 topk.FILTER_STRIPS=32 \
  --variant strips64 topk.FILTER_STRIPS=64 --variant cap128 topk.FILTER_CAP=128 --variant cap256 topk.FILTER_CAP=256 \
  > "$OUT/ab3.log" 2>&1; echo "ab rc=$?"
grep -h 'same_ids' "$OUT/ab3.jsonl" | cut -c1-200
