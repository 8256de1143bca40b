#!/bin/bash
# device: where a 16-thread MNIST IVF batch spends its time (perf, symbols from a RelWithDebInfo build); rabitqlib's batch
# on 1 and 16 threads
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
lscpu | grep -E "^Thread|^Core|^Socket|^CPU\(s\)|MHz"
python3 .dev/loop_batch.py 16 rb | tee $OUT/rabitq.txt
python3 .dev/loop_batch.py 1 | tail -1 | tee -a $OUT/rabitq.txt
cmake -S . -B /tmp/dbg -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DNB_STRIP=OFF -Dnanobind_DIR=$(python3 -m nanobind --cmake_dir) -DPython_EXECUTABLE=$(which python3) > /dev/null && ninja -C /tmp/dbg > /dev/null && cp /tmp/dbg/_native*.so $(python3 -c "import tqvec._native as n; print(n.__file__)") && echo debug-so-installed
P="env LD_LIBRARY_PATH=$PWD/.dev/perf/lib $PWD/.dev/perf/perf"
python3 .dev/loop_batch.py 16 > /tmp/loop.out 2>&1 &
for i in $(seq 200); do grep -q go /tmp/loop.out && break; sleep 0.1; done
$P record -F 2000 -g -o /tmp/perf.b -p $(pgrep -f "loop_batch.py 16" | head -1) -- sleep 3 2>&1 | tail -1
wait; cat /tmp/loop.out | tail -1 | tee -a $OUT/rabitq.txt
$P report -i /tmp/perf.b --no-children --percent-limit 0.4 --stdio 2>/dev/null | grep -E "^ +[0-9]" | cut -c1-200 > $OUT/perf_batch.txt
$P report -i /tmp/perf.b --no-children --sort comm,dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -20 > $OUT/perf_batch_dso.txt
head -40 $OUT/perf_batch.txt; cat $OUT/perf_batch_dso.txt
