#!/bin/bash
# device: IVF batches prepared and scanned in one parallel region (paired) or two (unpaired), by threads; then the
# issue-15 sweeps with the paired build
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
cp .dev/kjv.hdf5 /tmp/kjv.hdf5
SO=$(python3 -c "import tqvec._native as n; print(n.__file__)")
NB=$(python3 -m nanobind --cmake_dir)
mkdir -p /tmp/t_unpaired && cp CMakeLists.txt /tmp/t_unpaired/ && cp -r csrc /tmp/t_unpaired/ && cp .dev/module_unpaired.cpp /tmp/t_unpaired/csrc/module.cpp
for v in paired unpaired; do
  src=$([ $v = paired ] && echo . || echo /tmp/t_$v)
  cmake -S $src -B /tmp/b_$v -G Ninja -DCMAKE_BUILD_TYPE=Release -Dnanobind_DIR=$NB -DPython_EXECUTABLE=$(which python3) > /dev/null && ninja -C /tmp/b_$v > /dev/null 2>&1 && cp /tmp/b_$v/_native*.so /tmp/$v.so
done
for r in 1 2; do for v in unpaired paired; do
  cp /tmp/$v.so $SO
  echo "$v $(python3 .dev/batch_threads.py mnist $([ $v = paired ] && echo rb) | tail -1)" | tee -a $OUT/ab.txt
  echo "$v $(python3 .dev/batch_threads.py /tmp/kjv.hdf5 | tail -1)" | tee -a $OUT/ab.txt
done; done
cp /tmp/paired.so $SO
mkdir -p /tmp/res && cp .dev/seed/*.json /tmp/res/
S="python3 -m tqvec.bench.sweep --runs 3 --out /tmp/res --update"
ONLY='tqvec-ivf 4b residual|tqvec-ivf 4b direct|rabitqlib|turbovec 4b'
$S --dataset mnist-784-euclidean --only "$ONLY" > /tmp/res/mnist.log 2>&1
$S --dataset mnist-784-euclidean --only "$ONLY" --batch --threads 16 > /tmp/res/mnist_batch.log 2>&1
$S --dataset /tmp/kjv.hdf5 --only "$ONLY" > /tmp/res/kjv.log 2>&1
$S --dataset /tmp/kjv.hdf5 --only "$ONLY" --batch --threads 16 > /tmp/res/kjv_batch.log 2>&1
tar czf $OUT/res.tgz -C /tmp res
for f in /tmp/res/*.md; do echo "== $f"; sed -n '/## Best/,/## Plots/p' $f | head -9; done
