# Issue 15 pool A/B on KJV (run from the repository root): the working tree's build against main's csrc, alternating.
set -e
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/inst.log 2>&1 || { tail -20 /tmp/inst.log; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site TQVEC_SHARED_DATA=$PWD/.carry/kjv
SO=$(python3 -c "import tqvec._native as n; print(n.__file__)")
cp "$SO" /tmp/new.so
cp -r .carry/base_csrc /tmp/base && (cd /tmp/base && cmake -S . -B build -G Ninja -DPython_EXECUTABLE=$(which python3) \
  -Dnanobind_DIR=$(python3 -m nanobind --cmake_dir) > /tmp/cmake.log 2>&1 && ninja -C build > /tmp/ninja.log 2>&1) || { tail /tmp/cmake.log /tmp/ninja.log; exit 1; }
cp /tmp/base/build/_native*.so /tmp/base.so
for r in 1 2 3; do for b in base new; do cp /tmp/$b.so "$SO"; python3 .carry/kjv_ab.py $b $OUT/kjv_ab.jsonl; done; done
cp /tmp/new.so "$SO"
