#!/bin/bash
# device: old (HEAD) vs new native kernel, single queries, alternating builds; then the issue-15 sweeps with the new one
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
cp .dev/kjv.hdf5 /tmp/kjv.hdf5
SO=$(python3 -c "import tqvec._native as n; print(n.__file__)")
NB=$(python3 -m nanobind --cmake_dir)
mkdir -p /tmp/oldtree && cp CMakeLists.txt /tmp/oldtree/ && cp -r .dev/old/csrc /tmp/oldtree/
for v in old new; do
  src=$([ $v = old ] && echo /tmp/oldtree || echo .)
  cmake -S $src -B /tmp/b_$v -G Ninja -DCMAKE_BUILD_TYPE=Release -Dnanobind_DIR=$NB -DPython_EXECUTABLE=$(which python3) > /dev/null && ninja -C /tmp/b_$v > /dev/null && cp /tmp/b_$v/_native*.so /tmp/$v.so
done
ls -la /tmp/*.so
for r in 1 2 3; do for v in old new; do
  cp /tmp/$v.so $SO
  echo "$v mnist $(python3 .dev/loop.py search | tail -1)  kjv $(python3 .dev/loop_kjv.py /tmp/kjv.hdf5 | tail -1)" | tee -a $OUT/ab.txt
done; done
cp /tmp/new.so $SO
mkdir -p /tmp/res && cp .dev/seed/*.json /tmp/res/
S="python3 -m tqvec.bench.sweep --runs 2 --out /tmp/res --update"
ONLY='tqvec-ivf 4b residual|tqvec-ivf 4b direct|rabitqlib|turbovec 4b'
$S --dataset mnist-784-euclidean --only "$ONLY" > /tmp/res/mnist.log 2>&1
$S --dataset mnist-784-euclidean --only "$ONLY" --batch --threads 16 > /tmp/res/mnist_batch.log 2>&1
$S --dataset /tmp/kjv.hdf5 --only "$ONLY" > /tmp/res/kjv.log 2>&1
$S --dataset /tmp/kjv.hdf5 --only "$ONLY" --batch --threads 16 > /tmp/res/kjv_batch.log 2>&1
cp -r /tmp/res $OUT/
for f in /tmp/res/*.md; do echo "== $f"; sed -n '/## Best/,/## Plots/p' $f | head -14; done
