"""A 6 s loop of one MNIST single-query variant (for perf): call4 (native call with prep) or scan0 (scan, no lists)."""
import os, sys, time
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixed_cost.py")).read().split("isa = int")[0])
which = sys.argv[1]
fns = {"call4": lambda i: nat.search_queries(plan, rows, prep, qs[i], snap.ids, True, 4, 10, 32, 3.0, 1, 2),
       "scan0": lambda i: nat.search(plan, rows, rot[i:i+1], none[i:i+1], const[i:i+1, :1], 10, 32, 3.0, 1, 2),
       "search": lambda i: ivf.search(qs[i], 10, nprobe=4)}
fn = fns[which]
print("go", flush=True)
t = time.perf_counter(); n = 0
while time.perf_counter() - t < 4:
    for i in range(500): fn(i)
    n += 500
print(which, (time.perf_counter() - t) / n * 1e6, "us", flush=True)
