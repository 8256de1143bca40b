"""Issue 18: A/B of the two-level group choice (and group sizes) on whole searches, rounds alternated.
One JSON line per (shape, variant, round) to argv[1]; the group choice alone per shape too."""
import dataclasses
import json
import sys
import time

import torch

from tqvec.bench import gpu_scan as g
from tqvec.kernels import ops

out = open(sys.argv[1], "w")
BIG = 10 ** 9
VARIANTS = {  # settings, module constants
    "one": ({"two_level_groups": False}, {}),
    "two": ({}, {}),
    "two_tri": ({"triton_topk_max_queries": BIG}, {}),
    "two_g64": ({}, {"INT8_NARROW_DIM": 0}),
        "two_fg128": ({}, {"FUSED_GROUP_128": True}),
    "two_rm": ({}, {"INT8_ROWS_AS_M": True}),
}
DEFAULT_NARROW = ops.INT8_NARROW_DIM
REAL_CFG = ops._tile_config

def patched_cfg(nq, layout, exact, many_rows, now, interpret):
    cfg = REAL_CFG(nq, layout, exact, many_rows, now, interpret)
    if FUSED_128 and cfg.int8 and nq < ops.INT8_FUSED_MAX_QUERIES:
        cfg = dataclasses.replace(cfg, block_n=128)
    return cfg

FUSED_128 = False
ops._tile_config = patched_cfg

def apply(name):
    global FUSED_128
    consts = VARIANTS[name][1]
    ops.INT8_NARROW_DIM = consts.get("INT8_NARROW_DIM", DEFAULT_NARROW)
    FUSED_128 = consts.get("FUSED_GROUP_128", False)
    ops.INT8_ROWS_AS_M = consts.get("INT8_ROWS_AS_M", False)
    REAL_CFG.cache_clear()
    ops.clear_graphs()
    return ops.configured(**VARIANTS[name][0])

def log(**kw):
    out.write(json.dumps(kw) + "\n")
    out.flush()
    print(kw, flush=True)

SHAPES = [(128, 100), (128, 10000), (128, 1), (384, 100), (384, 10000), (384, 1), (1536, 100), (1536, 10000),
          (1536, 1), (768, 100)]
n = 1_000_000
t0 = time.time()
for d in dict.fromkeys(d for d, _ in SHAPES):
    queries = torch.randn(10000, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
    db = g.Database(n, d, (4,), queries)
    tq, block = db.quantizers[4], db.blocks[4]
    table = tq.table("cuda")
    for dd, nq in SHAPES:
        if dd != d:
            continue
        qb = queries[:nq].to(torch.bfloat16)
        matmul = g.time_ms(lambda qb=qb, x=db.x_bf16: g.bf16_matmul(qb, x))
        rotated = tq.rotate_queries(queries[:nq])[0]
        cfg = ops.tile_config(nq, tq.layout, n=n)
        gm = ops.group_maxima(rotated[: min(nq, 10000)], None, block, table, cfg)
        kg = min(gm.shape[1], g.K + ops.GROUP_MARGIN)
        for two in (False, True):
            with ops.configured(two_level_groups=two, cuda_graphs=False):
                log(d=d, nq=nq, step="select_groups", two_level=two, groups=gm.shape[1],
                    chunk=ops.choice_chunk(gm.shape[1], kg), ms=g.time_ms(lambda gm=gm, kg=kg: ops.select_groups(gm, kg)))
        del gm
        ids = {}
        for rnd in range(2):
            for name in (VARIANTS if rnd == 0 else reversed(list(VARIANTS))):
                with apply(name):
                    try:
                        ms = g.time_ms(lambda r=rotated, b=block, t=table: ops.search(r, b, t, g.K))
                        ids.setdefault(name, ops.search(rotated[:200], block, table, g.K)[1].cpu())
                        log(d=d, nq=nq, variant=name, round=rnd, search_ms=ms, matmul_ms=matmul,
                            vs_matmul=matmul / ms, cfg=str(ops.tile_config(nq, tq.layout, n=n)))
                    except Exception as e:
                        log(d=d, nq=nq, variant=name, round=rnd, error=f"{type(e).__name__}: {str(e)[:300]}")
        base = ids.get("one")
        log(d=d, nq=nq, same_ids={k: bool(torch.equal(v, base)) for k, v in ids.items()}, t=time.time() - t0)
    with apply("two"):
        pass
    del db, block
    ops.clear_graphs()
    torch.cuda.empty_cache()
