"""A 4 s loop of single MNIST queries through rabitqlib's IVF (as the sweep's wrapper calls it), for timing and perf."""
import time, numpy as np
from tqvec.datasets.registry import mnist_split
from tqvec.bench.annb.competitors import RabitqIVF
train, test = mnist_split()
q = np.ascontiguousarray(test[:500], dtype=np.float32)
rb = RabitqIVF("euclidean", 64, 4, 1); rb.fit(train); rb.set_query_arguments(4)
print("go", flush=True)
t = time.perf_counter(); n = 0
while time.perf_counter() - t < 4:
    for x in q: rb.query(x, 10)
    n += len(q)
print("rabitq", (time.perf_counter() - t) / n * 1e6, "us", flush=True)
