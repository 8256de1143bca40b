"""Eager decode steps at one context: DynamicCache + SDPA (cuDNN off), TurboQuantCache and StaticTurboQuantCache + tqvec.

``python3 static_prof.py LAYERS CONTEXT`` from the repository root: ms per step (40 steps after an 8-step warm-up, two
rounds), then a cProfile of 32 StaticTurboQuantCache steps (by own time, then cumulative for tqvec and torch.library).
"""
import cProfile
import io
import pstats
import sys
import time

import torch
from transformers import DynamicCache

from tqvec.bench.kv_e2e import build_model, llama_config
from tqvec.kv import StaticTurboQuantCache, TurboQuantCache

torch.backends.cuda.enable_cudnn_sdp(False)
layers, context = int(sys.argv[1]), int(sys.argv[2])
cfg = llama_config(layers, False)
model = build_model(cfg, torch.device("cuda"))
ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
caches = {"dynamic": (lambda: DynamicCache(config=cfg), "sdpa"), "tqvec": (lambda: TurboQuantCache(cfg), "tqvec"),
          "static": (lambda: StaticTurboQuantCache(cfg, context + 200), "tqvec")}


def ms_per_step(name: str, steps: int, profile: cProfile.Profile | None = None) -> float:
    make, attention = caches[name]
    model.set_attn_implementation(attention)
    cache = make()
    with torch.no_grad():
        token = model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(8):
            token = model(input_ids=token, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        if profile:
            profile.enable()
        for _ in range(steps):
            token = model(input_ids=token, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
        if profile:
            profile.disable()
        torch.cuda.synchronize()
    del cache
    torch.cuda.empty_cache()
    return (time.perf_counter() - start) / steps * 1000


results = {f"{name}{round_}": round(ms_per_step(name, 40), 2) for round_ in range(2) for name in caches}
print(results, flush=True)
profile = cProfile.Profile()
results["static_prof"] = ms_per_step("static", 32, profile)
for order, restrictions in (("tottime", (30,)), ("cumulative", ("tqvec|kernels|cache_utils|masking|generic|_library|_ops", 40))):
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(order).print_stats(*restrictions)
    print(text.getvalue()[:8000])
print(results)
