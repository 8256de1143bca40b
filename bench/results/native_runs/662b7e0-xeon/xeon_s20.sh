#!/bin/bash
# device: one-query A/B (HEAD csrc vs working tree, rabitqlib beside), batch by threads, then the issue-15 sweeps
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
cp .dev/kjv.hdf5 /tmp/kjv.hdf5
SO=$(python3 -c "import tqvec._native as n; print(n.__file__)")
cp $SO /tmp/new.so
NB=$(python3 -m nanobind --cmake_dir)
cmake -S .dev/head_csrc -B /tmp/b_head -G Ninja -DCMAKE_BUILD_TYPE=Release -Dnanobind_DIR=$NB -DPython_EXECUTABLE=$(which python3) > /dev/null && ninja -C /tmp/b_head > /dev/null 2>&1 && cp /tmp/b_head/_native*.so /tmp/head.so
uptime | tee $OUT/load.txt
for r in 1 2 3; do for d in mnist /tmp/kjv.hdf5; do
  for v in head new; do cp /tmp/$v.so $SO; echo "$r $d $v $(python3 .dev/onequery.py $d tqvec)" | tee -a $OUT/ab.txt; done
  echo "$r $d rabitq $(python3 .dev/onequery.py $d rabitq)" | tee -a $OUT/ab.txt
done; done
for r in 1 2; do for v in head new; do cp /tmp/$v.so $SO
  echo "$v $(python3 .dev/batch_threads.py mnist $([ $v = new ] && echo rb) | tail -1)" | tee -a $OUT/batch.txt
  echo "$v $(python3 .dev/batch_threads.py /tmp/kjv.hdf5 | tail -1)" | tee -a $OUT/batch.txt
done; done
cp /tmp/new.so $SO
uptime | tee -a $OUT/load.txt
mkdir -p /tmp/res && cp .dev/seed/*.json /tmp/res/
S="python3 -m tqvec.bench.sweep --runs 3 --out /tmp/res --update"
ONLY='tqvec-ivf 4b residual|tqvec-ivf 4b direct|rabitqlib|turbovec 4b'
$S --dataset mnist-784-euclidean --only "$ONLY" > /tmp/res/mnist.log 2>&1
$S --dataset mnist-784-euclidean --only "$ONLY" --batch --threads 16 > /tmp/res/mnist_batch.log 2>&1
$S --dataset /tmp/kjv.hdf5 --only "$ONLY" > /tmp/res/kjv.log 2>&1
$S --dataset /tmp/kjv.hdf5 --only "$ONLY" --batch --threads 16 > /tmp/res/kjv_batch.log 2>&1
tar czf $OUT/res.tgz -C /tmp res
for f in /tmp/res/*.md; do echo "== $f"; sed -n '/## Best/,/## Plots/p' $f | head -9; done
