"""Decode steps replayed from CUDA graphs: StaticTurboQuantCache + tqvec against StaticCache + SDPA.

The model is :func:`tqvec.bench.kv_e2e.build_model`'s (a random bf16 Llama-3-8B-shaped model, ``--layers`` layers).
For each ``--contexts`` length (batch ``--batch``) and each cache:

* ``StaticCache + sdpa (graph)``: one decode step captured with ``torch.cuda.graph`` and replayed;
* ``StaticCache + sdpa (torch.compile)`` (``--compile``): ``torch.compile(model, mode="reduce-overhead",
  fullgraph=True, dynamic=False)``, the recipe transformers documents for ``StaticCache`` and its ``CompileConfig``
  defaults (CUDA graphs of inductor's fused code);
* ``StaticTurboQuantCache --bits + tqvec (graph)``: one decode step captured with ``torch.cuda.graph`` and replayed;
* ``StaticTurboQuantCache --bits + tqvec (torch.compile)`` (``--compile-tqvec``): the same ``torch.compile`` recipe
  (the step's writes and attention are custom operators, ``tqvec.kv.static_ops``);
* both static caches eagerly (the same steps without graphs), for reference.

Each run: a fresh cache of ``context + WARMUP + --steps + 1`` tokens, a one-shot prefill of ``context`` random tokens
(``logits_to_keep=1``), ``WARMUP`` eager steps (kernel compilation), then the measured steps: for a graph, one step
is captured (the greedy token is written back into the step's input inside the graph) and replayed ``--steps`` times
between two CUDA events; eager and compiled steps are timed the same way. Reported: ms per step and tokens/s
(batch × steps / time), and the cache's tokens afterwards (a replay that did not advance the cache would show).
Writes ``kv_graph.json`` and ``kv_graph.md`` under ``--out``. CUDA only.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import StaticCache

from tqvec.kv import StaticTurboQuantCache

from .kv_e2e import build_model, llama_config
from .kv_step import greedy_token

#: eager decode steps before the measured ones (kernel compilation, allocator warm-up, compiled-graph recording)
WARMUP = 4
#: acceptance of the end-to-end KV issue for the static variant: tqvec / StaticCache + torch.compile, by context
TARGETS = {32768: 1.0, 131072: 1.5}


def _timed(run: Callable[[], None], steps: int) -> float:
    """Milliseconds per call of ``run`` over ``steps`` calls, between CUDA events."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        run()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / steps


def measure(model, cache, context: int, batch: int, steps: int, mode: str) -> dict:
    """One run (see the module docstring): ``mode`` is ``"eager"``, ``"graph"`` or ``"compile"``."""
    gen = torch.Generator("cuda").manual_seed(context)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda", generator=gen)
    forward = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False) if mode == "compile" else model
    with torch.no_grad():
        token = greedy_token(model, cache, ids, logits_to_keep=1)
        del ids
        for _ in range(WARMUP):
            token = greedy_token(forward, cache, token).clone()
        torch.cuda.synchronize()
        state = {"token": token}
        if mode == "graph":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                token.copy_(greedy_token(model, cache, token))
            ms = _timed(graph.replay, steps)
        else:
            def run() -> None:
                state["token"] = greedy_token(forward, cache, state["token"]).clone()
            ms = _timed(run, steps)
    return {"ms_per_step": ms, "tokens_per_s": batch * 1000 / ms, "cached_tokens": int(cache.get_seq_length())}


def _ratio(rows: dict[tuple[str, str], dict], mode: str, tqvec_mode: str = "graph") -> str:
    """tqvec's tokens/s in ``tqvec_mode`` over StaticCache's in ``mode`` (``"—"`` where either is missing)."""
    tq, base = rows.get(("StaticTurboQuantCache", tqvec_mode)), rows.get(("StaticCache", mode))
    return "—" if tq is None or base is None else f"{tq['tokens_per_s'] / base['tokens_per_s']:.2f}×"


def markdown(data: dict) -> str:
    """The report: one row per (context, cache), and tqvec's ratio to each StaticCache row of its context."""
    lines = [f"# Decode steps from CUDA graphs: StaticTurboQuantCache against StaticCache ({data['device']})", "",
             f"Command: `{data['command']}`", "",
             f"Model: random bf16 Llama-3-8B shape, {data['layers']} layers; batch {data['batch']}; {data['steps']} "
             f"timed steps per run after {WARMUP} eager ones; transformers {data['transformers']}, torch {data['torch']}.",
             "", "| context | cache | mode | ms/step | tokens/s | cached tokens after |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['context']} | {r['cache']} | {r['mode']} | {r['ms_per_step']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['cached_tokens']} |")
    lines += ["", "| context | tqvec (graph) / StaticCache (graph) | tqvec (graph) / StaticCache (torch.compile) | "
              "tqvec (torch.compile) / StaticCache (torch.compile) | target (vs torch.compile) |", "|---|---|---|---|---|"]
    for context in sorted({r["context"] for r in data["rows"]}):
        rows = {(r["cache"], r["mode"]): r for r in data["rows"] if r["context"] == context}
        target = TARGETS.get(context)
        lines.append(f"| {context} | {_ratio(rows, 'graph')} | {_ratio(rows, 'compile')} | "
                     f"{_ratio(rows, 'compile', 'compile')} | {'—' if target is None else f'≥ {target}×'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Measure decode steps from CUDA graphs and write ``kv_graph.json`` / ``kv_graph.md`` under ``--out``."""
    p = argparse.ArgumentParser(prog="tqvec bench kv-graph", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="32768,131072", help="comma list of prompt lengths")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per run")
    p.add_argument("--compile", action="store_true", help="also StaticCache under torch.compile(mode='reduce-overhead')")
    p.add_argument("--compile-tqvec", action="store_true", help="also StaticTurboQuantCache under torch.compile")
    p.add_argument("--tiny", action="store_true", help="a small model (smoke runs)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("kv-graph captures CUDA graphs: it needs a CUDA GPU")
    cfg = llama_config(args.layers, args.tiny)
    model = build_model(cfg, torch.device("cuda"))
    data = {"device": torch.cuda.get_device_name(), "command": "tqvec bench kv-graph " + shlex.join(argv or sys.argv[1:]),
            "layers": args.layers, "batch": args.batch, "steps": args.steps, "transformers": transformers.__version__,
            "torch": torch.__version__, "rows": []}
    runs = [("StaticCache", "sdpa", "eager"), ("StaticCache", "sdpa", "graph"),
            *([("StaticCache", "sdpa", "compile")] if args.compile else []),
            ("StaticTurboQuantCache", "tqvec", "eager"), ("StaticTurboQuantCache", "tqvec", "graph"),
            *([("StaticTurboQuantCache", "tqvec", "compile")] if args.compile_tqvec else [])]
    args.out.mkdir(parents=True, exist_ok=True)
    for context in [int(x) for x in args.contexts.split(",") if x]:
        length = context + WARMUP + args.steps + 1
        for name, attention, mode in runs:
            model.set_attn_implementation(attention)
            cache = (StaticCache(config=cfg, max_cache_len=length) if name == "StaticCache" else
                     StaticTurboQuantCache(cfg, length, key_bits=args.bits, value_bits=args.bits))
            row = {"context": context, "cache": name, "mode": mode, **measure(model, cache, context, args.batch,
                                                                                 args.steps, mode)}
            print(json.dumps(row), flush=True)
            data["rows"].append(row)
            del cache
            torch.cuda.empty_cache()
            (args.out / "kv_graph.json").write_text(json.dumps(data, indent=1))
            (args.out / "kv_graph.md").write_text(markdown(data))


if __name__ == "__main__":
    main()
