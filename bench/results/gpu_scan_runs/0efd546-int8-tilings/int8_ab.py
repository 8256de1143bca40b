"""Issue 18: whole 4-bit searches over 1M x d Gaussian rows (gpu_scan's Database) with int8 stage-1 tilings changed,
two rounds (the second in reverse order), beside the bf16 matmul alone. Usage: python3 int8_ab.py warps|tiles|groups OUT.jsonl
(`tiles` needs row_tile_loop.patch applied). One JSON line per (shape, variant, round); a last line per shape says
whether each variant returned the base's ids for the first 200 queries."""
import dataclasses
import json
import sys
import time

import torch

from tqvec.bench import gpu_scan as g
from tqvec.kernels import ops

SETS = {  # tile-config fields (block_q, num_warps) or kernels.ops module constants
    "warps": {"base": {}, "w8": {"num_warps": 8}, "q64": {"block_q": 64}, "q64w8": {"block_q": 64, "num_warps": 8},
              "w8s4": {"num_warps": 8, "FUSED_STAGES": 4, "INT8_STAGES": 4},
              "w8s2": {"num_warps": 8, "FUSED_STAGES": 2, "INT8_STAGES": 2}},
    "tiles": {"base": {}, "t2": {"FUSED_TILES": 2, "INT8_TILES": 2}, "t4": {"FUSED_TILES": 4, "INT8_TILES": 4},
              "t2s2": {"FUSED_TILES": 2, "INT8_TILES": 2, "FUSED_STAGES": 2, "INT8_STAGES": 2},
              "t4s4": {"FUSED_TILES": 4, "INT8_TILES": 4, "FUSED_STAGES": 4, "INT8_STAGES": 4},
              "k128": {"INT8_BLOCK_K": 128}, "t2k128": {"FUSED_TILES": 2, "INT8_TILES": 2, "INT8_BLOCK_K": 128}},
    "groups": {"base": {}, "g128": {"block_n": 128}},
}
CONFIG_FIELDS = ("block_q", "num_warps", "block_n")
SHAPES = {"groups": [(384, 100)]}.get(
    sys.argv[1], [(128, 100), (128, 10000), (384, 100), (384, 10000), (768, 100), (1536, 100), (1536, 10000)])
variants = SETS[sys.argv[1]]
out = open(sys.argv[2], "w")
constants = {k: getattr(ops, k) for v in variants.values() for k in v if k not in CONFIG_FIELDS}
original_config = ops._tile_config


def apply(name: str) -> None:
    change = variants[name]
    for key, default in constants.items():
        setattr(ops, key, change.get(key, default))
    fields = {k: v for k, v in change.items() if k in CONFIG_FIELDS}

    def config(*args):
        cfg = original_config(*args)
        return dataclasses.replace(cfg, **fields) if cfg.int8 and fields else cfg
    ops._tile_config = config
    ops.clear_graphs()


def log(**row) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()


def run_shape(db: g.Database, queries: torch.Tensor, nq: int, t0: float) -> None:
    """Both rounds of every variant for the first nq queries over db."""
    tq, block = db.quantizers[4], db.blocks[4]
    table = tq.table("cuda")
    qb = queries[:nq].to(torch.bfloat16)
    matmul = g.time_ms(lambda: g.bf16_matmul(qb, db.x_bf16))
    rotated = tq.rotate_queries(queries[:nq])[0]
    ids = {}
    for rnd in range(2):
        for name in (list(variants) if rnd == 0 else list(reversed(variants))):
            apply(name)
            try:
                ms = g.time_ms(lambda: ops.search(rotated, block, table, g.K))
                s1 = g.stage1_ms(rotated, block, table)
                ids.setdefault(name, ops.search(rotated[:200], block, table, g.K)[1].cpu())
                log(d=db.d, nq=nq, variant=name, round=rnd, search_ms=ms, stage1_ms=s1, matmul_ms=matmul,
                    vs_matmul=matmul / ms, cfg=str(ops.tile_config(nq, tq.layout, n=db.n)))
            except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is a result too
                log(d=db.d, nq=nq, variant=name, round=rnd, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    log(d=db.d, nq=nq, same_ids={k: bool(torch.equal(v, ids["base"])) for k, v in ids.items()}, t=time.time() - t0)


start_time = time.time()
for d in sorted({d for d, _ in SHAPES}):
    gen = torch.Generator(device="cuda").manual_seed(7)
    shape_queries = torch.randn(10000, d, device="cuda", generator=gen)
    database = g.Database(1 << 20, d, (4,), shape_queries)
    for dd, count in SHAPES:
        if dd == d:
            run_shape(database, shape_queries, count, start_time)
    apply("base")
    del database
    ops.clear_graphs()
    torch.cuda.empty_cache()
