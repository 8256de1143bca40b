"""Fixed per-query cost of the native MNIST IVF search: scan of 0, 1, 4 lists; native call with prep."""
import sys, time, numpy as np, torch
from tqvec import IVFIndex, scan
from tqvec._ivf_search import probe_lists
import tqvec._native as nat
from tqvec.datasets.registry import mnist_split
torch.set_num_threads(1)
train, test = mnist_split(); test = np.ascontiguousarray(test[:500], np.float32)
qs = [np.ascontiguousarray(test[i:i + 1]) for i in range(len(test))]
ivf = IVFIndex(784, 64, 4, "l2", rotation="fht-kac", seed=0); ivf.add(train)
ivf.search(qs[0], 10, nprobe=4)
snap = ivf._snap; tab = ivf.quantizer.table("cpu"); plan = tab.native_plan().handle
rows = scan.native_rows(ivf._scan_block(snap), tab, ivf._native_lists(snap)); prep = ivf._query_prep[-1]
q = torch.from_numpy(test)
probe, const = probe_lists(ivf, q, 4); rot, _ = ivf.quantizer.rotate_checked(q)
rot, probe, const = rot.numpy(), probe.numpy(), const.numpy()
none = -np.ones_like(probe[:, :1])
def best(fn, reps=9):
    b = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t0)
    return b / len(qs) * 1e6
isa = int(sys.argv[1]) if len(sys.argv) > 1 else 2
r = {}
for _ in range(2):
    r["search"] = best(lambda: [ivf.search(x, 10, nprobe=4) for x in qs])
    r["call4"] = best(lambda: [nat.search_queries(plan, rows, prep, x, snap.ids, True, 4, 10, 32, 3.0, 1, isa) for x in qs])
    r["call1"] = best(lambda: [nat.search_queries(plan, rows, prep, x, snap.ids, True, 1, 10, 32, 3.0, 1, isa) for x in qs])
    r["scan4"] = best(lambda: [nat.search(plan, rows, rot[i:i+1], probe[i:i+1], const[i:i+1], 10, 32, 3.0, 1, isa) for i in range(len(qs))])
    r["scan1"] = best(lambda: [nat.search(plan, rows, rot[i:i+1], probe[i:i+1, :1], const[i:i+1, :1], 10, 32, 3.0, 1, isa) for i in range(len(qs))])
    r["scan0"] = best(lambda: [nat.search(plan, rows, rot[i:i+1], none[i:i+1], const[i:i+1, :1], 10, 32, 3.0, 1, isa) for i in range(len(qs))])
print({k: round(v, 2) for k, v in r.items()})
