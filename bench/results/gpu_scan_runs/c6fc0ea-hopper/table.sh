#!/usr/bin/env bash
# The table (1M rows at d = 128-1536 and 10M x 128, 4 bits) of the tree as it is, on whatever card comes (the issue's
# acceptance names the H200), from the repository root with OUT set, imported from a folder of links. It ran three
# times: with hoist.patch of ../c6fc0ea-stalls applied (h100_with_hoist), without it (h100_table), and with the
# query tile resident (h100_table_resident, the tree as committed).
export PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
cd /tmp || exit 1
export PYTHONPATH=/tmp/p
timeout 170 python3 -m tqvec.bench.gpu_scan --out "$OUT/t1m" --sizes 1000000 --bits 4 --max-seconds 70 \
  > "$OUT/t1m.log" 2>&1; echo "table rc=$?"
timeout 110 python3 -m tqvec.bench.gpu_scan --out "$OUT/t10m" --sizes 10000000 --dims 128 --bits 4 \
  --max-seconds 90 > "$OUT/t10m.log" 2>&1; echo "10m rc=$?"
