"""tqvec as an ann-benchmarks algorithm: ``bench/annb/install_harness.py`` copies this folder's ``module.py``,
``config.yml`` and ``Dockerfile`` to ``ann_benchmarks/algorithms/tqvec/`` of an ann-benchmarks checkout.

``TqvecIVF(metric, bits, encoding, nlist, rerank_bits, rotation)`` builds a :class:`tqvec.ivf.IVFIndex`;
``set_query_arguments(nprobe, rerank)`` sets the lists probed and the re-ranking depth factor (0: none).
Angular data are searched with ``metric="cosine"``, euclidean with ``"l2"``.

Contract with the harness (``ann_benchmarks/runner.py``):

- ``fit`` trains the coarse k-means explicitly before adding, so any ``nlist`` ≤ rows works (more lists
  than rows are clipped to the row count); it builds on every CPU the process may use.
- ``query`` (one vector) runs on one torch thread, the harness's one-CPU rule; ``batch_query`` uses every CPU
  in ``os.sched_getaffinity(0)`` and restores one thread afterwards.
- ``fit`` drops its float copies and k-means temporaries and returns freed heap to the OS before it ends, and
  :meth:`get_memory_usage` returns freed heap before it reads the resident set size, so the harness's
  ``index_size`` (the growth across ``fit``) measures the index: neither tqvec's leftovers nor, in ``--local``
  mode where one process runs every definition, heap that earlier algorithms freed (trimming that only after
  ``fit`` made the growth negative). ``get_additional()["index_bytes"]`` is the index's own byte count.
- ``str(algo)`` names every constructor and query argument, so each setting is a distinct run.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tqvec.ivf import IVFIndex

try:  # inside an ann-benchmarks checkout
    from ..base.module import BaseANN
except ImportError:  # in the tqvec repository
    from .base import BaseANN

METRICS = {"angular": "cosine", "euclidean": "l2", "ip": "ip"}


def allowed_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` torch intra-op threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def release_free_heap() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


class TqvecIVF(BaseANN):
    """tqvec's inverted-file TurboQuant index. ``bits``: storage bits per dimension (codes + side info);
    ``encoding``: "residual" | "direct"; ``nlist``: coarse lists (clipped to the number of rows);
    ``rerank_bits``: bits of the re-ranking code, 0 for none; ``rotation``: "haar" | "hadamard" | "fht-kac"."""

    def __init__(self, metric: str, bits: float, encoding: str = "residual", nlist: int = 1024,
                 rerank_bits: float = 0, rotation: str = "haar") -> None:
        if metric not in METRICS:
            raise ValueError(f"unsupported metric {metric!r}")
        self._metric, self._bits, self._encoding, self._nlist = metric, bits, encoding, int(nlist)
        self._rotation = rotation
        self._rerank_bits = rerank_bits or None
        self._nprobe, self._rerank = 1, 0
        self.index: IVFIndex | None = None
        self.res: np.ndarray | None = None

    def fit(self, X: np.ndarray) -> None:
        """Train the coarse lists on ``X`` ``(n, d)``, then encode and add every row (ids = row numbers)."""
        with torch_threads(allowed_cpus()):
            x = np.ascontiguousarray(X, dtype=np.float32)
            index = IVFIndex(x.shape[1], min(self._nlist, len(x)), self._bits, METRICS[self._metric],
                             encoding=self._encoding, rerank_bits=self._rerank_bits, rotation=self._rotation)
            index.train(x)
            index.add(x)
            del x
        self.index = index
        torch.set_num_threads(1)
        release_free_heap()

    def get_memory_usage(self) -> float:
        """Resident set size of this process in kB, read after freed heap is returned to the OS."""
        release_free_heap()
        return super().get_memory_usage()

    def set_query_arguments(self, nprobe: int, rerank: int = 0) -> None:
        """``nprobe`` lists probed per query; ``rerank`` > 0 rescores the best ``rerank · k`` candidates with
        the re-ranking code (needs ``rerank_bits``)."""
        if int(rerank) and self._rerank_bits is None:
            raise ValueError("rerank > 0 needs rerank_bits")
        self._nprobe, self._rerank = int(nprobe), int(rerank)

    def _search(self, X: np.ndarray, n: int) -> np.ndarray:
        _, ids = self.index.search(np.asarray(X, dtype=np.float32), n, nprobe=self._nprobe, rerank=self._rerank or None)
        return ids

    def query(self, v: np.ndarray, n: int) -> np.ndarray:
        """Ids of the ``n`` nearest rows to ``v`` ``(d,)``, best first, on one torch thread."""
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        ids = self._search(v[None, :], n)[0]
        return ids[ids >= 0]

    def batch_query(self, X: np.ndarray, n: int) -> None:
        """All queries ``X`` ``(nq, d)`` at once on every allowed CPU; results via :meth:`get_batch_results`."""
        with torch_threads(allowed_cpus()):
            self.res = self._search(X, n)

    def get_batch_results(self) -> list[np.ndarray]:
        return [ids[ids >= 0] for ids in self.res]

    def get_additional(self) -> dict[str, Any]:
        """The index's own byte count (codes, side information, ids, list entries, centroids), its lists and
        its correction."""
        return {"index_bytes": self.index.nbytes, "bytes_per_vector": self.index.nbytes / max(1, len(self.index)),
                "nlist": self.index.nlist, "correction": self.index.correction}

    def __str__(self) -> str:
        rerank = f", rerank_bits={self._rerank_bits:g}, rerank={self._rerank}" if self._rerank_bits else ""
        rotation = f", rotation={self._rotation}" if self._rotation != "haar" else ""
        return (f"TqvecIVF(bits={self._bits:g}, encoding={self._encoding}, nlist={self._nlist}{rotation}, "
                f"nprobe={self._nprobe}{rerank})")
