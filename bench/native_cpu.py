"""The native CPU scan of a flat 4-bit index beside turbovec's, on one data set, in one process.

    tqvec bench native-cpu --dataset kjv-minilm-384-angular [--queries 1000] [--threads 16] [--out DIR]

Measures, with ``torch`` and turbovec on the same thread counts:

* single queries on one thread: QPS of ``Index.search`` and of ``turbovec.TurboQuantIndex.search``, recall@10
  against the data set's ground truth, and the scan rate (vectors scored per second per thread) of the kernel
  alone (``tqvec.scan.search`` on rotated queries: the Python around it excluded), and the code bytes of the rows
  it scores per second beside this machine's single-thread copy bandwidth (numpy copy of 1 GiB; the two-stage
  scan reads the rows' sign bits and the codes of the few it scores exactly, so it may exceed that bandwidth);
* the batch: all queries in one call on ``--threads`` threads, QPS of both (best of :data:`BATCH_RUNS` calls each,
  the two libraries alternating);
* the torch reference path on a few queries (the speed-up of the native kernel, same process);
* memory: a 1M × 128 4-bit flat index searched with 10,000 queries at once: peak RSS growth during the search
  (sampled every millisecond) beside the index's own bytes (``--skip-memory`` to leave it out).

Writes ``native_cpu_<dataset>.{json,md}`` in ``--out`` (default ``bench/results``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tqvec.bench._cli import positive_int

RESULTS_DIR = Path(__file__).resolve().parent / "results"
K = 10
BATCH_RUNS = 7  # timed batch calls of each library, alternating; the best counts


def copy_bandwidth(gib: float = 1.0, repeats: int = 3) -> float:
    """Single-thread copy bandwidth in GB/s (bytes read + written), best of ``repeats`` numpy copies."""
    src = np.ones(int(gib * (1 << 30)) // 8, np.float64)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * src.nbytes / best / 1e9


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f[f >= 0]) & set(t[:K])) / K for f, t in zip(found, truth)]))


def _per_query(fn: Any, queries: np.ndarray, runs: int = 3) -> tuple[float, np.ndarray]:
    """Best mean seconds per query over ``runs`` passes of one-at-a-time calls, and the ids of the last pass."""
    best, ids = float("inf"), []
    for _ in range(runs):
        start = time.perf_counter()
        ids = [fn(q[None, :]) for q in queries]
        best = min(best, (time.perf_counter() - start) / len(queries))
    return best, np.stack(ids)


def flat_comparison(name: str, nq: int, threads: int) -> dict[str, Any]:
    """Single-query and batch figures of tqvec's flat 4-bit index and turbovec's on data set ``name``."""
    import turbovec  # noqa: PLC0415 - bench extra

    from tqvec import Index, _fastscan, scan  # noqa: PLC0415
    from tqvec.datasets import load  # noqa: PLC0415

    ds = load(name)
    train, queries = np.ascontiguousarray(ds.train, np.float32), np.ascontiguousarray(ds.test[:nq], np.float32)
    truth = ds.neighbors[:nq]
    metric = {"angular": "cosine", "euclidean": "l2"}.get(ds.metric, "ip")
    index = Index(train.shape[1], 4, metric)
    index.add(train)
    dim = -(-train.shape[1] // 8) * 8
    pad = lambda x: np.ascontiguousarray(np.pad(x / np.linalg.norm(x, axis=1, keepdims=True), ((0, 0), (0, dim - x.shape[1]))))  # noqa: E731
    tv = turbovec.TurboQuantIndex(dim, 4)
    tv.calibrate(pad(train[np.random.default_rng(0).choice(len(train), min(1024, len(train)), replace=False)]))
    tv.add(pad(train))

    torch.set_num_threads(1)
    tq_s, tq_ids = _per_query(lambda q: index.search(q, K)[1][0], queries)
    tv_s, tv_ids = _per_query(lambda q: tv.search(pad(q), K)[1][0], queries)
    rotated, _ = index.quantizer.rotate_queries(torch.nn.functional.normalize(torch.from_numpy(queries), dim=1)
                                                - (index._center if index._center is not None else 0))
    block, table = index._rows.scoring[0], index.quantizer.table("cpu")
    kernel_s = min(_timed(lambda: [scan.search(rotated[i:i + 1], block, table, K) for i in range(len(rotated))])
                   for _ in range(3)) / len(rotated)
    few = queries[: max(1, min(5, nq))]
    _fastscan.set_cpu_kernel("torch")
    torch_s, _ = _per_query(lambda q: index.search(q, K)[1][0], few, runs=1)
    _fastscan.set_cpu_kernel("auto")

    torch.set_num_threads(threads)
    tq_batch = tv_batch = float("inf")
    for _ in range(BATCH_RUNS):  # interleaved, so that both see the same load of a shared host
        tq_batch = min(tq_batch, _timed(lambda: index.search(queries, K)))
        tv_batch = min(tv_batch, _timed(lambda: tv.search(pad(queries), K)))
    code_bytes = index.quantizer.layout.row_bytes
    return {
        "dataset": ds.name, "n": len(train), "dim": train.shape[1], "queries": nq, "metric": metric,
        "index": repr(index), "code_bytes_per_vector": code_bytes, "kernel": (_fastscan.kernels() or ("torch",))[-1],
        "tqvec_single_qps": 1 / tq_s, "turbovec_single_qps": 1 / tv_s, "torch_single_qps": 1 / torch_s,
        "tqvec_kernel_vectors_per_s": len(train) / kernel_s, "tqvec_search_vectors_per_s": len(train) / tq_s,
        "turbovec_vectors_per_s": len(train) / tv_s, "tqvec_kernel_code_gb_per_s": len(train) * code_bytes / kernel_s / 1e9,
        "tqvec_recall": _recall(tq_ids, truth), "turbovec_recall": _recall(tv_ids, truth),
        "batch_threads": threads, "tqvec_batch_qps": nq / tq_batch, "turbovec_batch_qps": nq / tv_batch,
    }


def memory_run(n: int = 1_000_000, dim: int = 128, nq: int = 10_000) -> dict[str, Any]:
    """Peak RSS growth while a flat 4-bit index of ``n`` × ``dim`` Gaussian vectors answers ``nq`` queries at once."""
    import psutil  # noqa: PLC0415 - bench extra

    from tqvec import Index  # noqa: PLC0415

    rng = np.random.default_rng(0)
    index = Index(dim, 4, "l2")
    for start in range(0, n, 100_000):
        index.add(rng.standard_normal((min(100_000, n - start), dim), dtype=np.float32))
    queries = rng.standard_normal((nq, dim), dtype=np.float32)
    index.search(queries[:10], K)  # first-search caches (scan view of the side fields) are part of the index's cost
    process, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.001)

    before = process.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    seconds = _timed(lambda: index.search(queries, K))
    done.set()
    sampler.join()
    layout = index._rows.scoring[0].cache["rows"][1].layout_nbytes  # the fast-scan copy of the codes, built once
    return {"n": n, "dim": dim, "queries": nq, "index_bytes": len(index) * index.code_bytes_per_vector,
            "fast_scan_layout_bytes": layout,
            "rss_before_search_mb": before / 2**20, "search_peak_growth_mb": (peak[0] - before) / 2**20,
            "search_seconds": seconds, "threads": torch.get_num_threads()}


def markdown(result: dict[str, Any], command: str) -> str:
    f, m = result["flat"], result.get("memory")
    bw = result["copy_gb_per_s"]
    lines = [f"```\n{command}\n```", "",
             f"{result['cpu']}, {result['cpu_count']} CPUs; torch {result['torch']}; {result['date']}.",
             f"Data: {f['dataset']} ({f['n']:,} × {f['dim']}, {f['metric']}), {f['queries']} queries; {f['index']}, "
             f"{f['code_bytes_per_vector']} code bytes per vector; kernel: {f['kernel']}.", "",
             "| | tqvec 4-bit flat | turbovec 4-bit flat |", "|---|---|---|",
             f"| single query, 1 thread: QPS | {f['tqvec_single_qps']:,.0f} | {f['turbovec_single_qps']:,.0f} |",
             f"| vectors scored per second per thread | {f['tqvec_search_vectors_per_s'] / 1e6:.1f} M (kernel alone "
             f"{f['tqvec_kernel_vectors_per_s'] / 1e6:.1f} M) | {f['turbovec_vectors_per_s'] / 1e6:.1f} M |",
             f"| batch of {f['queries']}, {f['batch_threads']} threads: QPS | {f['tqvec_batch_qps']:,.0f} | "
             f"{f['turbovec_batch_qps']:,.0f} |",
             f"| recall@10 | {f['tqvec_recall']:.3f} | {f['turbovec_recall']:.3f} |", "",
             f"The kernel scores rows holding {f['tqvec_kernel_code_gb_per_s']:.2f} GB/s of codes on one thread (the "
             f"two-stage scan reads their sign bits and the codes of the rows it scores exactly); this machine's "
             f"single-thread copy bandwidth is {bw:.1f} GB/s (read + write). The torch reference path answers "
             f"{f['torch_single_qps']:.1f} single queries per second on the same index "
             f"({f['tqvec_single_qps'] / f['torch_single_qps']:.0f}× fewer than the native kernel)."]
    if m:
        lines += ["", f"Memory: {m['n']:,} × {m['dim']} at 4 bits ({m['index_bytes'] / 2**20:.0f} MiB of codes and side "
                      f"fields, plus {m['fast_scan_layout_bytes'] / 2**20:.0f} MiB for the fast-scan layout that the first "
                      f"search builds), {m['queries']:,} queries in one call on {m['threads']} threads: RSS grew by "
                      f"{m['search_peak_growth_mb']:.0f} MiB during the search (from {m['rss_before_search_mb']:.0f} MiB; "
                      f"{m['search_seconds']:.1f} s)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tqvec bench native-cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="kjv-minilm-384-angular", help="registered name or ann-benchmarks HDF5 path")
    p.add_argument("--queries", type=positive_int, default=1000)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1, help="threads of the batch runs")
    p.add_argument("--skip-memory", action="store_true", help="leave out the 1M × 128 memory run")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    prog = Path(sys.argv[0]).name
    head = ["tqvec", "bench", "native-cpu"] if prog == "tqvec" else [sys.executable, "-m", "tqvec.bench.native_cpu"]
    command = shlex.join(head + (sys.argv[1:] if argv is None else argv))
    result: dict[str, Any] = {"command": command, "cpu": platform.processor() or platform.machine(),
                              "cpu_count": os.cpu_count(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result["copy_gb_per_s"] = copy_bandwidth()
    result["flat"] = flat_comparison(args.dataset, args.queries, args.threads)
    if not args.skip_memory:
        torch.set_num_threads(args.threads)
        result["memory"] = memory_run()
    stem = args.out / f"native_cpu_{Path(result['flat']['dataset']).stem}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result, command)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
