"""``python -m tqvec.bench.index_cuda_check``: ``Index(device="cuda")`` against the CPU index on the same data.

Run on a CUDA machine. For several metrics, bit budgets and modes it builds both indexes from the same
seeded data, checks that the packed codes are identical, that search ids agree (up to near-ties of the
float16 scan) and scores agree, and times add and search on the GPU. Prints and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tqvec import Index

#: (metric, bits, mode, dim or None for --dim); the 50-d 1-bit cosine case stores its centering bias in the
#: code row's padding bits (tqvec.index, correction="center")
CASES = [("cosine", 4, "mse", None), ("cosine", 2, "mse", None), ("ip", 3.5, "mse", None), ("l2", 4, "mse", None),
         ("ip", 4, "prod", None), ("cosine", 1, "mse", 50)]


def check(metric: str, bits: float, mode: str, n: int, dim: int, nq: int) -> dict:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((n, dim)) + 0.3).astype(np.float32)
    q = (rng.standard_normal((nq, dim)) + 0.3).astype(np.float32)
    cpu, gpu = Index(dim, bits, metric=metric, mode=mode), Index(dim, bits, metric=metric, mode=mode, device="cuda")
    cpu.add(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    gpu.add(x)
    torch.cuda.synchronize()
    add_s = time.perf_counter() - start
    same_codes = all(torch.equal(cpu._rows.view().tensors[k], gpu._rows.view().tensors[k].cpu())
                     for k in cpu._rows.tensors if cpu._rows.tensors[k].dtype == torch.uint8)
    d_cpu, i_cpu = cpu.search(q, 10)
    d_gpu, i_gpu = gpu.search(q, 10)
    start = time.perf_counter()
    for _ in range(5):
        gpu.search(q, 10)
    torch.cuda.synchronize()
    search_s = (time.perf_counter() - start) / 5
    return {
        "metric": metric, "bits": bits, "mode": mode, "n": n, "dim": dim, "nq": nq, "correction": gpu.correction,
        "codes_identical": bool(same_codes),
        "id_agreement": float((i_cpu == i_gpu).mean()),
        "max_score_diff": float(np.abs(d_cpu - d_gpu).max()),
        "score_scale": float(np.abs(d_cpu).max()),
        "gpu_add_vectors_per_s": n / add_s,
        "gpu_search_qps": nq / search_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tqvec bench index-cuda-check", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--nq", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("index_cuda_check.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this check compares CUDA and CPU indexes: it needs a CUDA GPU (torch.cuda.is_available() is False)")
    rows = [check(m, b, mode, args.n, dim or args.dim, args.nq) for m, b, mode, dim in CASES]
    for row in rows:
        print(row)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
