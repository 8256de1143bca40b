"""Lloyd–Max codebooks checked independently of the solver.

Reference samples come straight from the exact coordinate density of a uniform unit vector in R^d,
f(x) ∝ (1 − x²)^((d−3)/2): if B ~ Beta(a, a) with a = (d−1)/2 then x = 2B − 1 has density
∝ ((1+x)(1−x))^(a−1) = (1 − x²)^((d−3)/2). Only numpy draws them; the code under test supplies just the
levels and boundaries being judged.

Monte Carlo precision: with N = 2·10^6 samples the relative standard error of a mean squared error is
CV(e²)/√N ≲ 2/1414 ≈ 0.15 %, so the 2 % acceptance tolerance is > 10 standard errors wide.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from tqvec import codebook as codebook_module
from tqvec.codebook import lloyd_max_codebook

pytestmark = pytest.mark.usefixtures("single_torch_thread")

N_SAMPLES = 2_000_000
# TurboQuant paper (arXiv 2504.19874), Thm. 1 / Table: D_mse ≈ 0.36, 0.117, 0.03, 0.009 for b = 1..4;
# the Gaussian-limit Lloyd–Max values (Max 1960) are 0.3634, 0.1175, 0.03454, 0.009497.
PAPER_MSE_D1536 = {1: 0.363, 2: 0.117, 3: 0.0345, 4: 0.0095}


def exact_density_samples(dim: int, n: int = N_SAMPLES, seed: int = 0) -> np.ndarray:
    """``n`` draws of one coordinate of a uniform unit vector in R^dim (numpy only)."""
    a = (dim - 1) / 2
    return 2.0 * np.random.default_rng(seed).beta(a, a, size=n) - 1.0


def quantize(x: np.ndarray, levels: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Nearest-level scalar quantizer given ascending decision boundaries."""
    return levels[np.searchsorted(boundaries, x)]


@pytest.fixture(scope="module")
def samples() -> dict[int, np.ndarray]:
    return {d: exact_density_samples(d, seed=d) for d in (25, 128, 1536)}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [25, 128, 1536])
def test_unit_vector_mse_matches_monte_carlo(samples: dict[int, np.ndarray], dim: int, bits: int) -> None:
    """d·E[(x − Q(x))²] by Monte Carlo on exact-density samples is within 2 % of ``unit_vector_mse``."""
    cb = lloyd_max_codebook(dim, bits)
    x = samples[dim]
    measured = dim * float(np.mean((x - quantize(x, cb.levels, cb.boundaries)) ** 2))
    assert measured == pytest.approx(cb.unit_vector_mse, rel=0.02)
    assert cb.unit_vector_mse == pytest.approx(dim * cb.mse)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_d1536_matches_paper_values(bits: int) -> None:
    """At d = 1536 the density is ≈ N(0, 1/d); the MSE is within 1 % of the paper's rounded values.

    The finite-d correction is O(1/d) ≈ 0.07 %, far below the 3-significant-digit rounding (≤ 0.5 %).
    """
    assert lloyd_max_codebook(1536, bits).unit_vector_mse == pytest.approx(PAPER_MSE_D1536[bits], rel=0.01)


def test_small_dim_differs_from_gaussian_limit() -> None:
    """At d = 25 the exact density is visibly lighter-tailed than N(0, 1/d): the MSE is lower than the limit.

    Per-coordinate variance is exactly 1/d in both cases, but the bounded support [−1, 1] makes the
    exact density easier to quantize; at 1 bit d·E|x|² − d·(E|x|)² gives 1 − d·(E|x|)², and
    d·(E|x|)² > 2/π for finite d, so d·mse < 1 − 2/π ≈ 0.3634.
    """
    assert lloyd_max_codebook(25, 1).unit_vector_mse < PAPER_MSE_D1536[1] * 0.98


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("dim", [3, 25, 128, 1536])
def test_levels_sorted_symmetric_boundaries_midpoints(dim: int, bits: int) -> None:
    """2^b strictly ascending levels in [−1, 1], symmetric about 0; boundaries are the midpoints."""
    cb = lloyd_max_codebook(dim, bits)
    assert cb.levels.shape == (1 << bits,) and cb.boundaries.shape == ((1 << bits) - 1,)
    assert np.all(np.diff(cb.levels) > 0)
    assert np.all(np.abs(cb.levels) <= 1.0)
    np.testing.assert_allclose(cb.levels, -cb.levels[::-1], atol=1e-12)
    np.testing.assert_allclose(cb.boundaries, 0.5 * (cb.levels[1:] + cb.levels[:-1]), rtol=0, atol=1e-15)
    assert 0 < cb.mse < 1.0 / dim  # better than coding every coordinate as 0 (variance 1/d)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [25, 128, 1536])
def test_levels_are_conditional_means(samples: dict[int, np.ndarray], dim: int, bits: int) -> None:
    """Lloyd–Max centroid condition: each level equals E[x | x in its cell], within 5 Monte Carlo SEs.

    SE of a cell mean = (within-cell std)/√(cell count); a tiny absolute floor (1e-4/√d) covers the
    solver's quadrature grid (spacing 32/(√d·2^17) ≈ 2.4e-4/√d).
    """
    cb = lloyd_max_codebook(dim, bits)
    x = samples[dim]
    cell = np.searchsorted(cb.boundaries, x)
    counts = np.bincount(cell, minlength=1 << bits)
    assert np.all(counts > 1000)
    means = np.bincount(cell, weights=x, minlength=1 << bits) / counts
    second = np.bincount(cell, weights=x * x, minlength=1 << bits) / counts
    se = np.sqrt(np.maximum(second - means**2, 0) / counts)
    np.testing.assert_array_less(np.abs(cb.levels - means), 5 * se + 1e-4 / np.sqrt(dim))


def test_codebook_is_locally_optimal(samples: dict[int, np.ndarray]) -> None:
    """Moving any one level by ±2 % of its cell width raises the Monte Carlo MSE (d = 128, b = 3)."""
    cb = lloyd_max_codebook(128, 3)
    x = samples[128]

    def mse(levels: np.ndarray) -> float:
        return float(np.mean((x - quantize(x, levels, 0.5 * (levels[1:] + levels[:-1]))) ** 2))

    base = mse(cb.levels)
    step = 0.02 * np.min(np.diff(cb.levels))
    for i in range(len(cb.levels)):
        for sign in (-1, 1):
            moved = cb.levels.copy()
            moved[i] += sign * step
            assert mse(moved) > base


def test_disk_cache_first_use_fast(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A (d, b) solved once is cached on disk; after clearing the in-memory cache, loading takes < 0.5 s."""
    monkeypatch.setenv("TQVEC_CACHE", str(tmp_path))
    lloyd_max_codebook.cache_clear()
    try:
        solved = lloyd_max_codebook(999, 8)
        files = list((tmp_path / "codebooks").glob("*.npy"))
        assert len(files) == 1
        lloyd_max_codebook.cache_clear()
        start = time.perf_counter()
        loaded = lloyd_max_codebook(999, 8)
        elapsed = time.perf_counter() - start
        assert elapsed < 0.5
        np.testing.assert_array_equal(loaded.levels, solved.levels)
        assert loaded.mse == solved.mse
        # a corrupt cache file is ignored and re-solved, not trusted
        files[0].write_bytes(b"not a numpy file")
        lloyd_max_codebook.cache_clear()
        np.testing.assert_allclose(lloyd_max_codebook(999, 8).levels, solved.levels, rtol=0, atol=1e-12)
    finally:
        lloyd_max_codebook.cache_clear()


def test_cache_dir_follows_environment(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQVEC_CACHE", str(tmp_path))
    assert codebook_module.cache_dir() == tmp_path


@pytest.mark.parametrize("dim, bits", [(2, 1), (0, 4), (25.0, 2), (25, 0), (25, 9), (25, 2.5)])
def test_invalid_arguments_raise(dim: object, bits: object) -> None:
    lloyd_max_codebook.cache_clear()
    with pytest.raises(ValueError, match="dim|bits"):
        lloyd_max_codebook(dim, bits)
