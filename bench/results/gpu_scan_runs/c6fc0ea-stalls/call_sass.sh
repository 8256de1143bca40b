#!/usr/bin/env bash
# The second device call at c6fc0ea: warp stalls sampled per SASS instruction of the fused int8 stage 1 at
# 1M x 384 with 100 queries (ncu SourceCounters, source page as SASS), from the repository root with OUT set.
export PYTHONUNBUFFERED=1
ROOT=$PWD
SHAPES=$ROOT/bench/results/gpu_scan_runs/fce8906-flat-loop/ncu_shapes.py
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
cd /tmp || exit 1
export PYTHONPATH=/tmp/p
timeout 200 ncu --clock-control none --profile-from-start off -k regex:group_max --section SourceCounters \
  --section WarpStateStats --import-source no --page source --print-source sass --csv \
  python3 "$SHAPES" 384 100 ncu > "$OUT/ncu_sass_384_100.csv" 2> "$OUT/ncu_sass.err"; echo "ncu rc=$?"
tail -3 "$OUT/ncu_sass.err"; wc -c "$OUT/ncu_sass_384_100.csv"; head -c 1500 "$OUT/ncu_sass_384_100.csv"
