"""tqvec's ann-benchmarks module driven as the harness drives it (``ann_benchmarks/runner.py``, issue 19).

Every run of every run group in ``bench/annb/config.yml`` is constructed from its config arguments, ``fit`` on a
small real set (GloVe-50, ``N_TRAIN`` rows: fewer than 39 per list for every ``nlist`` of the config, so ``add``
alone could not train), then queried with its first and last query-argument groups through ``query`` and
``batch_query`` / ``get_batch_results``, as ``run_individual_query`` does. The module is imported from an
ann-benchmarks-shaped package (``ann_benchmarks/algorithms/tqvec/module.py`` beside ``base/module.py``), the way
``instantiate_algorithm`` imports it.
"""
from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from tqvec.bench.annb import runs as annb_runs
from tqvec.datasets import exact_knn
from tqvec.datasets.registry import glove_split
from tqvec.ivf import MIN_POINTS_PER_LIST

ANNB = Path(__file__).resolve().parents[1] / "bench" / "annb"
N_TRAIN = 1_500
N_TEST = 20
K = 10


@pytest.fixture(scope="module")
def glove() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``N_TRAIN`` train rows and ``N_TEST`` queries of tqvec's glove-50-angular split, with exact top-K ids."""
    train, test = glove_split()
    train, test = np.ascontiguousarray(train[:N_TRAIN]), np.ascontiguousarray(test[:N_TEST])
    neighbors, _ = exact_knn(train, test, K, "angular")
    return train, test, neighbors


@pytest.fixture(scope="module")
def harness_module(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """``ann_benchmarks.algorithms.tqvec.module`` from a package laid out as in an ann-benchmarks checkout."""
    root = tmp_path_factory.mktemp("harness")
    algorithms = root / "ann_benchmarks" / "algorithms"
    for folder in (algorithms / "base", algorithms / "tqvec"):
        folder.mkdir(parents=True)
    for init in (root / "ann_benchmarks", algorithms, algorithms / "base", algorithms / "tqvec"):
        (init / "__init__.py").touch()
    shutil.copy(ANNB / "base.py", algorithms / "base" / "module.py")
    shutil.copy(ANNB / "module.py", algorithms / "tqvec" / "module.py")
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("ann_benchmarks.algorithms.tqvec.module")
        assert module.BaseANN.__module__ == "ann_benchmarks.algorithms.base.module"
        yield module
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "ann_benchmarks" or m.startswith("ann_benchmarks.")]:
            del sys.modules[name]


def _record_threads(algo: object) -> list[int]:
    """Wrap ``algo.index.search`` to record torch's thread count at each call."""
    seen: list[int] = []
    search = algo.index.search

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return search(*args, **kwargs)

    algo.index.search = recording
    return seen


def _recall(results: list[np.ndarray], neighbors: np.ndarray) -> float:
    return float(np.mean([len(set(r.tolist()) & set(t.tolist())) / K for r, t in zip(results, neighbors)]))


def test_config_nlists_exceed_auto_training() -> None:
    """The CI set is too small for ``add`` to train itself at every list count of the config."""
    runs = annb_runs.definitions("angular", 50)
    assert min(int(r.args[3]) for r in runs) * MIN_POINTS_PER_LIST > N_TRAIN


@pytest.fixture(scope="module")
def warm_runtime(harness_module: ModuleType, glove) -> None:
    """One build and search on two threads before any memory is measured: the process's one-time allocations
    (torch's and MKL's per-thread buffers, the native extension) are not temporaries that ``fit`` leaves."""
    run = annb_runs.definitions("angular", 50)[0]
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        algo = getattr(harness_module, run.constructor)(*run.args)
        algo.fit(glove[0])
        algo.set_query_arguments(*run.query_groups[0])
        algo.batch_query(glove[1], K)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("run", annb_runs.definitions("angular", 50), ids=lambda r: f"{r.group}-{r.args[1]}b")
def test_harness_call_sequence(run: annb_runs.Run, harness_module: ModuleType, glove, warm_runtime: None) -> None:
    train, test, neighbors = glove
    assert run.name == "tqvec-ivf" and run.constructor == "TqvecIVF"
    algo = getattr(harness_module, run.constructor)(*run.args)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # a process allowed several CPUs, as the harness's --local runs are
    try:
        before = algo.get_memory_usage()
        algo.fit(train)
        index_kb = algo.get_memory_usage() - before
        assert index_kb < algo.get_additional()["index_bytes"] / 1024 + 16 * 1024, "fit left temporaries behind"
        seen = _record_threads(algo)
        groups = [run.query_groups[0], run.query_groups[-1]]
        names, recalls = set(), []
        for group in groups:
            algo.set_query_arguments(*group)
            names.add(str(algo))
            single = [algo.query(q, K) for q in test]
            assert seen and set(seen) == {1}, f"single queries ran on {set(seen)} torch threads"
            seen.clear()
            algo.batch_query(test, K)
            batch = algo.get_batch_results()
            assert seen == [harness_module.allowed_cpus()]
            seen.clear()
            assert torch.get_num_threads() == 1
            for res in (*single, *batch):
                assert len(res) == len(set(res.tolist())) <= K
                assert np.all((res >= 0) & (res < N_TRAIN))
            assert _recall(single, neighbors) == pytest.approx(_recall(batch, neighbors), abs=0.02)
            recalls.append(_recall(single, neighbors))
        assert len(names) == len(groups)
        assert recalls[-1] >= recalls[0] - 0.05 and recalls[-1] >= 0.5, recalls  # more lists probed: no real loss
        extra = algo.get_additional()
        assert extra["nlist"] == min(int(run.args[3]), N_TRAIN) and extra["index_bytes"] > 0
        algo.done()
    finally:
        torch.set_num_threads(previous)


def test_names_unique_per_setting(harness_module: ModuleType) -> None:
    """``str(algo)`` differs for every (constructor, query-argument group) of the config: the harness labels
    results and plot points by it."""
    names = []
    for run in annb_runs.definitions("angular", 50):
        algo = getattr(harness_module, run.constructor)(*run.args)
        for group in run.query_groups:
            algo.set_query_arguments(*group)
            names.append(str(algo))
    assert len(names) == len(set(names))


def test_full_run_cost_on_1m_vectors() -> None:
    """The committed config stays sized for a full run on 1M × 100-d vectors and 10k queries (one timed run per
    query group) in well under an hour at the native kernel's scan rate (cost model in ``runs``)."""
    runs = annb_runs.definitions("angular", 100)
    cost = annb_runs.full_run_seconds(runs, n=1_000_000, nq=10_000, dim=100)
    assert cost["total"] < 45 * 60, cost


def test_summary_names_its_command_and_each_algorithms_best_run(tmp_path: Path) -> None:
    """``summary.md`` (what the README quotes) starts with the command that made it; per (data set, algorithm) it keeps
    the fastest run at recall ≥ the goal, and says so when none reached it."""
    from tqvec.bench.annb.harness import RECALL_GOAL, summarize  # noqa: PLC0415 - the harness module is heavy

    csv_path = tmp_path / "results.csv"
    header = "dataset,algorithm,parameters,k-nn,qps,indexsize,build\n"
    rows = [f"d,a,fast-low,{RECALL_GOAL - 0.01},900,1,0.1", f"d,a,slow,{RECALL_GOAL},100,1,0.1",
            f"d,a,fast,{RECALL_GOAL + 0.05},300,1,0.1", "d,b,never,0.5,999,1,0.1"]
    csv_path.write_text(header + "\n".join(rows) + "\n")
    text = summarize(csv_path, tmp_path / "summary.md", "python -m tqvec.bench.annb.harness ckout --cpu 1")
    assert (tmp_path / "summary.md").read_text() == text
    lines = text.splitlines()
    assert lines[0].startswith("`python -m tqvec.bench.annb.harness ckout --cpu 1`")
    assert "| d | a | 3 | 300 |" in text and "`fast`" in text
    assert "| d | b | 1 | never reached |" in text
