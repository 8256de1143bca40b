"""tqvec as an ann-benchmarks algorithm: copy this folder (``module.py``, ``config.yml``, ``Dockerfile``) to
``ann_benchmarks/algorithms/tqvec/`` of an ann-benchmarks checkout; nothing needs changing.

``TqvecIVF(metric, bits, encoding, nlist, rerank_bits)`` builds a :class:`tqvec.ivf.IVFIndex`;
``set_query_arguments(nprobe, rerank)`` sets the lists probed and the re-ranking depth factor (0: none).
Angular data are searched with ``metric="cosine"``, euclidean with ``"l2"``.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from tqvec.ivf import IVFIndex

try:  # inside an ann-benchmarks checkout
    from ..base.module import BaseANN
except ImportError:  # in the tqvec repository
    from .base import BaseANN

METRICS = {"angular": "cosine", "euclidean": "l2", "ip": "ip"}


class TqvecIVF(BaseANN):
    """tqvec's inverted-file TurboQuant index. ``bits``: storage bits per dimension (codes + side info);
    ``encoding``: "residual" | "direct"; ``rerank_bits``: bits of the re-ranking code, 0 for none."""

    def __init__(self, metric: str, bits: float, encoding: str = "residual", nlist: int = 1024,
                 rerank_bits: float = 0) -> None:
        if metric not in METRICS:
            raise ValueError(f"unsupported metric {metric!r}")
        self._metric, self._bits, self._encoding, self._nlist = metric, bits, encoding, int(nlist)
        self._rerank_bits = rerank_bits or None
        self._nprobe, self._rerank = 1, 0
        self.index: IVFIndex | None = None
        self.res: np.ndarray | None = None

    def fit(self, X: np.ndarray) -> None:
        if hasattr(os, "sched_getaffinity"):  # ann-benchmarks pins the container to its CPU share
            torch.set_num_threads(min(torch.get_num_threads(), len(os.sched_getaffinity(0))))
        X = np.ascontiguousarray(X, dtype=np.float32)
        self.index = IVFIndex(X.shape[1], min(self._nlist, len(X)), self._bits, METRICS[self._metric],
                              encoding=self._encoding, rerank_bits=self._rerank_bits)
        self.index.add(X)

    def set_query_arguments(self, nprobe: int, rerank: int = 0) -> None:
        self._nprobe, self._rerank = int(nprobe), int(rerank)
        if self._rerank and self._rerank_bits is None:
            raise ValueError("rerank > 0 needs rerank_bits")

    def _search(self, X: np.ndarray, n: int) -> np.ndarray:
        _, ids = self.index.search(np.asarray(X, dtype=np.float32), n, nprobe=self._nprobe, rerank=self._rerank or None)
        return ids

    def query(self, v: np.ndarray, n: int) -> np.ndarray:
        ids = self._search(v[None, :], n)[0]
        return ids[ids >= 0]

    def batch_query(self, X: np.ndarray, n: int) -> None:
        self.res = self._search(X, n)

    def get_batch_results(self) -> list[np.ndarray]:
        return [ids[ids >= 0] for ids in self.res]

    def get_additional(self) -> dict[str, Any]:
        """The index's own byte count (codes, side information, ids, list entries, centroids) and its correction."""
        return {"index_bytes": self.index.nbytes, "bytes_per_vector": self.index.nbytes / max(1, len(self.index)),
                "correction": self.index.correction}

    def __str__(self) -> str:
        rerank = f", rerank_bits={self._rerank_bits:g}, rerank={self._rerank}" if self._rerank_bits else ""
        return (f"TqvecIVF(bits={self._bits:g}, encoding={self._encoding}, nlist={self._nlist}, "
                f"nprobe={self._nprobe}{rerank})")
