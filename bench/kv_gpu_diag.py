"""Decode-attention diagnostics on the GPU, behind the analysis in ``bench/results/kv_gpu.md`` (needs CUDA).

* fixed cost: the split kernel, the combine kernel and the whole step, each replayed from its own CUDA graph
  (L2 flushed), from 256 to 131,072 tokens, with and without the 128-token exact window;
* configurations: the whole step at 32k and 128k tokens with 1- and 2-warp split programs (short tiles, more
  programs per SM), with register caps that fit more warps per SM, and with 8-warp programs, beside the default;
* host cost: Python and launch time per eager call (no synchronization inside the timed calls: what eager
  decoding pays per layer) of the split kernel, the combine kernel, the whole step and fp16 SDPA, at 8k tokens, with
  the kernels' direct launches and through Triton's own launch path.

``python -m tqvec.bench.kv_gpu_diag --out DIR`` writes ``kv_gpu_diag.json`` / ``kv_gpu_diag.md`` (batch 1, 4-bit K/V).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tqvec import scan

from .kv_gpu import CONFIG_NAMES, HKV, HQ, RESULTS, D, _configuration, _configure, _time_ms, random_step

FIXED_CONTEXTS = (256, 1024, 4096, 32768, 131072)
LAUNCHES = {"direct": "direct (`kernels.launch.Launcher`, default)", "triton": "Triton's `kernel[grid](...)`"}
#: (block_n, warps, stages, programs_per_sm, max_registers); the first is the default of ``kernels.attention``
CONFIGURATIONS = ((128, 4, 2, 4, 128), (128, 2, 2, 6, 0), (64, 2, 2, 8, 0), (32, 2, 2, 12, 0), (32, 1, 2, 16, 0),
                  (64, 1, 2, 16, 0), (32, 1, 2, 24, 0), (128, 4, 2, 5, 96), (64, 4, 2, 5, 96), (64, 4, 2, 7, 72),
                  (128, 8, 2, 2, 128), (128, 8, 2, 3, 80), (256, 8, 2, 2, 128))


def host_us(fn: Callable[[], object], calls: int = 300, rounds: int = 5) -> float:
    """Median over ``rounds`` of the host time per call of ``fn`` in µs (the GPU queue drained between rounds)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def fixed_cost(iters: int) -> list[dict]:
    """Graph-replayed µs of the split kernel, the combine kernel and the step per context and window."""
    from tqvec.kernels import attention as ka  # noqa: PLC0415 - CUDA only

    rows = []
    for window in (128, 0):
        for context in FIXED_CONTEXTS:
            step = random_step(1, context, 4, window)
            launch = ka.DecodeLaunch(step)
            partials = launch.split_step(step)
            rows.append({"window": window, "context": context, "slices": partials.parts - 1,
                         "split_us": 1000 * _time_ms(lambda: launch.split_step(step), iters, graph=True),  # noqa: B023
                         "combine_us": 1000 * _time_ms(lambda: launch.combine(partials), iters, graph=True),  # noqa: B023
                         "step_us": 1000 * _time_ms(lambda: scan.attend(step), iters, graph=True)})  # noqa: B023
            print(json.dumps(rows[-1]), flush=True)
    return rows


def configurations(iters: int) -> list[dict]:
    """Graph-replayed µs of the step for each of :data:`CONFIGURATIONS` at 32k and 128k tokens."""
    from tqvec.kernels import attention as ka  # noqa: PLC0415

    default = _configuration(ka)
    rows = []
    for context in (32768, 131072):
        step = random_step(1, context, 4, 128)
        for config in CONFIGURATIONS:
            _configure(ka, config)
            rows.append({"context": context, **dict(zip(CONFIG_NAMES, config)),
                         "step_us": 1000 * _time_ms(lambda: scan.attend(step), iters, graph=True)})  # noqa: B023
            print(json.dumps(rows[-1]), flush=True)
    _configure(ka, default)
    return rows


def host_cost() -> list[dict]:
    """Host µs per eager call at 8k tokens: split, combine (of a bound :class:`tqvec.kernels.attention.DecodeLaunch`), step
    (``tqvec.scan.attend``, which binds one per call), the bound launch's whole step (what a cache layer runs) and fp16
    SDPA, with the kernels' direct launches (the default) and through Triton's own launch path."""
    from tqvec.kernels import attention as ka  # noqa: PLC0415

    step = random_step(1, 8192, 4, 128)
    launch = ka.DecodeLaunch(step)
    partials = launch.split_step(step)
    k = torch.randn(1, HKV, 8192, D, device="cuda", dtype=torch.float16)
    q = torch.randn(1, HQ, 1, D, device="cuda", dtype=torch.float16)
    rows = []
    available = ka.SPLIT.direct, ka.COMBINE.direct
    for direct in (True, False):
        ka.SPLIT.direct, ka.COMBINE.direct = (direct and available[0]), (direct and available[1])
        rows.append({"launch": "direct" if direct else "triton", "split_us": host_us(lambda: launch.split_step(step)),
                     "combine_us": host_us(lambda: launch.combine(partials)), "step_us": host_us(lambda: scan.attend(step)),
                     "bound_step_us": host_us(lambda: launch.attend(step)),
                     "sdpa_us": host_us(lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True))})
        print(json.dumps(rows[-1]), flush=True)
    ka.SPLIT.direct, ka.COMBINE.direct = available
    return rows


def _markdown(fixed: list[dict], configs: list[dict], host: list[dict], command: str, device: str) -> str:
    out = [f"# Decode-attention diagnostics on {device} (batch 1, 4-bit K/V, 32 query / 8 KV heads, d 128)", "",
           f"Command: `{command}`. Graph-replayed medians (L2 flushed) unless said otherwise.", "",
           "Fixed cost (each kernel replayed alone from its own graph, so each carries its own replay overhead):", "",
           "| window | context | coded slices | split µs | combine µs | step µs |", "|---|---|---|---|---|---|"]
    out += [f"| {r['window']} | {r['context']} | {r['slices']} | {r['split_us']:.1f} | {r['combine_us']:.1f} | "
            f"{r['step_us']:.1f} |" for r in fixed]
    out += ["", "Split-program configurations (the first row of each context is the default):", "",
            "| context | tokens per tile | warps | stages | programs per SM | max registers (0: no cap) | step µs |",
            "|---|---|---|---|---|---|---|"]
    out += [f"| {r['context']} | {r['block_n']} | {r['warps']} | {r['stages']} | {r['programs_per_sm']} | "
            f"{r['max_registers']} | {r['step_us']:.1f} |" for r in configs]
    out += ["", "Host time per eager call at 8k tokens (Python and launch; median of 5 rounds of 300 calls):", "",
            "| launch | split µs | combine µs | step µs | bound step µs | fp16 SDPA µs |", "|---|---|---|---|---|---|"]
    out += [f"| {LAUNCHES[r['launch']]} | {r['split_us']:.1f} | {r['combine_us']:.1f} | {r['step_us']:.1f} | "
            f"{r['bound_step_us']:.1f} | {r['sdpa_us']:.1f} |" for r in host]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the three diagnostics and write ``kv_gpu_diag.json`` / ``kv_gpu_diag.md`` under ``--out``."""
    p = argparse.ArgumentParser(prog="tqvec bench kv-gpu-diag", description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.kv_gpu_diag needs a CUDA device")
    command = "python -m tqvec.bench.kv_gpu_diag " + shlex.join(argv if argv is not None else sys.argv[1:])
    fixed, configs, host = fixed_cost(args.iters), configurations(args.iters), host_cost()
    device = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_gpu_diag.json").write_text(json.dumps(
        {"command": command, "device": device, "fixed_cost": fixed, "configurations": configs, "host_cost": host}, indent=2))
    (args.out / "kv_gpu_diag.md").write_text(_markdown(fixed, configs, host, command, device))


if __name__ == "__main__":
    main()
