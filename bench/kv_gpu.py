"""GPU decode-attention latency: tqvec attention over 4-bit K/V codes vs fp16 SDPA (Llama-3-8B shape).

Random fp16 queries/keys/values (speed does not depend on weights): 32 query heads, 8 KV heads,
head_dim 128, one decode query token, contexts 4k…128k, batch 1 and 8. tqvec: a
:class:`~tqvec.kv.TurboQuantLayer` holding ``context − window`` tokens as codes plus the window, read by
:func:`tqvec.kv.attention.compressed_attention` (scores through :func:`tqvec.scan.scores`, i.e. the
Triton scan on CUDA). Also: end-to-end greedy decode tokens/s and peak memory of a randomly initialized
Llama-3-8B-shaped model cut to ``--e2e-layers`` layers, DynamicCache + SDPA vs TurboQuantCache + tqvec.
Writes ``kv_gpu.json`` / ``kv_gpu.md``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tqvec import scan
from tqvec.kv import TurboQuantCache, TurboQuantLayer
from tqvec.kv.attention import compressed_attention, decode_step
from tqvec.kv.codec import HeadCodec

from .kv_cpu import cache_nbytes
from .kv_step import decode_ms

RESULTS = Path(__file__).resolve().parent / "results"
HQ, HKV, D = 32, 8, 128
#: untimed decode steps before the end-to-end timing (two TurboQuantCache compression rounds)
E2E_WARMUP = 40


_FLUSH: list[torch.Tensor] = []


def _time_ms(fn: Callable[[], object], iters: int, graph: bool = False) -> float:
    """Median milliseconds of ``fn`` over ``iters`` CUDA-event-timed calls, the L2 cache flushed before each
    (a 256 MiB write, outside the timed span). ``graph``: time a CUDA-graph replay of ``fn`` instead of
    eager launches (what a decode loop with static shapes does; removes Python launch latency)."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    for _ in range(3):
        fn()
    run = fn
    if graph:
        from tqvec.kernels.ops import capture_graph  # noqa: PLC0415 - CUDA only

        run = capture_graph(fn)[0].replay
    times = []
    for _ in range(iters):
        _FLUSH[0].zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def attention_row(batch: int, context: int, bits: float, window: int, iters: int) -> dict[str, float]:
    """One (batch, context) point: SDPA and tqvec latency (tqvec: the launch of a cache layer, bound once; and its two
    kernels alone), their relative output difference, bytes held."""
    from tqvec.kernels import attention as ka  # noqa: PLC0415 - CUDA only
    g = torch.Generator(device="cuda").manual_seed(context + batch)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(batch, HKV, context, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(batch, HKV, context, D, device="cuda", dtype=torch.float16, generator=g)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    sdpa_ms, sdpa_graph_ms = _time_ms(sdpa, iters), _time_ms(sdpa, iters, graph=True)
    ref = sdpa().float()
    layer = TurboQuantLayer(HeadCodec(D, bits), HeadCodec(D, bits, seed=1000), window)
    layer.update(k[:, :, :-1], v[:, :, :-1])
    handle, _ = layer.update(k[:, :, -1:], v[:, :, -1:])
    fp_bytes = (k.numel() + v.numel()) * 2
    step = decode_step(handle, q, None, D ** -0.5)
    launch = ka.DecodeLaunch(step)  # bound once, as a cache layer keeps it between compressions
    tq = lambda: launch.attend(step)  # noqa: E731
    tq_ms, tq_graph_ms = _time_ms(tq, iters), _time_ms(tq, iters, graph=True)
    partials = launch.split_step(step)
    split_ms = _time_ms(lambda: launch.split_step(step), iters, graph=True)
    combine_ms = _time_ms(lambda: launch.combine(partials), iters, graph=True)
    out = tq().reshape(q.shape).float()
    err = float((out - ref).norm() / ref.norm())
    ref_err = float((out - compressed_attention(handle, q, None, D ** -0.5)).norm() / ref.norm())
    return {"batch": batch, "context": context, "sdpa_us": 1000 * sdpa_ms, "tqvec_us": 1000 * tq_ms,
            "speedup": sdpa_ms / tq_ms, "sdpa_graph_us": 1000 * sdpa_graph_ms, "tqvec_graph_us": 1000 * tq_graph_ms,
            "graph_speedup": sdpa_graph_ms / tq_graph_ms,
            "split_graph_us": 1000 * split_ms, "combine_graph_us": 1000 * combine_ms, "rel_err": err, "rel_diff_per_head_path": ref_err,
            "fp16_bytes": fp_bytes, "tqvec_bytes": layer.nbytes(), "code_bytes_read": _code_bytes(layer)}


def _code_bytes(layer: TurboQuantLayer) -> int:
    """Bytes of the valid codes and scales (what the split kernel reads)."""
    n = layer.key_store.length
    return sum(t[:, :, :n].numel() * t.element_size() for store in (layer.key_store, layer.value_store)
               for f in store.fields for t in f.values())


def end_to_end(layers: int, context: int, new_tokens: int, bits: float) -> list[dict[str, float]]:
    """Eager greedy decode tokens/s and peak memory, random Llama-3-8B-shaped model with ``layers`` layers. Warm-up:
    ``E2E_WARMUP`` untimed steps, so that the timed ones include no kernel compilation (TurboQuantCache compresses
    ``compress_chunk`` tokens at a time: the first compression after prefill compiles its kernels). DynamicCache runs
    twice: PyTorch's default SDPA backend choice (cuDNN here) and with the cuDNN backend switched off."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=HQ, num_key_value_heads=HKV,
                      head_dim=D, num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=context + 256)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).half().eval()
    ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")
    rows = []
    runs = (("DynamicCache + sdpa", "sdpa", True, lambda: DynamicCache(config=cfg)),
            ("DynamicCache + sdpa, cuDNN off", "sdpa", False, lambda: DynamicCache(config=cfg)),
            (f"TurboQuantCache {bits:g}b + tqvec", "tqvec", True, lambda: TurboQuantCache(cfg, key_bits=bits, value_bits=bits)))
    for name, impl, cudnn, make in runs:
        model.set_attn_implementation(impl)
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cache = make()
        seconds = decode_ms(model, cache, ids, new_tokens, warmup=E2E_WARMUP) * new_tokens / 1000
        cache_bytes = cache_nbytes(cache)
        rows.append({"cache": name, "layers": layers, "context": context, "tokens_per_s": new_tokens / seconds,
                     "peak_mem_gib": (torch.cuda.max_memory_allocated() - base) / 2 ** 30, "cache_mib": cache_bytes / 2 ** 20})
        del cache
    torch.backends.cuda.enable_cudnn_sdp(True)
    return rows


def _markdown(rows: list[dict], e2e: list[dict], command: str, device: str) -> str:
    out = [f"# Decode attention on {device}: tqvec (4-bit K/V codes) vs fp16 SDPA", "",
           f"Command: `{command}`. 32 query heads, 8 KV heads, head_dim 128, 1 query token; median of CUDA-event timings.",
           "L2 flushed before every timed call. *Graph*: the call replayed from a CUDA graph (a decode loop with static "
           "shapes); *eager*: launched from Python. tqvec = the split-sequence Triton kernels over the codes, sinks and "
           "window (`kernels/attention.py`), launched as a cache layer does: bound once (`DecodeLaunch`). Code GB/s: K/V codes and scales read per second (graph). "
           "Split / combine: tqvec's two kernels, each replayed alone from its own graph (so each carries its own "
           "replay overhead).",
           "", "| batch | context | SDPA µs graph | tqvec µs graph | speed-up graph | SDPA µs eager | tqvec µs eager | "
           "speed-up eager | split µs | combine µs | code GB/s | rel. error vs SDPA | KV bytes fp16 → tqvec |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['batch']} | {r['context']} | {r['sdpa_graph_us']:.1f} | {r['tqvec_graph_us']:.1f} | "
                   f"{r['graph_speedup']:.2f}× | {r['sdpa_us']:.1f} | {r['tqvec_us']:.1f} | {r['speedup']:.2f}× | "
                   f"{r['split_graph_us']:.1f} | {r['combine_graph_us']:.1f} | "
                   f"{r['code_bytes_read'] / r['tqvec_graph_us'] / 1e3:.0f} | {r['rel_err']:.3f} | "
                   f"{r['fp16_bytes'] / 2**20:.0f} MiB → {r['tqvec_bytes'] / 2**20:.0f} MiB |")
    if e2e:
        out += ["", "End-to-end eager greedy decode (random Llama-3-8B-shaped model, fewer layers; after " + str(E2E_WARMUP) + " untimed steps):", "",
                "| cache | layers | context | tokens/s | peak extra memory GiB | cache MiB |", "|---|---|---|---|---|---|"]
        out += [f"| {r['cache']} | {r['layers']} | {r['context']} | {r['tokens_per_s']:.1f} | {r['peak_mem_gib']:.2f} | "
                f"{r['cache_mib']:.0f} |" for r in e2e]
    return "\n".join(out) + "\n"


#: the split-kernel constants of ``kernels.attention`` that ``--config`` / ``--sweep`` set (max_registers 0: no cap)
CONFIG_NAMES = ("block_n", "warps", "stages", "programs_per_sm", "max_registers")


def _configure(ka: object, config: tuple[int, ...]) -> None:
    block_n, warps, stages, per_sm, max_registers = config
    ka.BLOCK_N, ka.NUM_WARPS, ka.NUM_STAGES, ka.PROGRAMS_PER_SM = block_n, warps, stages, per_sm
    ka.MAX_REGISTERS = max_registers or None


def _configuration(ka: object) -> tuple[int, ...]:
    """The split-kernel constants of ``kernels.attention`` now, as :func:`_configure` takes them."""
    return ka.BLOCK_N, ka.NUM_WARPS, ka.NUM_STAGES, ka.PROGRAMS_PER_SM, ka.MAX_REGISTERS or 0


def random_step(batch: int, context: int, bits: float, window: int) -> scan.DecodeAttention:
    """One decode step over ``context`` random fp16 tokens (keys double as values: speed does not depend on them)
    held by a :class:`TurboQuantLayer` (``window`` exact), Llama-3-8B head shape."""
    g = torch.Generator(device="cuda").manual_seed(context + batch)
    k = torch.randn(batch, HKV, context, D, device="cuda", dtype=torch.float16, generator=g)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.float16, generator=g)
    layer = TurboQuantLayer(HeadCodec(D, bits), HeadCodec(D, bits, seed=1000), window)
    layer.update(k[:, :, :-1], k[:, :, :-1])
    handle, _ = layer.update(k[:, :, -1:], k[:, :, -1:])
    return decode_step(handle, q, None, D ** -0.5)


def sweep(contexts: list[int], batches: list[int], bits: float, window: int, iters: int) -> list[dict]:
    """Graph-replayed tqvec latency for each split-kernel configuration (``kernels.attention`` constants)."""
    from tqvec.kernels import attention as ka  # noqa: PLC0415

    rows = []
    for batch in batches:
        for context in contexts:
            step = random_step(batch, context, bits, window)
            grid = itertools.product((64, 128), (4,), (2, 3), (3, 4, 6), (0, 128))
            for config in grid:
                _configure(ka, config)
                try:
                    us = 1000 * _time_ms(lambda: scan.attend(step), iters, graph=True)  # noqa: B023
                except Exception as err:  # noqa: BLE001 - a configuration that does not compile is reported
                    us = float("nan")
                    print(f"config failed: {err!r}"[:200], flush=True)
                rows.append({"batch": batch, "context": context, **dict(zip(CONFIG_NAMES, config)), "us": us})
                print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run the GPU attention benchmark (needs CUDA) and write ``kv_gpu.json`` / ``kv_gpu.md`` under ``--out``."""
    p = argparse.ArgumentParser(prog="tqvec bench kv-gpu", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--bits", type=float, default=4)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--e2e-layers", type=int, default=4, help="0 skips the end-to-end decode")
    p.add_argument("--e2e-context", type=int, default=32768)
    p.add_argument("--e2e-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--sweep", action="store_true", help="time split-kernel configurations instead (kv_gpu_sweep.json)")
    p.add_argument("--config", type=int, nargs=5, metavar=("BLOCK_N", "WARPS", "STAGES", "PER_SM", "MAX_REGS"),
                   help="split-kernel configuration (default: the constants in kernels/attention.py; MAX_REGS 0: no cap)")
    args = p.parse_args(argv)
    if args.config:
        from tqvec.kernels import attention as ka  # noqa: PLC0415

        _configure(ka, args.config)
    if not torch.cuda.is_available():
        raise SystemExit("bench.kv_gpu needs a CUDA device")
    if args.sweep:
        rows = sweep(args.contexts, args.batches, args.bits, args.window, args.iters)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_gpu_sweep.json").write_text(json.dumps(rows, indent=2))
        return
    command = "python -m tqvec.bench.kv_gpu " + shlex.join(argv if argv is not None else sys.argv[1:])
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            rows.append(attention_row(batch, context, args.bits, args.window, args.iters))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    e2e = end_to_end(args.e2e_layers, args.e2e_context, args.e2e_tokens, args.bits) if args.e2e_layers else []
    for r in e2e:
        print(json.dumps(r), flush=True)
    device = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_gpu.json").write_text(json.dumps({"command": command, "device": device, "attention": rows, "end_to_end": e2e}, indent=2))
    (args.out / "kv_gpu.md").write_text(_markdown(rows, e2e, command, device))


if __name__ == "__main__":
    main()
