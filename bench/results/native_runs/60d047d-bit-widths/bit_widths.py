"""Native search speed by bit budget on KJV MiniLM (30,102 × 384, cosine), one thread: a flat ``Index`` or an
``IVFIndex`` (128 lists, nprobe 16, FHT-Kac); one query at a time (mean of 50, best of 3) and 200 queries at once
(best of 3), with the layout each budget's codes take (``tqvec._fastscan.layout``).
Usage: python bit_widths.py flat|ivf KJV_HDF5"""
import sys
import time

import h5py
import numpy as np
import torch

import tqvec
from tqvec import _fastscan

torch.set_num_threads(1)
kind = sys.argv[1]
with h5py.File(sys.argv[2]) as f:
    train, test = np.ascontiguousarray(f["train"][:], np.float32), np.ascontiguousarray(f["test"][:200], np.float32)
for bits in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8):
    if kind == "flat":
        index = tqvec.Index(384, bits, "cosine", seed=0)
        index.add(train)
        search = index.search
        probe = {}
    else:
        index = tqvec.IVFIndex(384, 128, bits, "cosine", seed=0, rotation="fht-kac")
        index.train(train)
        index.add(train)
        search = index.search
        probe = {"nprobe": 16}
    search(test, 10, **probe)
    plan = index.quantizer.table("cpu").native_plan()
    one, batch = [], []
    for _ in range(3):
        start = time.perf_counter()
        for i in range(50):
            search(test[i:i + 1], 10, **probe)
        one.append((time.perf_counter() - start) / 50)
        start = time.perf_counter()
        search(test, 10, **probe)
        batch.append((time.perf_counter() - start) / len(test))
    print(f"| {kind} | {bits:g} | {plan.bits_per_channel:.2f} | {_fastscan.layout(plan)} | {1 / min(one):,.0f} | "
          f"{1 / min(batch):,.0f} |", flush=True)
