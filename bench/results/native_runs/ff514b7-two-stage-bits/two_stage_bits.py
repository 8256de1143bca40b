"""IVF search, one thread, FHT-Kac, direct codes: each bit budget with the two-stage scan's threshold
(``tqvec._fastscan.TWO_STAGE_MIN_BITS``) at 3 (before) and 2.25 (now), the two indexes built alike and timed in
turn (best of 5 searches of all queries, two rounds); recall@10 against exact float32 neighbours.
Usage: python two_stage_bits.py mnist|kjv BITS,... [KJV_HDF5]"""
import sys
import time

import numpy as np
import torch

import tqvec
from tqvec import _fastscan

torch.set_num_threads(1)
name, budgets = sys.argv[1], [float(b) for b in sys.argv[2].split(",")]
if name == "mnist":
    from tqvec.datasets.registry import mnist_split
    train, test = mnist_split()
    metric, nlist, nprobe = "l2", 64, 4
else:
    import h5py
    with h5py.File(sys.argv[3]) as f:
        train, test = f["train"][:], f["test"][:1000]
    metric, nlist, nprobe = "cosine", 128, 16
train, test = np.ascontiguousarray(train, np.float32), np.ascontiguousarray(test, np.float32)
t, q = torch.from_numpy(train), torch.from_numpy(test)
if metric == "cosine":
    t, q = torch.nn.functional.normalize(t, dim=1), torch.nn.functional.normalize(q, dim=1)
truth = torch.cdist(q, t).topk(10, largest=False).indices.numpy()
dim = train.shape[1]
for bits in budgets:
    built = {}
    for threshold in (3.0, 2.25):
        _fastscan.TWO_STAGE_MIN_BITS = threshold
        index = tqvec.IVFIndex(dim, nlist, bits, metric, rotation="fht-kac", encoding="direct", seed=0)
        index.train(train)
        index.add(train)
        ids = index.search(test, 10, nprobe=nprobe)[1]  # builds the layout under this threshold
        plan = index.quantizer.table("cpu").native_plan()
        recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, truth)])
        built[threshold] = (index, ids, recall, _fastscan.layout(plan), plan.bits_per_channel)
    qps = {th: [] for th in built}
    for _ in range(2):
        for th, (index, *_rest) in built.items():
            times = []
            for _ in range(5):
                start = time.perf_counter()
                index.search(test, 10, nprobe=nprobe)
                times.append(time.perf_counter() - start)
            qps[th].append(len(test) / min(times))
    differ = int((built[3.0][1] != built[2.25][1]).sum())
    for th, (_, _, recall, layout, bpc) in built.items():
        print(f"| {name} | {bits:g} | {bpc:.2f} | {th:g} | {layout} | {recall:.4f} | "
              f"{' / '.join(f'{x:,.0f}' for x in qps[th])} |", flush=True)
    speedup = np.median(qps[2.25]) / np.median(qps[3.0])
    print(f"| {name} | {bits:g} | | | speed-up {speedup:.2f}x, ids differing {differ} of {truth.size} | | |", flush=True)
