#!/bin/bash
# device: old (9afc631) vs new vs new without the AVX-512 preparation and settling, MNIST single queries; rabitqlib beside;
# perf profiles of tqvec (new) and rabitqlib
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site OMP_NUM_THREADS=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
SO=$(python3 -c "import tqvec._native as n; print(n.__file__)")
NB=$(python3 -m nanobind --cmake_dir)
for v in old avx2prep; do mkdir -p /tmp/t_$v && cp CMakeLists.txt /tmp/t_$v/; done
cp -r .dev/old/csrc /tmp/t_old/; cp -r csrc /tmp/t_avx2prep/
sed -i '/return matmat_avx512;/d; /return rotate_avx512;/d' /tmp/t_avx2prep/csrc/queries.cpp
sed -i 's/settle_avx512(sums, bq/settle_avx2(sums, bq/' /tmp/t_avx2prep/csrc/fastscan.cpp
for v in old new avx2prep; do
  src=$([ $v = new ] && echo . || echo /tmp/t_$v)
  cmake -S $src -B /tmp/b_$v -G Ninja -DCMAKE_BUILD_TYPE=Release -Dnanobind_DIR=$NB -DPython_EXECUTABLE=$(which python3) > /dev/null && ninja -C /tmp/b_$v > /dev/null 2>&1 && cp /tmp/b_$v/_native*.so /tmp/$v.so
done
ls -la /tmp/*.so
for r in 1 2 3; do for v in old new avx2prep; do
  cp /tmp/$v.so $SO
  echo "$v mnist $(python3 .dev/loop.py search | tail -1) | $(python3 .dev/loop.py call4 | tail -1)" | tee -a $OUT/ab.txt
done; python3 .dev/loop_rabitq.py | tail -1 | tee -a $OUT/ab.txt; done
cp /tmp/new.so $SO
P="env LD_LIBRARY_PATH=$PWD/.dev/perf/lib $PWD/.dev/perf/perf"
for which in rabitq tqvec; do
  if [ $which = rabitq ]; then python3 .dev/loop_rabitq.py > /tmp/loop.out 2>&1 & else python3 .dev/loop.py search > /tmp/loop.out 2>&1 & fi
  for i in $(seq 200); do grep -q go /tmp/loop.out && break; sleep 0.1; done
  $P record -F 4000 -o /tmp/perf.$which -p $(pgrep -f "loop" | head -1) -- sleep 3 2>&1 | tail -1
  wait; cat /tmp/loop.out | tail -1
  $P report -i /tmp/perf.$which --no-children --percent-limit 0.4 --stdio 2>/dev/null | grep -E "^ +[0-9]" | cut -c1-200 > $OUT/perf_$which.txt
  head -30 $OUT/perf_$which.txt
done
