"""Peak memory of IVF training, adding and batch search: what each step adds to the process's peak RSS.

Each case runs in a fresh process (so one case's peak cannot hide another's): it builds what the step needs,
resets the kernel's peak-RSS mark (``/proc/self/clear_refs``, Linux), runs the step once and reports the growth
of ``VmHWM`` over the RSS just before it, beside the bytes of the step's own output. Cases:

- ``add``: ``IVFIndex(32, 8192, 4, "l2")`` trained on, then filled with, 65,536 Gaussian rows (one step);
- ``search-native`` / ``search-torch``: that index searched with 10,000 queries at ``nprobe`` 64, ``k`` 300,
  through the native CPU kernel and through the torch reference path.

    python -m tqvec.bench.ivf_memory            # writes bench/results/ivf_memory.{json,md}
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from ._memory import reset_peak, status_kib

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("add", "search-native", "search-torch")
DIM, NLIST, ROWS, QUERIES, NPROBE, K = 32, 8192, 65_536, 10_000, 64, 300


def _gaussian(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def measure(case: str) -> dict:
    """Run one case in this process; returns RSS before, peak growth and output bytes (MiB) and seconds."""
    import torch  # noqa: PLC0415 - imported in the measuring process

    from tqvec import IVFIndex, _fastscan  # noqa: PLC0415

    torch.set_num_threads(1)
    x = _gaussian(ROWS, 0)
    index = IVFIndex(DIM, NLIST, 4, "l2", nprobe=NPROBE)
    queries = _gaussian(QUERIES, 1)
    if case != "add":
        index.train(x)
        index.add(x)
        _fastscan.set_cpu_kernel(case.removeprefix("search-"))
        index.search(queries[:10], K)  # builds the scan layout, which is part of the index, not the step
    before = status_kib("VmRSS")
    if not reset_peak():
        raise RuntimeError("measuring a peak needs Linux's /proc/self/clear_refs")
    start = time.perf_counter()
    if case == "add":
        index.train(x)
        index.add(x)
        out_bytes = 0
    else:
        D, I = index.search(queries, K)
        out_bytes = D.nbytes + I.nbytes
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    return {"case": case, "rss_before_mib": before / 1024, "peak_growth_mib": (peak - before) / 1024,
            "output_mib": out_bytes / 2**20, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    """Measure every case (each in a fresh process) and write ``bench/results/ivf_memory.{json,md}``."""
    parser = argparse.ArgumentParser(prog="tqvec bench ivf-memory", description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=float, default=300.0, help="growth each case must stay under")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for case in CASES:
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as fresh:
            rows.append(fresh.submit(measure, case).result())
        print(json.dumps(rows[-1]), flush=True)
    ok = all(r["peak_growth_mib"] < args.limit_mib for r in rows)
    command = " ".join(["python -m tqvec.bench.ivf_memory", *(argv if argv is not None else sys.argv[1:])])
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "ivf_memory.json").write_text(json.dumps(
            {"command": command, "machine": platform.processor() or platform.machine(), "rows": rows,
             "limit_mib": args.limit_mib, "ok": ok}, indent=1) + "\n")
        lines = ["# IVF memory: peak RSS growth of one step", "",
                 f"`{command}` (one thread). `IVFIndex({DIM}, {NLIST}, 4, \"l2\")`, {ROWS:,} Gaussian rows; search: "
                 f"{QUERIES:,} queries, nprobe {NPROBE}, k {K}. Growth: `VmHWM` after the step minus `VmRSS` before it.",
                 "", "| step | RSS before MiB | peak growth MiB | output MiB | seconds |", "|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['rss_before_mib']:.0f} | {r['peak_growth_mib']:.0f} | {r['output_mib']:.1f} | "
                  f"{r['seconds']:.1f} |" for r in rows]
        lines += ["", f"Every step under +{args.limit_mib:.0f} MiB: **{'yes' if ok else 'no'}**."]
        (RESULTS / "ivf_memory.md").write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
