"""ann-benchmarks-style sweep: tqvec's IVF index against FAISS, turbovec and rabitqlib on one data set.

    tqvec bench sweep --dataset glove-50-angular [--batch] [--queries 1000] [--runs 3]
    .venv/bin/python -m tqvec.bench.sweep --dataset kjv-minilm-384-angular

Rules, as ann-benchmarks' runner: every algorithm is a ``BaseANN`` (:mod:`bench.annb`); ``fit`` once per
build configuration (build time = wall time of ``fit``), then for each query-argument set the queries are
answered one at a time on one thread (``--batch``: all at once, ``--threads`` threads), k = 10. The QPS is
1 / (the best over ``--runs`` runs of the mean time per query); a run longer than ``--run-cap`` seconds is
not repeated (the record says how many runs were made). Distances are recomputed from the returned ids
against the train vectors (``1 − cos`` / L2 / ``−⟨q, x⟩``); recall is ann-benchmarks' ``knn`` metric:
a returned neighbour counts when its distance is ≤ the true k-th distance + 1e-3.
Index size: each library's own byte count (its serialized index), and ann-benchmarks' RSS growth
during ``fit`` (``index_size_kb``, noisy). Query arguments run in increasing cost order and stop once
recall ≥ ``STOP_RECALL`` or a run takes longer than ``--arg-cap`` seconds.

Writes ``bench/results/sweep_<dataset>[_batch].json`` (one record per run), ``.md`` (command, conditions,
the best QPS at recall ≥ 0.9 per algorithm) and three PNG plots like ann-benchmarks': recall vs QPS
(Pareto frontier, logit x, log y), recall vs bytes per vector, recall vs build time.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tqvec.bench._cli import positive_int

RESULTS_DIR = Path(__file__).resolve().parent / "results"
K = 10
EPSILON = 1e-3
#: query arguments of one build stop once recall reaches this (larger arguments only cost time)
STOP_RECALL = 0.995
RECALL_GOAL = 0.9


# ---------------------------------------------------------------- metrics
def true_distances(train: np.ndarray, queries: np.ndarray, ids: Sequence[np.ndarray], metric: str) -> list[np.ndarray]:
    """Distance of each query ``(nq, d)`` to each of its returned train rows (ann-benchmarks conventions,
    float64): ``1 − cos`` (angular), L2 (euclidean), ``−⟨q, x⟩`` (ip)."""
    out = []
    for q, rows in zip(queries.astype(np.float64), ids):
        x = train[np.asarray(rows, dtype=np.int64)].astype(np.float64)
        if metric == "angular":
            d = 1.0 - x @ q / np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(q), 1e-300)
        elif metric == "euclidean":
            d = np.sqrt(((x - q) ** 2).sum(1))
        else:
            d = -(x @ q)
        out.append(d)
    return out


def knn_recall(gt_distances: np.ndarray, run_distances: Sequence[np.ndarray], k: int = K,
               epsilon: float = EPSILON) -> np.ndarray:
    """Per-query k-NN recall ``(nq,)``: the share of the first ``k`` returned distances that are ≤ the true
    ``k``-th distance + ``epsilon`` (ann-benchmarks' ``knn``; missing results count as misses)."""
    threshold = gt_distances[:, k - 1].astype(np.float64) + epsilon
    return np.array([np.count_nonzero(d[:k] <= t) / k for d, t in zip(run_distances, threshold)])


def pareto_frontier(recall: Sequence[float], qps: Sequence[float]) -> list[int]:
    """Indices of the points no other point beats on both recall and QPS, by decreasing recall."""
    order = sorted(range(len(recall)), key=lambda i: (-recall[i], -qps[i]))
    front, best = [], -math.inf
    for i in order:
        if qps[i] > best:
            front.append(i)
            best = qps[i]
    return front


# ---------------------------------------------------------------- timing
def time_queries(algo: Any, queries: np.ndarray, k: int, batch: bool) -> tuple[float, list[np.ndarray]]:
    """One run: (mean seconds per query, returned ids per query). Single mode times each ``query`` call
    alone (as ann-benchmarks); batch mode times one ``batch_query`` call."""
    if batch:
        start = time.perf_counter()
        algo.batch_query(queries, k)
        total = time.perf_counter() - start
        return total / len(queries), [np.asarray(r, dtype=np.int64) for r in algo.get_batch_results()]
    total, results = 0.0, []
    for v in queries:
        start = time.perf_counter()
        ids = algo.query(v, k)
        total += time.perf_counter() - start
        results.append(np.asarray(ids, dtype=np.int64))
    return total / len(queries), results


@dataclass
class Definition:
    """One build configuration: ``family`` (plot series), ``make`` (a fresh ``BaseANN``), and the query
    argument tuples to run on it, cheapest first."""

    family: str
    make: Callable[[], Any]
    query_args: list[tuple] = field(default_factory=lambda: [()])


def run_definition(definition: Definition, train: np.ndarray, queries: np.ndarray, gt_distances: np.ndarray,
                   metric: str, *, k: int, runs: int, batch: bool, run_cap: float, arg_cap: float,
                   log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Build once, run every query-argument set; one record per set (see the module docstring)."""
    algo = definition.make()
    memory_before = algo.get_memory_usage()
    start = time.perf_counter()
    algo.fit(train)
    build_time = time.perf_counter() - start
    index_size_kb = algo.get_memory_usage() - memory_before
    records = []
    for args in definition.query_args:
        if hasattr(algo, "set_query_arguments"):
            algo.set_query_arguments(*args)
        times, results = [], None
        for _ in range(runs):
            wall = time.perf_counter()
            per_query, results = time_queries(algo, queries, k, batch)
            times.append(per_query)
            if time.perf_counter() - wall > run_cap:
                break
        recall = knn_recall(gt_distances, true_distances(train, queries, results, metric), k)
        extra = algo.get_additional()
        record = {
            "family": definition.family, "name": str(algo), "query_args": list(args), "build_time_s": build_time,
            "index_size_kb": index_size_kb, "index_bytes": extra.get("index_bytes"),
            "bytes_per_vector": extra.get("bytes_per_vector"), "additional": extra, "recall": float(recall.mean()),
            "qps": 1.0 / min(times), "run_times_per_query_s": times, "runs": len(times), "k": k,
            "queries": len(queries), "batch": batch,
        }
        records.append(record)
        log(f"  {record['name']:<70} recall {record['recall']:.4f}  {record['qps']:9.1f} QPS  "
            f"{record['bytes_per_vector'] or float('nan'):7.1f} B/vec  build {build_time:6.1f} s")
        if record["recall"] >= STOP_RECALL or times[0] * len(queries) > arg_cap:
            break
    if hasattr(algo, "done"):
        algo.done()
    return records


# ---------------------------------------------------------------- the line-up
def default_nlist(n: int) -> int:
    """Lists for ``n`` vectors: the power of two nearest √n (ann-benchmarks' FAISS grids span 32–8192)."""
    return 1 << max(1, round(math.log2(math.sqrt(n))))


def lineup(n: int, dim: int, metric: str, threads: int, only: str | None = None) -> list[Definition]:
    """Every configuration of the sweep for a data set of ``n`` × ``dim`` vectors (``only``: a regex on families)."""
    from .annb.competitors import FaissFactory, RabitqIVF, Turbovec  # noqa: PLC0415
    from .annb.module import TqvecIVF  # noqa: PLC0415

    nlist = default_nlist(n)
    nprobes = [p for p in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128) if p <= nlist // 2]
    ip = metric == "angular"
    half = dim // 2 if dim % 2 == 0 else dim + 1  # fast-scan PQ wants an even M
    full = dim if dim % 2 == 0 else dim + 1
    tq = lambda *a: (lambda: TqvecIVF(metric, *a))  # noqa: E731
    defs = [
        Definition("tqvec-ivf 4b residual", tq(4, "residual", nlist), [(p,) for p in nprobes]),
        Definition("tqvec-ivf 4b direct", tq(4, "direct", nlist), [(p,) for p in nprobes]),
        Definition("tqvec-ivf 4b residual fht-kac", tq(4, "residual", nlist, 0, "fht-kac"), [(p,) for p in nprobes]),
        Definition("tqvec-ivf 4b direct fht-kac", tq(4, "direct", nlist, 0, "fht-kac"), [(p,) for p in nprobes]),
        Definition("tqvec-ivf 6b residual", tq(6, "residual", nlist), [(p,) for p in nprobes]),
        Definition("tqvec-ivf 8b residual", tq(8, "residual", nlist), [(p,) for p in nprobes]),
        Definition("tqvec-ivf 4b + 8b rerank", tq(4, "residual", nlist, 8), [(p, 4) for p in nprobes]),
        Definition(f"faiss IVF,PQ{full}x4fs", lambda: FaissFactory(metric, f"IVF{nlist},PQ{full}x4fs", ip),
                   [(f"nprobe={p}",) for p in nprobes]),
        Definition(f"faiss IVF,PQ{half}x4fs", lambda: FaissFactory(metric, f"IVF{nlist},PQ{half}x4fs", ip),
                   [(f"nprobe={p}",) for p in nprobes]),
        Definition(f"faiss IVF,PQ{half}x4fs,RFlat", lambda: FaissFactory(metric, f"IVF{nlist},PQ{half}x4fs,RFlat", ip),
                   [(f"nprobe={p},k_factor_rf={f}",) for p in nprobes for f in (4, 16)]),
        Definition("faiss IVF,RaBitQ4", lambda: FaissFactory(metric, f"IVF{nlist},RaBitQ4", ip),
                   [(f"nprobe={p}",) for p in nprobes]),
        Definition("faiss RR,SQtqmse4 (flat)", lambda: FaissFactory(metric, f"RR{dim},SQtqmse4", ip), [("",)]),
        Definition("faiss HNSW32,SQ8", lambda: FaissFactory(metric, "HNSW32,SQ8", ip),
                   [(f"efSearch={e}",) for e in (16, 32, 64, 128, 256)]),
        Definition("rabitqlib IVF 4b", lambda: RabitqIVF(metric, nlist, 4, threads), [(p,) for p in nprobes]),
    ]
    if metric == "angular":  # turbovec scores inner products only
        defs += [Definition(f"turbovec {b}b (flat)", lambda b=b: Turbovec(metric, b), [()]) for b in (2, 4)]
    return [d for d in defs if only is None or re.search(only, d.family)]


# ---------------------------------------------------------------- reporting
def best_at(records: list[dict[str, Any]], goal: float = RECALL_GOAL) -> dict[str, dict[str, Any]]:
    """Per family, the record with the highest QPS among those with recall ≥ ``goal``."""
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["recall"] >= goal and (r["family"] not in best or r["qps"] > best[r["family"]]["qps"]):
            best[r["family"]] = r
    return best


def plot(records: list[dict[str, Any]], title: str, stem: Path) -> list[Path]:
    """The three ann-benchmarks-style plots as PNG: ``<stem>_qps.png``, ``_size.png``, ``_build.png``."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    families = list(dict.fromkeys(r["family"] for r in records))
    cmap = plt.get_cmap("tab20")
    markers = "os^vD<>pXPh*"
    specs = [("qps", "Queries per second (1/s)", "_qps.png", True),
             ("bytes_per_vector", "Index bytes per vector", "_size.png", False),
             ("build_time_s", "Build time (s)", "_build.png", False)]
    paths = []
    for key, label, suffix, frontier in specs:
        fig, ax = plt.subplots(figsize=(10, 6.5))
        for j, fam in enumerate(families):
            rs = [r for r in records if r["family"] == fam and r.get(key) is not None and 0 < r["recall"] < 1]
            rs += [dict(r, recall=1 - 1e-4) for r in records if r["family"] == fam and r["recall"] >= 1 and r.get(key)]
            if not rs:
                continue
            x, y = [r["recall"] for r in rs], [r[key] for r in rs]
            style = {"color": cmap(j % 20), "marker": markers[j % len(markers)], "label": fam}
            if frontier:
                idx = pareto_frontier(x, y)
                ax.plot([x[i] for i in idx], [y[i] for i in idx], "-", ms=5, **style)
            else:
                ax.plot(x, y, ls="none", ms=6, **style)
        ax.set_xscale("logit")
        ax.set_yscale("log")
        ax.set_xlabel(f"Recall@{K} (k-NN, distance slack {EPSILON:g})")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.axvline(RECALL_GOAL, color="grey", lw=0.8, ls=":")
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = stem.with_name(stem.name + suffix)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def markdown(records: list[dict[str, Any]], meta: dict[str, Any], plots: list[Path]) -> str:
    """The results page: command, conditions, best QPS at recall ≥ 0.9 per algorithm, plots."""
    lines = [f"# Sweep: {meta['dataset']}{' (batch)' if meta['batch'] else ''}", "", "```bash", meta["command"], "```", "",
             f"{meta['n_train']:,} × {meta['dim']} {meta['metric']}; first {meta['queries']:,} of {meta['n_test']:,} "
             f"queries; k = {K}; {'batch' if meta['batch'] else 'one query at a time'}, {meta['threads']} thread(s); "
             f"nlist = {meta['nlist']}; best of ≤ {meta['runs']} runs. {meta['started']} → {meta['finished']}, "
             f"{meta['machine']}; load average at start {meta['load_start']}, at end {meta['load_end']} "
             "(a shared machine: timings are noisy).", ""]
    if "updated_from" in meta:
        first = meta["updated_from"]
        lines += [f"Only the families this command ran were re-run; the others' records come from `{first['command']}` "
                  f"(started {first['started']}, load average {first['load_start']}).", ""]
    lines += [f"## Best QPS at recall@{K} ≥ {RECALL_GOAL}", "",
              "| algorithm | configuration | recall | QPS | bytes/vector | build (s) |", "|---|---|---|---|---|---|"]
    best = best_at(records)
    for fam, r in sorted(best.items(), key=lambda kv: -kv[1]["qps"]):
        bpv = "—" if r["bytes_per_vector"] is None else f"{r['bytes_per_vector']:.1f}"
        lines.append(f"| {fam} | `{r['name']}` | {r['recall']:.3f} | {r['qps']:,.0f} | {bpv} | {r['build_time_s']:.1f} |")
    missing = sorted({r["family"] for r in records} - set(best))
    if missing:
        top = {f: max(r["recall"] for r in records if r["family"] == f) for f in missing}
        lines += ["", "Never reached the goal: " + ", ".join(f"{f} (best recall {top[f]:.3f})" for f in missing) + "."]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    lines += ["", f"All {len(records)} runs: `{meta['json']}`.", ""]
    return "\n".join(lines)


def _load_average() -> str:
    try:
        return " ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tqvec bench sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="registered name (glove-50-angular, kjv-minilm-384-angular, "
                   "mnist-784-euclidean, synthetic-<n>-<d>) or an ann-benchmarks HDF5 path")
    p.add_argument("--batch", action="store_true", help="all queries in one call (default: one at a time)")
    p.add_argument("--threads", type=positive_int, default=1, help="threads for builds and queries (default 1)")
    p.add_argument("--queries", type=positive_int, default=1000, help="use the first N test queries (default 1000)")
    p.add_argument("--runs", type=positive_int, default=3, help="timed runs per query-argument set; the best counts")
    p.add_argument("--run-cap", type=float, default=5.0, help="a run longer than this (s) is not repeated")
    p.add_argument("--arg-cap", type=float, default=30.0, help="skip the larger arguments of a build once one "
                   "run took longer than this (s)")
    p.add_argument("--only", help="regex: run only the algorithm families it matches")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="output folder (default bench/results)")
    p.add_argument("--update", action="store_true", help="keep the other families' records of an earlier "
                   "sweep of this data set and replace only those run now (with --only)")
    return p


def _set_threads(threads: int) -> None:
    """One thread count for every library (turbovec's and rabitqlib's pools read the environment at import); FAISS is
    optional: a sweep whose ``--only`` leaves it out runs without it."""
    os.environ["RAYON_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch  # noqa: PLC0415

    torch.set_num_threads(threads)
    if importlib.util.find_spec("faiss") is not None:
        import faiss  # noqa: PLC0415

        faiss.omp_set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and write JSON, markdown and plots; returns the exit status."""
    args = _parser().parse_args(argv)
    _set_threads(args.threads)
    from tqvec.datasets import load  # noqa: PLC0415

    ds = load(args.dataset)
    queries = ds.test[: args.queries]
    gt = ds.distances[: args.queries]
    tag = "_batch" if args.batch else ""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", ds.name)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"sweep_{safe}{tag}"
    argv_used = sys.argv[1:] if argv is None else argv
    head = ["tqvec", "bench", "sweep"] if Path(sys.argv[0]).name == "tqvec" else [".venv/bin/python", "-m", "tqvec.bench.sweep"]
    meta = {
        "dataset": ds.name, "metric": ds.metric, "n_train": len(ds.train), "n_test": len(ds.test), "dim": ds.dim,
        "queries": len(queries), "batch": args.batch, "threads": args.threads, "runs": args.runs,
        "nlist": default_nlist(len(ds.train)), "command": shlex.join([*head, *argv_used]),
        "started": dt.datetime.now().isoformat(timespec="seconds"), "load_start": _load_average(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
                   f"{platform.python_version()}", "json": stem.name + ".json",
    }
    print(f"{ds.name}: {len(ds.train):,} × {ds.dim} {ds.metric}, {len(queries)} queries, nlist {meta['nlist']}")
    definitions = lineup(len(ds.train), ds.dim, ds.metric, args.threads, args.only)
    records: list[dict[str, Any]] = []
    if args.update and stem.with_suffix(".json").is_file():
        previous = json.loads(stem.with_suffix(".json").read_text())
        rerun = {d.family for d in definitions}
        records = [r for r in previous["runs"] if r["family"] not in rerun]
        meta["updated_from"] = previous["meta"].get("updated_from") or {
            k: previous["meta"][k] for k in ("command", "started", "load_start")}
    for definition in definitions:
        print(definition.family)
        try:
            records += run_definition(definition, ds.train, queries, gt, ds.metric, k=K, runs=args.runs,
                                      batch=args.batch, run_cap=args.run_cap, arg_cap=args.arg_cap)
        except (ImportError, RuntimeError, ValueError) as err:  # a competitor that will not build here
            print(f"  skipped: {type(err).__name__}: {err}")
            records.append({"family": definition.family, "skipped": f"{type(err).__name__}: {err}"})
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": records}, indent=1))
    meta.update(finished=dt.datetime.now().isoformat(timespec="seconds"), load_end=_load_average())
    done = [r for r in records if "skipped" not in r]
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": records}, indent=1))
    plots = plot(done, f"{ds.name}{' (batch)' if args.batch else ''}: recall@{K} (k-NN)", stem)
    page = markdown(done, meta, plots)
    skipped = [r for r in records if "skipped" in r]
    if skipped:
        page += "\nSkipped: " + "; ".join(f"{r['family']} ({r['skipped']})" for r in skipped) + "\n"
    stem.with_suffix(".md").write_text(page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
