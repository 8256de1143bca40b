#!/usr/bin/env bash
# Fifth device call: the query tile resident in shared memory (HOPPER_RESIDENT_QUERY_STEPS), from the repository root
# with OUT set: the Gluon stage's GPU tests after an install, then whole searches with it, without it
# (HOPPER_RESIDENT_QUERY_STEPS=0: the query ring) and with the Triton kernel (`tqvec bench kernel-ab`).
export PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests.log" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k hopper tests/test_hopper_stage.py \
  >> "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/tests.log"
cd /tmp || exit 1
timeout 200 python3 -m tqvec.bench.kernel_ab --out "$OUT/resident_ab.jsonl" --shapes 384x100 256x100 384x300 \
  --variant resident --variant ring HOPPER_RESIDENT_QUERY_STEPS=0 --variant triton HOPPER_MIN_STEPS=99 \
  > "$OUT/resident_ab.log" 2>&1; echo "ab rc=$?"
grep same_ids "$OUT/resident_ab.jsonl"
