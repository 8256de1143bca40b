#!/bin/bash
# device: inverted-file batch chunk size (nq / (D threads) queries per chunk, at most 8): D = 8 (main), 4, 16
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
cp .dev/kjv.hdf5 /tmp/kjv.hdf5
SO=$(python3 -c "import tqvec._native as n; print(n.__file__)")
cp $SO /tmp/d8.so
NB=$(python3 -m nanobind --cmake_dir)
for d in 4 16; do cmake -S .dev/var$d -B /tmp/b$d -G Ninja -DCMAKE_BUILD_TYPE=Release -Dnanobind_DIR=$NB -DPython_EXECUTABLE=$(which python3) > /dev/null && ninja -C /tmp/b$d > /dev/null 2>&1 && cp /tmp/b$d/_native*.so /tmp/d$d.so; done
for r in 1 2; do for v in d8 d4 d16; do cp /tmp/$v.so $SO
  echo "$r $v $(python3 .dev/batch_threads.py mnist $([ $v = d8 ] && echo rb) | tail -1)" | tee -a $OUT/chunk.txt
  echo "$r $v $(python3 .dev/batch_threads.py /tmp/kjv.hdf5 | tail -1)" | tee -a $OUT/chunk.txt
done; done
