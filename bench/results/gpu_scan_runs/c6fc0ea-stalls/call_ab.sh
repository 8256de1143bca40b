#!/usr/bin/env bash
# The third device call at c6fc0ea: hoist.patch (the int8 stage 1's epilogue loads before the channel loop) against
# the tree without it, whole 4-bit searches by `gpu_scan` in alternating processes (base, new, new, base), then
# `--check` and `index-cuda-check` on the new tree, then 128-row groups (kernel-ab) on the new tree. From the
# repository root with OUT set; the tree imported from folders of links (no install).
export PYTHONUNBUFFERED=1
ROOT=$PWD
HERE=$ROOT/bench/results/gpu_scan_runs/c6fc0ea-stalls
nvidia-smi --query-gpu=name --format=csv,noheader
for t in new base; do
  mkdir -p /tmp/$t/tqvec
  for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/$t/tqvec/; done
  for d in bench datasets; do ln -sfn "$ROOT/$d" /tmp/$t/tqvec/$d; done
done
ln -sfn "$ROOT/kernels" /tmp/new/tqvec/kernels
cp -r "$ROOT/kernels" /tmp/base_kernels && (cd /tmp/base_kernels && patch -s -p2 -R < "$HERE/hoist.patch") && \
  ln -sfn /tmp/base_kernels /tmp/base/tqvec/kernels
cd /tmp || exit 1
for t in base new new base; do
  PYTHONPATH=/tmp/$t timeout 150 python3 -m tqvec.bench.gpu_scan --out "$OUT/$t-$SECONDS" --sizes 1000000 \
    --dims 128 384 768 1536 --nqs 100 10000 --bits 4 --max-seconds 100 > "$OUT/$t-$SECONDS.log" 2>&1
  echo "$t rc=$?"
done
export PYTHONPATH=/tmp/new
timeout 200 python3 -m tqvec.bench.gpu_scan --check > "$OUT/gpu_scan_check.log" 2>&1; echo "check rc=$?"
grep -c " OK$" "$OUT/gpu_scan_check.log"; grep -v " OK$" "$OUT/gpu_scan_check.log" | tail -5
timeout 100 python3 -m tqvec.bench.index_cuda_check --dim 128 --nq 100 --out "$OUT/index_cuda_check_128_100.json" \
  2>&1 | tail -2
timeout 100 python3 -m tqvec.bench.index_cuda_check --dim 384 --nq 300 --out "$OUT/index_cuda_check_384_300.json" \
  2>&1 | tail -2
timeout 120 python3 -m tqvec.bench.kernel_ab --out "$OUT/groups_ab.jsonl" --shapes 384x100 768x100 \
  --variant base --variant g128 INT8_GROUP_ROWS=128 > "$OUT/groups_ab.log" 2>&1; echo "ab rc=$?"
