"""One 4-bit search of nq queries over 1M x d Gaussian rows (gpu_scan's Database), after warm-up searches (kernels
compiled, graph recorded): under ncu (mode ncu: only that search is profiled) or torch.profiler (mode prof: kernel
times of 20 searches)."""
import sys

import torch

from tqvec.bench.gpu_scan import Database
from tqvec.kernels import ops

d, nq, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
queries = torch.randn(max(nq, 100), d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
db = Database(1_000_000, d, (4,), queries)
tq, block = db.quantizers[4], db.blocks[4]
table = tq.table("cuda")
rotated = tq.rotate_queries(queries[:nq])[0]
for _ in range(3):
    ops.search(rotated, block, table, 10)
torch.cuda.synchronize()
if mode == "ncu":
    torch.cuda.cudart().cudaProfilerStart()
    ops.search(rotated, block, table, 10)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
else:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            ops.search(rotated, block, table, 10)
        torch.cuda.synchronize()
    print(f"== d={d} nq={nq}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))
