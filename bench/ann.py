"""``tqvec bench ann``: recall, bytes and speed of tqvec beside FAISS on one ann-benchmarks dataset.

For every bit width, tqvec rows and FAISS rows trained on the same data (PQ at equal code bits,
PQ fast-scan, SQ4/SQ8 where they fit, FAISS's own TurboQuant ``SQtqmse``/``SQtq``, and RaBitQ with
float queries ``qb=0`` and with its default). Per row: bytes per vector (codes + per-vector side
information; ids excluded for every method), recall@10, recall 1@k (k = 1, 10, 100: the paper's
metric), build time (train + add), QPS on one thread and on all threads, index bytes, and
distortion: reconstruction MSE ‖x − x̂‖²/‖x‖² and inner-product error (mean, variance) on
(query, vector) pairs. Writes ``bench/results/ann_<dataset>.{json,md,png}`` and
``ann_<dataset>_distortion.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import tqvec
from tqvec import Index
from tqvec.bench._cli import positive_int
from tqvec.datasets import AnnDataset, load

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PAIRS = 20_000  # (query, vector) pairs for the inner-product error
MSE_ROWS = 5_000  # vectors for the reconstruction MSE
QPS_QUERIES = 200  # queries per timed batch (recall uses all queries)
SLOW_QUERIES = 200  # all queries of methods whose search is too slow for the full set


@dataclass
class Row:
    """One method at one bit width."""

    method: str
    family: str  # "tqvec", "tqvec+rerank", "faiss-pq", "faiss-sq", "faiss-tq", "faiss-rabitq"
    bits: float  # the nominal bit width this row is listed under
    bytes_per_vector: float
    recall10: float = math.nan
    recall1_at: dict[str, float] = field(default_factory=dict)
    build_s: float = math.nan
    qps_1t: float = math.nan
    qps_all: float = math.nan
    index_bytes: int = 0
    mse: float = math.nan
    ip_bias: float = math.nan
    ip_var: float = math.nan
    note: str = ""


@dataclass
class Method:
    """A way to build and query an index: ``build(train) -> handle``; the rest take the handle."""

    name: str
    family: str
    bits: float
    build: Callable[[np.ndarray], Any]
    search: Callable[[Any, np.ndarray, int], np.ndarray]  # → ids (nq, k)
    bytes_per_vector: Callable[[Any], float]
    reconstruct: Callable[[Any, np.ndarray], np.ndarray] | None  # rows → (n, d), or None
    pair_scores: Callable[[Any, np.ndarray, np.ndarray], np.ndarray] | None  # (queries, rows) → (nq, n)
    note: str = ""
    max_queries: int | None = None  # evaluate on fewer queries (very slow searches)


# ---------------------------------------------------------------- tqvec
def tqvec_method(name: str, family: str, bits: float, dim: int, metric: str, rerank: int | None = None,
                 note: str = "", **kwargs: Any) -> Method:
    budget = kwargs.pop("budget", bits)
    if "correction" not in kwargs and rerank is None and kwargs.get("mode", "mse") == "mse":
        probe = Index(dim, budget, metric=metric, **kwargs)  # what "auto" resolves to, for the note
        tail = f", bias in {probe.tail_bits} padding bits" if probe.tail_bits else ""
        note = "; ".join(filter(None, [note, f"auto: correction={probe.correction}{tail}"]))

    def build(train: np.ndarray) -> Index:
        index = Index(dim, budget, metric=metric, **kwargs)
        index.add(train)
        return index

    def search(index: Index, q: np.ndarray, k: int) -> np.ndarray:
        return index.search(q, k, rerank=rerank)[1]

    def per_vector(index: Index) -> float:
        return index.code_bytes_per_vector + index.rerank_bytes_per_vector

    return Method(name, family, bits, build, search, per_vector,
                  lambda index, rows: index.reconstruct(rows), lambda index, q, rows: index.score(q, rows), note)


# ---------------------------------------------------------------- faiss
def faiss_method(name: str, family: str, bits: float, factory: str, dim: int, metric: str,
                 qb: int | None = None, note: str = "", max_queries: int | None = None) -> Method:
    import faiss  # noqa: PLC0415 - optional dependency

    faiss_metric = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT

    def build(train: np.ndarray) -> Any:
        index = faiss.index_factory(dim, factory, faiss_metric)
        index.train(train)
        index.add(train)
        if qb is not None:
            faiss.downcast_index(faiss.downcast_index(index).index).qb = qb
        return index

    def search(index: Any, q: np.ndarray, k: int) -> np.ndarray:
        return index.search(q, k)[1]

    def reconstruct(index: Any, rows: np.ndarray) -> np.ndarray:
        return index.reconstruct_batch(rows.astype(np.int64))

    return Method(name, family, bits, build, search, lambda index: float(index.sa_code_size()), reconstruct, None, note,
                  max_queries)


def pq_configs(dim: int, budget_bytes: int) -> list[tuple[int, int]]:
    """(M, nbits) PQ configurations of at most ``budget_bytes`` per vector: the most code bits with
    nbits ∈ {5, 6, 8} (M ≤ 96 at 8 bits, ≤ 192 at 5–6 bits, so that training stays in minutes on two
    cores; PQ192x8 took about 700 s here) and with nbits = 4 (fast scan)."""
    out = []
    for nbits, max_m in ((8, 96), (6, 192), (5, 192), (4, dim)):
        fits = [m for m in range(1, max_m + 1) if dim % m == 0 and math.ceil(m * nbits / 8) <= budget_bytes]
        if fits:
            out.append((max(fits), nbits))
    best_slow = max((c for c in out if c[1] != 4), key=lambda c: c[0] * c[1], default=None)
    return [c for c in out if c[1] == 4 or c == best_slow]


def methods_for(dim: int, metric: str, bits: float, rerank: int) -> list[Method]:
    """Every row listed under one bit width."""
    b, budget = int(bits), math.ceil(dim * bits / 8)
    out = [
        tqvec_method(f"tqvec {bits:g}b (default)", "tqvec", bits, dim, metric),
        tqvec_method(f"tqvec {bits:g}b plain (correction=none)", "tqvec", bits, dim, metric, correction="none"),
    ]
    try:
        Index(dim, bits, metric=metric, mode="prod")
        out.append(tqvec_method(f"tqvec {bits:g}b prod (QJL)", "tqvec", bits, dim, metric, mode="prod"))
    except ValueError:
        pass
    out.append(tqvec_method(f"tqvec {bits:g}b + rerank×{rerank} (8-bit)", "tqvec+rerank", bits, dim, metric,
                            rerank=rerank, rerank_bits=8, note="extra 8-bit code for re-ranking"))
    for m, nbits in pq_configs(dim, budget):
        factory = f"PQ{m}x{nbits}" + ("fs" if nbits == 4 else "")
        out.append(faiss_method(f"FAISS {factory}", "faiss-pq", bits, factory, dim, metric))
    if b == bits and b in (4, 8):
        out.append(faiss_method(f"FAISS SQ{b}", "faiss-sq", bits, f"SQ{b}", dim, metric))
    if b == bits:
        out.append(faiss_method(f"FAISS RR,SQtqmse{b}", "faiss-tq", bits, f"RR{dim},SQtqmse{b}", dim, metric))
        if b >= 2:
            out.append(faiss_method(f"FAISS RR,SQtq{b} (QJL)", "faiss-tq", bits, f"RR{dim},SQtq{b}", dim, metric))
        rabitq = f"RR{dim},RaBitQ" + ("" if b == 1 else str(b))
        out.append(faiss_method(f"FAISS RR,RaBitQ{b} qb=0", "faiss-rabitq", bits, rabitq, dim, metric, qb=0,
                                note=f"float queries; slow search: first {SLOW_QUERIES} queries only",
                                max_queries=SLOW_QUERIES))
        out.append(faiss_method(f"FAISS RR,RaBitQ{b} (default qb=4)", "faiss-rabitq", bits, rabitq, dim, metric))
    return out


def rabitq_matched(dim: int, metric: str, bits: float, rabitq_bytes: float) -> Method:
    """tqvec's default at exactly RaBitQ's bytes per vector (a fractional budget)."""
    budget = rabitq_bytes * 8 / dim
    return tqvec_method(f"tqvec {budget:.2f}b (default, = RaBitQ{int(bits)} bytes)", "tqvec", bits, dim, metric,
                        budget=budget)


# ---------------------------------------------------------------- measuring
def recall_metrics(found: np.ndarray, truth: np.ndarray) -> tuple[float, dict[str, float]]:
    """recall@10 (10-NN recall) and recall 1@k for k = 1, 10, 100 from ids ``found`` (nq, ≥100)."""
    r10 = float(np.mean([len(set(f[:10]) & set(t[:10])) / 10 for f, t in zip(found, truth)]))
    r1 = {str(k): float(np.mean([t[0] in f[:k] for f, t in zip(found, truth)])) for k in (1, 10, 100)}
    return r10, r1


def timed_qps(method: Method, handle: Any, queries: np.ndarray, threads: int, repeats: int = 3) -> float:
    """Queries per second of one batch search (k = 10) on ``threads`` threads, best of ``repeats``."""
    import faiss  # noqa: PLC0415

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    try:
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            method.search(handle, queries, 10)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
        faiss.omp_set_num_threads(previous)
    return len(queries) / best


def distortion(method: Method, handle: Any, ds: AnnDataset, metric: str, rng: np.random.Generator) -> tuple[float, float, float]:
    """(MSE ‖x − x̂‖²/‖x‖², mean and variance of est⟨q,x⟩ − ⟨q,x⟩) on seeded vectors and (query, vector) pairs."""
    mse = bias = var = math.nan
    rows = rng.choice(len(ds.train), size=min(MSE_ROWS, len(ds.train)), replace=False)
    x = ds.train[rows]
    if method.reconstruct is not None:
        try:
            rec = method.reconstruct(handle, rows)
            mse = float(np.mean(((rec - x) ** 2).sum(1) / np.maximum((x * x).sum(1), 1e-30)))
        except RuntimeError:
            pass  # this FAISS index cannot reconstruct
    q = ds.test[: min(200, len(ds.test))]
    pair_rows = rows[: PAIRS // len(q)]
    exact = q @ ds.train[pair_rows].T
    if method.pair_scores is not None and metric != "l2":
        est = method.pair_scores(handle, q, pair_rows)
    elif method.reconstruct is not None and not math.isnan(mse):
        est = q @ method.reconstruct(handle, pair_rows).T
    else:
        return mse, bias, var
    err = (est - exact).ravel()
    return mse, float(err.mean()), float(err.var())


def evaluate(method: Method, ds: AnnDataset, metric: str, nq: int, threads: int) -> Row:
    """Build, search and measure one method."""
    train = np.ascontiguousarray(ds.train, dtype=np.float32)
    nq = min(nq, method.max_queries or nq)
    queries = np.ascontiguousarray(ds.test[:nq], dtype=np.float32)
    start = time.perf_counter()
    handle = method.build(train)
    build_s = time.perf_counter() - start
    r10, r1 = recall_metrics(method.search(handle, queries, 100), ds.neighbors[:nq])
    per_vector = method.bytes_per_vector(handle)
    mse, bias, var = distortion(method, handle, ds, metric, np.random.default_rng(0))
    timed = queries[:QPS_QUERIES]
    return Row(method.name, method.family, method.bits, per_vector, r10, r1, build_s,
               timed_qps(method, handle, timed, 1), timed_qps(method, handle, timed, threads),
               int(per_vector * len(train)), mse, bias, var, method.note)


# ---------------------------------------------------------------- output
def markdown(rows: list[Row], title: str, command: str, timed_queries: int) -> str:
    lines = [f"# {title}", "", f"`{command}`", "",
             f"Recall over all queries (except where a note says otherwise); QPS: best of 3 batch searches of the "
             f"first {timed_queries} queries, k = 10. "
             "bytes/vec: codes + per-vector side information (ids excluded for every method; tqvec stores "
             "int64 ids on top, FAISS flat indexes store none). Gap to RaBitQ: recall@10 of the row minus the "
             "best RaBitQ row at the same bit width.", "",
             "| bits | method | bytes/vec | recall@10 | 1@1 | 1@10 | 1@100 | build s | QPS 1 thread | QPS all | MSE | IP bias | IP var | gap to RaBitQ | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for bits in sorted({r.bits for r in rows}):
        group = [r for r in rows if r.bits == bits]
        best_rabitq = max((r.recall10 for r in group if r.family == "faiss-rabitq"), default=math.nan)
        for r in group:
            gap = "" if r.family == "faiss-rabitq" or math.isnan(best_rabitq) else f"{r.recall10 - best_rabitq:+.3f}"
            lines.append(
                f"| {bits:g} | {r.method} | {r.bytes_per_vector:.1f} | {r.recall10:.3f} | {r.recall1_at['1']:.3f} | "
                f"{r.recall1_at['10']:.3f} | {r.recall1_at['100']:.3f} | {r.build_s:.2f} | {r.qps_1t:,.0f} | "
                f"{r.qps_all:,.0f} | {r.mse:.4f} | {r.ip_bias:+.5f} | {r.ip_var:.2e} | {gap} | {r.note} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], dim: int, title: str, path: Path, distortion_path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    families = sorted({r.family for r in rows})
    colors = dict(zip(families, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for fam in families:
        sel = [r for r in rows if r.family == fam]
        axes[0].scatter([r.bytes_per_vector for r in sel], [r.recall10 for r in sel], label=fam, color=colors[fam])
        axes[1].scatter([r.qps_1t for r in sel], [r.recall10 for r in sel], label=fam, color=colors[fam])
    axes[0].set(xlabel="bytes per vector", ylabel="recall@10", title=f"{title}: recall vs bytes", xscale="log")
    axes[1].set(xlabel="queries/s, one thread (batch)", ylabel="recall@10", title="recall vs QPS", xscale="log")
    _save(fig, axes, path, legend_size=8)

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    grid = np.linspace(1, max(r.bits for r in rows), 50)
    axes[0].plot(grid, math.sqrt(3) * math.pi / 2 * 4.0 ** -grid, "k--", label="TurboQuant upper bound √3π/2·4^-b")
    axes[0].plot(grid, 4.0 ** -grid, "k:", label="lower bound 4^-b (any quantizer)")
    axes[1].plot(grid, math.sqrt(3) * math.pi ** 2 / dim * 4.0 ** -grid, "k--", label="prod variance bound √3π²/d·4^-b")
    for fam in families:
        sel = [r for r in rows if r.family == fam and not math.isnan(r.mse)]
        axes[0].scatter([r.bits for r in sel], [r.mse for r in sel], label=fam, color=colors[fam])
        sel = [r for r in rows if r.family == fam and not math.isnan(r.ip_var)]
        axes[1].scatter([r.bits for r in sel], [r.ip_var for r in sel], label=fam, color=colors[fam])
    axes[0].set(xlabel="bits per dimension", ylabel="‖x − x̂‖² / ‖x‖²", yscale="log", title=f"{title}: reconstruction MSE")
    axes[1].set(xlabel="bits per dimension", ylabel="variance of est⟨q,x⟩ − ⟨q,x⟩", yscale="log",
                title="inner-product error variance")
    _save(fig, axes, distortion_path, legend_size=7)


def _save(fig: Any, axes: Any, path: Path, legend_size: int) -> None:
    """Grid and legend on every axis, then write ``path`` (PNG, 110 dpi) and close the figure."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tqvec bench ann", description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="glove-50-angular", help="registry name or ann-benchmarks .hdf5 path")
    parser.add_argument("--bits", type=float, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--queries", type=positive_int, default=1000, help="first N test queries")
    parser.add_argument("--rerank", type=int, default=4, help="R for the re-ranking rows (R·k candidates)")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads(), help="threads for the 'all' QPS")
    parser.add_argument("--only", default="", help="comma-separated method-name substrings to run (debugging)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    ds = load(args.dataset)
    metric = {"angular": "cosine", "euclidean": "l2", "ip": "ip"}[ds.metric]
    dim = ds.train.shape[1]
    methods = [m for b in args.bits for m in methods_for(dim, metric, b, args.rerank)]
    if args.only:
        methods = [m for m in methods if any(s in m.name for s in args.only.split(","))]
    rows: list[Row] = []
    for method in tqdm(methods, desc=f"{ds.name}", unit="method"):
        rows.append(evaluate(method, ds, metric, args.queries, args.threads))
        if method.name.startswith("FAISS RR,RaBitQ") and "qb=0" in method.name:
            matched = rabitq_matched(dim, metric, method.bits, rows[-1].bytes_per_vector)
            rows.append(evaluate(matched, ds, metric, args.queries, args.threads))
    rows.sort(key=lambda r: (r.bits, r.family, r.bytes_per_vector))

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"ann_{ds.name}"
    command = "tqvec bench ann " + shlex.join(argv if argv is not None else sys.argv[1:])
    title = f"{ds.name}: {len(ds.train):,} × {dim}, {args.queries:,} queries"
    text = markdown(rows, title, command, min(QPS_QUERIES, args.queries))
    environment = {"python": platform.python_version(), "torch": torch.__version__, "tqvec": tqvec.__version__,
                   "machine": platform.machine(), "threads": args.threads}
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"dataset": ds.name, "n": len(ds.train), "dim": dim,
                                                     "queries": args.queries, "command": command,
                                                     "environment": environment,
                                                     "rows": [asdict(r) for r in rows]}, indent=1))
    plot(rows, dim, ds.name, stem.with_suffix(".png"), args.out / f"ann_{ds.name}_distortion.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
