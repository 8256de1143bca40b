"""Flat Index search, one thread: 2.5- and 3-bit budgets with the two-stage threshold
(``tqvec._fastscan.TWO_STAGE_MIN_BITS``) at 3 (before) and 2.25 (now), the two indexes built alike and timed in turn
(two rounds): one query at a time (mean of 50, best of 3) and all 200 queries at once (best of 3).
Usage: python flat_two_stage_bits.py mnist|kjv [KJV_HDF5]"""
import sys
import time

import numpy as np
import torch

import tqvec
from tqvec import _fastscan

torch.set_num_threads(1)
if sys.argv[1] == "kjv":
    import h5py
    with h5py.File(sys.argv[2]) as f:
        train, test = f["train"][:], f["test"][:200]
    metric = "cosine"
else:
    from tqvec.datasets.registry import mnist_split
    train, test = mnist_split()
    metric = "l2"
train, test = np.ascontiguousarray(train, np.float32), np.ascontiguousarray(test[:200], np.float32)
for bits in (2.5, 3):
    built = {}
    for threshold in (3, 2.25):
        _fastscan.TWO_STAGE_MIN_BITS = threshold
        index = tqvec.Index(train.shape[1], bits, metric, seed=0)
        index.add(train)
        index.search(test, 10)  # builds the layout under this threshold
        built[threshold] = index
    for _ in range(2):
        for threshold, index in built.items():
            one, batch = [], []
            for _ in range(3):
                start = time.perf_counter()
                for i in range(50):
                    index.search(test[i:i + 1], 10)
                one.append((time.perf_counter() - start) / 50)
                start = time.perf_counter()
                index.search(test, 10)
                batch.append((time.perf_counter() - start) / len(test))
            print(f"| {sys.argv[1]} | {bits:g} | {threshold:g} | {1 / min(one):,.0f} | {1 / min(batch):,.0f} |", flush=True)
