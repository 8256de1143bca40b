"""The ``tqvec`` command: ``tqvec demo``, ``tqvec datasets …`` and ``tqvec bench …``.

Each subcommand lives beside its code (``tqvec.datasets.cli``, ``tqvec.bench.*``) and is imported only
when run, so optional dependencies (faiss, h5py, transformers, ray, triton) load only where needed.
"""
from __future__ import annotations

import importlib
import sys

#: subcommand → (module, function taking argv)
BENCHMARKS = {
    "ann": ("tqvec.bench.ann", "main", "recall / bytes / speed against FAISS on an ann-benchmarks dataset"),
    "distortion": ("tqvec.bench.core", "distortion_main", "measured vs theoretical MSE and inner-product error"),
    "encode": ("tqvec.bench.core", "encode_main", "CPU encode throughput beside FAISS"),
    "sweep": ("tqvec.bench.sweep", "main", "ann-benchmarks-style sweep with plots (IVF, FAISS, others)"),
    "native-cpu": ("tqvec.bench.native_cpu", "main", "native CPU scan of a flat index beside turbovec, memory run"),
    "kv": ("tqvec.bench.kv", "main", "KV-cache quality on SmolLM2 (perplexity, KL, passkey)"),
    "gpu-scan": ("tqvec.bench.gpu_scan", "main", "GPU fused search and encode throughput (needs CUDA)"),
    "sharded": ("tqvec.bench.sharded", "main", "Ray sharded index build/query throughput"),
    "index-cuda-check": ("tqvec.bench.index_cuda_check", "main", "Index(device='cuda') against the CPU index"),
    "kv-step": ("tqvec.bench.kv_step", "main", "cost of one decode step with the KV cache"),
    "kv-gpu": ("tqvec.bench.kv_gpu", "main", "GPU decode attention against SDPA (needs CUDA)"),
    "kv-gpu-diag": ("tqvec.bench.kv_gpu_diag", "main", "host cost and launch diagnostics of decode attention"),
    "kv-gpu-floor": ("tqvec.bench.kv_gpu_floor", "main", "streaming floors of decode attention (needs CUDA)"),
}
#: ``tqvec demo``: the quick comparison that ``make run`` prints
DEMO = ("tqvec.bench.demo", "main")

USAGE = ("usage: tqvec {demo,datasets,bench} ...\n\n"
         "  tqvec demo [options]            tqvec beside FAISS at equal bytes on GloVe-50, in minutes\n"
         "  tqvec datasets {list,build NAME}\n  tqvec bench NAME [options]\n\nbenchmarks:\n"
         + "\n".join(f"  {name:<17} {help_}" for name, (_, _, help_) in BENCHMARKS.items()))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tqvec`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return int(getattr(importlib.import_module(DEMO[0]), DEMO[1])(rest) or 0)
    if command == "datasets":
        from tqvec.datasets.cli import main as datasets_main  # noqa: PLC0415

        return int(datasets_main(rest) or 0)
    if command == "bench" and rest and rest[0] in BENCHMARKS:
        module, function, _ = BENCHMARKS[rest[0]]
        result = getattr(importlib.import_module(module), function)(rest[1:])
        return result if isinstance(result, int) else 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
