"""``index-cuda-check``'s six configurations at d = 384 with 600 queries (rows decoded once), each GPU index searched
with the Gluon stage 1 (``int8_hopper``) and with the Triton one: ids and scores of the two against each other and
against the CPU index, and how many of the differing queries are among the first 300 (the queries of the 300-query
check, which agreed fully at 105a7ab). ``python3 gluon_vs_triton.py`` on a Hopper GPU, tree importable."""
import json

import numpy as np

from tqvec import Index
from tqvec.bench.index_cuda_check import CASES
from tqvec.kernels import ops

N, DIM, NQ = 200_000, 384, 600
for metric, bits, mode, dim in CASES:
    dim = dim or DIM
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((N, dim)) + 0.3).astype(np.float32)
    q = (rng.standard_normal((NQ, dim)) + 0.3).astype(np.float32)
    cpu, gpu = Index(dim, bits, metric=metric, mode=mode), Index(dim, bits, metric=metric, mode=mode, device="cuda")
    cpu.add(x)
    gpu.add(x)
    d_cpu, i_cpu = cpu.search(q, 10)
    found = {}
    for hopper in (True, False):
        with ops.configured(int8_hopper=hopper):
            found[hopper] = gpu.search(q, 10)
    (d_g, i_g), (d_t, i_t) = found[True], found[False]
    rows_cpu = np.nonzero((i_g != i_cpu).any(axis=1))[0]
    print(json.dumps({"metric": metric, "bits": bits, "mode": mode, "dim": dim,
                      "gluon_eq_triton_ids": bool((i_g == i_t).all()),
                      "gluon_vs_triton_max_score_diff": float(np.abs(d_g - d_t).max()),
                      "gluon_vs_cpu_id_agreement": float((i_g == i_cpu).mean()),
                      "triton_vs_cpu_id_agreement": float((i_t == i_cpu).mean()),
                      "queries_differing_from_cpu": rows_cpu.tolist()[:20],
                      "of_them_below_300": int((rows_cpu < 300).sum())}))
