"""Issue 15, MNIST IVF batch (500 queries, nprobe 4, residual FHT-Kac): where a 16-thread batch call's time goes, from
a traced build (.carry/trace.patch: steady-clock stamps per chunk in search_queries). Writes argv[1] (JSON)."""

import json
import os
import sys
import time

import numpy as np
import torch

from tqvec import _native
from tqvec.bench.annb.module import TqvecIVF
from tqvec.datasets.registry import mnist_split

train, test = mnist_split()
test = np.ascontiguousarray(test, np.float32)
tq = TqvecIVF("euclidean", 4, "residual", 64, 0, "fht-kac")
tq.fit(train)
tq.set_query_arguments(4)
calls = int(os.environ.get("CALLS", "400"))


def med(x):
    return float(np.median(x))


out = {}
thread_list = [int(t) for t in os.environ.get("THREADS", "2,4,8,16").split(",")]
for rnd in range(2):
    for T in thread_list if rnd == 0 else thread_list[::-1]:
        torch.set_num_threads(T)
        for _ in range(20):
            tq.index.search(test, 10, nprobe=4)
        rec = {
            k: []
            for k in (
                "wall",
                "py",
                "pre",
                "native",
                "wake_first",
                "wake_last",
                "prep_q",
                "search_q",
                "answer_q",
                "busy_max",
                "busy_min",
                "end_spread",
                "join_after_last",
                "post",
                "threads_used",
            )
        }
        for _ in range(calls):
            s = time.perf_counter()
            tq.index.search(test, 10, nprobe=4)
            wall = (time.perf_counter() - s) * 1e6
            tr = _native.last_trace()
            ch = np.array([c[:6] for c in tr["chunks"]])
            th = [c[6] for c in tr["chunks"]]
            rec["wall"].append(wall)
            rec["native"].append(tr["exit"] - tr["entry"])
            rec["py"].append(wall - (tr["exit"] - tr["entry"]))
            rec["pre"].append(tr["region"] - tr["entry"])
            rec["post"].append(tr["exit"] - tr["joined"])
            firsts, ends, busy = {}, {}, {}
            for (_first, _cnt, st, _pr, _se, an), t in zip(ch, th):
                firsts[t] = min(firsts.get(t, 1e300), st)
                ends[t] = max(ends.get(t, 0), an)
                busy[t] = busy.get(t, 0) + an - st
            starts = sorted(firsts.values())
            rec["wake_first"].append(starts[0] - tr["region"])
            rec["wake_last"].append(starts[-1] - tr["region"])
            n = ch[:, 1].sum()
            rec["prep_q"].append(float((ch[:, 3] - ch[:, 2]).sum() / n))
            rec["search_q"].append(float((ch[:, 4] - ch[:, 3]).sum() / n))
            rec["answer_q"].append(float((ch[:, 5] - ch[:, 4]).sum() / n))
            rec["busy_max"].append(max(busy.values()))
            rec["busy_min"].append(min(busy.values()))
            rec["end_spread"].append(max(ends.values()) - min(ends.values()))
            rec["join_after_last"].append(tr["joined"] - max(ends.values()))
            rec["threads_used"].append(len(busy))
        summary = {k: med(v) for k, v in rec.items()}
        summary["qps_median"] = len(test) / summary["wall"] * 1e6
        out[f"r{rnd} t{T}"] = summary
        print(f"r{rnd} t{T:2d} " + " ".join(f"{k}={v:,.2f}" for k, v in summary.items()), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
