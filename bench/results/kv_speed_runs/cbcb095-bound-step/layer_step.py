"""One-token tqvec attention steps over one SmolLM2-shaped cache layer (3 KV heads, 9 query heads, d = 64) of a
2,048-token context, one thread: median µs of 7 x 300 calls of tqvec_attention_forward."""
import statistics
import sys
import time

import torch

from tqvec.kv import attention
from tqvec.kv.cache import TurboQuantLayer
from tqvec.kv.codec import HeadCodec

torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
for bits in (4, 2.5):
    layer = TurboQuantLayer(HeadCodec(64, bits), HeadCodec(64, bits, seed=1000), 64)
    layer.update(torch.randn(1, 3, 2047, 64, generator=gen), torch.randn(1, 3, 2047, 64, generator=gen))
    handle, _ = layer.update(torch.randn(1, 3, 1, 64, generator=gen), torch.randn(1, 3, 1, 64, generator=gen))
    query = torch.randn(1, 9, 1, 64, generator=gen)
    module = torch.nn.Module()
    call = lambda m=module, q=query, h=handle: attention.tqvec_attention_forward(m, q, h, h, None)  # noqa: E731
    for _ in range(100):
        call()
    medians = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(300):
            call()
        medians.append((time.perf_counter() - t) / 300 * 1e6)
    print(f"{sys.argv[1] if len(sys.argv) > 1 else ''} bits {bits}: {statistics.median(medians):.1f} us", flush=True)
