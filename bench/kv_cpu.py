"""CPU end-to-end measurements of ``TurboQuantCache`` on SmolLM2-135M: bytes held, peak memory, decode speed.

Three measurements, each run in one process so that the caches compared share the machine's state:

* ``bytes``: a ``--context``-token KJV prompt and ``--new-tokens`` greedy tokens through ``model.generate``; the
  bytes each cache holds afterwards (TurboQuantCache: ``nbytes()``; quanto: packed data, scales and zero-points of
  its quantized tensors plus its full-precision residual; DynamicCache: its keys and values);
* ``memory``: peak resident memory of one ``generate`` (a long prompt + a few tokens) above the resident memory
  before it, each cache in its own subprocess (``MALLOC_MMAP_THRESHOLD_`` makes large buffers come from ``mmap``,
  so freed memory leaves the resident set at once; the peak is read from ``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``). A randomly initialized Llama of SmolLM2's layer shapes with ``--layers`` layers runs
  it (the weights do not matter to memory);
* ``speed``: decode tokens/s: prefill ``--context`` KJV tokens, then ``--new-tokens`` greedy one-token steps, timed
  (the steps only); the caches take turns, ``--repeats`` rounds, median per cache.

Writes ``kv_<measurement>.json`` and ``.md`` under ``--out`` (default ``bench/results``).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Cache, DynamicCache, QuantizedCache

from tqvec.kv import TurboQuantCache
from tqvec.kv import evaluate as ev
from tqvec.kv.cache import CodedCache

from ._memory import reset_peak, status_kib
from .kv_step import greedy_token

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1 << 20


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def quanto_nbytes(cache: Cache) -> int:
    """Bytes a transformers ``QuantizedCache`` (quanto) holds: quantized parts (packed data, scales, zero-points) and
    the full-precision residual tokens, all layers."""
    total = 0
    for layer in cache.layers:
        for q in (layer._quantized_keys, layer._quantized_values):
            names, _ = q.__tensor_flatten__()
            total += _tensor_bytes(getattr(getattr(q, n), "_data", getattr(q, n)) for n in names)
        total += _tensor_bytes((layer.keys, layer.values))
    return total


def dynamic_nbytes(cache: Cache) -> int:
    """Bytes of a ``DynamicCache``'s keys and values, all layers."""
    return sum(_tensor_bytes((layer.keys, layer.values)) for layer in cache.layers)


def cache_nbytes(cache: Cache) -> int:
    """Bytes a cache holds: tqvec's caches (``TurboQuantCache``, ``StaticTurboQuantCache``) by their ``nbytes()``,
    quanto's and transformers' dynamic caches by their tensors."""
    if isinstance(cache, CodedCache):
        return cache.nbytes()
    if isinstance(cache, QuantizedCache):
        return quanto_nbytes(cache)
    return dynamic_nbytes(cache)


def _factories(cfg, names: list[str], window: int) -> dict[str, Callable[[], Cache]]:
    """Cache factories by name: ``dynamic``, ``tqvec-<bits>``, ``quanto-<bits>``."""
    out: dict[str, Callable[[], Cache]] = {}
    for name in names:
        if name == "dynamic":
            out[name] = lambda: DynamicCache(config=cfg)
        elif name.startswith("tqvec-"):
            bits = float(name.split("-", 1)[1])
            out[name] = lambda b=bits: TurboQuantCache(cfg, key_bits=b, value_bits=b, window=window)
        elif name.startswith("quanto-"):
            bits = int(name.split("-", 1)[1])
            out[name] = lambda b=bits: QuantizedCache("quanto", cfg, nbits=b, residual_length=window)
        else:
            raise ValueError(f"--caches: unknown cache {name!r} (dynamic, tqvec-<bits>, quanto-<bits>)")
    return out


# ---------------------------------------------------------------------------------------------------- bytes
def _replay(cache: Cache, cfg, context: int, new_tokens: int) -> None:
    """Feed ``cache`` what ``generate`` feeds it, without the model: per layer a ``context``-token prefill update, then
    ``new_tokens`` one-token updates, of random float32 K/V with ``cfg``'s shapes (bytes held depend on shapes only)."""
    g = torch.Generator().manual_seed(0)
    shape = (1, cfg.num_key_value_heads, context, cfg.head_dim)
    for step in range(1 + new_tokens):
        t = context if step == 0 else 1
        for layer in range(cfg.num_hidden_layers):
            keys = torch.randn(*shape[:2], t, shape[3], generator=g)
            cache.update(keys, torch.randn(*shape[:2], t, shape[3], generator=g), layer)


def measure_bytes(args) -> dict:
    model, tokenizer = ev.load_smollm2()
    model.set_attn_implementation("tqvec")  # plain-tensor caches fall back to SDPA inside it
    ids = ev.text_ids(tokenizer, "kjv", args.context)
    rows = {}
    for name, make in _factories(model.config, args.caches, args.window).items():
        cache = make()
        if args.source == "model":
            with torch.no_grad():
                model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                               cache=cache)
        else:
            _replay(cache, model.config, args.context, args.new_tokens)
        held = cache_nbytes(cache)
        rows[name] = {"bytes": held, "MiB": held / MiB, "tokens": cache.get_seq_length(),
                      "bytes_per_token": held / cache.get_seq_length()}
        if isinstance(cache, TurboQuantCache):  # codes (allocated / valid) vs the full-precision sinks + window
            layers = [layer for layer in cache.layers if hasattr(layer, "key_store")]
            rows[name]["codes_MiB"] = sum(l.key_store.nbytes() + l.value_store.nbytes() for l in layers) / MiB
            rows[name]["codes_used_MiB"] = sum(l.key_store.used_nbytes() + l.value_store.used_nbytes() for l in layers) / MiB
            rows[name]["exact_tokens"] = layers[0].keys.shape[2] + layers[0].sink_keys.shape[2]
        print(f"{name:12s} {held / MiB:8.2f} MiB  {held / cache.get_seq_length():8.0f} B/token", flush=True)
    return rows


def bytes_markdown(args, rows: dict, command: str) -> str:
    lines = ["| cache | MiB held | tokens | bytes/token (all held / all tokens) |", "|---|---|---|---|"]
    lines += [f"| {n} | {r['MiB']:.2f} | {r['tokens']} | {r['bytes_per_token']:.0f} |" for n, r in rows.items()]
    for n, r in rows.items():
        if "codes_MiB" in r:
            lines += ["", f"{n}: codes {r['codes_MiB']:.2f} MiB allocated ({r['codes_used_MiB']:.2f} MiB valid), the rest "
                          f"the {r['exact_tokens']} full-precision tokens (sinks + window) and the centering means."]
    return "\n".join([
        "# KV cache bytes held: SmolLM2-135M-Instruct (float32 compute), CPU", "",
        f"Command: `{command}`", "",
        (f"A {args.context}-token KJV prompt, then {args.new_tokens} greedy tokens (`model.generate`)" if args.source == "model"
         else f"SmolLM2's config; what `generate` feeds the cache replayed without running the model (`--source random`: per "
              f"layer a {args.context}-token prefill update, then {args.new_tokens} one-token updates, random float32 "
              "K/V of the model's shapes: the bytes held depend on shapes, not values)") + "; bytes held by "
        "the cache afterwards, all 30 layers, keys + values: TurboQuantCache `nbytes()` (codes at their allocated "
        "capacity, the float32 window of the newest tokens and the 4 sinks, centering means); quanto: packed data, "
        f"scales, zero-points and its float32 residual (residual_length {args.window}); DynamicCache: float32 K/V.",
        "", *lines, ""])


# ---------------------------------------------------------------------------------------------------- memory
def memory_child(args) -> None:
    """One cache, one generate: prints a JSON line with the peak resident growth (bytes) and the cache's bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=args.context + 64,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("tqvec")
    ids = torch.randint(0, cfg.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    cache = _factories(cfg, args.caches, args.window)[args.caches[0]]()
    if not reset_peak():
        raise RuntimeError("measuring a peak needs Linux's /proc/self/clear_refs")
    base = status_kib("VmRSS")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, cache=cache)
    peak = status_kib("VmHWM")
    print(json.dumps({"peak_bytes": (peak - base) * 1024, "cache_bytes": cache_nbytes(cache)}))


def measure_memory(args) -> dict:
    rows = {}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    for name in args.caches:
        cmd = [sys.executable, str(Path(__file__).resolve()), "memory-child", "--caches", name, "--context", str(args.context),
               "--new-tokens", str(args.new_tokens), "--layers", str(args.layers), "--window", str(args.window),
               "--threads", str(args.threads)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows[name] = json.loads(out)
        print(f"{name:12s} peak +{rows[name]['peak_bytes'] / MiB:8.1f} MiB, cache {rows[name]['cache_bytes'] / MiB:8.1f} MiB",
              flush=True)
    return rows


def memory_markdown(args, rows: dict, command: str, extra: str = "") -> str:
    lines = ["| cache | peak resident growth MiB | cache MiB after |", "|---|---|---|"]
    lines += [f"| {n} | {r['peak_bytes'] / MiB:.1f} | {r['cache_bytes'] / MiB:.1f} |" for n, r in rows.items()]
    return "\n".join([
        "# Peak CPU memory of one generate(): long prompt", "",
        f"Command: `{command}`{extra}", "",
        f"A randomly initialized Llama with SmolLM2-135M's layer shapes (hidden 576, 9 query / 3 KV heads, head_dim 64), "
        f"{args.layers} layers, float32; a {args.context}-token prompt and {args.new_tokens} greedy tokens. Each cache "
        "in its own process: peak resident set during `generate` minus the resident set before it (VmHWM reset via "
        "/proc/self/clear_refs; MALLOC_MMAP_THRESHOLD_=65536 so freed buffers leave the resident set).", "",
        *lines, ""])


# ---------------------------------------------------------------------------------------------------- speed
@torch.no_grad()
def _decode_rate(model, ids: torch.Tensor, make: Callable[[], Cache], new_tokens: int) -> float:
    cache = make()
    token = greedy_token(model, cache, ids, use_cache=True, logits_to_keep=1)
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = greedy_token(model, cache, token, use_cache=True)
    return new_tokens / (time.perf_counter() - start)


def measure_speed(args) -> dict:
    model, tokenizer = ev.load_smollm2()
    model.set_attn_implementation("tqvec")
    ids = ev.text_ids(tokenizer, "kjv", args.context)
    makers = _factories(model.config, args.caches, args.window)
    rates: dict[str, list[float]] = {n: [] for n in makers}
    for r in range(args.repeats):
        for name, make in makers.items():
            rates[name].append(_decode_rate(model, ids, make, args.new_tokens))
            print(f"round {r + 1} {name:12s} {rates[name][-1]:7.2f} tokens/s", flush=True)
    base = statistics.median(rates["dynamic"]) if "dynamic" in rates else None
    return {n: {"tokens_per_s": statistics.median(v), "runs": v,
                "vs_dynamic": None if base is None else statistics.median(v) / base} for n, v in rates.items()}


def speed_markdown(args, rows: dict, command: str) -> str:
    lines = ["| cache | decode tokens/s (median) | × DynamicCache | runs |", "|---|---|---|---|"]
    for n, r in rows.items():
        ratio = "—" if r["vs_dynamic"] is None else f"{r['vs_dynamic']:.2f}"
        lines.append(f"| {n} | {r['tokens_per_s']:.2f} | {ratio} | {', '.join(f'{x:.2f}' for x in r['runs'])} |")
    return "\n".join([
        "# CPU decode speed: SmolLM2-135M-Instruct (float32 compute)", "",
        f"Command: `{command}`", "",
        f"Prefill {args.context} KJV tokens, then {args.new_tokens} greedy one-token steps (timed: the steps only); "
        f"the caches take turns in one process, {args.repeats} rounds; torch threads: {torch.get_num_threads()}. "
        f"tqvec and quanto: window / residual_length {args.window}. The machine is shared: compare the ratios "
        "within this run, not absolute figures across runs.", "", *lines, ""])


# ---------------------------------------------------------------------------------------------------- main
def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tqvec bench kv-cpu", description=__doc__.splitlines()[0])
    p.add_argument("measurement", choices=["bytes", "memory", "speed", "memory-child"])
    p.add_argument("--caches", nargs="+", default=None, help="dynamic, tqvec-<bits>, quanto-<bits>")
    p.add_argument("--context", type=int, default=None, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--window", type=int, default=128, help="tqvec window / quanto residual_length")
    p.add_argument("--layers", type=int, default=4, help="memory: layers of the random model")
    p.add_argument("--repeats", type=int, default=3, help="speed: rounds")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--source", choices=["model", "random"], default="model",
                   help="bytes: K/V from the model's generate(), or random K/V of its shapes fed to cache.update")
    p.add_argument("--note", default="", help="memory: a sentence appended after the command in the .md")
    args = p.parse_args(argv)
    defaults = {"bytes": (["tqvec-4", "quanto-4", "dynamic"], 4096, 40),
                "memory": (["dynamic", "tqvec-4"], 16384, 4), "memory-child": (["tqvec-4"], 16384, 4),
                "speed": (["dynamic", "tqvec-4", "tqvec-3", "tqvec-2.5", "quanto-4"], 2048, 64)}[args.measurement]
    args.caches = args.caches or defaults[0]
    args.context = args.context or defaults[1]
    args.new_tokens = args.new_tokens or defaults[2]
    return args


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.measurement == "memory-child":
        memory_child(args)
        return
    command = "python -m tqvec.bench.kv_cpu " + shlex.join(argv if argv is not None else sys.argv[1:])
    rows = {"bytes": measure_bytes, "memory": measure_memory, "speed": measure_speed}[args.measurement](args)
    render = {"bytes": bytes_markdown, "speed": speed_markdown}.get(args.measurement)
    md = render(args, rows, command) if render else memory_markdown(args, rows, command, args.note)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kv_{args.measurement}"
    stem.with_suffix(".json").write_text(json.dumps({"command": command, "args": {k: str(v) for k, v in vars(args).items()},
                                                     "results": rows}, indent=2))
    stem.with_suffix(".md").write_text(md)
    print(f"wrote {stem}.md")


if __name__ == "__main__":
    main()
