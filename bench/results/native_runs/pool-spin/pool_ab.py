"""Issue 15, MNIST IVF batch (500 queries, nprobe 4, residual FHT-Kac, 16 threads) in the sweep's pattern (the sweep's
wrapper TqvecIVF.batch_query timed, then the sweep's conversion of the results): one process per build, the tqvec and
rabitqlib blocks alternating. Prints and appends one JSON line per block to argv[2]; argv[1] names the build."""

import json
import os
import sys
import time

import numpy as np

from tqvec.bench.annb.competitors import RabitqIVF
from tqvec.bench.annb.module import TqvecIVF
from tqvec.datasets.registry import mnist_split

build, out = sys.argv[1], sys.argv[2]
train, test = mnist_split()
test = np.ascontiguousarray(test, np.float32)
tq = TqvecIVF("euclidean", 4, "residual", 64, 0, "fht-kac")
tq.fit(train)
tq.set_query_arguments(4)
rb = RabitqIVF("euclidean", 64, 4, 16)
rb.fit(train)
rb.set_query_arguments(4)
calls = int(os.environ.get("CALLS", "300"))


def block(algo):
    for _ in range(10):
        algo.batch_query(test, 10)
    ws = []
    for _ in range(calls):
        s = time.perf_counter()
        algo.batch_query(test, 10)
        ws.append(time.perf_counter() - s)
        [np.asarray(r, dtype=np.int64) for r in algo.get_batch_results()]
    return len(test) / float(np.median(ws)), len(test) / min(ws)


with open(out, "a") as f:
    for rnd in range(2):
        for name, algo in (("tqvec", tq), ("rabitqlib", rb)) if rnd == 0 else (("rabitqlib", rb), ("tqvec", tq)):
            med, best = block(algo)
            rec = {"build": build, "round": rnd, "algo": name, "median_qps": med, "best_qps": best, "calls": calls}
            f.write(json.dumps(rec) + "\n")
            print(f"{build:14s} r{rnd} {name:9s} median {med:10,.0f} best {best:10,.0f}", flush=True)
