"""ShardedIndex build and query throughput with 1, 2 and 4 shards on a local Ray cluster.

    python -m tqvec.bench.sharded [--shards 1 2 4] [--cpus N]

Data: KJV MiniLM-384 (``tqvec.datasets.load("kjv-minilm-384-angular")``: 30,102 vectors, 1,000 queries),
``Index(384, bits=4, metric="cosine")`` settings (auto correction: centered) on every shard. Per shard
count it measures: actor start, ``ShardedIndex.add`` of all vectors in one call, ``build_shards`` from
``.npy`` files with Ray Data, and search throughput for one batch of 1,000 queries and for single queries;
it checks that every shard count returns the ids and scores of one in-process ``Index``. The in-process
``Index`` at 1 and at all torch threads gives the single-node figures of the capacity model.
Writes ``bench/results/sharded.{json,md}`` (the md starts with the command) and prints the markdown.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from tqvec.bench._cli import positive_int
from tqvec.datasets import load
from tqvec.distributed import IndexSettings, ShardedIndex, build_shards
from tqvec.index import Index

RESULTS_DIR = Path(__file__).resolve().parent / "results"
K = 10
SINGLE_QUERIES = 200


def recall_at_k(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    """Mean |found[:, :k] ∩ truth[:, :k]| / k."""
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(found, truth)]))


def search_rates(search: Any, q: np.ndarray) -> dict[str, float]:
    """Queries per second for one batch of all ``q`` and for ``SINGLE_QUERIES`` one-query calls (+ p50 ms)."""
    search(q[:10], K)  # warm up
    t = time.perf_counter()
    search(q, K)
    batch_s = time.perf_counter() - t
    lat = []
    for i in range(SINGLE_QUERIES):
        t = time.perf_counter()
        search(q[i:i + 1], K)
        lat.append(time.perf_counter() - t)
    return {"batch_qps": len(q) / batch_s, "single_qps": SINGLE_QUERIES / sum(lat),
            "single_p50_ms": 1e3 * float(np.median(lat))}


def _gemm_seconds(_: int) -> float:
    """Seconds for 5 single-threaded (1000 × 384) @ (384 × 30000) float32 products (after a warm-up)."""
    torch.set_num_threads(1)
    a, b = torch.randn(1000, 384), torch.randn(384, 30_000)
    a @ b
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    return time.perf_counter() - t


def cpu_parallelism(cpus: int) -> float:
    """Compute actually available: ``cpus`` × (one process's GEMM time / the mean time when ``cpus`` run at once)."""
    with multiprocessing.get_context("spawn").Pool(cpus) as pool:
        alone = pool.map(_gemm_seconds, [0])[0]
        together = pool.map(_gemm_seconds, range(cpus))
    return cpus * alone / float(np.mean(together))


def single_node(x: np.ndarray, q: np.ndarray, threads: int) -> dict[str, Any]:
    """In-process ``Index`` with ``threads`` torch threads: add and search rates."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        index = Index(x.shape[1], 4, "cosine")
        t = time.perf_counter()
        index.add(x)
        add_s = time.perf_counter() - t
        rates = search_rates(index.search, q)
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "add_vps": len(x) / add_s, **rates,
            "code_bytes_per_vector": index.code_bytes_per_vector, "bytes_per_vector": index.bytes_per_vector}


def sharded(x: np.ndarray, q: np.ndarray, truth: np.ndarray, n_shards: int, want: tuple[np.ndarray, np.ndarray],
            npy_files: list[Path], workdir: Path) -> dict[str, Any]:
    """Start, add, build_shards, search with ``n_shards`` shard actors."""
    t = time.perf_counter()
    index = ShardedIndex(IndexSettings(x.shape[1], 4, "cosine"), n_shards)
    start_s = time.perf_counter() - t
    try:
        t = time.perf_counter()
        index.add(x)
        add_s = time.perf_counter() - t
        D, I = index.search(q, K)
        same = {"identical_to_index": bool(np.array_equal(I, want[1]) and np.array_equal(D, want[0])),
                "ids_equal_fraction": float(np.mean(I == want[1])), "max_abs_score_diff": float(np.abs(D - want[0]).max())}
        rates = search_rates(index.search, q)
    finally:
        index.close()
    t = time.perf_counter()
    build_shards(npy_files, workdir / f"built-{n_shards}", IndexSettings(x.shape[1], 4, "cosine"), n_shards,
                 center=index.center, rows_per_task=8192)
    build_s = time.perf_counter() - t
    return {"n_shards": n_shards, "start_s": start_s, "add_vps": len(x) / add_s, "build_shards_s": build_s,
            "build_shards_vps": len(x) / build_s, **same, "recall_at_10": recall_at_k(I, truth, K), **rates}


def markdown(result: dict[str, Any]) -> str:
    """The results as a markdown report."""
    env, n = result["environment"], result["data"]["n"]
    lines = [f"`{result['command']}`", "",
             f"KJV MiniLM-384: {n:,} vectors, {result['data']['nq']:,} queries, k={K}, bits=4, cosine, "
             f"correction auto = {result['data']['correction']}. {env['cpus']} CPUs, Ray {env['ray']}, torch {env['torch']}, {env['date']}.", "",
             f"Compute actually available: {env['effective_parallel_cpus']:.2f} CPUs ({env['cpus']} single-threaded "
             "GEMM processes at once, against one alone).", "",
             "| shards | actor start s | add vec/s | build_shards vec/s | batch QPS (1,000 q) | single-query QPS "
             "| p50 ms | recall@10 | ids = one Index | max abs score diff |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["sharded"]:
        lines.append(f"| {r['n_shards']} | {r['start_s']:.1f} | {r['add_vps']:,.0f} | {r['build_shards_vps']:,.0f} "
                     f"| {r['batch_qps']:,.0f} | {r['single_qps']:,.0f} | {r['single_p50_ms']:.2f} "
                     f"| {r['recall_at_10']:.4f} | {100 * r['ids_equal_fraction']:.2f} % | {r['max_abs_score_diff']:.1e} |")
    lines += ["", "In-process `Index` (no Ray) on the same data:", "",
              "| torch threads | add vec/s | batch QPS | single-query QPS | p50 ms |", "|---:|---:|---:|---:|---:|"]
    for r in result["single_node"]:
        lines.append(f"| {r['threads']} | {r['add_vps']:,.0f} | {r['batch_qps']:,.0f} | {r['single_qps']:,.0f} "
                     f"| {r['single_p50_ms']:.2f} |")
    s = result["single_node"][0]
    lines += ["", f"Bytes per vector: {s['code_bytes_per_vector']} scanned (codes + side information), "
              f"{s['bytes_per_vector']} stored with the int64 id.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="tqvec bench sharded", description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=positive_int, nargs="+", default=[1, 2, 4], help="shard counts to time")
    parser.add_argument("--cpus", type=positive_int, default=os.cpu_count(),
                        help="CPUs of the local Ray cluster, at least 2 (default: this machine's)")
    args = parser.parse_args(argv)
    if args.cpus < 2:
        parser.error("--cpus: at least 2 (build_shards runs Ray Data's read task beside its encoders)")
    parallelism = cpu_parallelism(args.cpus)
    data = load("kjv-minilm-384-angular")
    x, q, truth = data.train.astype(np.float32), data.test.astype(np.float32), data.neighbors
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    try:
        single = [single_node(x, q, 1), single_node(x, q, torch.get_num_threads())]
        reference = Index(x.shape[1], 4, "cosine")
        reference.add(x)
        want = reference.search(q, K)
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            npy_files = []
            for i, part in enumerate(np.array_split(x, 4)):
                npy_files.append(workdir / f"kjv-{i}.npy")
                np.save(npy_files[-1], part)
            build_shards(npy_files[:1], workdir / "warm-up", IndexSettings(x.shape[1], 4, "cosine"), 1,
                         center=reference.center)
            rows = []
            for n in args.shards:
                rows.append(r := sharded(x, q, truth, n, want, npy_files, workdir))
                print(f"{n} shards: {r}", file=sys.stderr)
    finally:
        ray.shutdown()
    result = {
        "command": " ".join(["python -m tqvec.bench.sharded", shlex.join(argv if argv is not None else sys.argv[1:])]).strip(),
        "data": {"name": data.name, "n": len(x), "nq": len(q), "dim": x.shape[1], "correction": reference.correction},
        "environment": {"cpus": args.cpus, "effective_parallel_cpus": parallelism, "ray": ray.__version__, "torch": torch.__version__,
                        "python": platform.python_version(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")},
        "sharded": rows, "single_node": single,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "sharded.json").write_text(json.dumps(result, indent=1))
    report = markdown(result)
    (RESULTS_DIR / "sharded.md").write_text(report)
    print(report)
    return result


if __name__ == "__main__":
    main()
