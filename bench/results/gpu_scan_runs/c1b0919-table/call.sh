#!/usr/bin/env bash
# The final device call at c1b0919's kernels, from the repository root with OUT set, the tree imported from a folder of
# links: the table (1M rows at d = 128-1536, 10M x 128, 4 bits) on whatever card comes (the issue names the H200),
# then `tqvec bench gpu-scan --check` and `tqvec bench index-cuda-check` at d = 384 with 600 queries (rows decoded
# once: the decoded Gluon kernel).
export PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
cd /tmp || exit 1
export PYTHONPATH=/tmp/p
timeout 200 python3 -m tqvec.bench.gpu_scan --out "$OUT/t1m" --sizes 1000000 --bits 4 --max-seconds 110 \
  > "$OUT/t1m.log" 2>&1; echo "table rc=$?"
timeout 110 python3 -m tqvec.bench.gpu_scan --out "$OUT/t10m" --sizes 10000000 --dims 128 --bits 4 \
  --max-seconds 90 >> "$OUT/t1m.log" 2>&1; echo "10m rc=$?"
timeout 150 python3 -m tqvec.bench.gpu_scan --check > "$OUT/checks.log" 2>&1; echo "check rc=$?"
grep -c " OK$" "$OUT/checks.log"; grep -v " OK$" "$OUT/checks.log" | tail -5
timeout 100 python3 -m tqvec.bench.index_cuda_check --dim 384 --nq 600 --out "$OUT/index_cuda_check_384_600.json" \
  2>&1 | tail -2
