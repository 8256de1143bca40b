#!/bin/bash
# device: IVF batch answered per chunk with per-chunk buffers (new) vs the whole batch's buffers and answers on the
# calling thread (f62a182), MNIST 500 queries, 16 threads, alternating; rabitqlib's batch beside
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
SO=$(python3 -c "import tqvec._native as n; print(n.__file__)")
cp $SO /tmp/new.so
mkdir -p /tmp/t_old && cp CMakeLists.txt /tmp/t_old/ && cp -r csrc /tmp/t_old/ && cp .dev/module_new6.cpp /tmp/t_old/csrc/module.cpp
cmake -S /tmp/t_old -B /tmp/b_old -G Ninja -DCMAKE_BUILD_TYPE=Release -Dnanobind_DIR=$(python3 -m nanobind --cmake_dir) -DPython_EXECUTABLE=$(which python3) > /dev/null && ninja -C /tmp/b_old > /dev/null 2>&1 && cp /tmp/b_old/_native*.so /tmp/old.so
for r in 1 2 3; do for v in old new; do
  cp /tmp/$v.so $SO
  echo "$v $(python3 .dev/loop_batch.py 16 | tail -1)" | tee -a $OUT/ab.txt
done; done
python3 .dev/loop_batch.py 16 rb | tee -a $OUT/ab.txt
