#!/usr/bin/env bash
# One device call, from the repository root with OUT set: the table of ../c6fc0ea-hopper/table.sh (t1m, t10m), then
# after an install the int8 and Gluon GPU tests, and whole searches with the Gluon stage 1 beside the Triton one
# (`tqvec bench kernel-ab`, varying SearchSettings.int8_hopper) into tests.log / ab.jsonl; then at 10,000 queries,
# where rows are decoded once, the fused stage 1 (Gluon and Triton) beside it (INT8_FUSED_MAX_QUERIES raised) into
# ab10k.jsonl. The tree derives the Gluon kernel's blocks per multiprocessor from its compiled kernel (ops._wave_lanes).
export PYTHONUNBUFFERED=1
ROOT=$PWD
bash bench/results/gpu_scan_runs/c6fc0ea-hopper/table.sh
cat "$OUT/t10m.log" >> "$OUT/t1m.log" && rm "$OUT/t10m.log"  # files back are counted
cd "$ROOT" || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests.log" 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "hopper or int8" \
  tests/test_hopper_stage.py >> "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/tests.log"
cd /tmp || exit 1
timeout 120 python3 -m tqvec.bench.kernel_ab --out "$OUT/ab.jsonl" --shapes 384x100 1536x100 --variant gluon \
  --variant triton settings.int8_hopper=False >> "$OUT/tests.log" 2>&1; echo "ab rc=$?"
grep same_ids "$OUT/ab.jsonl"
timeout 150 python3 -m tqvec.bench.kernel_ab --out "$OUT/ab10k.jsonl" --shapes 384x10000 1536x10000 --rounds 1 \
  --variant decoded --variant gluon_fused INT8_FUSED_MAX_QUERIES=20000 \
  --variant triton_fused INT8_FUSED_MAX_QUERIES=20000 settings.int8_hopper=False >> "$OUT/tests.log" 2>&1
echo "ab10k rc=$?"; grep -h '"search_ms"' "$OUT/ab10k.jsonl" | cut -c1-200
