"""Small committed test fixtures cut from real data sets, so that the tests need no data folder.

``kjv_slice`` writes a seeded slice of the KJV MiniLM-384 set (King James Bible verses embedded with
all-MiniLM-L6-v2) as a compressed ``.npz``: ``x`` (rows, 384) float16 (unit vectors rounded to float16;
readers cast to float32 and renormalise), ``rows`` (rows,) int64, the sorted train-row numbers taken, and
``source``, a one-line description. No pickle: every array is numeric or a fixed-width string.

Made by (``shared/data`` holds the full set)::

    python -m tqvec.datasets.fixtures --source ../shared/data/kjv-minilm-384-angular.hdf5 \\
        --out tests/data/kjv-minilm-384-slice.npz
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import h5py
import numpy as np

ROWS = 5_000
SEED = 384


def kjv_slice(source: str | os.PathLike, out: str | os.PathLike, rows: int = ROWS, seed: int = SEED) -> Path:
    """Write ``rows`` seeded train rows of the KJV HDF5 file ``source`` to ``out`` (see the module docstring).

    Raises ``ValueError`` when ``rows`` is not in [1, the train size] or the train set is not 384-d unit vectors.
    """
    with h5py.File(source, "r") as f:
        train = f["train"]
        if not 1 <= rows <= train.shape[0]:
            raise ValueError(f"rows must lie in [1, {train.shape[0]}], got {rows}")
        picked = np.sort(np.random.default_rng(seed).choice(train.shape[0], size=rows, replace=False))
        x = np.asarray(train[picked], dtype=np.float32)
    if x.shape[1] != 384 or not np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-4):
        raise ValueError(f"{source}: expected 384-d unit vectors, got shape {x.shape}")
    description = (f"KJV MiniLM-384 (all-MiniLM-L6-v2 verse embeddings): {rows} of {train.shape[0]} train rows, "
                   f"numpy default_rng({seed}).choice, sorted; float16")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, x=x.astype(np.float16), rows=picked.astype(np.int64), source=np.array(description))
    os.replace(tmp, out)
    return out


def load_slice(path: str | os.PathLike) -> np.ndarray:
    """The vectors of a slice written by :func:`kjv_slice`: (rows, 384) float32, unit-normalised."""
    with np.load(path, allow_pickle=False) as f:
        x = f["x"].astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m tqvec.datasets.fixtures --source KJV.hdf5 --out FILE.npz [--rows N] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="python -m tqvec.datasets.fixtures", description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="kjv-minilm-384-angular.hdf5")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    print(kjv_slice(args.source, args.out, args.rows, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
