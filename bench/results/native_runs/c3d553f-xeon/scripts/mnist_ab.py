"""Same process: MNIST single-query tqvec IVF vs rabitqlib IVF, interleaved; plus tqvec's overhead split."""
import os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np, torch
import tqvec
from tqvec.datasets.registry import mnist_split

from tqvec.bench.annb.competitors import RabitqIVF
torch.set_num_threads(1)
nprobe = int(sys.argv[1]) if len(sys.argv) > 1 else 4
if len(sys.argv) > 2:  # an ann-benchmarks HDF5 file (angular): KJV
    import h5py
    with h5py.File(sys.argv[2]) as f:
        train, test = f["train"][:], f["test"][:500]
    nlist, metric, rmetric = 128, "cosine", "angular"
else:
    train, test = mnist_split(); nlist, metric, rmetric = 64, "l2", "euclidean"
q = np.ascontiguousarray(test[:500], dtype=np.float32)
idx = tqvec.IVFIndex(train.shape[1], nlist, 4, metric, rotation="fht-kac"); idx.add(train)
rb = RabitqIVF(rmetric, nlist, 4, 1); rb.fit(train)
rb.set_query_arguments(nprobe)
search = idx._native_search(idx._snap)
def t_tq():
    for i in range(len(q)): idx.search(q[i:i + 1], 10, nprobe=nprobe)
def t_native():
    for i in range(len(q)): search(q[i:i + 1], 10, nprobe)
def t_rb():
    for i in range(len(q)): rb.query(q[i], 10)
def t_rbraw():
    for i in range(len(q)): rb.index.search(q[i:i+1], 10, nprobe, num_threads=1)
fns = dict(tqvec=t_tq, native=t_native, rabitq=t_rb, rabitq_raw=t_rbraw)
best = {k: 1e9 for k in fns}
for r in range(7):
    for k, f in fns.items():
        t = time.perf_counter(); f(); best[k] = min(best[k], (time.perf_counter() - t) / len(q) * 1e6)
print({k: round(v, 1) for k, v in best.items()}, "µs/query")
ids = np.stack([idx.search(q[i:i+1], 10, nprobe=nprobe)[1][0] for i in range(len(q))])
if metric == "l2":
    gt = np.argsort(((test[:500, None, :] - train[None]) ** 2).sum(-1), 1)[:, :10]
else:
    tn = train / np.linalg.norm(train, axis=1, keepdims=True)
    gt = np.argsort(-(test[:500] @ tn.T), 1)[:, :10]
print("tqvec recall", np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, gt)]))
ids = [rb.query(q[i], 10) for i in range(len(q))]
print("rabitq recall", np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, gt)]))
