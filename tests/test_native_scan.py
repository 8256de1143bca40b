"""The native CPU fast-scan kernel (tqvec._fastscan) against the torch reference path.

Both paths compute the same estimates: the native kernel re-scores its candidates exactly with float tables
(sums in another order than torch's GEMM), so scores agree to float32 rounding of a sum of D terms
(tolerance 1e-5 relative to the largest score) and ids agree wherever two scores are not within that
tolerance of each other (ties may swap).
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tqvec import Index, TurboQuantizer, _fastscan, scan
from tqvec.bench.annb.module import torch_threads
from tqvec.ivf import IVFIndex
from tqvec.packing import Layout

pytestmark = pytest.mark.skipif(not _fastscan.available(), reason="the native extension is not built")


@pytest.fixture
def kernel():
    """Run a block under one CPU kernel setting; restores the previous one."""
    before = _fastscan.cpu_kernel()

    def use(name: str) -> None:
        _fastscan.set_cpu_kernel(name)

    yield use
    _fastscan.set_cpu_kernel(before)


@pytest.fixture(params=["nibbles", "signs", "high-pairs", "high-nibbles"])
def layout(request, monkeypatch) -> str:
    """Every SIMD scan on these small dimensions: one stage (8-bit tables of the codes, then the best candidates
    re-scored; wide codes then take the exact kernel), two stages from the signs or, for 3- and 4-bit codes, from
    the high 2 bits of each code (then exact scores of the rows whose bound reaches the k-th best; otherwise only
    for codes of at least TWO_STAGE_MIN_CHANNELS channels), and two stages from the high nibbles of wide codes
    (narrow codes: one stage)."""
    two_stage = request.param in ("signs", "high-pairs")
    monkeypatch.setattr(_fastscan, "TWO_STAGE_MIN_CHANNELS", 1 if two_stage else 1 << 30)
    monkeypatch.setattr(_fastscan, "HIGH_PAIRS", request.param == "high-pairs")
    monkeypatch.setattr(_fastscan, "HIGH_NIBBLES", request.param == "high-nibbles")
    return request.param


#: bits of the codes each two-stage layout reads
_TWO_STAGE_BITS = {"signs": 4, "high-pairs": 4, "high-nibbles": 6}


@pytest.fixture(params=list(_TWO_STAGE_BITS))
def two_stage(request, monkeypatch) -> str:
    """Each two-stage layout, for codes of any number of channels (and of _TWO_STAGE_BITS[layout] bits)."""
    if not _fastscan.simd():
        pytest.skip("this CPU has no AVX2 + FMA: no two-stage layout is built")
    monkeypatch.setattr(_fastscan, "TWO_STAGE_MIN_CHANNELS", 1)
    monkeypatch.setattr(_fastscan, "HIGH_PAIRS", request.param == "high-pairs")
    return request.param


def _assert_same_results(ref: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray]) -> None:
    (d_ref, i_ref), (d_got, i_got) = ref, got
    finite = np.isfinite(d_ref)
    assert np.array_equal(finite, np.isfinite(d_got)) and np.array_equal(i_ref[~finite], i_got[~finite])
    tol = 1e-5 * max(1.0, float(np.abs(d_ref[finite]).max(initial=0.0)))
    np.testing.assert_allclose(d_got[finite], d_ref[finite], rtol=0, atol=tol)
    for q in range(len(i_ref)):
        for j in np.flatnonzero(i_ref[q] != i_got[q]):  # only a tie may swap ids
            assert abs(d_ref[q, j] - d_got[q, j]) <= tol
            others = np.delete(d_ref[q], j)
            assert np.min(np.abs(others - d_ref[q, j])) <= 2 * tol, (q, j)


def _search_both(kernel, index, queries: np.ndarray, k: int, **kw):
    kernel("torch")
    ref = index.search(queries, k, **kw)
    kernel("native")
    return ref, index.search(queries, k, **kw)


def _data(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)) + rng.standard_normal(d)).astype(np.float32)


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("bits,correction", [(1, "auto"), (1.5, "none"), (2, "center"), (2.5, "rescale"),
                                             (3, "auto"), (3.5, "center"), (4, "none"), (4, "rescale"),
                                             (4, "center"), (4.5, "auto"), (8, "auto")])
def test_flat_index_matches_torch(kernel, layout: str, metric: str, bits: float, correction: str) -> None:
    """Odd sizes: d = 93 (not a multiple of 8), n = 1,001 (not of 32), with removals."""
    x, q = _data(1001, 93, seed=1), _data(13, 93, seed=2)
    index = Index(93, bits, metric, correction=correction, seed=3)
    index.add(x)
    index.remove(np.arange(0, 1001, 7))
    assert scan.native_serves(torch.zeros(1, index.quantizer.rotated_dim), index.quantizer.code_block(
        index._codes(index._rows.view().tensors)), index.quantizer.table("cpu"))
    ref, got = _search_both(kernel, index, q, 10)
    _assert_same_results(ref, got)
    _assert_same_results(*_search_both(kernel, index, q, 2000))  # k > n pads alike


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("encoding", ["residual", "direct"])
@pytest.mark.parametrize("bits", [3.5, 8])
def test_ivf_index_matches_torch(kernel, layout: str, metric: str, encoding: str, bits: float) -> None:
    """8-bit codes take the exact kernel over the rows copied in list order in the one-stage setting, two stages
    from their high nibbles in the high-nibble setting."""
    x, q = _data(3001, 40, seed=4), _data(17, 40, seed=5)
    index = IVFIndex(40, 24, bits, metric, encoding=encoding, seed=6)
    index.add(x)
    index.remove(np.arange(0, 3001, 11))
    for nprobe in (1, 5, 24):
        _assert_same_results(*_search_both(kernel, index, q, 10, nprobe=nprobe))
    _assert_same_results(*_search_both(kernel, index, q[:1], 10, nprobe=3))


@pytest.mark.parametrize("max_isa", [0, 1, 2])
@pytest.mark.parametrize("rotation", ["hadamard", "fht-kac"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_structured_rotations_and_zero_queries_match_torch(kernel, monkeypatch, metric: str, rotation: str,
                                                           max_isa: int) -> None:
    """The kernel prepares queries itself (normalize, rotate, probe) as torch does, for a flat and an inverted-file
    index, a zero query included: the Walsh-Hadamard rotation with d = 93 padded to 128, and the FHT-Kac rotation
    at d = 93 (blocks of 64 at both ends, an odd coordinate left out of the butterflies); with the scalar code
    (max_isa 0), and with AVX2 and AVX-512 where the CPU has them."""
    monkeypatch.setattr(_fastscan, "MAX_ISA", max_isa)
    x, q = _data(1200, 93, seed=20), _data(7, 93, seed=21)
    q[3] = 0.0
    for index in (Index(93, 3, metric, rotation=rotation, correction="center", seed=22),
                  IVFIndex(93, 12, 3, metric, encoding="direct", rotation=rotation, correction="center", seed=23),
                  IVFIndex(93, 12, 4, metric, encoding="residual", rotation=rotation, seed=24)):
        index.add(x)
        kw = {"nprobe": 5} if isinstance(index, IVFIndex) else {}
        _assert_same_results(*_search_both(kernel, index, q, 10, **kw))


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_k_beyond_ntotal_pads_as_torch_and_impossible_k_fails_like_it(kernel, metric: str) -> None:
    """A k far beyond ntotal scans for ntotal rows and pads (the torch path's answer, −1 and ∓inf); a k whose (nq, k)
    outputs cannot exist fails with numpy's ValueError on both paths (the native call once raised a TypeError for its
    arguments, from the re-score count 2·k past int64)."""
    x, q = _data(300, 40, seed=50), _data(4, 40, seed=51)
    for index in (Index(40, 4, metric, seed=52), IVFIndex(40, 6, 4, metric, seed=53)):
        if isinstance(index, IVFIndex):
            index.train(x)
        index.add(x)
        kw = {"nprobe": 6} if isinstance(index, IVFIndex) else {}
        ref, got = _search_both(kernel, index, q, 5000, **kw)
        assert got[0].shape == (4, 5000) and (got[1][:, 300:] == -1).all()
        _assert_same_results(ref, got)
        for name in ("torch", "native"):
            kernel(name)
            with pytest.raises(ValueError, match="too big"):
                index.search(q, 2**62, **kw)


def test_flat_batches_on_threads_equal_one_thread() -> None:
    """A flat batch on several threads (prepared, scanned and answered on the pool) returns what one thread returns,
    ties in id order included."""
    x = _data(3000, 96, seed=43)
    q = np.concatenate([x[:5], _data(70, 96, seed=44)])
    index = Index(96, 4, "l2", rotation="fht-kac", seed=45)
    index.add(np.concatenate([x, x[:5]]), ids=np.arange(3005)[::-1].copy())  # duplicates: equal distances, id order
    with torch_threads(1):
        expected = index.search(q, 10)
    with torch_threads(4):
        got = index.search(q, 10)
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_array_equal(got[0], expected[0])
    assert (np.diff(got[1][:5, :2], axis=1) > 0).all()  # each duplicated row's two ids, the lower first


@pytest.mark.parametrize("nq,threads", [(61, 4), (300, 3), (40, 16)])
def test_inverted_file_batches_on_threads_equal_one_thread_and_check_every_query(nq: int, threads: int) -> None:
    """An inverted-file batch on several threads is prepared and scanned in chunks, one thread per chunk (guided: 8
    queries, then smaller chunks towards the end): it returns what one thread returns (bit for bit: each query's work
    is the same), and a NaN or an oversized row anywhere in the batch raises the ValueError one thread raises, naming
    that row."""
    x, q = _data(3000, 96, seed=40), _data(nq, 96, seed=41)
    index = IVFIndex(96, 16, 4, "l2", rotation="fht-kac", seed=42)
    index.add(x)
    with torch_threads(1):
        expected = index.search(q, 10, nprobe=5)
    with torch_threads(threads):
        got = index.search(q, 10, nprobe=5)
        np.testing.assert_array_equal(got[1], expected[1])
        np.testing.assert_array_equal(got[0], expected[0])
        bad = q.copy()
        bad[nq * 3 // 5, 5] = np.nan
        with pytest.raises(ValueError, match="queries contains NaN or Inf"):
            index.search(bad, 10, nprobe=5)
        bad = q.copy()
        bad[nq - 9] = 1e20
        with pytest.raises(ValueError, match=f"queries row {nq - 9} has squared L2 norm"):
            index.search(bad, 10, nprobe=5)


@pytest.mark.parametrize("max_isa", [1, 2])
@pytest.mark.parametrize("dim", [300, 784])
def test_wide_fht_kac_queries_match_torch(kernel, monkeypatch, dim: int, max_isa: int) -> None:
    """The kernel's Walsh-Hadamard transform runs up to three levels per pass (after the levels within a register):
    FHT-Kac blocks of 256 and 512 rotate queries as torch does, with AVX2 and with AVX-512 where the CPU has it."""
    monkeypatch.setattr(_fastscan, "MAX_ISA", max_isa)
    x, q = _data(900, dim, seed=31), _data(6, dim, seed=32)
    index = Index(dim, 4, "l2", rotation="fht-kac", seed=33)
    index.add(x)
    _assert_same_results(*_search_both(kernel, index, q, 10))


@pytest.mark.parametrize("dim,bits", [(67, 2.7), (93, 4), (384, 4), (50, 1), (64, 2), (200, 8), (45, 3), (77, 5.5), (50, 6.3)])
def test_every_kernel_returns_the_same_rows(layout: str, dim: int, bits: float) -> None:
    """The scalar kernel (exact float tables for every row) and the fast scans (8-bit tables, then an exact
    re-score of the best candidates; AVX2, and AVX-512 where the CPU has it) return the same rows: 4-, 3-, 2- and
    1-bit segments, straddling tails, odd and even runs of nibble pairs, lists of sizes not a multiple of 32."""
    if not _fastscan.simd():
        pytest.skip("this CPU has no AVX2 + FMA: only the scalar kernel exists")
    quantizer = TurboQuantizer(dim, bits, seed=7, rescale=True)
    codes = quantizer.encode(_data(2000, dim, seed=8))
    rotated, _ = quantizer.rotate_queries(_data(9, dim, seed=9))
    plan = quantizer.table("cpu").native_plan()
    lists = _fastscan.Lists(np.array([0, 700, 701, 1333, 2000], np.int64), np.random.default_rng(3).permutation(2000))
    probe = np.array([[0, 2, -1], [1, 3, 2]] * 4 + [[3, 0, 1]], np.int64)
    constant = np.random.default_rng(4).standard_normal(probe.shape).astype(np.float32)
    source = _fastscan.rows(codes.packed, codes.scales, None, plan, lists)
    out = {}
    chosen = _fastscan.layout(plan, lists)  # lists copied in order (wide codes, one stage): the scalar kernel runs
    for isa, name in enumerate(_fastscan.kernels()):
        values, rows, used, _ = _fastscan._native.search(plan.handle, source, rotated.numpy(), probe, constant, 10, 64,
                                                      _fastscan.CONFIDENCE, 1, isa)
        two_stage = chosen in ("signs", "high-pairs", "high-nibbles")
        simd_name = "avx512" if name in ("avx512-vnni", "amx") else name  # the int8 kernel serves flat batches only
        assert used == ("scalar" if not isa or chosen == "lists" else simd_name + ("-two-stage" if two_stage else ""))
        out[name] = (values, rows)
    for name in _fastscan.kernels()[1:]:
        _assert_same_results(out["scalar"], out[name])


@pytest.mark.parametrize("dim,bits", [(93, 3), (384, 4), (45, 3.5), (67, 3.2), (77, 5.5), (200, 8)])
def test_flat_batches_by_int8_products_return_the_same_rows(monkeypatch, dim: int, bits: float) -> None:
    """A flat batch of 70 queries over 1,001 rows (with AVX-512 VNNI the int8 kernel: rows decoded to byte levels,
    byte runs of 4-bit codes, 3-bit runs, single steps and straddling codes, 16-query tiles with a partial last one
    (with AMX: an odd number of tiles, the last paired with a padding tile), candidates re-scored exactly) returns the
    scalar kernel's rows, with per-query constants and k past the rows."""
    if not _fastscan.simd():
        pytest.skip("this CPU has no AVX2 + FMA: only the scalar kernel exists")
    monkeypatch.setattr(_fastscan, "TWO_STAGE_MIN_CHANNELS", 1)
    quantizer = TurboQuantizer(dim, bits, seed=11, rescale=True)
    codes = quantizer.encode(_data(1001, dim, seed=12))
    rotated = quantizer.rotate_queries(_data(70, dim, seed=13))[0].numpy()
    plan = quantizer.table("cpu").native_plan()
    source = _fastscan.rows(codes.packed, codes.scales, torch.linspace(-1, 1, 1001), plan)
    probe = np.zeros((70, 1), np.int64)
    constant = np.random.default_rng(14).standard_normal((70, 1)).astype(np.float32)
    for k in (10, 1200):
        out = {}
        for isa, name in enumerate(_fastscan.kernels()):
            values, rows, used, exact = _fastscan._native.search(plan.handle, source, rotated, probe, constant, k,
                                                                 _fastscan.rescore_count(k), _fastscan.CONFIDENCE, 2, isa)
            if name in ("avx512-vnni", "amx"):
                assert used == name and np.all(exact == min(1001, max(k, _fastscan.rescore_count(k))))
            out[name] = (values, rows)
        for name in _fastscan.kernels()[1:]:
            _assert_same_results(out["scalar"], out[name])


@pytest.mark.parametrize("threads", [3, 4])
def test_int8_batches_split_rows_across_threads(monkeypatch, threads: int) -> None:
    """With fewer query chunks than threads the int8 kernel splits the rows into parts (at least 1,024 rows each:
    4,500 rows make 3 and 4 parts) that share their cuts: the best candidates by estimate over all parts are the
    one-part ones (k = rescore: each is a result, so a part that skipped a row it should keep changes the answer),
    and with k = 10 the rows are the scalar kernel's."""
    if "avx512-vnni" not in _fastscan.kernels():
        pytest.skip("this CPU has no AVX-512 VNNI: the int8 kernel does not run")
    monkeypatch.setattr(_fastscan, "TWO_STAGE_MIN_CHANNELS", 1)
    quantizer = TurboQuantizer(64, 4, seed=21)
    codes = quantizer.encode(_data(4500, 64, seed=22))
    rotated = quantizer.rotate_queries(_data(50, 64, seed=23))[0].numpy()
    plan = quantizer.table("cpu").native_plan()
    source = _fastscan.rows(codes.packed, codes.scales, None, plan)
    none = np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32)

    def search(k: int, rescore: int, threads: int, isa: int):
        values, rows, used, exact = _fastscan._native.search(plan.handle, source, rotated, *none, k, rescore,
                                                             _fastscan.CONFIDENCE, threads, isa)
        assert used == _fastscan.kernels()[isa] and (isa < 3 or np.all(exact == rescore))
        return values, rows

    for isa in range(3, len(_fastscan.kernels())):  # VPDPBUSD, and AMX tiles where the CPU has them
        _assert_same_results(search(40, 40, 1, isa), search(40, 40, threads, isa))
        _assert_same_results(search(10, 32, 1, 0), search(10, 32, threads, isa))


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("bits,correction", [(3, "auto"), (4, "center"), (4.5, "none"), (8, "rescale")])
def test_flat_index_batches_match_torch(kernel, monkeypatch, metric: str, bits: float, correction: str) -> None:
    """Index.search of a batch large enough for the int8 kernel (where the CPU has AVX-512 VNNI), with removals."""
    monkeypatch.setattr(_fastscan, "TWO_STAGE_MIN_CHANNELS", 1)
    x, q = _data(1001, 93, seed=15), _data(70, 93, seed=16)
    index = Index(93, bits, metric, correction=correction, seed=17)
    index.add(x)
    index.remove(np.arange(0, 1001, 7))
    _assert_same_results(*_search_both(kernel, index, q, 10))
    _assert_same_results(*_search_both(kernel, index, q[:40], 1000))  # k > n pads alike


def test_two_stage_layout_copies_codes_only_for_lists(monkeypatch) -> None:
    """One group of rows (a flat index): the two-stage layout holds sign bits and per-row factors and re-scores from
    the stored codes (no second copy: fewer bytes than the codes); lists (an inverted file): it also copies each row
    in list order."""
    if not _fastscan.simd():
        pytest.skip("this CPU has no AVX2 + FMA: no fast-scan layout is built")
    monkeypatch.setattr(_fastscan, "TWO_STAGE_MIN_CHANNELS", 1)
    monkeypatch.setattr(_fastscan, "HIGH_PAIRS", False)
    quantizer = TurboQuantizer(128, 4, seed=7)
    codes = quantizer.encode(_data(3000, 128, seed=12))
    plan = quantizer.table("cpu").native_plan()
    lists = _fastscan.Lists(np.array([0, 1000, 3000], np.int64), np.random.default_rng(3).permutation(3000))
    for grouping in (None, lists):
        assert _fastscan.layout(plan, grouping) == "signs"
        source = _fastscan.rows(codes.packed, codes.scales, None, plan, grouping)
        copied = source.layout_nbytes > codes.packed.numel()
        assert copied == (grouping is not None), (grouping, source.layout_nbytes, codes.packed.numel())


@pytest.mark.parametrize(("bits", "expected"), [(4, "signs"), (3, "signs"), (2.5, "signs"), (2, "nibbles")])
def test_index_budgets_of_two_and_a_half_bits_and_up_scan_in_two_stages(monkeypatch, bits: float, expected: str) -> None:
    """An index's bit budget pays for the per-row scale and bias too, so its 3-bit codes hold under 3 bits per channel
    (784 channels: 2.92): the two-stage scan must still take them (one stage scanned them several times slower), and
    2-bit codes keep the one-stage scan."""
    if not _fastscan.simd():
        pytest.skip("this CPU has no AVX2 + FMA: no fast-scan layout is built")
    monkeypatch.setattr(_fastscan, "HIGH_PAIRS", False)
    plan = IVFIndex(784, 4, bits, "l2", seed=0).quantizer.table("cpu").native_plan()
    assert int(bits) - 1 < plan.bits_per_channel < bits
    assert _fastscan.layout(plan) == expected


def _flat_top10_as_reference(quantizer: TurboQuantizer, codes, rotated: torch.Tensor) -> tuple[np.ndarray, int]:
    """The native top 10 of one rotated query ``(1, dim)`` over ``codes`` as one group (the layout's default kernel
    and settings), asserted equal to the torch reference's; returns its rows and how many rows it scored exactly."""
    plan = quantizer.table("cpu").native_plan()
    source = _fastscan.rows(codes.packed, codes.scales, None, plan)
    values, rows, _, exact = _fastscan._native.search(plan.handle, source, rotated.numpy(), *_fastscan._NO_PROBE, 10,
                                                      _fastscan.rescore_count(10), _fastscan.CONFIDENCE, 1, _fastscan.MAX_ISA)
    reference = scan._search_torch(rotated, quantizer.code_block(codes), quantizer.table("cpu"), 10, None)
    _assert_same_results((reference[0].numpy(), reference[1].numpy()), (values, rows))
    return rows[0], int(exact.reshape(-1)[0])


def test_two_stage_scores_exactly_only_rows_that_can_reach_the_top_k(two_stage: str) -> None:
    """One block of 32 rows, 10 near the query and 22 near its opposite: before the top 10 has any exact score, the
    rows whose upper bound is below the 10th largest lower bound are skipped, so only the 10 near rows get an exact
    score (scoring all 32 fails this); the answer is the reference's."""
    dim, bits = 256, _TWO_STAGE_BITS[two_stage]
    rng = np.random.default_rng(21)
    query = rng.standard_normal(dim).astype(np.float32)
    noise = 0.3 * rng.standard_normal((32, dim)).astype(np.float32)
    near = (np.arange(32) % 3 == 0) & (np.arange(32) < 30)  # rows 0, 3, .., 27
    x = np.where(near[:, None], query, -query) + noise
    quantizer = TurboQuantizer(dim, bits, seed=7)
    codes = quantizer.encode(x)
    plan = quantizer.table("cpu").native_plan()
    assert _fastscan.layout(plan) == two_stage
    rows, scored = _flat_top10_as_reference(quantizer, codes, quantizer.rotate_queries(query[None])[0])
    assert scored == 10
    assert sorted(rows.tolist()) == list(range(0, 30, 3))


def test_two_stage_scores_queued_rows_best_first_and_drops_those_passed(two_stage: str) -> None:
    """Two blocks: 32 rows at a middling angle to the query, then 32 nearer ones at graded angles. The first block's
    rows are queued for an exact score (each reaches the 10th largest lower bound of its block) and wait while the
    second block's first stage runs, whose lower bounds then pass their upper bounds: none of them is scored (as
    queued, all 32 were). A block's queued rows are scored highest upper end first, each only while it can still
    enter the top 10, so the number scored does not depend on the rows' order in the block (in scan order, the
    second block reversed scores more). The answers are the reference's."""
    dim, bits = 256, _TWO_STAGE_BITS[two_stage]
    rng = np.random.default_rng(23)
    query, other = rng.standard_normal((2, dim)).astype(np.float32)
    middling = 0.5 * query + other + 0.2 * rng.standard_normal((32, dim)).astype(np.float32)
    closeness = np.linspace(1.0, 0.5, 32, dtype=np.float32)[:, None]
    near = closeness * query + (1 - closeness) * other + 0.05 * rng.standard_normal((32, dim)).astype(np.float32)
    quantizer = TurboQuantizer(dim, bits, seed=7)
    plan = quantizer.table("cpu").native_plan()
    assert _fastscan.layout(plan) == two_stage
    rotated, _ = quantizer.rotate_queries(query[None])
    scored = [_flat_top10_as_reference(quantizer, quantizer.encode(np.concatenate([middling, second])), rotated)[1]
              for second in (near, near[::-1])]
    assert scored[0] == scored[1] < 32, scored


@pytest.mark.parametrize("k", [1, 32, 33, 70])
def test_two_stage_keeps_the_top_k_for_any_k(kernel, k: int) -> None:
    """The two-stage scan keeps the k largest lower bounds in a sorted array up to 32 of them and in a heap beyond:
    every k returns the reference's top k."""
    x, q = _data(1500, 256, seed=50), _data(9, 256, seed=51)
    index = IVFIndex(256, 8, 4, "ip", seed=52)
    index.add(x)
    _assert_same_results(*_search_both(kernel, index, q, k, nprobe=3))


def test_two_stage_keeps_near_duplicates_of_the_query(two_stage: str) -> None:
    """Rows and queries all close to one vector (cosines 0.9-1): the first stage's estimate must be exact along the
    row itself, as RaBitQ's is (a projection on the coarse code underestimates such rows by the coarse code's squared
    error, about 5 bound widths at 2 bits, and drops true neighbours); the top 10 is the reference's."""
    dim, bits = 384, _TWO_STAGE_BITS[two_stage]
    rng = np.random.default_rng(31)
    base = rng.standard_normal(dim).astype(np.float32)
    x = base + rng.uniform(0.1, 0.5, (2000, 1)).astype(np.float32) * rng.standard_normal((2000, dim)).astype(np.float32)
    queries = base + 0.1 * rng.standard_normal((20, dim)).astype(np.float32)
    quantizer = TurboQuantizer(dim, bits, seed=7)
    codes = quantizer.encode(x)
    plan = quantizer.table("cpu").native_plan()
    assert _fastscan.layout(plan) == two_stage
    rotated, _ = quantizer.rotate_queries(queries)
    got = _fastscan.search(rotated.numpy(), _fastscan.rows(codes.packed, codes.scales, None, plan), plan, 10)
    reference = scan._search_torch(rotated, quantizer.code_block(codes), quantizer.table("cpu"), 10, None)
    _assert_same_results((reference[0].numpy(), reference[1].numpy()), got)


def test_reference_vectors_tighten_the_first_stage(two_stage: str) -> None:
    """Four lists of residual codes around far-apart centroids, queries near one of them: bounding each estimate
    around its list's centroid (|q − c| for |q| where smaller, the estimate shifted by its exact error at c) scores
    fewer rows exactly (without the shift the answer is wrong; with |q| alone, more rows are scored), and the answer
    stays the reference's."""
    dim, bits, per_list = 256, _TWO_STAGE_BITS[two_stage], 500
    rng = np.random.default_rng(41)
    centers = 4.0 * rng.standard_normal((4, dim)).astype(np.float32)
    x = np.repeat(centers, per_list, axis=0) + rng.standard_normal((4 * per_list, dim)).astype(np.float32)
    queries = centers[np.arange(12) % 4] + rng.standard_normal((12, dim)).astype(np.float32)
    quantizer = TurboQuantizer(dim, bits, seed=7)
    codes = quantizer.encode(x - np.repeat(centers, per_list, axis=0))  # residual codes, as an inverted file stores
    plan = quantizer.table("cpu").native_plan()
    rotated, _ = quantizer.rotate_queries(queries)
    rotated_centers, _ = quantizer.rotate_queries(centers)
    offsets, members = np.arange(0, 4 * per_list + 1, per_list, dtype=np.int64), np.arange(4 * per_list, dtype=np.int64)
    closeness = (rotated @ rotated_centers.T).numpy().astype(np.float32)  # <q, c_l>: the residual codes' list constant
    probe = np.argsort(-closeness, axis=1, kind="stable").astype(np.int64)  # every list, nearest first (as IVF probes)
    constant = np.take_along_axis(closeness, probe, 1)
    found = {}
    for name, reference in (("none", None), ("centroids", rotated_centers.numpy())):
        lists = _fastscan.Lists(offsets, members, reference)
        source = _fastscan.rows(codes.packed, codes.scales, None, plan, lists)
        values, rows, _, exact = _fastscan._native.search(plan.handle, source, rotated.numpy(), probe, constant, 10,
                                                          _fastscan.rescore_count(10), _fastscan.CONFIDENCE, 1,
                                                          _fastscan.MAX_ISA)
        found[name] = (values, rows, int(exact.sum()))
    assert found["centroids"][2] < 0.8 * found["none"][2], (found["centroids"][2], found["none"][2])
    for q in range(12):  # the reference: every row's exact score plus its list's constant for this query
        bias = torch.from_numpy(np.repeat(closeness[q], per_list))
        values, rows = scan._search_torch(rotated[q:q + 1], quantizer.code_block(codes, bias), quantizer.table("cpu"),
                                          10, None)
        _assert_same_results((values.numpy(), rows.numpy()), (found["centroids"][0][q:q + 1], found["centroids"][1][q:q + 1]))


def test_threads_do_not_change_results(kernel) -> None:
    """One query on four threads splits its rows (flat) or its lists (IVF) across them; three queries batch."""
    x, q = _data(20000, 32, seed=10), _data(3, 32, seed=11)
    flat, ivf = Index(32, 4, "l2"), IVFIndex(32, 8, 4, "ip")
    flat.add(x)
    ivf.add(x)
    kernel("native")
    for search in (lambda v: flat.search(v, 10), lambda v: ivf.search(v, 10, nprobe=8)):
        for queries in (q[:1], q):
            with torch_threads(1):
                one = search(queries)
            with torch_threads(4):
                many = search(queries)
            assert np.array_equal(one[1], many[1]) and np.array_equal(one[0], many[0])


@pytest.mark.parametrize("rotation", ["haar", "fht-kac"])
def test_a_batch_answers_each_query_as_alone(kernel, rotation: str) -> None:
    """Queries are prepared in blocks (each row of the centroids and of a Haar matrix read once for the block): a
    query's answer, distances bit for bit, does not depend on its block mates (batches of 2 to 11 queries)."""
    x, q = _data(3000, 100, seed=34), _data(11, 100, seed=35)
    ivf = IVFIndex(100, 16, 4, "l2", rotation=rotation, seed=3)
    ivf.add(x)
    kernel("native")
    with torch_threads(1):
        alone = [ivf.search(q[i:i + 1], 10, nprobe=4) for i in range(len(q))]
        for n in range(2, len(q) + 1):
            distances, ids = ivf.search(q[:n], 10, nprobe=4)
            for i in range(n):
                assert np.array_equal(ids[i], alone[i][1][0]) and np.array_equal(distances[i], alone[i][0][0]), (n, i)


def test_concurrent_searches_share_the_thread_pool(kernel) -> None:
    """Searches from several Python threads at once, each on several native threads (one shared pool), return what
    one thread returns alone."""
    x, q = _data(6000, 48, seed=30), _data(40, 48, seed=31)
    flat, ivf = Index(48, 4, "l2"), IVFIndex(48, 16, 4, "cosine")
    flat.add(x)
    ivf.add(x)
    kernel("native")
    with torch_threads(1):
        alone = [flat.search(q, 10), ivf.search(q, 10, nprobe=4)]
    with torch_threads(4), ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(lambda: (flat.search(q, 10), ivf.search(q, 10, nprobe=4))) for _ in range(16)]
        results = [run.result() for run in runs]
    for got in results:
        for (d_ref, i_ref), (d_got, i_got) in zip(alone, got):
            assert np.array_equal(i_ref, i_got) and np.array_equal(d_ref, d_got)


def _voluntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def test_a_narrow_search_wakes_only_the_helpers_it_uses(kernel) -> None:
    """After a 16-thread search has started 15 pool helpers, a 2-thread search wakes one of them, not all: each
    helper woken for nothing sleeps again (a voluntary context switch), and the 15 of them halved a 2-core machine's
    throughput. The old pool made at least 15 switches per search here, this one about 1.5."""
    x, q = _data(4000, 64, seed=34), _data(200, 64, seed=35)
    ivf = IVFIndex(64, 16, 4, "l2", seed=0)
    ivf.add(x)
    kernel("native")
    with torch_threads(16):
        ivf.search(q, 10, nprobe=4)
    with torch_threads(2):
        ivf.search(q, 10, nprobe=4)
        before = _voluntary_switches()
        for _ in range(50):
            ivf.search(q, 10, nprobe=4)
        per_search = (_voluntary_switches() - before) / 50
    assert per_search < 8, per_search


# A child process that makes 20 two-thread searches, each followed by 10 ms of sleep, and prints the process's CPU
# seconds during those sleeps (the pool helpers' polling) and its number of usable CPUs. argv: "one-cpu" pins it to one.
_IDLE_CPU_CHILD = """
import os, sys, time
import numpy as np, torch
from tqvec.ivf import IVFIndex
if sys.argv[1] == "one-cpu":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
rng = np.random.default_rng(0)
x, q = rng.standard_normal((4000, 64), dtype=np.float32), rng.standard_normal((200, 64), dtype=np.float32)
ivf = IVFIndex(64, 16, 4, "l2", seed=0)
ivf.add(x)
torch.set_num_threads(2)
ivf.search(q, 10, nprobe=4)
time.sleep(0.5)  # torch's own threads, busy in add(), have gone to sleep
idle = 0.0
for _ in range(20):
    ivf.search(q, 10, nprobe=4)
    start = time.process_time()
    time.sleep(0.01)
    idle += time.process_time() - start
print(idle, len(os.sched_getaffinity(0)))
"""


def _idle_cpu_after_searches(pinning: str, **env: str) -> tuple[float, int]:
    env = {**os.environ, "TQVEC_CPU_KERNEL": "native", **env}
    run = subprocess.run([sys.executable, "-c", _IDLE_CPU_CHILD, pinning], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    idle, cpus = run.stdout.split()
    return float(idle), int(cpus)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pool_helpers_poll_for_the_next_search_briefly_and_only_where_allowed() -> None:
    """After a search, its pool helper polls for the next job for up to kSpinMicroseconds (2 ms) before it sleeps, as
    OpenMP's threads do: 20 searches on 2 threads, each followed by 10 ms of sleep, cost some CPU in those sleeps (20-50
    ms on an idle 2-core machine; less on a busy one, since a poll ends by the clock), never the 200 ms of a helper
    left polling. It does not poll under OMP_WAIT_POLICY=passive, nor where the pool's threads outnumber the process's
    CPUs (pinned to one CPU)."""
    idle, cpus = _idle_cpu_after_searches("all")
    if cpus >= 2:
        assert 0.002 < idle < 0.100, idle
    else:
        assert idle < 0.004, idle
    passive, _ = _idle_cpu_after_searches("all", OMP_WAIT_POLICY="passive")
    pinned, _ = _idle_cpu_after_searches("one-cpu")
    assert passive < 0.004 and pinned < 0.004, (passive, pinned)


def _search_in_child(index: Index, q: np.ndarray, out) -> None:
    torch.set_num_threads(4)
    out.put(index.search(q, 10)[1])


def test_forked_child_starts_its_own_thread_pool(kernel) -> None:
    """After fork() the parent's pool threads do not exist in the child: a multi-threaded search there must start
    its own instead of waiting for them forever."""
    x, q = _data(3000, 32, seed=32), _data(8, 32, seed=33)
    index = Index(32, 4, "ip")
    index.add(x)
    kernel("native")
    with torch_threads(4):
        expected = index.search(q, 10)[1]  # the parent's pool is running now
        context = multiprocessing.get_context("fork")
        out = context.Queue()
        child = context.Process(target=_search_in_child, args=(index, q, out))
        child.start()
        got = out.get(timeout=60)
        child.join(timeout=60)
    assert child.exitcode == 0 and np.array_equal(got, expected)


def test_plan_reads_every_code_bit_and_no_padding() -> None:
    """Each channel is covered by exactly one step, and steps read only the segment's ``dim · bits`` stream bits."""
    layout = Layout(((5, 4), (9, 3), (3, 2), (6, 1), (3, 7), (2, 0), (4, 8)))
    plan = _fastscan.plan(layout, torch.randn(len(layout.segments), 256))
    channels = plan.channel[plan.channel >= 0]
    starts = np.cumsum([0, *(dim for dim, _ in layout.segments)])
    coded = [c for (dim, bits), first in zip(layout.segments, starts) if bits for c in range(first, first + dim)]
    assert sorted(channels.tolist()) == coded  # 0-bit channels decode to 0: no step reads them
    starts = np.cumsum([0, *layout.segment_bytes])
    for byte, shift, width, chans in zip(plan.byte, plan.shift, plan.width, plan.channel):
        segment = int(np.searchsorted(starts, byte, side="right") - 1)
        dim, bits = layout.segments[segment]
        first_bit = 8 * (byte - starts[segment]) + shift
        assert first_bit + width <= dim * bits
        assert width == bits * int((chans >= 0).sum())
    assert np.array_equal(np.diff(plan.offset), 1 << plan.width)


def test_qjl_signs_fall_back_or_raise(kernel) -> None:
    x, q = _data(300, 64, seed=12), _data(2, 64, seed=13)
    for index in (Index(64, 4, "ip", mode="prod"), Index(64, 3, "cosine", mode="prod")):  # QJL signs
        index.add(x)
        kernel("auto")
        auto = index.search(q, 5)
        kernel("torch")
        assert np.array_equal(auto[1], index.search(q, 5)[1])
        kernel("native")
        with pytest.raises(RuntimeError, match="cannot serve"):
            index.search(q, 5)


def test_missing_extension_falls_back(kernel, monkeypatch) -> None:
    """Without the compiled module "auto" runs torch and "native" says why it cannot."""
    x, q = _data(500, 24, seed=14), _data(4, 24, seed=15)
    index = Index(24, 4, "cosine")
    index.add(x)
    kernel("native")
    native = index.search(q, 10)
    monkeypatch.setattr(_fastscan, "_native", None)
    kernel("auto")
    _assert_same_results(native, index.search(q, 10))
    kernel("native")
    with pytest.raises(RuntimeError, match="not built"):
        index.search(q, 10)


def test_bad_kernel_name() -> None:
    with pytest.raises(ValueError, match="cpu kernel"):
        _fastscan.set_cpu_kernel("gpu")
