"""Emulate filtered_topk_kernel's passed-candidate count (k = 18, blocks of 4,096) on group maxima of real data (exact
float scores), with the first floor (least of 32 strip maxima) and the committed one (18th largest of 128 or 32). Run
here (CPU) from the repository root: `python bench/results/gpu_scan_runs/30bc81d-filter/passed_on_real_data.py`."""
import numpy as np
import torch

from tqvec.datasets.hdf5 import read_ann_hdf5
from tqvec.datasets.registry import glove_split


def passed(gm: np.ndarray, k: int = 18, block: int = 4096, strips: int = 128, mode: str = "kth") -> np.ndarray:
    """Candidates passed per row of group maxima ``gm``, the floor the k-th largest (or least) strip maximum."""
    out = []
    for row in gm:
        s = np.full(strips, -np.inf)
        count = 0
        for start in range(0, len(row), block):
            v = row[start:start + block]
            pad = np.full(block, -np.inf)
            pad[:len(v)] = v
            s = np.maximum(s, pad.reshape(-1, strips).max(0))
            floor = np.sort(s)[::-1][k - 1] if mode == "kth" else s.min()
            count += int((v >= floor).sum())
        out.append(count)
    return np.array(out)


def report(name: str, x: np.ndarray, q: np.ndarray, group: int) -> None:
    x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    q = torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))
    sc = q @ x.T
    n = sc.shape[1]
    g = -(-n // group)
    pad = torch.full((sc.shape[0], g * group), -float("inf"))
    pad[:, :n] = sc
    gm = pad.view(sc.shape[0], g, group).amax(2).numpy()
    for mode, strips in (("min", 32), ("kth", 128), ("kth", 32)):
        c = passed(gm, strips=strips, mode=mode)
        print(f"{name}: {g} groups of {group}, floor {mode} of {strips} strips: passed median {np.median(c):.0f}, "
              f"p99 {np.percentile(c, 99):.0f}, max {c.max()}")


xtr, xte = glove_split()
report("glove-50 (ip)", xtr, xte[:200], 128)
xn = xtr / np.linalg.norm(xtr, axis=1, keepdims=True)
report("glove-50 (cosine)", xn, xte[:200] / np.linalg.norm(xte[:200], axis=1, keepdims=True), 128)
ds = read_ann_hdf5("../shared/data/kjv-minilm-384-angular.hdf5")
rep = np.concatenate([ds.train] * 32)  # 31k rows -> 1M rows, as a 1M database of these vectors would be grouped
report("kjv-minilm-384 x32", rep, ds.test[:200], 64)
order = np.argsort(ds.train @ ds.train[0])  # rows sorted by one direction: clustered order
report("kjv-minilm-384 sorted x32", np.concatenate([ds.train[order]] * 32), ds.test[:200], 64)
