"""A stand-in for ann-benchmarks' ``ann_benchmarks.algorithms.base.module.BaseANN`` (same methods, same
defaults), used when :mod:`bench.annb.module` runs outside an ann-benchmarks checkout."""
from __future__ import annotations

from multiprocessing.pool import ThreadPool
from typing import Any

import numpy as np
import psutil


class BaseANN:
    """Interface of an ann-benchmarks algorithm: ``fit`` once, then ``set_query_arguments`` and queries."""

    name = "BaseANN"

    def done(self) -> None:
        """Release resources (nothing by default)."""

    def get_memory_usage(self) -> float | None:
        """Resident set size of this process in kB (ann-benchmarks takes the difference around ``fit``)."""
        return psutil.Process().memory_info().rss / 1024

    def fit(self, X: np.ndarray) -> None:
        """Build the index on ``X`` ``(n, d)`` float32."""

    def query(self, q: np.ndarray, n: int) -> Any:
        """Ids of the ``n`` nearest neighbours of ``q`` ``(d,)``."""
        return []

    def batch_query(self, X: np.ndarray, n: int) -> None:
        """Answer all queries ``X`` ``(nq, d)``; results via :meth:`get_batch_results`."""
        pool = ThreadPool()
        self.res = pool.map(lambda q: self.query(q, n), X)

    def get_batch_results(self) -> Any:
        return self.res

    def get_additional(self) -> dict[str, Any]:
        """Extra attributes stored with each run."""
        return {}

    def __str__(self) -> str:
        return self.name
