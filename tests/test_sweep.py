"""``bench.sweep`` (issue 6): ann-benchmarks' recall with distance slack, true distances, QPS bookkeeping,
Pareto frontier, and one tiny end-to-end sweep writing JSON, markdown and plots."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tqvec.bench import sweep
from tqvec.datasets import AnnDataset, exact_knn, write_ann_hdf5
from tqvec.ivf import IVFIndex


def test_knn_recall_uses_the_kth_distance_plus_slack() -> None:
    gt = np.array([[0.1, 0.2, 0.3], [1.0, 1.0, 1.0]])
    runs = [np.array([0.1, 0.2, 0.3009]),  # within 1e-3 of the 3rd true distance: all count
            np.array([1.0, 1.0011])]  # beyond the slack, and a missing third result
    assert np.allclose(sweep.knn_recall(gt, runs, k=3), [1.0, 1 / 3])
    assert np.allclose(sweep.knn_recall(gt, [np.array([0.2, 0.25, 0.3]), np.array([9.0, 0.5, 1.0])], k=2), [0.5, 0.5])
    # only the first k returned results count
    assert sweep.knn_recall(gt[:1], [np.array([5.0, 0.1, 0.1])], k=1)[0] == 0.0


def test_true_distances_follow_ann_benchmarks_metrics() -> None:
    train = np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]], dtype=np.float32)
    q = np.array([[1.0, 0.0]], dtype=np.float32)
    ids = [np.array([0, 2])]
    assert np.allclose(sweep.true_distances(train, q, ids, "angular")[0], [1 - 0.6, 1.0])
    assert np.allclose(sweep.true_distances(train, q, ids, "euclidean")[0], [np.sqrt(4 + 16), np.sqrt(1 + 4)])
    assert np.allclose(sweep.true_distances(train, q, ids, "ip")[0], [-3.0, 0.0])


def test_pareto_frontier() -> None:
    recall = [0.5, 0.9, 0.8, 0.95, 0.7]
    qps = [100.0, 50.0, 40.0, 10.0, 200.0]
    assert sweep.pareto_frontier(recall, qps) == [3, 1, 4]


class _Fake:
    """A BaseANN that answers from a fixed table, sleeping a known time per query."""

    def __init__(self, answers: np.ndarray, delay: float) -> None:
        self.answers, self.delay, self.calls = answers, delay, []
        self.nprobe = 0

    def get_memory_usage(self) -> float:
        return 0.0

    def fit(self, X: np.ndarray) -> None:
        self.n = len(X)

    def set_query_arguments(self, nprobe: int) -> None:
        self.nprobe = nprobe
        self.calls.append(nprobe)

    def query(self, v: np.ndarray, n: int) -> np.ndarray:
        time.sleep(self.delay)
        row = int(np.argmin(np.abs(self.queries - v).sum(1)))
        return self.answers[row][: self.nprobe]

    def batch_query(self, X: np.ndarray, n: int) -> None:
        time.sleep(self.delay * len(X))
        self.res = [self.answers[i][: self.nprobe] for i in range(len(X))]

    def get_batch_results(self) -> list[np.ndarray]:
        return self.res

    def get_additional(self) -> dict:
        return {"index_bytes": 1000, "bytes_per_vector": 10.0}

    def __str__(self) -> str:
        return f"Fake({self.nprobe})"


@pytest.mark.parametrize("batch", [False, True])
def test_run_definition_bookkeeping(batch: bool) -> None:
    rng = np.random.default_rng(0)
    train, queries = rng.standard_normal((100, 4)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    neighbors, distances = exact_knn(train, queries, 10, "euclidean")
    fake = _Fake(neighbors.astype(np.int64), delay=0.002)
    fake.queries = queries
    records = sweep.run_definition(sweep.Definition("fake", lambda: fake, [(5,), (10,), (10,)]), train, queries,
                                   distances, "euclidean", k=10, runs=2, batch=batch, run_cap=60, arg_cap=60,
                                   log=lambda s: None)
    # returning the first 5 true neighbours: recall 0.5; all 10: 1.0, and then the sweep stops
    assert [r["recall"] for r in records] == [0.5, 1.0]
    assert fake.calls == [5, 10]
    for r in records:
        assert r["runs"] == 2 and len(r["run_times_per_query_s"]) == 2
        assert r["qps"] == pytest.approx(1 / min(r["run_times_per_query_s"]))
        assert 0.002 <= min(r["run_times_per_query_s"]) < 0.05
        assert r["bytes_per_vector"] == 10.0 and r["queries"] == 5 and r["batch"] is batch and r["build_time_s"] >= 0


def test_run_cap_stops_repeats() -> None:
    rng = np.random.default_rng(1)
    train, queries = rng.standard_normal((50, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    neighbors, distances = exact_knn(train, queries, 10, "euclidean")
    fake = _Fake(neighbors.astype(np.int64), delay=0.001)
    fake.queries = queries
    records = sweep.run_definition(sweep.Definition("fake", lambda: fake, [(3,), (4,)]), train, queries, distances,
                                   "euclidean", k=10, runs=5, batch=False, run_cap=0.0, arg_cap=0.0, log=lambda s: None)
    assert len(records) == 1 and records[0]["runs"] == 1  # one run, and no larger arguments after it


@pytest.mark.slow  # builds every competitor library's index
def test_end_to_end_tiny_sweep(tmp_path) -> None:
    rng = np.random.default_rng(2)
    centres = rng.standard_normal((8, 32)) * 3
    x = (centres[rng.integers(0, 8, 2100)] + rng.standard_normal((2100, 32))).astype(np.float32)
    train, test = x[:2000], x[2000:]
    neighbors, distances = exact_knn(train, test, 10, "euclidean")
    path = tmp_path / "tiny-32-euclidean.hdf5"
    write_ann_hdf5(path, AnnDataset("tiny", train, test, neighbors, distances, "euclidean"))
    out = tmp_path / "out"
    assert sweep.main(["--dataset", str(path), "--queries", "20", "--runs", "1", "--only", "tqvec-ivf 4b residual$",
                       "--out", str(out)]) == 0
    data = json.loads((out / "sweep_tiny-32-euclidean.json").read_text())
    assert data["meta"]["queries"] == 20 and data["meta"]["nlist"] == 32
    assert {r["family"] for r in data["runs"]} == {"tqvec-ivf 4b residual"}
    last = data["runs"][-1]
    # the recorded recall is what the index itself returns, scored by the ann-benchmarks rule
    index = IVFIndex(32, 32, 4, metric="l2")
    index.add(train)
    _, ids = index.search(test[:20], 10, nprobe=last["query_args"][0])
    ids = [row[row >= 0] for row in ids]
    expected = sweep.knn_recall(distances[:20], sweep.true_distances(train, test[:20], ids, "euclidean")).mean()
    assert last["recall"] == pytest.approx(expected) and last["bytes_per_vector"] == pytest.approx(index.nbytes / 2000)
    page = (out / "sweep_tiny-32-euclidean.md").read_text()
    assert "--dataset" in page and "Best QPS at recall@10" in page
    for suffix in ("qps", "size", "build"):
        assert (out / f"sweep_tiny-32-euclidean_{suffix}.png").stat().st_size > 1000
    # --update re-runs one family and keeps the others' records
    assert sweep.main(["--dataset", str(path), "--queries", "20", "--runs", "1", "--only", "tqvec-ivf 4b direct$",
                       "--out", str(out), "--update"]) == 0
    updated = json.loads((out / "sweep_tiny-32-euclidean.json").read_text())
    assert {r["family"] for r in updated["runs"]} == {"tqvec-ivf 4b residual", "tqvec-ivf 4b direct"}
    assert [r for r in updated["runs"] if r["family"] == "tqvec-ivf 4b residual"] == data["runs"]
    assert "were re-run" in (out / "sweep_tiny-32-euclidean.md").read_text()
