"""``tqvec bench kv``: TurboQuant KV cache quality on SmolLM2-135M over real text (CPU).

For each text (stdlib ``pydoc_data.topics``; the KJV verses) and each cache — full precision
(``DynamicCache``), ``TurboQuantCache`` at bits × key mode, transformers' ``QuantizedCache`` (quanto) —
measure chunked teacher-forced perplexity, KL(full ‖ cache) and top-1 agreement (protocol:
:mod:`tqvec.kv.evaluate`), passkey retrieval at several context lengths, and stored bytes per token
(all layers, keys + values, for tokens held in compressed form). Writes ``kv.json`` and ``kv.md``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import Cache, DynamicCache, QuantizedCache

from tqvec.kv import TurboQuantCache
from tqvec.kv import evaluate as ev

RESULTS = Path(__file__).resolve().parent / "results"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tqvec bench kv", description=__doc__.splitlines()[0])
    p.add_argument("--texts", nargs="+", default=["pydoc", "kjv"], choices=["pydoc", "kjv"])
    p.add_argument("--tokens", type=int, default=1536, help="tokens per text, prefill included")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--bits", type=float, nargs="+", default=[2, 2.5, 3, 3.5, 4])
    p.add_argument("--key-modes", nargs="+", default=["mse", "prod"], choices=["mse", "prod"])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--quanto-bits", type=int, nargs="*", default=[2, 4])
    p.add_argument("--passkey-lengths", type=int, nargs="*", default=[1024, 2048, 4096])
    p.add_argument("--passkey-depths", type=float, nargs="*", default=[0.25, 0.6])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def _configs(args: argparse.Namespace, model) -> dict[str, tuple[Callable[[], Cache], float]]:
    """name → (cache factory, stored bytes per compressed token over all layers, K + V)."""
    cfg = model.config
    layers, heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    out: dict[str, tuple[Callable[[], Cache], float]] = {
        "full (fp16 equiv.)": (lambda: DynamicCache(config=cfg), layers * heads * dim * 2 * 2)}
    for mode in args.key_modes:
        for bits in args.bits:
            probe = TurboQuantCache(cfg, key_bits=bits, value_bits=bits, key_mode=mode)
            per_token = layers * heads * (probe.key_codec.bytes_per_vector + probe.value_codec.bytes_per_vector)
            out[f"tqvec {bits:g}b K-{mode}"] = (
                lambda b=bits, m=mode: TurboQuantCache(cfg, key_bits=b, value_bits=b, key_mode=m, window=args.window),
                per_token)
    for bits in args.quanto_bits:
        out[f"QuantizedCache quanto {bits}b"] = (
            lambda b=bits: QuantizedCache("quanto", cfg, nbits=b, residual_length=args.window), float("nan"))
    return out


def _quanto_bytes_per_token(cache: Cache) -> float:
    """Bytes per quantized token over all layers (packed data, scales, zero-points) of a quanto cache."""
    total, tokens = 0, 0
    for layer in cache.layers:
        for q in (layer._quantized_keys, layer._quantized_values):
            names, _ = q.__tensor_flatten__()
            parts = [getattr(q, n) for n in names]
            parts = [getattr(t, "_data", t) for t in parts]  # a PackedTensor keeps its bytes in ._data
            total += sum(t.numel() * t.element_size() for t in parts)
        tokens = layer._quantized_keys.shape[-2]
    return total / tokens


def _quality(args, model, tokenizer, configs, log) -> dict[str, dict[str, dict[str, float]]]:
    results: dict[str, dict[str, dict[str, float]]] = {}
    for text in args.texts:
        ids = ev.text_ids(tokenizer, text, args.tokens)
        prefix = ev.Prefix.run(model, ids[:, : args.prefill])
        targets = ids[0, args.prefill:]
        reference = None
        for name, (make, per_token) in configs.items():
            t0 = time.time()
            made: list[Cache] = []
            lp = ev.chunked_logprobs(model, ids, prefix, lambda: made.append(make()) or made[-1], args.chunk)
            reference = lp if reference is None else reference
            row = ev.compare(reference, lp, targets)
            row["bytes_per_token"] = _quanto_bytes_per_token(made[0]) if name.startswith("QuantizedCache") else per_token
            row["seconds"] = time.time() - t0
            results.setdefault(name, {})[text] = row
            log(f"{text:6s} {name:28s} ppl {row['ppl']:.3f} kl {row['kl']:.4f} top1 {row['top1']:.3f} "
                f"B/tok {row['bytes_per_token']:.0f} ({row['seconds']:.0f}s)")
    return results


def _passkey(args, model, tokenizer, configs, log) -> dict[str, dict[str, float]]:
    hits: dict[str, dict[str, int]] = {name: {} for name in configs}
    for length in args.passkey_lengths:
        for i, depth in enumerate(args.passkey_depths):
            key = 10007 + (7919 * (i + 3 * length)) % 89989
            context, question = ev.passkey_prompt(tokenizer, length, depth, key)
            prefix = ev.Prefix.run(model, context)
            for name, (make, _) in configs.items():
                answer = ev.passkey_answer(model, tokenizer, prefix, question, make)
                hits[name][str(length)] = hits[name].get(str(length), 0) + (str(key) in answer)
            log(f"passkey {length} depth {depth}: " + ", ".join(f"{n}={hits[n][str(length)]}" for n in configs))
    trials = len(args.passkey_depths)
    return {name: {length: n / trials for length, n in per.items()} for name, per in hits.items()}


def _markdown(args, results, passkey, command: str, seconds: float) -> str:
    full = results["full (fp16 equiv.)"]
    head = ["cache", "bytes/token"]
    for t in args.texts:
        head += [f"{t} ppl", f"{t} Δppl", f"{t} KL", f"{t} top-1"]
    head += [f"passkey {n}" for n in args.passkey_lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, per_text in results.items():
        row = [name, f"{next(iter(per_text.values()))['bytes_per_token']:.0f}"]
        for t in args.texts:
            r = per_text[t]
            row += [f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / full[t]['ppl'] - 1):+.2f}%", f"{r['kl']:.4f}", f"{r['top1']:.3f}"]
        row += [f"{passkey.get(name, {}).get(str(n), float('nan')):.2f}" for n in args.passkey_lengths]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join([
        "# KV cache quality: SmolLM2-135M-Instruct (Q4_1 weights, float32 compute), CPU", "",
        f"Command: `{command}` ({seconds / 60:.1f} min).", "",
        f"Texts: {', '.join(args.texts)}; {args.tokens} tokens each: prefill {args.prefill} (exact attention), then "
        f"chunks of {args.chunk} tokens that read the cache; window {args.window} exact tokens for tqvec and "
        "QuantizedCache (its residual_length). Δppl, KL(full ‖ cache) and top-1 agreement against the "
        "full-precision cache on the same tokens. bytes/token: stored bytes per compressed token, all 30 layers, "
        "keys + values (full: what fp16 would take; the model here runs float32). tqvec values always mse; "
        "fractional bits: outlier channels by magnitude (tqvec.kv.codec). Passkey: fraction of "
        f"{len(args.passkey_depths)} depths {args.passkey_depths} retrieved per context length.", "",
        *lines, ""])


def main(argv: list[str] | None = None) -> None:
    """Run the KV-cache benchmark and write ``kv.json`` / ``kv.md`` under ``--out``."""
    args = _args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.time()
    log = lambda msg: print(f"[{time.time() - start:6.0f}s] {msg}", flush=True)  # noqa: E731
    model, tokenizer = ev.load_smollm2()
    model.set_attn_implementation("tqvec")
    configs = _configs(args, model)
    results = _quality(args, model, tokenizer, configs, log)
    passkey = _passkey(args, model, tokenizer, configs, log)
    command = "tqvec bench kv " + shlex.join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    seconds = time.time() - start
    (args.out / "kv.json").write_text(json.dumps({
        "command": command, "seconds": seconds, "args": {k: str(v) for k, v in vars(args).items()},
        "quality": results, "passkey": passkey}, indent=2))
    (args.out / "kv.md").write_text(_markdown(args, results, passkey, command, seconds))
    log(f"wrote {args.out / 'kv.md'}")


if __name__ == "__main__":
    main()
