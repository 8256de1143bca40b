"""Issue 18: whole 4-bit searches over 1M x d Gaussian rows (gpu_scan's Database) with the int8 stage 1's row tiles
taken smaller than a group (subtile.patch applied), two rounds (the second in reverse order), beside the bf16 matmul
alone. Usage: python3 tile_ab.py OUT.jsonl. One JSON line per (shape, variant, round); a last line per shape says
whether each variant returned the base's ids for the first 200 queries."""
import json
import sys
import time

import torch

from tqvec.bench import gpu_scan as g
from tqvec.kernels import ops

VARIANTS = {"base": {}, "t64": {"FUSED_TILE_ROWS": 64, "INT8_TILE_ROWS": 64},
            "t32": {"FUSED_TILE_ROWS": 32, "INT8_TILE_ROWS": 32},
            "t64k64": {"FUSED_TILE_ROWS": 64, "INT8_TILE_ROWS": 64, "FUSED_BLOCK_K": 64},
            "t64k128": {"FUSED_TILE_ROWS": 64, "INT8_TILE_ROWS": 64, "INT8_BLOCK_K": 128}}
SHAPES = [(128, 100), (128, 10000), (384, 100), (384, 10000), (768, 100), (1536, 100), (1536, 10000)]
out = open(sys.argv[1], "w")
constants = {k: getattr(ops, k) for v in VARIANTS.values() for k in v}


def apply(name: str) -> None:
    for key, default in constants.items():
        setattr(ops, key, VARIANTS[name].get(key, default))
    ops.clear_graphs()


def log(**row) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(json.dumps(row), flush=True)


def run_shape(db: g.Database, queries: torch.Tensor, nq: int, t0: float) -> None:
    tq, block = db.quantizers[4], db.blocks[4]
    table = tq.table("cuda")
    qb = queries[:nq].to(torch.bfloat16)
    matmul = g.time_ms(lambda: g.bf16_matmul(qb, db.x_bf16))
    rotated = tq.rotate_queries(queries[:nq])[0]
    ids = {}
    for rnd in range(2):
        for name in (list(VARIANTS) if rnd == 0 else list(reversed(VARIANTS))):
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
