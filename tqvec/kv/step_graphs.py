"""CUDA graphs of a static cache's eager one-token steps: each layer's write and attention replayed, not relaunched.

A one-token step of a :class:`~tqvec.kv.static.StaticTurboQuantLayer` on CUDA has fixed shapes, fixed addresses and
no host synchronization (the module docstring of :mod:`tqvec.kv.static`). Run eagerly (not traced by
``torch.compile``, not inside a graph the caller is capturing), the layer's update leaves the step's write to the
step's attention (:attr:`~tqvec.kv.static.StaticTurboQuantLayer.pending`), which records the write (the fused append
kernels and the length update) and the attention (the decode kernels' split and combine) in one CUDA graph; later
steps copy the step's query, key and value into the graph's input buffers (one launch) and the mask's validity rows,
when a mask is given, into a buffer all the cache's graphs read (once per step: transformers gives every layer the same
mask, :meth:`GraphPool.validity`), and replay it: tens of microseconds of host time per layer where the Python around
the launches cost a few hundred (docs/kv.md). An eager ``generate()`` or decode loop over a
:class:`~tqvec.kv.StaticTurboQuantCache` gets this without asking; :data:`ENABLED` switches it off.

A graph is recorded again whenever what it was recorded for changes: the step's shapes and dtypes, whether a mask is
given (and the validity buffer), the scaling, the decode kernels' tuning constants, autocast, or the layer's buffers
themselves (a layer keeps its buffers; the recorded entry holds them, so an address a graph writes cannot be freed
under it). The step that
records runs eagerly first on the copied inputs (doing the step's work and compiling any new kernel specialization),
then records (a recording runs nothing); a step that cannot be recorded (a synchronization inside it, say) warns once
and runs eagerly from then on for that key. All graphs of one cache share one memory pool and one recording stream
(:class:`GraphPool`): the steps of a cache run one after another on one stream, so the work buffers each graph
allocates share memory. Recording uses thread-local capture, so other threads may keep working meanwhile; using one
cache from several streams at once is not supported (it was not before either: its buffers are written in place). The
output of a replayed attention is returned as a copy, so holding it across steps is safe.

Copies of a layer (``copy.deepcopy``, pickling) start without recorded graphs and with a pool of their own: the
graphs write the original's buffers.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: replay recorded CUDA graphs for eager one-token steps of a static cache (off: launch the kernels each step)
ENABLED = True


@dataclass
class _Rows:
    """One device's validity rows: the buffer step graphs read, the token naming it, and the mask last copied into it
    with that mask's version counter then (None: none, or an inference tensor, which keeps no version)."""

    buffer: torch.Tensor
    token: object
    mask: torch.Tensor | None = None
    version: int | None = None


class GraphPool:
    """What the step graphs of one cache's layers share: one CUDA graph memory pool and one recording stream per device,
    made at first use (the caching allocator reuses a freed block only on the stream that allocated it: one stream lets
    the graphs' temporaries share memory), and the step's validity rows per device (:meth:`validity`). A copy is a new,
    unused pool."""

    def __init__(self) -> None:
        self._handle = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._rows: dict[torch.device, _Rows] = {}

    @property
    def handle(self):
        """The pool handle ``torch.cuda.CUDAGraph.capture_begin`` takes."""
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream graphs on ``device`` are recorded on (made at first use)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def validity(self, mask: torch.Tensor, batch: int) -> tuple[torch.Tensor, object]:
        """The validity rows ``(batch, kv_length)`` of a one-token step's boolean ``mask`` ``(b, 1, 1, kv_length)``, in
        the buffer the cache's step graphs on ``mask``'s device read, and the token naming that buffer (for the graphs'
        keys). The rows are copied there unless ``mask`` is the last tensor given on that device, unchanged since:
        transformers makes one mask per forward for every layer (moved once per device where the model spans several).
        A mask written in place counts as changed, and so does every inference tensor (it keeps no version), and so
        does any mask after :meth:`forget_masks`. The buffer is made anew, with a new token, when the rows' shape or
        dtype changes.

        Examples
        --------
        >>> pool = GraphPool()
        >>> mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
        >>> rows, token = pool.validity(mask, 2)
        >>> mask[1, ..., :3] = False  # in place: copied again, into the same buffer
        >>> pool.validity(mask, 2)[0] is rows, rows[1].sum().item()
        (True, 5)
        """
        version = None if mask.is_inference() else mask._version
        held = self._rows.get(mask.device)
        if held is not None and held.mask is mask and version is not None and version == held.version:
            return held.buffer, held.token
        rows = mask[:, 0, 0, :].expand(batch, -1)
        if held is None or (held.buffer.shape, held.buffer.dtype) != (rows.shape, rows.dtype):
            held = self._rows[mask.device] = _Rows(rows.clone(memory_format=torch.contiguous_format), object())
        else:
            held.buffer.copy_(rows)
        held.mask, held.version = mask, version
        return held.buffer, held.token

    def forget_masks(self) -> None:
        """Copy the next mask :meth:`validity` is given on each device even if it is the last one (a cache calls this
        at each forward's first layer, so no write to a mask between forwards goes unseen)."""
        for held in self._rows.values():
            held.mask = held.version = None

    def __reduce__(self):
        return GraphPool, ()


@dataclass
class _Recorded:
    """One recorded step: what it was recorded for, the graph, its input buffers, its output (None for a write) and the
    other tensors it uses (kept alive)."""

    key: tuple
    graph: torch.cuda.CUDAGraph | None  # None: the step could not be recorded (it runs eagerly)
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor | None
    keep: tuple[torch.Tensor, ...]


def replayable(x: torch.Tensor) -> bool:
    """Whether a step on ``x``'s device may replay or record a graph now: CUDA, :data:`ENABLED`, not being traced by
    ``torch.compile`` and not inside a CUDA graph the caller is capturing."""
    return (ENABLED and x.is_cuda and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing())


class StepGraphs:
    """The recorded write and attention of one static layer's one-token steps (see the module docstring).

    Parameters
    ----------
    pool : GraphPool
        The memory pool the layer's graphs record into (a cache's layers share one).

    Examples
    --------
    >>> graphs = StepGraphs(GraphPool())
    >>> graphs.run("write", key, (k, v), lambda k, v: layer.write_one(k, v))  # doctest: +SKIP
    """

    def __init__(self, pool: GraphPool) -> None:
        self.pool = pool
        self._recorded: dict[str, _Recorded] = {}
        #: graphs recorded so far (a step that replays adds none)
        self.recordings = 0

    def run(self, slot: str, key: tuple, inputs: tuple[torch.Tensor, ...], step: Callable[..., torch.Tensor | None],
            keep: Callable[[], tuple[torch.Tensor, ...]] = tuple) -> torch.Tensor | None:
        """``step(*inputs)``, through the graph recorded in ``slot`` for ``key`` (recorded now if there is none, or one
        for another key).

        Parameters
        ----------
        slot : str
            Which step (``"write"``, ``"attend"``): one recorded graph per slot.
        key : tuple
            Everything ``step`` depends on besides the inputs' values, compared with ``==`` (no tensors: name a set of
            tensors by a token object that is replaced when they are, as a layer's ``buffer_token``); the inputs'
            shapes and dtypes and whether autocast is on are added here.
        inputs : tuple of torch.Tensor
            The step's inputs (CUDA); copied into the graph's own buffers.
        step : callable
            Runs the step on tensors shaped like ``inputs``; returns a tensor, or None.
        keep : callable
            Returns the tensors the recorded graph reads or writes besides its inputs, kept alive with it (called when
            recording).

        Returns
        -------
        torch.Tensor or None
            A copy of the step's output (a fresh tensor each call), or None.

        Warns
        -----
        RuntimeWarning
            When the step cannot be recorded; it then runs eagerly for this key (its work is done once either way).
        """
        key = (key, tuple(x.shape for x in inputs), tuple(x.dtype for x in inputs), torch.is_autocast_enabled("cuda"))
        held = self._recorded.get(slot)
        if held is not None and held.key == key:
            if held.graph is None:
                return step(*inputs)
            torch._foreach_copy_(held.inputs, inputs)  # one launch where the inputs share a dtype
            held.graph.replay()
            return None if held.output is None else held.output.clone()
        self._recorded.pop(slot, None)
        device = inputs[0].device
        buffers = tuple(x.clone() for x in inputs)  # the inputs' strides where dense (the copies' fast path needs them)
        result = step(*buffers)  # this step's work, eagerly (and any kernel compilation, outside the recording)
        graph = torch.cuda.CUDAGraph()
        side = self.pool.stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self.pool.handle, capture_error_mode="thread_local")
                try:
                    output = step(*buffers)
                finally:
                    graph.capture_end()
        except RuntimeError as err:
            warnings.warn(f"the {slot} step could not be recorded in a CUDA graph ({err}); it runs eagerly",
                          RuntimeWarning, stacklevel=2)
            self._recorded[slot] = _Recorded(key, None, (), None, ())
            return result
        finally:
            torch.cuda.current_stream(device).wait_stream(side)
        self._recorded[slot] = _Recorded(key, graph, buffers, output, keep())
        self.recordings += 1
        return result

    @property
    def slots(self) -> tuple[str, ...]:
        """The slots with a recorded graph, in order of recording."""
        return tuple(slot for slot, held in self._recorded.items() if held.graph is not None)

    def __reduce__(self):
        return StepGraphs, (self.pool,)
