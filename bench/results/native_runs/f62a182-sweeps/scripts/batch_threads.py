"""Batch QPS by threads, MNIST (nprobe 4) and KJV (nprobe 24), IVF 4-bit FHT-Kac; rabitqlib's MNIST batch beside."""
import sys, time, h5py, numpy as np, torch, tqvec
from tqvec.datasets.registry import mnist_split
from tqvec.bench.annb.competitors import RabitqIVF
name = sys.argv[1]
def best(fn, reps=7):
    b = 1e9
    for _ in range(reps):
        t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
    return b
if name == "mnist":
    train, test = mnist_split(); nlist, nprobe, metric = 64, 4, "l2"
else:
    with h5py.File(name) as f: train, test = f["train"][:], f["test"][:1000]
    nlist, nprobe, metric = 128, 24, "cosine"
test = np.ascontiguousarray(test, np.float32)
idx = tqvec.IVFIndex(train.shape[1], nlist, 4, metric, rotation="fht-kac", seed=0); idx.add(train)
out = []
for t in (1, 2, 4, 8, 16):
    torch.set_num_threads(t)
    out.append(f"{t}:{len(test) / best(lambda: idx.search(test, 10, nprobe=nprobe)):,.0f}")
line = f"{name.split('/')[-1]} tqvec " + " ".join(out)
if name == "mnist" and len(sys.argv) > 2:
    rb = RabitqIVF("euclidean", 64, 4, 16); rb.fit(train); rb.set_query_arguments(4)
    line += f" | rabitqlib 16: {len(test) / best(lambda: rb.batch_query(test, 10)):,.0f}"
print(line, flush=True)
