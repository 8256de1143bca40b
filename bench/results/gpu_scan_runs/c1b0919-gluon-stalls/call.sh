#!/usr/bin/env bash
# Where the Gluon stage 1 waits (kernels/hopper_stage.py), from the repository root with OUT set, the tree imported
# from a folder of links: at 1M x 384 with 100 queries (group_max_kernel, fused) and 10,000 queries
# (decoded_group_max_kernel), ncu's stall reasons per issued instruction and warp samples per SASS instruction, as
# ../c6fc0ea-stalls did for the Triton kernel.
export PYTHONUNBUFFERED=1
ROOT=$PWD
SHAPES=$ROOT/bench/results/gpu_scan_runs/fce8906-flat-loop/ncu_shapes.py
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
cd /tmp || exit 1
export PYTHONPATH=/tmp/p
for nq in 100 10000; do
  timeout 150 ncu --clock-control none --profile-from-start off -k regex:group_max \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.sum,smsp__inst_executed.sum,gpu__time_duration.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__warps_active.avg.pct_of_peak_sustained_active" \
    --csv --page raw python3 "$SHAPES" 384 $nq ncu > "$OUT/ncu_stalls_384_$nq.csv" 2>> "$OUT/ncu.err"
  echo "stalls $nq rc=$?"
  timeout 150 ncu --clock-control none --profile-from-start off -k regex:group_max --section SourceCounters \
    --section WarpStateStats --import-source no --page source --print-source sass --csv \
    python3 "$SHAPES" 384 $nq ncu > "$OUT/ncu_sass_384_$nq.csv" 2>> "$OUT/ncu.err"
  echo "sass $nq rc=$?"
done
tail -3 "$OUT/ncu.err"; wc -c "$OUT"/*.csv
