"""A 6 s loop of single KJV queries through IVFIndex.search (nlist 128, nprobe 24, fht-kac), for perf."""
import sys, time, h5py, numpy as np, torch, tqvec
torch.set_num_threads(1)
with h5py.File(sys.argv[1]) as f:
    train, test = f["train"][:], f["test"][:500]
idx = tqvec.IVFIndex(384, 128, 4, "cosine", rotation="fht-kac"); idx.add(train)
qs = [np.ascontiguousarray(test[i:i + 1], np.float32) for i in range(len(test))]
idx.search(qs[0], 10, nprobe=24)
print("go", flush=True)
t = time.perf_counter(); n = 0
while time.perf_counter() - t < 4:
    for x in qs: idx.search(x, 10, nprobe=24)
    n += len(qs)
print((time.perf_counter() - t) / n * 1e6, "us", flush=True)
