#!/usr/bin/env bash
# The device call of this folder, run from the repository root with OUT set: the H200 table (when the card is an
# H200), the rows-as-M A/B through `tqvec bench kernel-ab` on a copy of kernels/ with rows_as_m.patch, its equality
# test on the GPU, then the CUDA tests of the committed tree after an install.
export PYTHONUNBUFFERED=1
R=bench/results/gpu_scan_runs/b301acc-rows-as-m
ROOT=$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU"
mkdir -p /tmp/p/tqvec /tmp/f/tqvec
for f in "$ROOT"/tqvec/*; do ln -sf "$f" /tmp/p/tqvec/; ln -sf "$f" /tmp/f/tqvec/; done
for d in kernels bench datasets; do ln -sfn "$ROOT/$d" /tmp/p/tqvec/$d; done
for d in bench datasets; do ln -sfn "$ROOT/$d" /tmp/f/tqvec/$d; done
rm -rf /tmp/f/tqvec/kernels && cp -r kernels /tmp/f/tqvec/kernels
(cd /tmp/f/tqvec && patch -p1 -s < "$ROOT/$R/rows_as_m.patch") || exit 1
if echo "$GPU" | grep -q H200; then
  (cd /tmp && PYTHONPATH=/tmp/p timeout 150 python3 -m tqvec.bench.gpu_scan --out "$OUT/t1m" --sizes 1000000 --bits 4 \
     --max-seconds 60 > "$OUT/t1m.log" 2>&1; echo "table rc=$?")
  (cd /tmp && PYTHONPATH=/tmp/p timeout 100 python3 -m tqvec.bench.gpu_scan --out "$OUT/t10m" --sizes 10000000 \
     --dims 128 --bits 4 --max-seconds 90 > "$OUT/t10m.log" 2>&1; echo "10m rc=$?")
fi
(cd /tmp && PYTHONPATH=/tmp/f timeout 240 python3 -m tqvec.bench.kernel_ab --out "$OUT/rows_ab.jsonl" \
   --shapes 128x100 384x100 768x100 1536x100 --variant base --variant rows INT8_ROWS_AS_M=True \
   --variant rows_k64 INT8_ROWS_AS_M=True FUSED_BLOCK_K=64 --variant rows_s2 INT8_ROWS_AS_M=True FUSED_STAGES=2 \
   --variant rows_t64 INT8_ROWS_AS_M=True FUSED_TILE_ROWS=64 2>&1 | grep -v '"kernels"' | cut -c1-220)
PYTHONPATH=/tmp/f:$ROOT/tests:$ROOT/tests/support timeout 120 python3 -P -m pytest -q -p no:cacheprovider \
  "$R/test_rows_as_m.py" 2>&1 | tail -3
python3 -m pip install -q --no-deps --no-index --no-compile .whl/kv/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels.py tests/test_kv_decode_attention.py \
  tests/test_kv_static.py tests/test_kv_compile.py tests/test_kv_step_graphs.py tests/test_dp4a_stage.py \
  tests/test_topk_kernel.py tests/test_launch.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
