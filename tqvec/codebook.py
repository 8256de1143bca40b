"""Lloyd–Max codebooks for one coordinate of a uniformly random unit vector in R^d.

After a random rotation every coordinate of a unit vector has density
``f(x) ∝ (1 − x²)^((d−3)/2)`` on [−1, 1] (≈ N(0, 1/d) for large d), whatever the data. The optimal
scalar quantizer of that density is solved here once per (d, bits) by Lloyd–Max iteration on a
fine quadrature grid, then cached in memory and on disk (``$TQVEC_CACHE`` or ``~/.cache/tqvec``).
"""
from __future__ import annotations

import functools
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_GRID_POINTS = 1 << 17
_MAX_ITERATIONS = 20_000
_TOLERANCE = 1e-13
_CACHE_FORMAT = 2  # bump when the solver changes, so stale disk caches are ignored


@dataclass(frozen=True)
class Codebook:
    """The Lloyd–Max scalar quantizer of one coordinate of a random unit vector in R^dim (module docstring).

    Made by :func:`lloyd_max_codebook`; frozen, and shared by every caller of the same ``(dim, bits)``, so its
    arrays must not be modified.

    Attributes
    ----------
    dim : int
        Dimension of the unit vectors whose coordinate density the codebook is solved for (≥ 3).
    bits : int
        Bits per coordinate, 1..8.
    levels : numpy.ndarray of shape (2**bits,), dtype float64
        Reconstruction levels, ascending and symmetric about 0.
    boundaries : numpy.ndarray of shape (2**bits - 1,), dtype float64
        Decision boundaries, ascending: the midpoints of adjacent ``levels``.
    mse : float
        Expected squared error of one coordinate.
    unit_vector_mse : float
        ``dim * mse``: the expected ‖u − û‖² of a unit vector u (read-only property).
    """

    dim: int
    bits: int
    levels: np.ndarray
    boundaries: np.ndarray
    mse: float

    @property
    def unit_vector_mse(self) -> float:
        """``dim * mse``: the expected ‖u − û‖² of a unit vector u."""
        return self.dim * self.mse


def cache_dir() -> Path:
    """Directory for cached codebooks and datasets."""
    return Path(os.environ.get("TQVEC_CACHE", Path.home() / ".cache" / "tqvec"))


def _grid(dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Quadrature nodes on the density's effective support and normalized weights (sum 1)."""
    half_width = min(1.0, 16.0 / math.sqrt(dim))
    x = np.linspace(-half_width, half_width, _GRID_POINTS)
    with np.errstate(divide="ignore"):
        log_density = 0.5 * (dim - 3) * np.log1p(-x * x) if dim > 3 else np.zeros_like(x)
    w = np.exp(log_density - log_density.max())
    w[[0, -1]] *= 0.5  # trapezoid rule
    return x, w / w.sum()


def _solve(dim: int, bits: int) -> tuple[np.ndarray, float]:
    """Lloyd–Max iteration on the quadrature grid; returns (levels, per-coordinate MSE)."""
    x, w = _grid(dim)
    cum_w = np.concatenate([[0.0], np.cumsum(w)])
    cum_xw = np.concatenate([[0.0], np.cumsum(x * w)])
    n_levels = 1 << bits
    # start from the centroids of equal-probability cells
    edges = np.searchsorted(cum_w[1:], np.linspace(0, 1, n_levels + 1)[1:-1])
    levels = _centroids(edges, cum_w, cum_xw)
    for _ in range(_MAX_ITERATIONS):
        edges = np.searchsorted(x, 0.5 * (levels[1:] + levels[:-1]))
        new_levels = _centroids(edges, cum_w, cum_xw)
        new_levels = 0.5 * (new_levels - new_levels[::-1])  # the density is symmetric
        done = np.max(np.abs(new_levels - levels)) < _TOLERANCE
        levels = new_levels
        if done:
            break
    edges = np.searchsorted(x, 0.5 * (levels[1:] + levels[:-1]))
    cell = np.searchsorted(edges, np.arange(len(x)), side="right")
    mse = float(np.sum(w * (x - levels[cell]) ** 2))
    return levels, mse


def _centroids(edges: np.ndarray, cum_w: np.ndarray, cum_xw: np.ndarray) -> np.ndarray:
    bounds = np.concatenate([[0], edges, [len(cum_w) - 1]])
    mass = np.diff(cum_w[bounds])
    moment = np.diff(cum_xw[bounds])
    return moment / np.maximum(mass, 1e-300)


def _cache_path(dim: int, bits: int) -> Path:
    return cache_dir() / "codebooks" / f"v{_CACHE_FORMAT}_d{dim}_b{bits}.npy"


def _load_or_solve(dim: int, bits: int) -> tuple[np.ndarray, float]:
    path = _cache_path(dim, bits)
    try:
        stored = np.load(path, allow_pickle=False)
        if stored.shape == ((1 << bits) + 1,) and np.all(np.isfinite(stored)):
            return stored[:-1], float(stored[-1])
    except (OSError, ValueError):
        pass
    levels, mse = _solve(dim, bits)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npy", delete=False) as tmp:
            np.save(tmp, np.append(levels, mse), allow_pickle=False)
        os.replace(tmp.name, path)
    except OSError:
        pass  # a read-only cache only costs a re-solve next time
    return levels, mse


@functools.cache
def lloyd_max_codebook(dim: int, bits: int) -> Codebook:
    """The Lloyd–Max codebook for coordinates of a random unit vector in R^dim at ``bits`` bits.

    Solved on first use, then cached in memory (the same object is returned for equal arguments) and on disk
    (module docstring); an unwritable disk cache is skipped.

    Parameters
    ----------
    dim : int
        Dimension of the unit vectors, ≥ 3.
    bits : int
        Bits per coordinate, 1..8.

    Returns
    -------
    Codebook
        ``levels`` of shape ``(2**bits,)`` and ``boundaries`` of shape ``(2**bits - 1,)``, float64.

    Raises
    ------
    ValueError
        ``dim`` is not an integer ≥ 3, or ``bits`` not an integer in 1..8 (bools are refused).

    Examples
    --------
    >>> import numpy as np
    >>> cb = lloyd_max_codebook(128, 2)
    >>> cb.levels.shape, cb.boundaries.shape, cb.levels.dtype
    ((4,), (3,), dtype('float64'))
    >>> bool(np.allclose(cb.levels, -cb.levels[::-1]))  # symmetric about 0
    True
    >>> bool(np.allclose(cb.boundaries, (cb.levels[1:] + cb.levels[:-1]) / 2))
    True
    >>> lloyd_max_codebook(128, 3).mse < cb.mse  # one more bit, smaller error
    True
    """
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 3:
        raise ValueError(f"dim must be an integer >= 3, got {dim!r}")
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    levels, mse = _load_or_solve(int(dim), int(bits))
    return Codebook(int(dim), int(bits), levels, 0.5 * (levels[1:] + levels[:-1]), mse)
