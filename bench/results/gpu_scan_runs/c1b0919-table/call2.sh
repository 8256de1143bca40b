#!/usr/bin/env bash
# Second call: gluon_vs_triton.py (the Gluon and Triton stage 1 of the same GPU indexes at 600 queries), from the
# repository root with OUT set, the tree imported from a folder of links.
export PYTHONUNBUFFERED=1
ROOT=$PWD
HERE=$ROOT/bench/results/gpu_scan_runs/c1b0919-table
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
cd /tmp || exit 1
export PYTHONPATH=/tmp/p
timeout 300 python3 "$HERE/gluon_vs_triton.py" > "$OUT/gluon_vs_triton.jsonl" 2> "$OUT/gluon_vs_triton.err"
echo "rc=$?"; cat "$OUT/gluon_vs_triton.jsonl"; tail -3 "$OUT/gluon_vs_triton.err"
