"""Device: host time per layer of the cache's update and the attention call, DynamicCache (sdpa, cuDNN off) vs
TurboQuantCache vs StaticTurboQuantCache (step graphs), 32-layer Llama-3-8B shape, interleaved rounds; plus
micro-timings of the ops a step graph's host side costs."""

import functools
import json
import os
import statistics as st
import sys
import time

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tqvec.bench import kv_e2e as e
from tqvec.kv import StaticTurboQuantCache, step_graphs

OUT = os.environ.get("OUT", "/tmp")
layers, context, steps, rounds = (int(x) for x in sys.argv[1:5])
cfg = e.llama_config(layers, tiny=False)
model = e.build_model(cfg, torch.device("cuda"))
torch.backends.cuda.enable_cudnn_sdp(False)
dyn, tq = e.cache_kinds(cfg, 4)
acc = {"update": 0.0, "attn": 0.0, "run_write": 0.0, "run_attend": 0.0}


def timed(slot, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        r = fn(*a, **k)
        acc[slot] += time.perf_counter() - t
        return r

    return wrapper


for name in ("sdpa", "tqvec"):
    ALL_ATTENTION_FUNCTIONS._global_mapping[name] = timed("attn", ALL_ATTENTION_FUNCTIONS._global_mapping[name])
orig_run = step_graphs.StepGraphs.run


def run(self, slot, *a, **k):
    t = time.perf_counter()
    r = orig_run(self, slot, *a, **k)
    acc["run_" + slot] += time.perf_counter() - t
    return r


step_graphs.StepGraphs.run = run
WARM = 40
variants = [
    ("dynamic", "sdpa", dyn.make),
    ("tq", "tqvec", tq.make),
    ("static", "tqvec", lambda: StaticTurboQuantCache(cfg, context + WARM + steps * rounds + 16, 4, 4)),
]
ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
state = {}
with torch.no_grad():
    for name, attn, make in variants:
        model.set_attn_implementation(attn)
        cache = make()
        cache.update = timed("update", cache.update)
        tok = model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(WARM):
            tok = model(input_ids=tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        state[name] = [cache, tok]
    rows = []
    for r in range(rounds):
        order = variants[r % 3 :] + variants[: r % 3]
        for name, attn, _ in order if r % 2 == 0 else order[::-1]:
            model.set_attn_implementation(attn)
            cache, tok = state[name]
            for k in acc:
                acc[k] = 0.0
            torch.cuda.synchronize()
            t = time.perf_counter()
            c = time.thread_time()
            for _ in range(steps):
                tok = model(input_ids=tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / steps * 1e3
            cpu = (time.thread_time() - c) / steps * 1e3
            state[name][1] = tok
            row = {
                "round": r,
                "variant": name,
                "ms_step": wall,
                "cpu_ms_step": cpu,
                **{k + "_us_layer": v / steps / layers * 1e6 for k, v in acc.items()},
            }
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
summary = {}
for name, _, _ in variants:
    mine = [x for x in rows if x["variant"] == name]
    summary[name] = {k: round(st.median(x[k] for x in mine), 2) for k in mine[0] if k not in ("round", "variant")}
print(json.dumps(summary, indent=1))


# micro-timings (µs per call, best of 5 x 400)
def t(fn, n=400):
    fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
        torch.cuda.synchronize()
    return round(best, 2)


q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
qb, kb, vb = q.clone(), k.clone(), k.clone()
x = torch.zeros(1024, device="cuda")
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    g.capture_begin()
    y = x + 1
    g.capture_end()
torch.cuda.current_stream().wait_stream(s)
micro = {
    "copy_": t(lambda: qb.copy_(q)),
    "3 copy_": t(lambda: (qb.copy_(q), kb.copy_(k), vb.copy_(k))),
    "_foreach_copy_ 3": t(lambda: torch._foreach_copy_([qb, kb, vb], [q, k, k])),
    "replay": t(g.replay),
    "clone": t(q.clone),
    "transpose.contiguous": t(lambda: q.transpose(1, 2).contiguous()),
    "cat": t(lambda: torch.cat([kb, k], dim=-2)),
    "x+1": t(lambda: x + 1),
}
print(json.dumps(micro))
json.dump({"rows": rows, "summary": summary, "micro": micro}, open(os.path.join(OUT, "kvhost.json"), "w"), indent=1)
