#!/usr/bin/env bash
# Third call: the Gluon GPU tests after the two Gluon kernels became one (group_max_kernel, DECODED), from the
# repository root with OUT set (tests.log).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/tests.log" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "hopper or int8" \
  >> "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/tests.log"
