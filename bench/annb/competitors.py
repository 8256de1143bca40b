"""The competitors of :mod:`bench.sweep`, wrapped in ann-benchmarks' ``BaseANN`` style, each configured
as its documentation tells a user to: FAISS index-factory strings, ``turbovec`` and ``rabitqlib`` (PyPI).

Angular data are L2-normalised before ``fit`` and ``query`` (as ann-benchmarks' own FAISS module does).
``get_additional()["index_bytes"]`` is each library's serialized index size.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from .base import BaseANN

#: rabitqlib's k-means and rotator need at least 64 dimensions: smaller vectors are zero-padded (L2 unchanged)
RABITQ_MIN_DIM = 64


def _normalized(X: np.ndarray) -> np.ndarray:
    X = np.ascontiguousarray(X, dtype=np.float32)
    return X / np.maximum(np.linalg.norm(X, axis=-1, keepdims=True), 1e-30)


class FaissFactory(BaseANN):
    """Any FAISS ``index_factory`` string; ``set_query_arguments(params)`` takes a FAISS ParameterSpace
    string such as ``"nprobe=16,k_factor=4"`` or ``"efSearch=64"``. ``ip``: inner-product metric (angular
    data), else L2."""

    def __init__(self, metric: str, factory: str, ip: bool = False) -> None:
        self._metric, self._factory, self._ip = metric, factory, ip
        self._params = ""

    def fit(self, X: np.ndarray) -> None:
        import faiss  # noqa: PLC0415 - bench extra

        X = _normalized(X) if self._metric == "angular" else np.ascontiguousarray(X, dtype=np.float32)
        metric = faiss.METRIC_INNER_PRODUCT if self._ip else faiss.METRIC_L2
        self.index = faiss.index_factory(X.shape[1], self._factory, metric)
        self.index.train(X)
        self.index.add(X)
        self._nbytes = len(faiss.serialize_index(self.index))
        self._space = faiss.ParameterSpace()

    def set_query_arguments(self, params: str) -> None:
        self._params = params
        if params:
            self._space.set_index_parameters(self.index, params)

    def _prep(self, X: np.ndarray) -> np.ndarray:
        return _normalized(X) if self._metric == "angular" else np.ascontiguousarray(X, dtype=np.float32)

    def query(self, v: np.ndarray, n: int) -> np.ndarray:
        _, ids = self.index.search(self._prep(v[None, :]), n)
        return ids[0][ids[0] >= 0]

    def batch_query(self, X: np.ndarray, n: int) -> None:
        self.res = self.index.search(self._prep(X), n)[1]

    def get_batch_results(self) -> list[np.ndarray]:
        return [ids[ids >= 0] for ids in self.res]

    def get_additional(self) -> dict[str, Any]:
        return {"index_bytes": self._nbytes, "bytes_per_vector": self._nbytes / max(1, self.index.ntotal)}

    def __str__(self) -> str:
        return f"Faiss({self._factory}{', ' + self._params if self._params else ''})"


class Turbovec(BaseANN):
    """``turbovec.TurboQuantIndex`` (flat SIMD TurboQuant, inner product; angular data only). As its README
    advises, ``calibrate`` on a uniform random sample of 1,024 rows before adding. Dimensions that are not a
    multiple of 8 are zero-padded (cosine unchanged)."""

    def __init__(self, metric: str, bits: int) -> None:
        if metric != "angular":
            raise ValueError("turbovec scores inner products: angular data only")
        self._metric, self._bits = metric, int(bits)

    def _pad(self, X: np.ndarray) -> np.ndarray:
        X = _normalized(X)
        return np.ascontiguousarray(np.pad(X, ((0, 0), (0, self._dim - X.shape[1]))))

    def fit(self, X: np.ndarray) -> None:
        import turbovec  # noqa: PLC0415 - optional competitor

        self._dim = -(-X.shape[1] // 8) * 8
        X = self._pad(X)
        self.index = turbovec.TurboQuantIndex(self._dim, self._bits)
        sample = np.random.default_rng(0).choice(len(X), size=min(1024, len(X)), replace=False)
        self.index.calibrate(X[sample])
        self.index.add(X)
        self._nbytes = len(self.index.to_bytes())

    def query(self, v: np.ndarray, n: int) -> np.ndarray:
        return self.index.search(self._pad(v[None, :]), n)[1][0]

    def batch_query(self, X: np.ndarray, n: int) -> None:
        self.res = self.index.search(self._pad(X), n)[1]

    def get_batch_results(self) -> list[np.ndarray]:
        return list(self.res)

    def get_additional(self) -> dict[str, Any]:
        return {"index_bytes": self._nbytes, "bytes_per_vector": self._nbytes / max(1, len(self.index))}

    def __str__(self) -> str:
        return f"turbovec(bits={self._bits})"


class RabitqIVF(BaseANN):
    """``rabitqlib.IvfIndex`` (the RaBitQ authors' IVF-RaBitQ) with ``RaBitQKMeans`` clustering on
    ``threads`` threads, vectors zero-padded to ``RABITQ_MIN_DIM``; ``set_query_arguments(nprobe)``."""

    def __init__(self, metric: str, nlist: int, bits: int, threads: int = 1) -> None:
        self._metric, self._nlist, self._bits, self._threads = metric, int(nlist), int(bits), int(threads)
        self._nprobe = 1

    def _prep(self, X: np.ndarray) -> np.ndarray:
        X = _normalized(X) if self._metric == "angular" else np.ascontiguousarray(X, dtype=np.float32)
        return np.ascontiguousarray(np.pad(X, ((0, 0), (0, self._dim - X.shape[1])))) if X.shape[1] < self._dim else X

    def fit(self, X: np.ndarray) -> None:
        import rabitqlib  # noqa: PLC0415 - optional competitor

        self._dim = max(X.shape[1], RABITQ_MIN_DIM)
        X = self._prep(X)
        clustering = rabitqlib.RaBitQKMeans(self._dim, self._nlist, num_threads=self._threads,
                                            final_assignment=rabitqlib.FinalAssignmentMode.Exact)
        clustering.train(X)
        self.index = rabitqlib.IvfIndex(dim=self._dim, max_elements=len(X), num_clusters=self._nlist,
                                        nbits=self._bits, metric="l2")
        self.index.build(X, clustering.centroids, clustering.assignments, num_threads=self._threads)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "index.bin")
            self.index.save(path)
            self._nbytes = os.path.getsize(path)
        self._n = len(X)

    def set_query_arguments(self, nprobe: int) -> None:
        self._nprobe = int(nprobe)

    def query(self, v: np.ndarray, n: int) -> np.ndarray:
        ids = self.index.search(self._prep(v[None, :]), n, self._nprobe, num_threads=1)[0][0].astype(np.int64)
        return ids[ids < self._n]

    def batch_query(self, X: np.ndarray, n: int) -> None:
        self.res = self.index.search(self._prep(X), n, self._nprobe, num_threads=self._threads)[0].astype(np.int64)

    def get_batch_results(self) -> list[np.ndarray]:
        return [ids[ids < self._n] for ids in self.res]

    def get_additional(self) -> dict[str, Any]:
        return {"index_bytes": self._nbytes, "bytes_per_vector": self._nbytes / max(1, self._n)}

    def __str__(self) -> str:
        return f"rabitqlib-IVF(nlist={self._nlist}, bits={self._bits}, nprobe={self._nprobe})"
