"""Exact k-nearest-neighbor ground truth, computed in float64 blocks with bounded memory.

Scores for a (query block × train block) tile come from one matmul and only that tile's top-k is
kept, so memory is O(block_q · (block_n + k · n / block_n)) rather than O(nq · n).
"""
from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from .hdf5 import METRICS, DatasetError

_BLOCK_Q = 1024
_BLOCK_N = 32768


def _normalized(x: torch.Tensor, name: str) -> torch.Tensor:
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    if bool((norms == 0).any()):
        raise DatasetError(f"angular metric: {name} has a zero vector (row {int((norms == 0).nonzero()[0, 0])})")
    return x / norms


def _top_k_scores(q: torch.Tensor, train: torch.Tensor, sq_norms: torch.Tensor | None,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``q @ train.T`` (minus ``sq_norms / 2`` per train row when given): each train
    block's top-k, then the top-k of those candidates. Returns (scores, indices), (nq, k) each."""
    scores, indices = [], []
    for start in range(0, train.shape[0], _BLOCK_N):
        s = q @ train[start:start + _BLOCK_N].T
        if sq_norms is not None:
            s -= 0.5 * sq_norms[start:start + _BLOCK_N]
        s, i = torch.topk(s, min(k, s.shape[1]), dim=1)
        scores.append(s)
        indices.append(i + start)
    best, pos = torch.topk(torch.cat(scores, dim=1), k, dim=1)
    return best, torch.gather(torch.cat(indices, dim=1), 1, pos)


def _distances(scores: np.ndarray, q: np.ndarray, metric: str) -> np.ndarray:
    """ann-benchmarks distances from the scores of ``_top_k_scores`` for queries ``q`` (nq, d)."""
    if metric == "angular":
        return 1.0 - scores
    if metric == "euclidean":  # ‖q − x‖² = ‖q‖² − 2 (⟨q, x⟩ − ‖x‖²/2)
        return np.sqrt(np.maximum((q * q).sum(axis=1, keepdims=True) - 2.0 * scores, 0.0))
    return -scores


def exact_knn(train: np.ndarray, test: np.ndarray, k: int, metric: str,
              progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` neighbors of each ``test`` row among ``train`` rows.

    train: (n, d); test: (nq, d), any float dtype, computed in float64. Returns ``neighbors``
    (nq, k) int32, best first (equal distances listed by index; which of several rows tied at the
    k-th place make the cut is arbitrary), and ``distances`` (nq, k) float32 in the ann-benchmarks
    convention: ``1 − cos`` (angular), L2 distance (euclidean), ``−⟨q, x⟩`` (ip).
    """
    if metric not in METRICS:
        raise DatasetError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    if train.ndim != 2 or test.ndim != 2 or train.shape[1] != test.shape[1]:
        raise DatasetError(f"train {train.shape} and test {test.shape} must be 2-D with the same dimension")
    if not (np.isfinite(train).all() and np.isfinite(test).all()):
        raise DatasetError("train and test must be finite (found NaN or Inf)")
    if not 1 <= k <= train.shape[0]:
        raise DatasetError(f"k must lie in [1, {train.shape[0]}] (the train size), got {k}")
    x = torch.from_numpy(np.asarray(train, dtype=np.float64))
    q_all = torch.from_numpy(np.asarray(test, dtype=np.float64))
    if metric == "angular":
        x, q_all = _normalized(x, "train"), _normalized(q_all, "test")
    sq_norms = (x * x).sum(dim=1) if metric == "euclidean" else None
    neighbors = np.empty((test.shape[0], k), dtype=np.int32)
    distances = np.empty((test.shape[0], k), dtype=np.float32)
    with tqdm(total=test.shape[0], unit="query", desc=f"ground truth ({metric}, k={k})",
              disable=not progress) as bar:
        for start in range(0, test.shape[0], _BLOCK_Q):
            q = q_all[start:start + _BLOCK_Q]
            s, i = _top_k_scores(q, x, sq_norms, k)
            s, i = s.numpy(), i.numpy()
            order = np.lexsort((i, -s), axis=-1)  # best score first, then lower index
            s, i = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
            neighbors[start:start + len(q)], distances[start:start + len(q)] = i, _distances(s, q.numpy(), metric)
            bar.update(len(q))
    return neighbors, distances
