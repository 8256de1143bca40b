#!/usr/bin/env bash
# Device run: sweep the split-kernel configurations, then the decode-attention table with the best one.
# Usage (repository root, on the GPU machine): bash bench/tune_kv.sh OUT_DIR
set -euo pipefail
out=${1:?output directory}
python3 -m tqvec.bench.kv_gpu --sweep --contexts 32768 131072 --batches 1 --iters 10 --out "$out" | grep -v '^{' || true
best=$(python3 - "$out" <<'PY'
import collections, json, sys
rows = json.load(open(sys.argv[1] + "/kv_gpu_sweep.json"))
total = collections.defaultdict(float)
for r in rows:  # equal weight to both contexts
    total[(r["block_n"], r["warps"], r["stages"], r["programs_per_sm"], r["max_registers"])] += r["us"] / (r["context"] / 32768)
print(*min((v, k) for k, v in total.items() if v == v)[1])
PY
)
echo "best split-kernel configuration (BLOCK_N WARPS STAGES PER_SM MAX_REGS): $best"
python3 -m tqvec.bench.kv_gpu --config $best --contexts 4096 32768 131072 --batches 1 8 --iters 20 \
    --e2e-layers 4 --e2e-context 32768 --e2e-tokens 64 --out "$out"
