"""Read and write ANN data sets in the ann-benchmarks HDF5 layout.

Datasets ``train`` (n, d) and ``test`` (nq, d) float32, ``neighbors`` (nq, k) int32 (row indices of
``train``, best first) and ``distances`` (nq, k) float32; attributes ``distance`` (the metric) and
``dimension`` (d). Distances ascend along each row: ``1 − cos`` for "angular", the L2 distance (not
squared) for "euclidean", and ``−⟨q, x⟩`` for "ip".
"""
from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

METRICS = ("angular", "euclidean", "ip")
_DATASETS = ("train", "test", "neighbors", "distances")


class DatasetError(ValueError):
    """A data set that is missing, malformed or unknown."""


@dataclass
class AnnDataset:
    """An ANN benchmark set; shapes are checked on construction.

    train: (n, d) float32; test: (nq, d) float32; neighbors: (nq, k) int32 indices into ``train``,
    best first; distances: (nq, k) float32, ascending (see the module docstring); metric: one of
    ``METRICS``.
    """

    name: str
    train: np.ndarray
    test: np.ndarray
    neighbors: np.ndarray
    distances: np.ndarray
    metric: str

    def __post_init__(self) -> None:
        self.train = np.asarray(self.train, dtype=np.float32)
        self.test = np.asarray(self.test, dtype=np.float32)
        self.neighbors = np.asarray(self.neighbors, dtype=np.int32)
        self.distances = np.asarray(self.distances, dtype=np.float32)
        problem = _problem(self.train, self.test, self.neighbors, self.distances, self.metric)
        if problem:
            raise DatasetError(f"data set {self.name!r}: {problem}")

    @property
    def dim(self) -> int:
        return self.train.shape[1]

    @property
    def k(self) -> int:
        """Number of ground-truth neighbors per query."""
        return self.neighbors.shape[1]


def _problem(train: np.ndarray, test: np.ndarray, neighbors: np.ndarray, distances: np.ndarray,
             metric: str) -> str | None:
    """What is wrong with these arrays as a data set, or None."""
    if metric not in METRICS:
        return f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}"
    for name, a in zip(_DATASETS, (train, test, neighbors, distances)):
        if a.ndim != 2:
            return f"{name} must be 2-D, got shape {a.shape}"
    if test.shape[1] != train.shape[1]:
        return f"dimension mismatch: train has d={train.shape[1]}, test has d={test.shape[1]}"
    if neighbors.shape[0] != test.shape[0]:
        return f"neighbors has {neighbors.shape[0]} rows but test has {test.shape[0]} queries"
    if distances.shape != neighbors.shape:
        return f"distances shape {distances.shape} != neighbors shape {neighbors.shape}"
    if neighbors.size and (neighbors.min() < 0 or neighbors.max() >= train.shape[0]):
        return f"neighbors must index train rows [0, {train.shape[0]})"
    return None


def _attr_str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_ann_hdf5(path: str | os.PathLike) -> AnnDataset:
    """Load an ann-benchmarks HDF5 file fully into memory; the name is the file's stem."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such data set file: {path}")
    if not h5py.is_hdf5(path):
        raise DatasetError(f"{path}: not an HDF5 file")
    with h5py.File(path, "r") as f:
        missing = [name for name in _DATASETS if name not in f]
        if missing:
            raise DatasetError(f"{path}: missing dataset(s) {', '.join(missing)} (found: {', '.join(f) or 'none'})")
        if "distance" not in f.attrs:
            raise DatasetError(f"{path}: missing attribute 'distance' (the metric: {', '.join(METRICS)})")
        arrays = {name: f[name][()] for name in _DATASETS}
        metric = _attr_str(f.attrs["distance"])
        dimension = f.attrs.get("dimension")
    problem = _problem(**arrays, metric=metric)
    if problem:
        raise DatasetError(f"{path}: {problem}")
    if dimension is not None and int(dimension) != arrays["train"].shape[1]:
        raise DatasetError(f"{path}: attribute dimension={int(dimension)} but train has d={arrays['train'].shape[1]}")
    return AnnDataset(path.stem, metric=metric, **arrays)


@contextlib.contextmanager
def _atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success fsync it and rename it to ``path``, else delete it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_ann_hdf5(path: str | os.PathLike, ds: AnnDataset, attrs: dict[str, str] | None = None) -> None:
    """Write ``ds`` atomically in the ann-benchmarks layout, with extra string ``attrs`` if given."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        for name in _DATASETS:
            f.create_dataset(name, data=getattr(ds, name))
        f.attrs.update({"distance": ds.metric, "dimension": ds.dim, "type": "dense", "point_type": "float",
                        **(attrs or {})})
