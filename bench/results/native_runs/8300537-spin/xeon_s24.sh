#!/bin/bash
# device: pool helpers spinning 2 ms before they sleep (working tree) against HEAD's pool: batch_threads and the
# MNIST batch sweep, builds alternating, two rounds
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
cp .dev/kjv.hdf5 /tmp/kjv.hdf5
SO=$(python3 -c "import tqvec._native as n; print(n.__file__)")
cp $SO /tmp/spin.so
NB=$(python3 -m nanobind --cmake_dir)
cmake -S .dev/head_csrc -B /tmp/b_head -G Ninja -DCMAKE_BUILD_TYPE=Release -Dnanobind_DIR=$NB -DPython_EXECUTABLE=$(which python3) > /dev/null && ninja -C /tmp/b_head > /dev/null 2>&1 && cp /tmp/b_head/_native*.so /tmp/head.so
ONLY='tqvec-ivf 4b (residual|direct) fht|rabitqlib'
for r in 1 2; do for v in head spin; do cp /tmp/$v.so $SO
  echo "$r $v $(python3 .dev/batch_threads.py mnist rb | tail -1)" | tee -a $OUT/ab.txt
  echo "$r $v $(python3 .dev/batch_threads.py /tmp/kjv.hdf5 | tail -1)" | tee -a $OUT/ab.txt
  mkdir -p /tmp/sw_${v}_$r && cp .dev/seed/*.json /tmp/sw_${v}_$r/
  python3 -m tqvec.bench.sweep --runs 5 --out /tmp/sw_${v}_$r --update --dataset mnist-784-euclidean --only "$ONLY" --batch --threads 16 > /tmp/sw_${v}_$r/log.txt 2>&1
  echo "$r $v sweep: $(grep -E '^\| (rabitqlib|tqvec-ivf 4b (residual|direct) fht)' /tmp/sw_${v}_$r/sweep_mnist-784-euclidean_batch.md | cut -d'|' -f2,5 | tr '\n' ';')" | tee -a $OUT/ab.txt
done; done
tar czf $OUT/sw.tgz -C /tmp $(cd /tmp && ls -d sw_*)
