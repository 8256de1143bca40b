#!/usr/bin/env bash
# Gluon stage 1 over decoded rows (hopper_stage.decoded_group_max_kernel), from the repository root with OUT set:
# after an install the int8 and Gluon GPU tests (tests.log), then whole searches at 10,000 queries with it (3-stage
# ring), with a 4-stage ring and with the Triton kernel, and at 384 x 100 (fused Gluon kernel, refactored) beside
# the Triton kernel (`tqvec bench kernel-ab`, ab.jsonl).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests.log" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "hopper or int8" \
  tests/test_hopper_stage.py >> "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/tests.log"
cd /tmp || exit 1
timeout 300 python3 -m tqvec.bench.kernel_ab --out "$OUT/ab.jsonl" --shapes 384x100 384x10000 768x10000 1536x10000 \
  --variant gluon --variant s4 HOPPER_DECODED_STAGES=4 --variant triton settings.int8_hopper=False \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -h 'same_ids\|"search_ms"' "$OUT/ab.jsonl" | cut -c1-190
