#!/usr/bin/env bash
# The Gluon kernels with two warpgroups per tile (8 warps: half the registers per thread, so twice the warps per
# multiprocessor; ../c1b0919-gluon-stalls found both kernels latency-bound at 2 warps per scheduler), from the
# repository root with OUT set: after an install the Gluon GPU tests at 4 and 8 warps (tests.log), then whole searches
# with 4 warps, 8 warps and the Triton kernel (`tqvec bench kernel-ab`, ab.jsonl).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests.log" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k hopper \
  >> "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/tests.log"
cd /tmp || exit 1
timeout 300 python3 -m tqvec.bench.kernel_ab --out "$OUT/ab.jsonl" \
  --shapes 384x100 768x100 1536x100 384x10000 1536x10000 \
  --variant w4 --variant w8 HOPPER_FUSED_WARPS=8 HOPPER_DECODED_WARPS=8 --variant triton settings.int8_hopper=False \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -h 'same_ids\|"search_ms"' "$OUT/ab.jsonl" | cut -c1-150
