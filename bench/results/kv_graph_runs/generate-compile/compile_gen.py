"""generate() on CUDA with StaticTurboQuantCache: eager against compiled as transformers chooses (tiny 4-layer model).

Writes ``compile_gen.json`` under ``$OUT``: per call, success, seconds, cached tokens and the greedy tokens (with the
share equal to the first eager call's).
"""
import json
import os
import time
import traceback

import torch

from tqvec.bench.kv_e2e import build_model, llama_config
from tqvec.kv import StaticTurboQuantCache

cfg = llama_config(4, tiny=True)
model = build_model(cfg, torch.device("cuda"))
model.set_attn_implementation("tqvec")
ids = torch.randint(0, cfg.vocab_size, (2, 600), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
mask = torch.ones_like(ids)
mask[1, :50] = 0
calls = (("eager", {"disable_compile": True}), ("auto-compile", {}), ("auto-compile, new cache", {}),
         ("eager again", {"disable_compile": True}))
out = {}
for name, options in calls:
    cache = StaticTurboQuantCache(cfg, 800)
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=128, do_sample=False, cache=cache,
                                pad_token_id=0, **options)
        torch.cuda.synchronize()
        out[name] = {"ok": True, "s": time.perf_counter() - start, "len": int(cache.get_seq_length()),
                     "tokens": tokens[:, 600:].tolist()}
    except Exception as error:  # noqa: BLE001 - the failure is the result
        traceback.print_exc()
        out[name] = {"ok": False, "error": repr(error)[:3000]}
    print(name, {k: v for k, v in out[name].items() if k != "tokens"}, flush=True)
reference = torch.tensor(out["eager"]["tokens"])
for name, result in out.items():
    if result.get("ok"):
        result["agree_with_eager"] = (torch.tensor(result["tokens"]) == reference).float().mean().item()
        print(name, "agrees with eager on", result["agree_with_eager"], flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "compile_gen.json"), "w") as f:
    json.dump(out, f)
