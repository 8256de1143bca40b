"""Lloyd's k-means for the coarse lists of :class:`~tqvec.ivf.IVFIndex`, and nearest-centroid assignment with
bounded memory."""
from __future__ import annotations

import torch

from .rotation import rowwise_matmul

KMEANS_ITERATIONS = 20
#: most scores (rows × nlist, float32) that assigning vectors to lists holds at once: 16 MiB
ASSIGN_BLOCK_SCORES = 1 << 22


def kmeans(x: torch.Tensor, k: int, iterations: int = KMEANS_ITERATIONS, seed: int = 0,
           by_ip: bool = False, max_points: int | None = None) -> torch.Tensor:
    """Lloyd's k-means of ``x`` ``(n, d)`` float32 into ``k`` centroids ``(k, d)`` (seeded init from rows).

    ``by_ip``: assign by largest inner product (for ``metric="ip"``) instead of L2. Empty clusters
    are re-seeded from the rows of the largest cluster. ``max_points``: train on a seeded sample of at most
    that many rows (FAISS's ``max_points_per_centroid · k``).
    """
    if max_points is not None and x.shape[0] > max_points:
        sample = torch.randperm(x.shape[0], generator=torch.Generator(device="cpu").manual_seed(seed))[:max_points]
        x = x[sample.to(x.device)]
    n = x.shape[0]
    if n < k:
        raise ValueError(f"k-means needs at least nlist={k} training vectors, got {n}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:k].to(x.device)].clone()
    for _ in range(iterations):
        assign = assign_nearest(x, centroids, by_ip)
        counts = torch.bincount(assign, minlength=k)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        empty = counts == 0
        centroids = torch.where(empty[:, None], centroids, sums / counts.clamp_min(1)[:, None])
        if bool(empty.any()):
            donors = torch.nonzero(assign == int(counts.argmax())).flatten()
            pick = donors[torch.randperm(len(donors), generator=gen)[: int(empty.sum())].to(x.device)]
            centroids[torch.nonzero(empty).flatten()[: len(pick)]] = x[pick] * (1 + 1e-4)
    return centroids


def assign_nearest(x: torch.Tensor, centroids: torch.Tensor, by_ip: bool) -> torch.Tensor:
    """Nearest centroid of each row of ``x`` ``(n, d)`` → ``(n,)`` int64.

    Blockwise: at most :data:`ASSIGN_BLOCK_SCORES` scores (rows × nlist) exist at a time, so memory stays
    bounded whatever ``n`` and ``nlist`` (training calls this every k-means iteration).
    """
    half_sq = 0.5 * (centroids * centroids).sum(1)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    block = max(1, ASSIGN_BLOCK_SCORES // max(1, centroids.shape[0]))
    for start in range(0, x.shape[0], block):
        s = rowwise_matmul(x[start:start + block], centroids.T)
        out[start:start + block] = (s if by_ip else s - half_sq).argmax(1)
    return out
