#!/bin/bash
# device: 16-thread MNIST IVF batch profiles, tqvec (RelWithDebInfo build) and rabitqlib, loops of 3 s
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
cmake -S . -B /tmp/dbg -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DNB_STRIP=OFF -Dnanobind_DIR=$(python3 -m nanobind --cmake_dir) -DPython_EXECUTABLE=$(which python3) > /dev/null && ninja -C /tmp/dbg > /dev/null && cp /tmp/dbg/_native*.so $(python3 -c "import tqvec._native as n; print(n.__file__)") && echo debug-so-installed
P="env LD_LIBRARY_PATH=$PWD/.dev/perf/lib $PWD/.dev/perf/perf"
for who in tq rb; do
  python3 .dev/loop_batch.py 16 $([ $who = rb ] && echo rbloop) > /tmp/loop.out 2>&1 &
  for i in $(seq 300); do grep -q go /tmp/loop.out && break; sleep 0.1; done
  $P record -F 2000 -g -o /tmp/perf.$who -p $(pgrep -f "loop_batch.py 16" | head -1) -- sleep 2.5 2>&1 | tail -1
  wait; tail -1 /tmp/loop.out | tee -a $OUT/qps.txt
  $P report -i /tmp/perf.$who --no-children --percent-limit 0.3 --stdio 2>/dev/null | grep -E "^ +[0-9]" | cut -c1-200 > $OUT/perf_$who.txt
  $P report -i /tmp/perf.$who --no-children --sort dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -15 > $OUT/perf_${who}_dso.txt
  $P report -i /tmp/perf.$who --children --percent-limit 2 --stdio 2>/dev/null | grep -E "^ +[0-9]" | cut -c1-200 | head -60 > $OUT/perf_${who}_children.txt
  echo "== $who"; head -30 $OUT/perf_$who.txt; cat $OUT/perf_${who}_dso.txt
done
