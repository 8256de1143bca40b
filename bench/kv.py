"""``tqvec bench kv``: TurboQuant KV cache quality on SmolLM2-135M or Gemma-3-270M over real text (CPU).

For each text (stdlib ``pydoc_data.topics``; the KJV verses) and each cache — full precision
(``DynamicCache``), ``TurboQuantCache`` at bits × key mode, transformers' ``QuantizedCache`` (quanto) —
measure chunked teacher-forced perplexity, KL(full ‖ cache) and top-1 agreement (protocol:
:mod:`tqvec.kv.evaluate`), and stored bytes per token (all layers, keys + values, for tokens held in
compressed form). Passkey retrieval: seeded trials (context lengths × depths × random 5-digit keys),
each prefilled once and answered by every cache (a prefill attends exactly in every cache here, so the
prefill is shared), reported as hits per length and paired against the full cache (trials one cache
answers and the other misses), with each trial's key margin. Writes ``kv.json`` and ``kv.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Cache, DynamicCache, QuantizedCache

from tqvec.kv import TurboQuantCache, TurboQuantLayer
from tqvec.kv import evaluate as ev

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_TITLES = {"smollm2": "SmolLM2-135M-Instruct (Q4_1 weights, float32 compute)",
                "gemma3": "Gemma-3-270M (Q4_K_M weights, float32 compute)"}
MODEL_LAYERS = {"smollm2": "all 30 layers", "gemma3": "the 3 full-attention layers of 18 (the 15 sliding-window layers "
                "hold their last 512 tokens uncompressed in every cache)"}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tqvec bench kv", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=sorted(ev.MODELS),
                   help="smollm2: Llama-shaped, all layers full attention; gemma3: 3 of 18 layers full attention")
    p.add_argument("--texts", nargs="+", default=["pydoc", "kjv"], choices=["pydoc", "kjv"])
    p.add_argument("--tokens", type=int, default=1536, help="tokens per text, prefill included")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--bits", type=float, nargs="+", default=[2, 2.5, 3, 3.5, 4])
    p.add_argument("--key-modes", nargs="+", default=["mse", "prod"], choices=["mse", "prod"])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--quanto-bits", type=int, nargs="*", default=[2, 4])
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--passkey-depths", type=float, nargs="+", default=[0.2, 0.4, 0.6, 0.8])
    p.add_argument("--passkey-keys", type=int, default=2, help="random keys per (length, depth)")
    p.add_argument("--passkey-seed", type=int, default=0)
    p.add_argument("--passkey-key-modes", nargs="*", default=["mse"], choices=["mse", "prod"],
                   help="tqvec key modes that also run the passkey trials")
    p.add_argument("--passkey-control-bits", type=float, nargs="*", default=[8],
                   help="extra near-lossless tqvec caches (passkey only): how often a tiny perturbation flips a trial")
    p.add_argument("--passkey-no-rescale-bits", type=float, nargs="*", default=[4],
                   help="extra tqvec caches without key rescaling (passkey only; the default before it)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--render", type=Path, default=None, metavar="KV_JSON",
                   help="measure nothing: rewrite the Markdown beside KV_JSON (same name, .md) from a saved kv.json")
    return p.parse_args(argv)


def _configs(args: argparse.Namespace, model) -> dict[str, tuple[Callable[[], Cache], float]]:
    """name → (cache factory, stored bytes per compressed token over the full-attention layers, K + V)."""
    cfg = model.config
    # the layers TurboQuantCache compresses (full attention; sliding-window layers hold a bounded window in every cache)
    layers = sum(isinstance(layer, TurboQuantLayer) for layer in TurboQuantCache(cfg).layers)
    heads, dim = cfg.num_key_value_heads, cfg.head_dim
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


def _sign_test(lost: int, won: int) -> float:
    """One-sided exact sign (McNemar) test: P(≥ ``lost`` of ``lost + won`` discordant trials go against the cache)."""
    n = lost + won
    return sum(math.comb(n, i) for i in range(lost, n + 1)) / 2 ** n if n else 1.0


def _passkey(args, model, tokenizer, configs, log) -> dict:
    """Every passkey trial answered by every config: hits, margins, answers, and the paired summary."""
    cfg = model.config
    names = [n for n in configs if not n.startswith("tqvec") or n.split("K-")[-1] in args.passkey_key_modes]
    makers = {n: configs[n][0] for n in names}
    for bits in args.passkey_control_bits:
        makers[f"tqvec {bits:g}b K-mse (control)"] = lambda b=bits: TurboQuantCache(cfg, key_bits=b, value_bits=b, window=args.window)
    for bits in args.passkey_no_rescale_bits:
        makers[f"tqvec {bits:g}b K-mse, no key rescale"] = lambda b=bits: TurboQuantCache(
            cfg, key_bits=b, value_bits=b, window=args.window, key_rescale=False)
    trials = ev.passkey_trials(args.passkey_lengths, args.passkey_depths, args.passkey_keys, args.passkey_seed)
    per = {n: {"hit": [], "margin": [], "answer": []} for n in makers}
    seconds: dict[str, list[float]] = {}
    for i, trial in enumerate(trials):
        t0 = time.time()
        context, question = ev.passkey_prompt(tokenizer, trial.length, trial.depth, trial.key)
        prefix = ev.Prefix.run(model, context)
        for name, make in makers.items():
            answer, margin = ev.passkey_decode(model, tokenizer, prefix, question, make, trial.key)
            per[name]["hit"].append(margin > 0)
            per[name]["margin"].append(round(margin, 4))
            per[name]["answer"].append(answer)
        seconds.setdefault(str(trial.length), []).append(time.time() - t0)
        log(f"passkey {i + 1}/{len(trials)} len {trial.length} depth {trial.depth} key {trial.key} "
            f"({seconds[str(trial.length)][-1]:.0f}s): " + " ".join(f"{n.removeprefix('tqvec ')}={per[n]['margin'][-1]:+.2f}" for n in makers))
    full = per["full (fp16 equiv.)"]["hit"]
    summary = {}
    for name, r in per.items():
        lost = sum(f and not h for f, h in zip(full, r["hit"]))
        won = sum(h and not f for f, h in zip(full, r["hit"]))
        by_length = {str(n): sum(h for h, t in zip(r["hit"], trials) if t.length == n) for n in args.passkey_lengths}
        summary[name] = {"hits": sum(r["hit"]), "trials": len(trials), "by_length": by_length, "lost": lost, "won": won,
                         "agreement": 1 - (lost + won) / len(trials), "p_worse": _sign_test(lost, won)}
    return {"trials": [vars(t) for t in trials], "per_config": per, "summary": summary,
            "seconds_per_trial": {n: sum(v) / len(v) for n, v in seconds.items()}}


UNCHANGED_AGREEMENT = 0.95  # same answer as the full cache on at least this fraction of the paired trials
UNCHANGED_P = 0.05  # ... and no significant excess of losses over wins (one-sided exact sign test)
DECISIVE = 0.5  # nats: trials whose full-cache margin is at least this far from 0 ("decisive" trials)


def passkey_verdict(row: dict) -> str:
    """"unchanged" when ``row`` (a passkey summary) meets both criteria above, else "changed"."""
    ok = row["agreement"] >= UNCHANGED_AGREEMENT and row["p_worse"] >= UNCHANGED_P
    return "unchanged" if ok else "changed"


def _passkey_markdown(args, passkey) -> list[str]:
    lengths = [str(n) for n in args.passkey_lengths]
    per_length = len(args.passkey_depths) * args.passkey_keys
    full_margins = passkey["per_config"]["full (fp16 equiv.)"]["margin"]
    decisive = [abs(m) >= DECISIVE for m in full_margins]
    head = ["cache", *[f"hits {n}" for n in lengths], "hits", "lost vs full", "won vs full", "same answer",
            "p (worse)", f"flips, decisive ({sum(decisive)})", "median margin", "mean abs Δmargin", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in passkey["summary"].items():
        margins = sorted(passkey["per_config"][name]["margin"])
        median = margins[len(margins) // 2] if len(margins) % 2 else (margins[len(margins) // 2 - 1] + margins[len(margins) // 2]) / 2
        mine = passkey["per_config"][name]["margin"]
        flips = sum(d and (a > 0) != (m > 0) for d, a, m in zip(decisive, full_margins, mine))
        shift = sum(abs(a - m) for a, m in zip(full_margins, mine)) / len(mine)
        row = [name, *[f"{r['by_length'][n]}/{per_length}" for n in lengths], f"{r['hits']}/{r['trials']}",
               str(r["lost"]), str(r["won"]), f"{r['agreement']:.3f}", f"{r['p_worse']:.3f}", str(flips),
               f"{median:+.2f}", f"{shift:.2f}", "—" if name.startswith("full") else passkey_verdict(r)]
        lines.append("| " + " | ".join(row) + " |")
    secs = ", ".join(f"{n}: {v:.0f} s" for n, v in passkey["seconds_per_trial"].items())
    return [
        "## Passkey retrieval", "",
        f"{len(passkey['trials'])} trials: context lengths {args.passkey_lengths} × depths {args.passkey_depths} × "
        f"{args.passkey_keys} random 5-digit keys (seed {args.passkey_seed}); each trial prefilled once (exact attention "
        "in every cache) and answered by every cache, greedily, reading the compressed cache. Hit: greedy decoding "
        "emits the key's six tokens (a space, five digits) right after the question. Margin: the smallest "
        "log p(key token) − log p(best other token) along the key; positive iff hit. Paired against the full cache: "
        "lost = trials the full cache answers and this cache misses, won = the reverse; p (worse): one-sided exact "
        "sign test of lost against won. Verdict **unchanged**: the same answer as the full cache on ≥ "
        f"{UNCHANGED_AGREEMENT:.0%} of the trials and p (worse) ≥ {UNCHANGED_P} (a systematic loss fails the test, "
        "a stray flip on a trial the full cache itself barely answers does not). Flips, decisive: changed answers "
        f"on the trials whose full-cache margin is at least {DECISIVE} nats from 0 (count in the header); mean abs "
        "Δmargin: mean |margin − full cache's margin| over all trials, a continuous measure of the perturbation. "
        "The control row (8 bits, "
        "passkey only) shows how often a near-lossless perturbation flips a trial; the no-key-rescale rows (passkey "
        "only) are the default before key rescaling (quality figures of those in the git history). Mean seconds per trial "
        f"(prefill + all caches): {secs}.", "",
        *lines, ""]


def _markdown(args, results, passkey, command: str, seconds: float, rendered: str = "") -> str:
    full = results["full (fp16 equiv.)"]
    head = ["cache", "bytes/token"]
    for t in args.texts:
        head += [f"{t} ppl", f"{t} Δppl", f"{t} KL", f"{t} top-1"]
    head += ["passkey hits"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    summary = passkey["summary"]
    for name, per_text in results.items():
        row = [name, f"{next(iter(per_text.values()))['bytes_per_token']:.0f}"]
        for t in args.texts:
            r = per_text[t]
            row += [f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / full[t]['ppl'] - 1):+.2f}%", f"{r['kl']:.4f}", f"{r['top1']:.3f}"]
        row += [f"{summary[name]['hits']}/{summary[name]['trials']}" if name in summary else "—"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join([
        f"# KV cache quality: {MODEL_TITLES[args.model]}, CPU", "",
        f"Command: `{command}` ({seconds / 60:.1f} min).{rendered}", "",
        f"Texts: {', '.join(args.texts)}; {args.tokens} tokens each: prefill {args.prefill} (exact attention), then "
        f"chunks of {args.chunk} tokens that read the cache; window {args.window} exact tokens for tqvec (plus up to 15 "
        "awaiting compression in one-token passkey steps: TurboQuantCache's default compress_chunk 16; chunks of 16 "
        "or more tokens compress at once); "
        + ("QuantizedCache's residual_length is set to the same, but it quantizes the whole prefill at once "
           "(its window only holds tokens added after the prefill). " if args.quanto_bits else
           "no QuantizedCache rows: transformers' QuantizedCache refuses models with sliding-window layers. ")
        + "Δppl, KL(full ‖ cache) and top-1 agreement "
        "against the full-precision cache on the same tokens. bytes/token: stored bytes per compressed token, "
        f"{MODEL_LAYERS[args.model]}, keys + values (full: what fp16 would take; the model here runs float32). tqvec values always mse; "
        "mse keys rescaled (TurboQuantCache's default key_rescale); "
        "fractional bits: outlier channels by magnitude (tqvec.kv.codec). Passkey hits: see below (— : not run).", "",
        *lines, "", *_passkey_markdown(args, passkey)])


def main(argv: list[str] | None = None) -> None:
    """Run the KV-cache benchmark and write ``kv.json`` / ``kv.md`` under ``--out``."""
    args = _args(argv)
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        run_args = _args(shlex.split(saved["command"])[3:])
        args.render.with_suffix(".md").write_text(
            _markdown(run_args, saved["quality"], saved["passkey"], saved["command"], saved["seconds"],
                      f" This file: rendered from {args.render.name} by `tqvec bench kv --render {args.render}`."))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.time()
    log = lambda msg: print(f"[{time.time() - start:6.0f}s] {msg}", flush=True)  # noqa: E731
    model, tokenizer = ev.MODELS[args.model]()
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
