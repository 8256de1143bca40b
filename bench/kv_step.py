"""Decode-step time of a small random Llama: DynamicCache + SDPA vs TurboQuantCache + tqvec attention.

``python -m tqvec.bench.kv_step`` (CPU by default; ``--device cuda`` on a GPU). Measures the cost a cache adds to
one greedy decode step after a prefill, including its host-side (Python and launch) work, for
``TurboQuantCache`` compressing the tokens that leave its window every step (``compress_chunk=1``) and in
batches (the default, 16). All caches run side by side in one process, each ``--repeats`` times; the table
reports the fastest repeat. Writes ``kv_step.json`` / ``kv_step.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tqvec.kv import TurboQuantCache

RESULTS = Path(__file__).resolve().parent / "results"


def greedy_token(forward: Callable[..., Any], cache, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The greedy next token ``(b, 1)`` of ``forward`` (a causal LM, or a compiled one) after ``ids`` ``(b, t)`` over
    ``cache`` (``kwargs``: more arguments of the forward, as ``logits_to_keep=1`` for a prefill)."""
    return forward(input_ids=ids, cache=cache, **kwargs).logits[:, -1].argmax(-1, keepdim=True)


def decode_ms(model, cache, ids: torch.Tensor, tokens: int, warmup: int = 2) -> float:
    """Milliseconds per greedy decode step of ``model`` over ``cache``: prefill ``ids`` ``(1, context)``, ``warmup``
    untimed steps (kernel compilation, allocator), then ``tokens`` timed steps (synchronized on CUDA)."""
    def sync() -> None:
        if ids.is_cuda:
            torch.cuda.synchronize()

    with torch.no_grad():
        token = greedy_token(model, cache, ids, logits_to_keep=1)
        for _ in range(warmup):
            token = greedy_token(model, cache, token)
        sync()
        start = time.perf_counter()
        for _ in range(tokens):
            token = greedy_token(model, cache, token)
        sync()
    return (time.perf_counter() - start) / tokens * 1000


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="tqvec bench kv-step", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("QUERY", "KV"))
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=64, help="timed decode steps per repeat")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA GPU here (torch.cuda.is_available() is False)")
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_attention_heads=args.heads[0],
                      num_key_value_heads=args.heads[1], head_dim=args.head_dim, num_hidden_layers=args.layers,
                      vocab_size=1000, max_position_embeddings=args.context + 4 * args.tokens)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).eval()
    caches = {"DynamicCache + sdpa": ("sdpa", lambda: DynamicCache(config=cfg)),
              "TurboQuantCache 4b, compress every step": ("tqvec", lambda: TurboQuantCache(cfg, compress_chunk=1)),
              "TurboQuantCache 4b, compress 16 at a time (default)": ("tqvec", lambda: TurboQuantCache(cfg))}
    ids = torch.randint(0, cfg.vocab_size, (1, args.context), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(args.repeats):
        for name, (impl, make) in caches.items():
            model.set_attn_implementation(impl)
            times[name].append(decode_ms(model, make(), ids, args.tokens))
            print(f"{name}: {times[name][-1]:.2f} ms/step", flush=True)
    command = "python -m tqvec.bench.kv_step " + shlex.join(argv if argv is not None else sys.argv[1:])
    rows = [{"cache": name, "ms_per_step": min(t), "repeats_ms": t} for name, t in times.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_step.json").write_text(json.dumps({"command": command, "device": args.device, "config": cfg.to_dict(),
                                                       "rows": rows}, indent=1, default=str))
    base = rows[0]["ms_per_step"]
    lines = ["# Decode-step time: DynamicCache vs TurboQuantCache", "",
             f"`{command}` — device {args.device}, torch {torch.__version__}, {args.threads} thread(s); random Llama, "
             f"{args.layers} layers, hidden {args.hidden}, {args.heads[0]}/{args.heads[1]} heads of {args.head_dim}, "
             f"{args.context}-token prefill, {args.tokens} greedy steps per repeat, fastest of {args.repeats} repeats.", "",
             "| cache | ms per step | vs DynamicCache |", "|---|---|---|"]
    lines += [f"| {r['cache']} | {r['ms_per_step']:.2f} | {r['ms_per_step'] / base:.2f}× |" for r in rows]
    (args.out / "kv_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
