"""Issue 18: whole 4-bit searches over 1M x d Gaussian rows (gpu_scan's Database) with the int8 stage 1 at several
channel steps per tile as one program per tile (base, committed) or as the flattened row-tile loop
(group_max_flat_kernel, ../edca7ac-row-loop/flat_loop.patch applied; 1-3 pipelined stages); two rounds, the second in
reverse order, beside the bf16 matmul alone. Usage: python3 flat_ab.py OUT.jsonl. One JSON line per (shape, variant,
round); a last line per shape says whether each variant returned the base's ids for the first 200 queries."""
import json
import sys
import time

import torch

from tqvec.bench import gpu_scan as g
from tqvec.kernels import int8_stage, ops

VARIANTS = {"base": {}, "flat": {"FLAT_ROW_LOOP": True, "ROW_LOOP_STAGES": 2},
            "flat_s1": {"FLAT_ROW_LOOP": True, "ROW_LOOP_STAGES": 1},
            "flat_s3": {"FLAT_ROW_LOOP": True, "ROW_LOOP_STAGES": 3}}
SHAPES = [(384, 100), (384, 10000), (768, 100), (1536, 100), (1536, 10000)]
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


def compiled_registers() -> list:
    """(kernel, constexprs of note, registers, spills, shared bytes) of every compiled int8 stage kernel so far."""
    found = []
    for fn in (int8_stage.group_max_kernel, int8_stage.group_max_flat_kernel):
        for caches in getattr(fn, "device_caches", {}).values():
            for key, kernel in caches[0].items():
                try:
                    found.append([fn.__name__, str(key)[:160], kernel.n_regs, kernel.n_spills,
                                  kernel.metadata.shared])
                except Exception as exc:  # noqa: BLE001 - a record, not a check
                    found.append([fn.__name__, str(exc)[:100]])
    return found


def run_shape(db: g.Database, queries: torch.Tensor, nq: int, t0: float) -> None:
    tq, block = db.quantizers[4], db.blocks[4]
    table = tq.table("cuda")
    matmul = g.time_ms(lambda: g.bf16_matmul(queries[:nq].to(torch.bfloat16), db.x_bf16))
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
                    vs_matmul=matmul / ms)
            except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is a result too
                log(d=db.d, nq=nq, variant=name, round=rnd, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    log(d=db.d, nq=nq, same_ids={k: bool(torch.equal(v, ids["base"])) for k, v in ids.items()}, t=time.time() - t0)


start_time = time.time()
log(device=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count)
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
log(registers=compiled_registers())
