#!/usr/bin/env bash
# Second device call for the Gluon stage 1, now persistent (one wave of programs looping over row tiles, copies
# running ahead across them), from the repository root with OUT set: its GPU tests after an install, whole searches
# with and without it (`tqvec bench kernel-ab`, the Triton kernel by HOPPER_MIN_STEPS=99), `--check` and
# `index-cuda-check`, then ../c6fc0ea-stalls/hoist.patch against the tree without it at d = 128 and 1536
# (`gpu_scan` in alternating processes: base, new, new, base).
export PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests.log" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "hopper or int8" tests/test_hopper_stage.py \
  >> "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests.log"
for t in new base; do
  mkdir -p /tmp/$t/tqvec
  for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/$t/tqvec/; done
  for d in bench datasets; do ln -sfn "$ROOT/$d" /tmp/$t/tqvec/$d; done
done
ln -sfn "$ROOT/kernels" /tmp/new/tqvec/kernels
cp -r "$ROOT/kernels" /tmp/base_kernels && (cd /tmp/base_kernels && patch -s -p2 -R \
  < "$ROOT/bench/results/gpu_scan_runs/c6fc0ea-stalls/hoist.patch") && ln -sfn /tmp/base_kernels /tmp/base/tqvec/kernels
cd /tmp || exit 1
PYTHONPATH=/tmp/new timeout 300 python3 -m tqvec.bench.kernel_ab --out "$OUT/hopper_ab.jsonl" \
  --shapes 384x100 768x100 1536x100 384x300 256x100 --variant hopper --variant triton HOPPER_MIN_STEPS=99 \
  > "$OUT/hopper_ab.log" 2>&1; echo "ab rc=$?"
grep same_ids "$OUT/hopper_ab.jsonl"
{ PYTHONPATH=/tmp/new timeout 200 python3 -m tqvec.bench.gpu_scan --check; echo "check rc=$?"
  PYTHONPATH=/tmp/new timeout 100 python3 -m tqvec.bench.index_cuda_check --dim 384 --nq 300 \
    --out "$OUT/index_cuda_check_384_300.json"; echo "index rc=$?"; } > "$OUT/checks.log" 2>&1
grep -c " OK$" "$OUT/checks.log"; grep "rc=" "$OUT/checks.log"
for t in base new new base; do
  echo "== $t" >> "$OUT/hoist_ab.log"
  PYTHONPATH=/tmp/$t timeout 100 python3 -m tqvec.bench.gpu_scan --out "/tmp/$t-$SECONDS" --sizes 1000000 \
    --dims 128 1536 --nqs 100 10000 --bits 4 --max-seconds 60 >> "$OUT/hoist_ab.log" 2>&1; echo "$t rc=$?"
done
