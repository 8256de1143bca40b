#!/usr/bin/env bash
# With the session's last device minutes: only on an H200 (else it stops at once), the table's cells at d = 128 and
# 384 (1M rows, 4 bits; the thinnest margins there at d045997), from the repository root with OUT set, the tree
# imported from a folder of links.
export PYTHONUNBUFFERED=1
ROOT=$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU"
echo "$GPU" | grep -q H200 || exit 0
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
cd /tmp || exit 1
export PYTHONPATH=/tmp/p
timeout 120 python3 -m tqvec.bench.gpu_scan --out "$OUT/t1m" --sizes 1000000 --dims 128 384 --bits 4 \
  --max-seconds 80 > "$OUT/t1m.log" 2>&1; echo "table rc=$?"
