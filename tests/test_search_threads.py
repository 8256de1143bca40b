"""Concurrent searches: the GPU search settings are per thread, and CUDA-graph replays never mix up callers.

The CUDA test searches one index from four threads at once with queries of one shape, so every call after the
second replays the same captured graph through the same static buffers; each result must equal the one computed
alone without graphs.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from tqvec import Index
from tqvec.kernels import ops

THREADS = 4
ROUNDS = 150


def test_configured_applies_to_the_calling_thread_only() -> None:
    seen: list[ops.SearchSettings] = []
    with ops.configured(cuda_graphs=False, triton_topk=False) as inside:
        assert ops.settings() == inside and not inside.cuda_graphs and not inside.triton_topk
        worker = threading.Thread(target=lambda: seen.append(ops.settings()))
        worker.start()
        worker.join()
    assert seen == [ops.SearchSettings()] and ops.settings() == ops.SearchSettings()


def test_configured_rejects_unknown_settings() -> None:
    with pytest.raises(TypeError, match="use_graphs"), ops.configured(use_graphs=False):
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_four_threads_replaying_one_graph_get_their_own_results() -> None:
    rng = np.random.default_rng(0)
    index = Index(64, 4, "ip", device="cuda")
    index.add(rng.standard_normal((20_000, 64)).astype(np.float32))
    batches = [rng.standard_normal((8, 64)).astype(np.float32) for _ in range(12)]
    with ops.configured(cuda_graphs=False):
        expected = [index.search(q, 10) for q in batches]
    ops.clear_graphs()
    start = threading.Barrier(THREADS)
    wrong: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def worker(thread: int) -> None:
        try:
            start.wait()
            for step in range(ROUNDS):
                which = (thread * 5 + step) % len(batches)
                distances, ids = index.search(batches[which], 10)
                if not (np.array_equal(ids, expected[which][1]) and np.allclose(distances, expected[which][0])):
                    wrong.append((thread, step))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    assert not wrong, f"{len(wrong)} of {THREADS * ROUNDS} searches returned another caller's results"
    ops.clear_graphs()
