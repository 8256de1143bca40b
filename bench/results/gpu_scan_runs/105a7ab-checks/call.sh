#!/usr/bin/env bash
# The device call of this folder, run from the repository root with OUT set, the tree imported from a folder of
# links (no install): the H200 table when the card is an H200, then `tqvec bench gpu-scan --check` and
# `tqvec bench index-cuda-check` at d = 128 (the row-tile loop) and d = 384 (the fused int8 stage), 100 / 300 queries.
export PYTHONUNBUFFERED=1
ROOT=$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU"
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
cd /tmp || exit 1
export PYTHONPATH=/tmp/p
if echo "$GPU" | grep -q H200; then
  timeout 150 python3 -m tqvec.bench.gpu_scan --out "$OUT/t1m" --sizes 1000000 --bits 4 --max-seconds 60 \
    > "$OUT/t1m.log" 2>&1; echo "table rc=$?"
  timeout 100 python3 -m tqvec.bench.gpu_scan --out "$OUT/t10m" --sizes 10000000 --dims 128 --bits 4 \
    --max-seconds 90 > "$OUT/t10m.log" 2>&1; echo "10m rc=$?"
fi
timeout 200 python3 -m tqvec.bench.gpu_scan --check > "$OUT/gpu_scan_check.log" 2>&1; echo "check rc=$?"
grep -c " OK$" "$OUT/gpu_scan_check.log"; grep -v " OK$" "$OUT/gpu_scan_check.log" | tail -5
timeout 100 python3 -m tqvec.bench.index_cuda_check --dim 128 --nq 100 --out "$OUT/index_cuda_check_128_100.json" \
  2>&1 | tail -2
timeout 100 python3 -m tqvec.bench.index_cuda_check --dim 384 --nq 300 --out "$OUT/index_cuda_check_384_300.json" \
  2>&1 | tail -2
