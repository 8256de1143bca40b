# Issue 15 pool A/B on the device host (run from the repository root): the working tree's build ("new") against main's
# csrc (.carry/base_csrc, "base"), swapped into the same installation, alternating processes; then the acceptance's
# sweep three times with each build, alternating.
set -e
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/inst.log 2>&1 || { tail -20 /tmp/inst.log; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
SO=$(python3 -c "import tqvec._native as n; print(n.__file__)")
cp "$SO" /tmp/new.so
cp -r .carry/base_csrc /tmp/base && (cd /tmp/base && cmake -S . -B build -G Ninja -DPython_EXECUTABLE=$(which python3) \
  -Dnanobind_DIR=$(python3 -m nanobind --cmake_dir) > /tmp/cmake.log 2>&1 && ninja -C build > /tmp/ninja.log 2>&1) || { tail /tmp/cmake.log /tmp/ninja.log; exit 1; }
cp /tmp/base/build/_native*.so /tmp/base.so
for r in 1 2 3; do
  for v in base new:0:0 new:0:100 new:2000:2000; do
    b=${v%%:*}; cp /tmp/$b.so "$SO"
    IFS=: read -r _ h j <<< "$v"
    TQVEC_HELPER_US=${h:-0} TQVEC_JOIN_US=${j:-0} python3 .carry/pool_ab.py $v $OUT/pool_ab.jsonl
  done
done
for r in 1 2 3; do
  for b in new base; do
    cp /tmp/$b.so "$SO"
    echo "== sweep round $r build $b"
    python3 -m tqvec.bench.sweep --runs 5 --out /tmp/sw_${b}_$r --dataset mnist-784-euclidean \
      --only 'tqvec-ivf 4b residual fht-kac|tqvec-ivf 4b direct fht-kac|rabitqlib' --batch --threads 16 2>&1 | grep "nprobe=4) "
  done
done 2>&1 | tee $OUT/sweeps.txt
cp /tmp/new.so "$SO"
