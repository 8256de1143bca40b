"""Issue 18: the final top-k over refined slices' best keys (Triton) for any query count, against the previous
rule (beyond triton_topk_max_queries: every refined score to torch.topk). Whole searches, rounds alternated."""
import json
import sys
import time

import torch

from tqvec.bench import gpu_scan as g
from tqvec.kernels import ops
from tqvec.kernels import topk as topk_kernels


def old_refined_topk(q, p, groups, block, table, group_rows, k):
    now = ops.settings()
    triton_topk = now.triton_topk and q.shape[0] <= now.triton_topk_max_queries
    if triton_topk and topk_kernels.k_pad(k) < ops._refine_rows(group_rows):
        keys, _ = ops._refine(q, p, groups, block, table, group_rows, local_k=topk_kernels.k_pad(k))
        return topk_kernels.keys_topk(keys, k, block=ops._topk_block())
    candidates, ids = ops._refine(q, p, groups, block, table, group_rows)
    kc = min(k, candidates.shape[1])
    if triton_topk and topk_kernels.supported(kc):
        return topk_kernels.row_topk(candidates, kc, ids, block=ops._topk_block())
    best, pos = torch.topk(candidates, kc, dim=1)
    return best, ids.gather(1, pos)

NEW = ops.refined_topk
out = open(sys.argv[1], "w")
def log(**kw):
    out.write(json.dumps(kw) + "\n")
    out.flush()
    print(kw, flush=True)
SHAPES = [(128, 10000), (1536, 10000), (384, 10000)]  # the second call: [(1536, 10000)], 4 rounds
t0 = time.time()
for d in dict.fromkeys(d for d, _ in SHAPES):
    queries = torch.randn(10000, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
    db = g.Database(1_000_000, d, (4,), queries)
    tq, block = db.quantizers[4], db.blocks[4]
    table = tq.table("cuda")
    for dd, nq in SHAPES:
        if dd != d:
            continue
        qb = queries[:nq].to(torch.bfloat16)
        matmul = g.time_ms(lambda qb=qb, x=db.x_bf16: g.bf16_matmul(qb, x))
        rotated = tq.rotate_queries(queries[:nq])[0]
        res = {}
        for rnd in range(2):
            for name in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                ops.refined_topk = old_refined_topk if name == "old" else NEW
                ops.clear_graphs()
                ms = g.time_ms(lambda r=rotated, b=block, t=table: ops.search(r, b, t, g.K))
                res.setdefault(name, ops.search(rotated, block, table, g.K))
                log(d=d, nq=nq, variant=name, round=rnd, search_ms=ms, matmul_ms=matmul, vs_matmul=matmul / ms)
        log(d=d, nq=nq, same_ids=bool(torch.equal(res["old"][1], res["new"][1])),
            same_values=bool(torch.equal(res["old"][0], res["new"][0])), t=time.time() - t0)
    ops.refined_topk = NEW
    del db, block
    ops.clear_graphs()
    torch.cuda.empty_cache()
