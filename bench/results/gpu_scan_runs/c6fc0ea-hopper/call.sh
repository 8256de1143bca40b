#!/usr/bin/env bash
# Device call for the Gluon stage 1 (kernels/hopper_stage.py), from the repository root with OUT set, the tree
# installed for its GPU tests, then imported from a folder of links: whole searches with and without it
# (`tqvec bench kernel-ab`, the Triton kernel by HOPPER_MIN_STEPS=99), then `--check` and `index-cuda-check`.
export PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/p/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests.log" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "hopper or int8" tests/test_hopper_stage.py \
  >> "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests.log"
export PYTHONPATH=/tmp/p
cd /tmp || exit 1
timeout 300 python3 -m tqvec.bench.kernel_ab --out "$OUT/hopper_ab.jsonl" \
  --shapes 384x100 768x100 1024x100 1536x100 384x300 1536x300 256x100 \
  --variant hopper --variant triton HOPPER_MIN_STEPS=99 > "$OUT/hopper_ab.log" 2>&1; echo "ab rc=$?"
grep same_ids "$OUT/hopper_ab.jsonl"
{ timeout 200 python3 -m tqvec.bench.gpu_scan --check; echo "check rc=$?"
  timeout 100 python3 -m tqvec.bench.index_cuda_check --dim 384 --nq 300 --out "$OUT/index_cuda_check_384_300.json"
  echo "index rc=$?"; } > "$OUT/checks.log" 2>&1
grep -c " OK$" "$OUT/checks.log"; grep "rc=" "$OUT/checks.log"; grep -v " OK$" "$OUT/checks.log" | grep -iv "^{" | tail -4
