#!/usr/bin/env bash
# The first device call at c6fc0ea, from the repository root with OUT set, the tree imported from a folder of links:
# on an H200 the acceptance table (../105a7ab-checks/call.sh); on any card the stall reasons of the fused int8 stage 1
# at 1M x 384 with 100 queries (ncu, warp-state sampling per reason) and the kernel times of that search.
export PYTHONUNBUFFERED=1
ROOT=$PWD
SHAPES=$ROOT/bench/results/gpu_scan_runs/fce8906-flat-loop/ncu_shapes.py
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU"
if echo "$GPU" | grep -q H200; then bash "$ROOT/bench/results/gpu_scan_runs/105a7ab-checks/call.sh"; fi
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
cd /tmp || exit 1
export PYTHONPATH=/tmp/p
timeout 120 ncu --clock-control none --profile-from-start off -k regex:group_max \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.sum,smsp__inst_executed.sum,gpu__time_duration.sum" \
  --csv --page raw python3 "$SHAPES" 384 100 ncu > "$OUT/ncu_stalls_384_100.csv" 2> "$OUT/ncu.err"; echo "ncu rc=$?"
timeout 60 python3 "$SHAPES" 384 100 prof > "$OUT/prof_384_100.log" 2>&1; echo "prof rc=$?"
tail -3 "$OUT/ncu.err"
