"""``tqvec.IVFIndex`` (issue 6): exactness against brute force with nprobe = nlist, both search paths,
ids / remove / reconstruct, persistence, training rules and bad input."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from tqvec import storage
from tqvec.index import Index
from tqvec.ivf import MIN_POINTS_PER_LIST, IVFIndex

pytestmark = pytest.mark.usefixtures("single_torch_thread")

DIM, NLIST = 32, 8


def _data(n: int = 1500, d: int = DIM, seed: int = 0) -> np.ndarray:
    """Gaussian clusters around 8 centres (so that the coarse partition means something)."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).standard_normal((8, d)) * 2
    return (centres[rng.integers(0, 8, n)] + rng.standard_normal((n, d))).astype(np.float32)


def _exact_scores(q: np.ndarray, x: np.ndarray, metric: str, normalize_x: bool = True) -> np.ndarray:
    """What the index's D holds for vectors ``x``: scores (ip, cosine) or squared L2 distances, float64.
    For cosine the queries are normalized, and ``x`` too unless ``normalize_x`` is False (decoded vectors)."""
    q64, x64 = q.astype(np.float64), x.astype(np.float64)
    if metric == "cosine":
        q64 = q64 / np.linalg.norm(q64, axis=1, keepdims=True)
        x64 = x64 / np.linalg.norm(x64, axis=1, keepdims=True) if normalize_x else x64
    if metric == "l2":
        return ((q64[:, None, :] - x64[None]) ** 2).sum(-1)
    return q64 @ x64.T


def _check_topk(D: np.ndarray, I: np.ndarray, expected: np.ndarray, ids: np.ndarray, metric: str) -> None:
    """``(D, I)`` is the top-k of ``expected`` ``(nq, n)`` (columns = ``ids``) up to float32 ties."""
    k = D.shape[1]
    sign = 1 if metric == "l2" else -1
    order = np.argsort(sign * expected, axis=1, kind="stable")[:, :k]
    ref_D = np.take_along_axis(expected, order, 1)
    tol = 1e-4 * (1 + np.abs(ref_D).max())
    assert np.allclose(D, ref_D, rtol=0, atol=tol)
    mismatch = I != ids[order]
    assert mismatch.mean() < 0.02
    # every returned id's own expected score equals its D (ties aside, the same set)
    col = {int(i): j for j, i in enumerate(ids)}
    got = np.array([[expected[r, col[int(i)]] for i in row] for r, row in enumerate(I)])
    assert np.allclose(got, D, rtol=0, atol=tol)


@pytest.mark.parametrize("metric, correction", [("ip", "rescale"), ("ip", "center"), ("l2", "rescale"),
                                                ("l2", "center"), ("cosine", "center"), ("cosine", "none")])
def test_direct_encoding_with_all_lists_equals_flat_index(metric: str, correction: str) -> None:
    """Same side-information format as Index (not cosine "rescale": Index stores a uint8 log scale there)."""
    x, q = _data(), _data(30, seed=1)
    flat = Index(DIM, 4, metric=metric, correction=correction, seed=3)
    flat.add(x)
    ivf = IVFIndex(DIM, NLIST, 4, metric=metric, encoding="direct", correction=correction, seed=3)
    ivf.add(x)
    assert ivf.quantizer.layout == flat.quantizer.layout
    assert np.array_equal(ivf.reconstruct(np.arange(50)), flat.reconstruct(np.arange(50)))
    D_ref, I_ref = flat.search(q, 10)
    tol = 1e-4 * (1 + np.abs(D_ref).max())
    D, I = ivf.search(q, 10, nprobe=NLIST)
    assert np.allclose(D, D_ref, rtol=0, atol=tol) and (I != I_ref).mean() < 0.02
    for i in range(3):  # one query at a time: the gather path
        D, I = ivf.search(q[i:i + 1], 10, nprobe=NLIST)
        assert np.allclose(D[0], D_ref[i], rtol=0, atol=tol) and (I[0] != I_ref[i]).mean() < 0.1


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("correction", ["none", "rescale", "center"])
def test_residual_encoding_with_all_lists_equals_brute_force_over_decoded(metric: str, correction: str) -> None:
    x, q = _data(), _data(25, seed=1)
    index = IVFIndex(DIM, NLIST, 4, metric=metric, correction=correction)
    ids = index.add(x)
    decoded = index.reconstruct(ids)
    expected = _exact_scores(q, decoded, metric, normalize_x=False)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True) if metric == "cosine" else x
    if metric == "l2":  # the index uses the exact ‖x‖², not ‖x̂‖²
        expected += (xn.astype(np.float64) ** 2).sum(1) - (decoded.astype(np.float64) ** 2).sum(1)
    if correction == "center":  # + ⟨c, x − x̂⟩ with c the vector's centroid (exact along c)
        c = index.centroids.numpy().astype(np.float64)
        home = ((xn[:, None, :] - c[None]) ** 2).sum(-1).argmin(1) if metric != "ip" else (xn @ c.T).argmax(1)
        along = (c[home] * (xn - decoded)).sum(1)
        expected += -2 * along if metric == "l2" else along
    for D, I in (index.search(q, 10, nprobe=NLIST), index.search(q[:1], 10, nprobe=NLIST)):
        _check_topk(D, I, expected[: len(D)], ids, metric)


@pytest.mark.parametrize("encoding", ["residual", "direct"])
def test_single_query_and_list_major_paths_agree(encoding: str) -> None:
    x, q = _data(), _data(40, seed=2)
    index = IVFIndex(DIM, NLIST, 3, metric="cosine", encoding=encoding)
    index.add(x)
    D, I = index.search(q, 10, nprobe=3)  # list by list (40 queries, ≤ 8 lists)
    for i in range(0, 40, 7):
        Di, Ii = index.search(q[i:i + 1], 10, nprobe=3)  # gather path
        assert np.allclose(Di[0], D[i], atol=1e-5) and (Ii[0] != I[i]).mean() <= 0.1


def test_recall_grows_with_nprobe_and_residual_codes_are_accurate() -> None:
    x, q = _data(3000), _data(50, seed=3)
    truth = np.argsort(-_exact_scores(q, x, "cosine"), axis=1)[:, :10]
    index = IVFIndex(DIM, 16, 4, metric="cosine")
    index.add(x)
    recalls = [np.mean([len(set(a) & set(b)) / 10 for a, b in zip(index.search(q, 10, nprobe=p)[1], truth)])
               for p in (1, 4, 16)]
    assert recalls[0] <= recalls[1] <= recalls[2]
    assert recalls[2] >= 0.8


def test_rerank_scores_with_the_fine_code() -> None:
    x, q = _data(), _data(20, seed=4)
    index = IVFIndex(DIM, NLIST, 2, metric="ip", rerank_bits=8)
    ids = index.add(x)
    D, I = index.search(q, 5, nprobe=NLIST, rerank=4)
    fine = index.reconstruct(I.reshape(-1)).reshape(20, 5, DIM)
    assert np.allclose(D, np.einsum("qd,qkd->qk", q, fine), atol=1e-3)
    truth = np.argsort(-_exact_scores(q, x, "ip"), axis=1)[:, :5]
    plain = index.search(q, 5, nprobe=NLIST)[1]
    hits = lambda I_: np.mean([len(set(a) & set(b)) for a, b in zip(I_, truth)])  # noqa: E731
    assert hits(I) >= hits(plain)
    assert index.rerank_bytes_per_vector == math.ceil(DIM * 8 / 8) + 4 and len(ids) == len(x)
    with pytest.raises(ValueError, match="rerank"):
        IVFIndex(DIM, NLIST).search(q, 5, rerank=2)


def test_budget_and_bytes_are_reported() -> None:
    index = IVFIndex(DIM, NLIST, 4, metric="cosine")
    assert index.code_bytes_per_vector <= math.ceil(DIM * 4 / 8) == index.row_bytes
    assert index.bytes_per_vector == index.row_bytes + 8 + 4
    index.add(_data())
    assert index.nbytes == len(index) * index.bytes_per_vector + NLIST * DIM * 4
    assert index.list_sizes.sum() == len(index)


def test_training_rules() -> None:
    x = _data()
    small = x[: MIN_POINTS_PER_LIST * NLIST - 1]
    index = IVFIndex(DIM, NLIST)
    with pytest.raises(ValueError, match="not trained"):
        index.add(small)
    assert len(index) == 0 and not index.is_trained
    index.train(x[:200])  # explicit training: any n ≥ nlist
    index.add(small[:10])
    assert len(index) == 10
    with pytest.raises(ValueError, match="already holds"):
        index.train(x)
    with pytest.raises(ValueError, match="at least"):
        IVFIndex(DIM, NLIST).train(x[:5])
    auto = IVFIndex(DIM, NLIST)
    auto.add(x)  # large enough: trains on its own vectors
    assert auto.is_trained and auto.centroids.shape == (NLIST, DIM)


def test_empty_index_and_fewer_than_k() -> None:
    index = IVFIndex(DIM, NLIST, metric="l2")
    D, I = index.search(_data(3), 4)
    assert (I == -1).all() and np.isinf(D).all()
    index.train(_data())
    index.add(_data(5, seed=7))
    D, I = index.search(_data(2, seed=8), 8, nprobe=NLIST)
    assert (I[:, :5] >= 0).all() and (I[:, 5:] == -1).all() and np.isinf(D[:, 5:]).all()


def test_ids_remove_reconstruct() -> None:
    x = _data()
    index = IVFIndex(DIM, NLIST, 8, metric="l2")
    ids = index.add(x, ids=np.arange(len(x)) * 10 + 5)
    assert np.array_equal(ids, np.arange(len(x)) * 10 + 5)
    err = np.abs(index.reconstruct([5, 15]) - x[:2]).max()
    assert err < 0.1 * np.abs(x).max()
    with pytest.raises(ValueError, match="already in the index"):
        index.add(x[:1], ids=[15])
    with pytest.raises(ValueError, match="duplicates"):
        index.add(x[:2], ids=[1, 1])
    with pytest.raises(KeyError):
        index.remove([5, 6])  # 6 is unknown: nothing removed
    assert len(index) == len(x)
    assert index.remove(ids[::2]) == len(ids[::2])
    assert len(index) == len(x) - len(ids[::2]) and index.list_sizes.sum() == len(index)
    _, I = index.search(x[:50], 10, nprobe=NLIST)
    assert not np.isin(I, ids[::2]).any()
    with pytest.raises(KeyError):
        index.reconstruct([5])
    assert np.allclose(index.reconstruct([15]), index.reconstruct([15]))
    new = index.add(x[:3])  # default ids continue after the largest
    assert new[0] == ids.max() + 1


@pytest.mark.parametrize("encoding, mmap", [("residual", False), ("direct", False), ("residual", True)])
def test_save_load_round_trip(tmp_path, encoding: str, mmap: bool) -> None:
    x, q = _data(), _data(10, seed=5)
    index = IVFIndex(DIM, NLIST, 3, metric="cosine", encoding=encoding, correction="center", rerank_bits=6, nprobe=2)
    ids = index.add(x)
    index.remove(ids[:100])
    path = tmp_path / "ivf.tqv"
    index.save(path)
    loaded = IVFIndex.load(path, mmap=mmap)
    assert repr(loaded) == repr(index) and loaded.nbytes == index.nbytes
    for a, b in zip(index.search(q, 7, rerank=2), loaded.search(q, 7, rerank=2)):
        assert np.array_equal(a, b)
    assert np.array_equal(loaded.reconstruct(ids[100:120]), index.reconstruct(ids[100:120]))
    assert np.array_equal(loaded.add(x[:2]), index.add(x[:2]))
    flat = Index(DIM)
    flat.add(x[:10])
    flat.save(tmp_path / "flat.tqv")
    with pytest.raises(storage.StorageError, match="expected 'tqvec.IVFIndex'"):
        IVFIndex.load(tmp_path / "flat.tqv")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (tmp_path / "bad.tqv").write_bytes(bytes(raw))
    with pytest.raises(storage.StorageError):
        IVFIndex.load(tmp_path / "bad.tqv")


@pytest.mark.parametrize("kwargs, message", [
    ({"nlist": 0}, "nlist"), ({"bits": 0}, "bits"), ({"encoding": "pq"}, "encoding"), ({"metric": "cos"}, "metric"),
    ({"correction": "x"}, "correction"), ({"nprobe": 0}, "nprobe"), ({"mode": "fast"}, "mode"), ({"dim": 0}, "dim"),
])
def test_constructor_rejects(kwargs: dict, message: str) -> None:
    args = {"dim": DIM, "nlist": NLIST, **kwargs}
    with pytest.raises(ValueError, match=message):
        IVFIndex(**args)


def test_bad_input_raises() -> None:
    index = IVFIndex(DIM, NLIST)
    index.add(_data())
    q = _data(2, seed=6)
    for bad, message in [(q[:, :-1], "dimension"), (np.full((1, DIM), np.nan, np.float32), "NaN"),
                         (q[0], "2-D"), (q.astype(np.int32), "floats")]:
        with pytest.raises(ValueError, match=message):
            index.search(bad, 5)
        with pytest.raises(ValueError, match=message):
            index.add(bad)
    with pytest.raises(ValueError, match="k"):
        index.search(q, 0)
    with pytest.raises(ValueError, match="nprobe"):
        index.search(q, 5, nprobe=0)
    with pytest.raises(ValueError, match="ids"):
        index.add(q, ids=[1])


@pytest.mark.parametrize("bad", [0, -3, 2.5, None, True, "4"])
def test_setting_a_bad_nprobe_raises_at_once_and_keeps_the_old_value(bad: object) -> None:
    """``index.nprobe = ...`` (the FAISS habit) is checked when set, not deep inside a later search."""
    index = IVFIndex(DIM, NLIST, nprobe=3)
    index.add(_data())
    with pytest.raises(ValueError, match="nprobe must be a positive integer"):
        index.nprobe = bad
    assert index.nprobe == 3
    index.nprobe = np.int64(NLIST)
    assert index.nprobe == NLIST and type(index.nprobe) is int
    assert index.search(_data(2, seed=6), 5)[1].shape == (2, 5)


def test_concurrent_searches_during_adds() -> None:
    x = _data(3000)
    index = IVFIndex(DIM, NLIST, 4, metric="ip")
    index.add(x[:1500])
    errors: list[BaseException] = []

    def searcher() -> None:
        try:
            for _ in range(20):
                D, I = index.search(x[:5], 5, nprobe=NLIST)
                assert (I >= 0).all() and (I < 3000).all()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=searcher) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(1500, 3000, 100):
        index.add(x[i:i + 100])
    for t in threads:
        t.join()
    assert not errors and len(index) == 3000
    assert torch.get_num_threads() == 1


def test_direct_codes_are_centered_by_the_training_rows() -> None:
    """``train(sample)`` freezes a direct-coded center as the sample's mean (a small first add no longer decides it),
    and warns when the sample is smaller than MIN_CENTER_ROWS."""
    sample, x = _data(1000, seed=2), _data(300, seed=3)
    index = IVFIndex(DIM, NLIST, 4, metric="ip", encoding="direct", correction="center")
    index.train(sample)
    index.add(x[:1])
    assert torch.allclose(index._center, torch.from_numpy(sample).mean(0))
    with pytest.warns(UserWarning, match=r"freezes its center from 20 row\(s\).*train on at least 100 rows") as caught:
        IVFIndex(DIM, 4, 4, metric="ip", encoding="direct", correction="center").train(sample[:20])
    assert caught[0].filename == __file__  # the user's line
