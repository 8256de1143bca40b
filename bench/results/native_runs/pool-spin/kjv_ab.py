"""Issue 15 pool A/B on KJV (30,102 x 384, 1,000 queries, 16 threads) in the sweep's pattern: the sweep's IVF wrapper
(residual FHT-Kac, nlist 128, nprobe 24), rabitqlib IVF (nlist 128, nprobe 24) and a flat 4-bit Index, each timed
per batch call, then the sweep's result conversion. argv[1]: build name, argv[2]: JSON lines out."""

import json
import os
import sys
import time

import numpy as np
import torch

import tqvec
from tqvec.bench.annb.competitors import RabitqIVF
from tqvec.bench.annb.module import TqvecIVF
from tqvec.datasets.registry import load

build, out = sys.argv[1], sys.argv[2]
ds = load("kjv-minilm-384-angular")
train = np.ascontiguousarray(ds.train, np.float32)
test = np.ascontiguousarray(ds.test[:1000], np.float32)
tq = TqvecIVF("angular", 4, "residual", 128, 0, "fht-kac")
tq.fit(train)
tq.set_query_arguments(24)
rb = RabitqIVF("angular", 128, 4, 16)
rb.fit(train)
rb.set_query_arguments(24)
flat = tqvec.Index(384, 4, "cosine")
flat.add(train)


class Flat:
    def batch_query(self, X, n):
        torch.set_num_threads(16)
        self.res = flat.search(X, n)[1]
        torch.set_num_threads(1)

    def get_batch_results(self):
        return list(self.res)


calls = int(os.environ.get("CALLS", "100"))


def block(algo):
    for _ in range(5):
        algo.batch_query(test, 10)
    ws = []
    for _ in range(calls):
        s = time.perf_counter()
        algo.batch_query(test, 10)
        ws.append(time.perf_counter() - s)
        [np.asarray(r, dtype=np.int64) for r in algo.get_batch_results()]
    return len(test) / float(np.median(ws)), len(test) / min(ws)


algos = [("tqvec-ivf", tq), ("rabitqlib", rb), ("tqvec-flat", Flat())]
with open(out, "a") as f:
    for rnd in range(2):
        for name, algo in algos if rnd == 0 else algos[::-1]:
            med, best = block(algo)
            f.write(
                json.dumps({"build": build, "round": rnd, "algo": name, "median_qps": med, "best_qps": best}) + "\n"
            )
            print(f"{build:5s} r{rnd} {name:10s} median {med:10,.0f} best {best:10,.0f}", flush=True)
