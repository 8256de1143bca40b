"""CUDA graphs for repeated searches: capture once, replay through static buffers, safe across threads.

:class:`GraphCache` keys a search by everything its kernels read (shapes, strides, addresses, settings). The first
call with a key runs eagerly, the second captures a graph on static copies of its inputs, later ones copy their
inputs in, replay, and copy the outputs out. One lock serializes the copy-in / replay / copy-out of every entry
(the static buffers are shared), and a CUDA event recorded after the copy-out makes a caller on another stream
wait until the previous replay's outputs have left the buffers; captures run in thread-local capture mode, so other
threads may keep using the GPU meanwhile.

Example (CUDA only)::

    cache = GraphCache()
    values, rows = cache.run(key, search_fn, (queries,), capacity=8)
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")
Tensors = tuple[torch.Tensor, ...]


def capture_graph(fn: Callable[[], T], device: torch.device | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``fn`` once on a side stream (warm-up: compilation, allocator), then capture it in a CUDA graph.

    Parameters
    ----------
    fn : callable
        CUDA work with no host synchronization.
    device : torch.device, optional
        Where it runs (the current device by default).

    Returns
    -------
    (graph, outputs)
        The graph and what ``fn`` returned during capture: static outputs that each replay rewrites.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


@dataclass
class _Entry:
    """A captured call: static inputs, the graph, static outputs, and an event marking the outputs copied out, on the
    stream and by the thread ``copied_on`` (stream handle, thread id; None before the first replay)."""

    graph: torch.cuda.CUDAGraph
    inputs: Tensors
    outputs: Tensors
    copied_out: torch.cuda.Event
    keep: object = None  # what the graph reads through (see GraphCache.run), alive as long as the entry
    copied_on: tuple[int, int] | None = None


_FIRST_CALL = object()


class GraphCache:
    """Least-recently-used captured graphs of a function of tensors, replayed under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry | None] = OrderedDict()

    def clear(self) -> None:
        """Drop every graph (and the memory its buffers hold), once the work queued on each has finished."""
        with self._lock:
            for entry in self._entries.values():
                if entry is not None:
                    entry.copied_out.synchronize()
            self._entries.clear()

    def run(self, key: Hashable, fn: Callable[..., Tensors], inputs: Sequence[torch.Tensor], capacity: int,
            keep: object = None) -> Tensors:
        """``fn(*inputs)``: eager on the key's first call, captured on its second, replayed after.

        Parameters
        ----------
        key : hashable
            Everything that decides what ``fn`` reads and launches besides the values of ``inputs``
            (shapes, strides, data pointers of the tensors it closes over, settings).
        fn : callable
            Returns a tuple of CUDA tensors; runs without host synchronization.
        inputs : sequence of CUDA tensors
            Copied into the graph's static buffers on replay (same shapes and dtypes on every call with ``key``).
        capacity : int
            Graphs kept; the least recently used beyond it are dropped.
        keep : object, optional
            Held by the captured entry while it lives: an object whose derived buffers the graph reads by address (a
            code table's look-up tables), so that neither its memory nor its ``id`` (which a key may hold) is
            taken by another object meanwhile.

        Returns
        -------
        tuple of tensors
            Fresh tensors (clones of the static outputs when replayed), safe to keep.
        """
        with self._lock:  # one lookup on the replay path: its host time is part of a search's latency
            entry = self._entries.get(key, _FIRST_CALL)
            if entry is not _FIRST_CALL:
                if entry is None:
                    entry = self._entries[key] = self._capture(fn, inputs, keep)
                self._entries.move_to_end(key)
                self._evict(capacity)
                return self._replay(entry, inputs)
            self._entries[key] = None
            self._evict(capacity)
        return fn(*inputs)

    @staticmethod
    def _replay(entry: _Entry, inputs: Sequence[torch.Tensor]) -> Tensors:
        """Copy ``inputs`` in, replay, return clones of the outputs (under the cache's lock)."""
        stream = torch.cuda.current_stream(inputs[0].device)
        # on the stream of the last copy-out the copy-in already follows it (the thread too: a per-thread default
        # stream has one handle in every thread)
        on = (stream.cuda_stream, threading.get_ident())
        if on != entry.copied_on:
            stream.wait_event(entry.copied_out)
        for static, new in zip(entry.inputs, inputs):
            static.copy_(new)
        entry.graph.replay()
        outputs = tuple(out.clone() for out in entry.outputs)
        entry.copied_out.record(stream)
        entry.copied_on = on
        return outputs

    @staticmethod
    def _capture(fn: Callable[..., Tensors], inputs: Sequence[torch.Tensor], keep: object) -> _Entry:
        static = tuple(t.clone() for t in inputs)
        graph, outputs = capture_graph(lambda: fn(*static), static[0].device)
        return _Entry(graph, static, tuple(outputs), torch.cuda.Event(), keep)

    def _evict(self, capacity: int) -> None:
        while len(self._entries) > capacity:
            _, entry = self._entries.popitem(last=False)
            if entry is not None:
                entry.copied_out.synchronize()
