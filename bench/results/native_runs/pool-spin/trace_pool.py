"""Issue 15, MNIST IVF batch (500 queries, nprobe 4, residual FHT-Kac) at 16 threads through the sweep's wrapper
(TqvecIVF.batch_query; PATTERN=sweep adds the sweep's result conversion after each call): the pool variants of the
experimental build (trace_pool.patch; TQVEC_POOL 0 = main's pool, 1 = one notify_all when every idle helper is
wanted + the caller spins up to 200 us for the join, 2 = 1 + idle helpers spin TQVEC_HELPER_SPIN_US, 3 = 2 + the job
on the heap, the caller waiting for chunks only) traced per chunk, and rabitqlib's batch, blocks of calls
alternating, the order reversed every other round. argv[1]: JSON."""

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
T = int(os.environ.get("T", "16"))
tq = TqvecIVF("euclidean", 4, "residual", 64, 0, "fht-kac")
tq.fit(train)
tq.set_query_arguments(4)
rb = None
try:
    from tqvec.bench.annb.competitors import RabitqIVF

    rb = RabitqIVF("euclidean", 64, 4, T)
    rb.fit(train)
    rb.set_query_arguments(4)
except Exception as e:
    print("no rabitqlib:", e)
calls = int(os.environ.get("CALLS", "400"))


def med(x):
    return float(np.median(x))


PATTERN = os.environ.get(
    "PATTERN", "loop"
)  # loop: back to back; sweep: each call followed by the sweep's result conversion


def after_call(algo):
    if PATTERN == "sweep":
        [np.asarray(r, dtype=np.int64) for r in algo.get_batch_results()]


def tq_variant(spec):
    mode, _, spin = spec.partition(":")

    def run():
        os.environ["TQVEC_POOL"] = mode
        os.environ["TQVEC_HELPER_SPIN_US"] = spin or "100"
        torch.set_num_threads(T)
        rec = {
            k: []
            for k in (
                "wall",
                "py",
                "native",
                "wake_first",
                "wake_last",
                "prep_q",
                "search_q",
                "end_spread",
                "join_after_last",
                "busy_max",
            )
        }
        for _ in range(20):
            tq.batch_query(test, 10)
        for _ in range(calls):
            s = time.perf_counter()
            tq.batch_query(test, 10)
            wall = (time.perf_counter() - s) * 1e6
            after_call(tq)
            tr = _native.last_trace()
            ch = np.array([c[:6] for c in tr["chunks"]])
            th = [c[6] for c in tr["chunks"]]
            firsts, ends, busy = {}, {}, {}
            for (_first, _cnt, st, _pr, _se, an), t in zip(ch, th):
                firsts[t] = min(firsts.get(t, 1e300), st)
                ends[t] = max(ends.get(t, 0), an)
                busy[t] = busy.get(t, 0) + an - st
            starts = sorted(firsts.values())
            n = ch[:, 1].sum()
            rec["wall"].append(wall)
            rec["native"].append(tr["exit"] - tr["entry"])
            rec["py"].append(wall - (tr["exit"] - tr["entry"]))
            rec["wake_first"].append(starts[0] - tr["region"])
            rec["wake_last"].append(starts[-1] - tr["region"])
            rec["prep_q"].append(float((ch[:, 3] - ch[:, 2]).sum() / n))
            rec["search_q"].append(float((ch[:, 4] - ch[:, 3]).sum() / n))
            rec["end_spread"].append(max(ends.values()) - min(ends.values()))
            rec["join_after_last"].append(tr["joined"] - max(ends.values()))
            rec["busy_max"].append(max(busy.values()))
        s = {k: med(v) for k, v in rec.items()}
        s["qps_median"] = len(test) / s["wall"] * 1e6
        s["qps_best"] = len(test) / min(rec["wall"]) * 1e6
        return s

    return run


def rb_run():
    ws = []
    for _ in range(20):
        rb.batch_query(test, 10)
    for _ in range(calls):
        s = time.perf_counter()
        rb.batch_query(test, 10)
        ws.append(time.perf_counter() - s)
        after_call(rb)
    return {"qps_median": len(test) / med(ws), "qps_best": len(test) / min(ws)}


variants = {f"pool{m}": tq_variant(m) for m in os.environ.get("MODES", "0,1,2").split(",")}
if rb is not None:
    variants["rabitqlib"] = rb_run
out = []
names = list(variants)
for rnd in range(int(os.environ.get("ROUNDS", "3"))):
    for name in names if rnd % 2 == 0 else names[::-1]:
        s = variants[name]()
        s.update(round=rnd, variant=name)
        out.append(s)
        print(
            f"r{rnd} {name:9s} " + " ".join(f"{k}={v:,.1f}" for k, v in s.items() if k not in ("round", "variant")),
            flush=True,
        )
json.dump(out, open(sys.argv[1], "w"), indent=1)
