"""``StaticTurboQuantCache``: TurboQuant KV codes in preallocated buffers, so a decode step can be a CUDA graph.

The counterpart of transformers' ``StaticCache``: every buffer is allocated at the first update for ``max_cache_len``
tokens and later updates write into it in place, so a one-token decode step has fixed shapes, fixed addresses and no
host synchronization: ``generate()`` compiles the decode steps on a GPU (``torch.compile(mode="reduce-overhead")``,
CUDA graphs), as it does for ``StaticCache``, and a step can also be captured by hand with ``torch.cuda.graph`` (docs/kv.md;
``tqvec bench kv-graph`` measures both). The step's writes and its attention are custom operators
(:mod:`tqvec.kv.static_ops`), so ``torch.compile(model, fullgraph=True)`` traces a step in one graph; the buffers are
static addresses, and whatever a step caches is made when they are allocated (:func:`~tqvec.kv.attention.prepare_static_step`).
Run eagerly on CUDA, a layer's one-token update leaves its write to the step's attention, which records both in one
CUDA graph of the layer's own and replays it (:mod:`tqvec.kv.step_graphs`), so an eager decode loop pays tens of
microseconds of host time per layer for them; whatever reads or edits the layer before that attention (its length, its
tokens, a copy, a crop) writes the token first (:meth:`StaticTurboQuantLayer.flush`). Code that reads the buffers or
``lengths`` directly between an update and its attention calls ``flush()`` first.

Per full-attention layer (:class:`StaticTurboQuantLayer`), cache positions are split three ways:

* sinks ``[0, min(total, sinks))``: full precision, ``(b, h, sinks, d)``;
* codes ``[sinks, codes_end)``: a :class:`~tqvec.kv.store.CodeStore` of ``max_cache_len − sinks`` tokens, position
  ``p`` at token ``p − sinks``, centered by per (batch row, KV head) means;
* the window ``[codes_end, total)``: full precision in a ring of ``window`` slots, position ``p`` in slot
  ``p mod window``; it holds at most ``window`` tokens.

``total`` and ``codes_end`` live on the device (``lengths``, int64 ``[total, codes_end]``), as ``StaticCache`` keeps
its ``cumulative_length``. A one-token update writes the token into its sink or ring slot; when the ring is full the
token it replaces (position ``total − window``) is encoded into the codes first. The decode attention on CUDA reads
the lengths on the device (:class:`tqvec.kernels.attention.DecodeLaunch`'s ring mode); on the CPU the handle is turned into the
dynamic cache's :class:`~tqvec.kv.cache.CompressedKV` (which reads the lengths on the host).

A multi-token update (a prompt, or a chunk of one) runs eagerly and reads the lengths on the host: like
:class:`~tqvec.kv.cache.TurboQuantLayer` it attends exactly to its own tokens and the window, and compresses whatever
leaves the window. The centering means are taken from the non-sink tokens present at the first multi-token update that
has any (the prompt); a cache filled one token at a time codes uncentered keys and values. With ``compress_chunk=1`` and
a prompt longer than ``sinks + window`` the dynamic :class:`~tqvec.kv.cache.TurboQuantCache` holds the same codes
(tested).

Limits: integer bit widths (one quantizer per side, what the CUDA kernel takes) and ``mse`` keys; at most
``max_cache_len`` tokens (a multi-token update past it raises, and so does an eager one-token step on the CPU; on CUDA
a one-token step past it is not checked, as that check would synchronize); the one-token step does not check its keys
and values for NaN or ±inf, for the same reason.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, CacheLayerMixin, get_layer_types_and_kwargs

from . import checks, static_ops
from .cache import CodedCache, CompressedKV, _channel_moments
from .codec import HeadCodec
from .step_graphs import GraphPool, StepGraphs, replayable
from .store import CodeStore

#: on CUDA, run a one-token step through the fused kernels of :mod:`tqvec.kernels.append` where they serve the codecs
FUSED_APPEND = True
#: the codec of each specification that every static layer built with it uses (:func:`_shared`)
_SHARED_CODECS: dict[tuple, HeadCodec] = {}


def _shared(codec: HeadCodec) -> HeadCodec:
    """The one codec of ``codec.spec`` (``codec`` itself if it is the first): a compiled step may run a layer's
    buffers through another live layer of the same specification (:mod:`tqvec.kv.static_ops`), so the device constants
    its CUDA graph records (rotations, tables) must be the same objects, alive for the life of the process."""
    return _SHARED_CODECS.setdefault(codec.spec, codec)


def _fused_append_serves(*codecs: HeadCodec) -> bool:
    """The fused one-token kernels can be imported and encode every codec's (single) quantizer."""
    try:
        from ..kernels import append  # noqa: PLC0415 - Triton is optional
    except ImportError:
        return False
    return all(append.serves(codec.groups[0].quantizer) for codec in codecs)


def _copy_sharing_codecs(obj: object, memo: dict, codecs: tuple[HeadCodec, ...]) -> object:
    """A deep copy of ``obj`` in which ``codecs`` (and everything that refers to them) keep the shared objects: a
    compiled step reads the constants of the codec objects it was recorded with (:func:`_shared`)."""
    for codec in codecs:
        memo[id(codec)] = codec
    twin = object.__new__(type(obj))
    memo[id(obj)] = twin
    twin.__dict__.update(copy.deepcopy(obj.__dict__, memo))
    return twin


@dataclass
class StaticKV:
    """What a one-token step's attention reads from a :class:`StaticTurboQuantLayer`: the layer itself (its buffers
    and device-side ``lengths``, after the step's token was written)."""

    layer: "StaticTurboQuantLayer"

    def __getattr__(self, name: str):
        """Any tensor attribute means another attention function got the handle: :func:`~tqvec.kv.checks.refuse_tensor_use`."""
        checks.refuse_tensor_use(self, name)

    def materialize(self) -> CompressedKV:
        """The same tokens as a :class:`~tqvec.kv.cache.CompressedKV` (window in position order), read on the host."""
        self.layer.flush()
        return self.layer.handle(*self.layer.lengths.tolist())


class StaticTurboQuantLayer(CacheLayerMixin):
    """One full-attention layer of a :class:`StaticTurboQuantCache` (see the module docstring)."""

    #: the cache class that builds these layers (named in error messages)
    cache_name = "StaticTurboQuantCache"
    #: ``generate()`` compiles the model's forward for the steps after the prompt (and for a chunked prompt's chunks)
    #: with ``torch.compile(mode="reduce-overhead")`` on a GPU; multi-token updates run eagerly inside it
    is_compileable = True
    is_sliding = False
    is_croppable = True
    #: the cache's first compressed layer: its update starts a forward, where the step graphs' mask copies start anew
    #: (:meth:`GraphPool.forget_masks <tqvec.kv.step_graphs.GraphPool.forget_masks>`)
    opens_step = False

    def __init__(self, key_codec: HeadCodec, value_codec: HeadCodec, max_cache_len: int, window: int = 128,
                 sinks: int = 4, graph_pool: GraphPool | None = None) -> None:
        super().__init__()
        checks.check_int("window", window, 1)
        checks.check_int("sinks", sinks, 0)
        checks.check_int("max_cache_len", max_cache_len, sinks + 1)
        for name, codec in (("key", key_codec), ("value", value_codec)):
            if len(codec.groups) != 1 or codec.mode != "mse":
                raise ValueError(f"a static cache takes integer {name} bits and mse codes, got {codec.bits:g} bits, "
                                 f"{codec.mode}")
        self.key_codec, self.value_codec = _shared(key_codec), _shared(value_codec)
        self.max_cache_len, self.window, self.sinks = int(max_cache_len), int(window), int(sinks)
        self.key_perm = self.value_perm = None  # one channel group: no channel order (read by the shared attention)
        #: the CUDA graphs of eager one-token steps (:mod:`tqvec.kv.step_graphs`), recorded into ``graph_pool``
        self.graphs = StepGraphs(GraphPool() if graph_pool is None else graph_pool)
        #: an eager CUDA one-token step's ``(key, value)``, written by the step's attention in the same graph
        #: (:meth:`update`), or by :meth:`flush` where anything else reads the layer first; None: nothing deferred
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        """Coded tokens the buffers hold (positions ``[sinks, max_cache_len)``)."""
        return self.max_cache_len - self.sinks

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        checks.check_states(key_states, value_states, self.key_codec.head_dim)
        self.pending = None  # new buffers: a token deferred for the old ones is not written into them
        self.device, self.dtype = key_states.device, key_states.dtype
        b, h, _, d = key_states.shape
        new = lambda t: key_states.new_zeros((b, h, t, d))  # noqa: E731
        self.sink_keys, self.sink_values = new(self.sinks), new(self.sinks)
        self.ring_keys, self.ring_values = new(self.window), new(self.window)
        self.key_store, self.value_store = CodeStore(self.key_codec), CodeStore(self.value_codec)
        self.key_store.allocate(self.capacity, b, h, self.device)
        self.value_store.allocate(self.capacity, b, h, self.device)
        self.key_mean = torch.zeros((b, h, d), dtype=torch.float32, device=self.device)
        self.value_mean = torch.zeros((b, h, d), dtype=torch.float32, device=self.device)
        self.lengths = torch.tensor([0, self.sinks], dtype=torch.int64, device=self.device)
        #: the decode kernel's validity row when transformers gives no mask: the kernel then takes one specialization
        #: whether or not a mask is given (transformers materializes the mask while a CUDA graph is being captured)
        self.all_valid = torch.ones((b, self.max_cache_len), dtype=torch.bool, device=self.device)
        self.centered = False
        #: names this set of buffers in the step graphs' keys (a new object whenever the layer holds other buffers)
        self.buffer_token = object()
        self.fused = FUSED_APPEND and self.device.type == "cuda" and _fused_append_serves(self.key_codec,
                                                                                          self.value_codec)
        if self.device.type == "cuda":
            from .attention import prepare_static_step  # noqa: PLC0415 - attention imports this module

            prepare_static_step(self)
        self._register_buffers()
        self.is_initialized = True

    def _register_buffers(self) -> None:
        """Register the layer's buffers for the compiled step's operators (``op_key``) and mark their addresses static
        (fixed addresses: cudagraphs under ``torch.compile`` copy no buffer)."""
        self.op_key = static_ops.register(self)
        if not torch.compiler.is_compiling():
            for t in self.buffers():
                torch._dynamo.mark_static_address(t)

    def __deepcopy__(self, memo: dict) -> "StaticTurboQuantLayer":
        """A copy with its own buffers (and no recorded step graphs) that shares the codecs, as layers of one
        specification do, and is registered for the compiled step's operators under the same key."""
        self.flush()
        twin = _copy_sharing_codecs(self, memo, (self.key_codec, self.value_codec))
        if twin.is_initialized:
            twin._register_buffers()
        return twin

    def spec(self) -> tuple:
        """What a one-token step takes from the layer besides its buffers (codecs, sizes, device, kernel choice):
        layers of equal ``spec`` are interchangeable given the buffers (:mod:`tqvec.kv.static_ops`)."""
        return (self.key_codec.spec, self.value_codec.spec, self.max_cache_len, self.window, self.sinks, str(self.device),
                self.fused)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the layer holds (what a one-token step writes and its attention reads), in the order
        :meth:`with_buffers` takes them."""
        stores = [t for store in (self.key_store, self.value_store) for t in store.fields[0].values()]
        return [self.sink_keys, self.sink_values, self.ring_keys, self.ring_values, self.key_mean, self.value_mean,
                self.lengths, self.all_valid, *stores]

    def with_buffers(self, tensors: list[torch.Tensor]) -> "StaticTurboQuantLayer":
        """This layer over other ``tensors`` (shaped as :meth:`buffers`): the layer itself when they are its own, else a
        shallow copy holding them. The custom operators (:mod:`tqvec.kv.static_ops`) work on the tensors they are
        given, which a compiled graph may have replaced by copies of the layer's."""
        if all(a is b for a, b in zip(tensors, self.buffers())):
            return self
        twin = copy.copy(self)
        twin.buffer_token, twin.pending = object(), None  # this layer's deferred token is not the other buffers' one
        (twin.sink_keys, twin.sink_values, twin.ring_keys, twin.ring_values, twin.key_mean, twin.value_mean, twin.lengths,
         twin.all_valid, key_packed, key_scales, value_packed, value_scales) = tensors
        twin.key_store, twin.value_store = copy.copy(self.key_store), copy.copy(self.value_store)
        twin.key_store.fields = [{"packed": key_packed, "scales": key_scales}]
        twin.value_store.fields = [{"packed": value_packed, "scales": value_scales}]
        return twin

    # ------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``(b, h, t, d)`` keys/values; return the read handle twice (:class:`StaticKV` for one token, else a
        :class:`~tqvec.kv.cache.CompressedKV`)."""
        self.flush()
        if self.opens_step and not torch.compiler.is_compiling():  # a new forward: its mask is copied for the graphs
            self.graphs.pool.forget_masks()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[:2] != self.ring_keys.shape[:2] or key_states.shape[-1] != self.ring_keys.shape[-1]:
            checks.check_states(key_states, value_states, self.key_codec.head_dim)
            raise ValueError(f"key_states {tuple(key_states.shape)} do not extend the cached (batch, heads, head_dim) "
                             f"{tuple(self.ring_keys.shape[:2])}, {self.ring_keys.shape[-1]}")
        if key_states.shape[2] == 1:
            if torch.compiler.is_compiling():
                torch.ops.tqvec.static_append(key_states, value_states, self.buffers(), self.op_key)
            elif replayable(key_states):  # eager on CUDA: written by the attention's recorded graph (tqvec.kv.step_graphs)
                self.pending = (key_states, value_states)
            else:  # eager: the operator's body without its dispatch (which cost more than the step's kernels)
                if not key_states.is_cuda:  # the host holds the length here (on CUDA reading it would synchronize)
                    self._check_room(int(self.lengths[0]), 1)
                self.write_one(key_states, value_states)
            handle = StaticKV(self)
            return handle, handle
        checks.check_states(key_states, value_states, self.key_codec.head_dim)
        handle = self._append_many(key_states, value_states)
        return handle, handle

    def flush(self) -> None:
        """Write the one-token step that :meth:`update` deferred to its attention (:attr:`pending`), if any, by
        launching its kernels: what reads or edits the layer outside the step's attention calls it first."""
        if self.pending is not None:
            (key, value), self.pending = self.pending, None
            self.write_one(key, value)

    def write_one(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """One token at position ``total``, without host synchronization and with fixed shapes: three Triton launches
        where :attr:`fused` (:mod:`tqvec.kernels.append`), else torch operations. :meth:`update` calls it directly, or
        through the ``tqvec::static_append`` operator (:mod:`tqvec.kv.static_ops`) while a graph is being traced."""
        if self.fused:
            from ..kernels import append  # noqa: PLC0415 - Triton is optional
            from .attention import _rotation_matrices  # noqa: PLC0415 - attention imports this module

            for x, ring, sinks, mean, store in (
                    (key, self.ring_keys, self.sink_keys, self.key_mean, self.key_store),
                    (value, self.ring_values, self.sink_values, self.value_mean, self.value_store)):
                quantizer, fields = store.codec.groups[0].quantizer, store.fields[0]
                append.append_side(x, ring, sinks, mean, _rotation_matrices(quantizer, x.device)[0], quantizer,
                                   fields["packed"], fields["scales"], self.lengths)
            append.advance(self.lengths, self.sinks, self.window)
            return
        total, codes_end = self.lengths[0], self.lengths[1]
        if self.sinks:
            at = total.clamp(max=self.sinks - 1).view(1)
            for buffer, x in ((self.sink_keys, key), (self.sink_values, value)):
                buffer.index_copy_(2, at, torch.where(total < self.sinks, x, buffer.index_select(2, at)))
        slot = (total % self.window).view(1)
        in_window = total >= self.sinks
        evict = in_window & (total - self.window == codes_end)  # the ring is full: its oldest token leaves
        index = (codes_end - self.sinks).clamp(0, self.capacity - 1)
        for buffer, x, store, mean in ((self.ring_keys, key, self.key_store, self.key_mean),
                                       (self.ring_values, value, self.value_store, self.value_mean)):
            occupant = buffer.index_select(2, slot)
            store.write_one(occupant, mean, index, evict)
            buffer.index_copy_(2, slot, torch.where(in_window, x, occupant))
        self.lengths.copy_(torch.stack([total + 1, codes_end + evict.long()]))

    def _check_room(self, total: int, t: int) -> None:
        """``ValueError`` when ``t`` new tokens after ``total`` cached ones exceed ``max_cache_len``."""
        if total + t > self.max_cache_len:
            raise ValueError(f"the static cache holds max_cache_len = {self.max_cache_len} tokens: {total} cached + {t} "
                             "new do not fit; build it with a larger max_cache_len")

    @torch.compiler.disable
    def _append_many(self, keys: torch.Tensor, values: torch.Tensor) -> CompressedKV:
        """Several tokens (eager, also inside a compiled model: it reads the lengths on the host and encodes with
        Triton kernels that dynamo does not trace): sinks first, then the window; what leaves the window is
        compressed. Returns the handle of the codes before this call plus the exact tokens."""
        total, codes_end = self.lengths.tolist()
        t = keys.shape[2]
        self._check_room(total, t)
        take = max(0, min(self.sinks - total, t))
        if take:
            self.sink_keys[:, :, total:total + take] = keys[:, :, :take]
            self.sink_values[:, :, total:total + take] = values[:, :, :take]
        keys, values = keys[:, :, take:], values[:, :, take:]
        handle = self.handle(total + t, codes_end, keys, values)
        pending_k, pending_v = handle.keys, handle.values
        if not self.centered and pending_k.shape[2]:
            for mean, x in ((self.key_mean, pending_k), (self.value_mean, pending_v)):
                mean.copy_(_channel_moments(x)[0])
            self.centered = True
        overflow = pending_k.shape[2] - self.window
        if overflow > 0:
            for store, x, mean, name in ((self.key_store, pending_k, self.key_mean, "key_states"),
                                         (self.value_store, pending_v, self.value_mean, "value_states")):
                store.append(x[:, :, :overflow], mean, None, name)  # at codes_end − sinks: self.handle set length
            codes_end += overflow
        keep = min(pending_k.shape[2], self.window)
        if keep:
            slots = torch.arange(total + t - keep, total + t, device=self.device) % self.window
            self.ring_keys.index_copy_(2, slots, pending_k[:, :, -keep:])
            self.ring_values.index_copy_(2, slots, pending_v[:, :, -keep:])
        self.lengths.copy_(torch.tensor([total + t, codes_end]))
        return handle

    def handle(self, total: int, codes_end: int, keys: torch.Tensor | None = None,
               values: torch.Tensor | None = None) -> CompressedKV:
        """A :class:`~tqvec.kv.cache.CompressedKV` of the sinks, the codes ``[sinks, codes_end)`` and the window
        positions ``[codes_end, total − t)`` in order followed by ``keys`` / ``values`` ``(b, h, t, d)`` (the tokens of
        a multi-token update not taken as sinks; None: none)."""
        b, h, _, d = self.ring_keys.shape
        keys = self.ring_keys.new_zeros((b, h, 0, d)) if keys is None else keys
        values = self.ring_values.new_zeros((b, h, 0, d)) if values is None else values
        window_end = total - keys.shape[2]
        if window_end > codes_end:
            slots = torch.arange(codes_end, window_end, device=self.device) % self.window
            keys = torch.cat([self.ring_keys.index_select(2, slots), keys], dim=2)
            values = torch.cat([self.ring_values.index_select(2, slots), values], dim=2)
        n_codes = max(0, codes_end - self.sinks)
        self.key_store.length = self.value_store.length = n_codes
        sinks = min(total, self.sinks)
        return CompressedKV(self, self.sink_keys[:, :, :sinks], self.sink_values[:, :, :sinks], n_codes, keys, values)

    # ------------------------------------------------------------------ sizes
    def get_seq_length(self) -> torch.Tensor | int:
        """Cached tokens: a 0-d device tensor (as ``StaticLayer``'s, read without synchronizing), 0 before any update."""
        self.flush()
        return self.lengths[0] if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(max_cache_len, 0)`` for one-token steps (a fixed mask shape, no host synchronization); for several tokens
        the cached length plus ``query_length`` (eager: a prompt then gets SDPA's causal path, no mask)."""
        self.flush()
        if query_length == 1 or not self.is_initialized:
            return (self.max_cache_len if query_length == 1 else query_length), 0
        return int(self.lengths[0]) + query_length, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def nbytes(self) -> int:
        """Bytes held (allocated): sinks, window ring, codes, means, lengths and the all-valid row."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in self.buffers())

    # ------------------------------------------------------------------ edits
    def reset(self) -> None:
        """Forget every token (buffers kept in place; the next prompt sets the means again)."""
        self.pending = None
        if self.is_initialized:
            self.lengths.copy_(torch.tensor([0, self.sinks]))
            self.centered = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count). Tokens already
        coded stay coded: the window then holds fewer tokens until new ones fill it."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.flush()
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        total, codes_end = self.lengths.tolist()
        total = max(0, total + tokens_to_remove)
        self.lengths.copy_(torch.tensor([total, max(self.sinks, min(codes_end, total))]))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows in place (beam search; buffer addresses are kept)."""
        self.flush()
        if not self.is_initialized:
            return
        index = beam_idx.to(self.device)
        for t in self.buffers():
            if t is not self.lengths and t is not self.all_valid:
                t.copy_(t.index_select(0, index))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a static cache keeps its batch size; use TurboQuantCache to select batch rows")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a static cache keeps its batch size; use TurboQuantCache to repeat batch rows")

    def offload(self) -> None:
        raise NotImplementedError("StaticTurboQuantLayer does not support offloading")

    def prefetch(self) -> None:
        raise NotImplementedError("StaticTurboQuantLayer does not support offloading")


class StaticTurboQuantCache(CodedCache):
    """TurboQuant KV cache with preallocated buffers for ``max_cache_len`` tokens (full-attention layers compressed,
    others transformers' static layers), whose one-token steps can be captured in a CUDA graph.

    Parameters
    ----------
    config : transformers ``PretrainedConfig``
        The model's config (``model.config``).
    max_cache_len : int
        Tokens the cache holds (prompt + generated), as for ``StaticCache``.
    key_bits, value_bits : int
        Bits per channel, 1–8 (integers: one quantizer per side).
    window, sinks : int
        Newest tokens (≥ 1) and first tokens kept in full precision (defaults as :class:`~tqvec.kv.TurboQuantCache`).
    key_rescale, value_rescale : bool
        TurboQuantizer's ``rescale`` per side (keys on by default, as :class:`~tqvec.kv.TurboQuantCache`).
    seed : int
        Rotation seed (the same codes as :class:`~tqvec.kv.TurboQuantCache` with the same seed).

    Raises
    ------
    ValueError
        Fractional bits, or an argument out of range (named).

    Examples
    --------
    >>> cache = StaticTurboQuantCache(model.config, max_cache_len=4096, key_bits=4, value_bits=4)  # doctest: +SKIP
    >>> model.set_attn_implementation("tqvec")                                                     # doctest: +SKIP
    >>> model.generate(**inputs, cache=cache, max_new_tokens=64)                                   # doctest: +SKIP
    """

    def __init__(self, config, max_cache_len: int, key_bits: int = 4, value_bits: int = 4, *, window: int = 128,
                 sinks: int = 4, key_rescale: bool = True, value_rescale: bool = False, seed: int = 0) -> None:
        text = checks.text_config(config)
        for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
            if checks.check_bits(name, bits) != int(bits):
                raise ValueError(f"{name}: a static cache takes integer bit widths (one quantizer per side), got {bits!r};"
                                 " TurboQuantCache serves fractional rates")
        checks.check_int("window", window, 1)
        checks.check_int("sinks", sinks, 0)
        checks.check_int("max_cache_len", max_cache_len, sinks + 1)
        checks.check_int("seed", seed, 0)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        key_codec = HeadCodec(head_dim, key_bits, "mse", key_rescale, "outlier", seed)
        value_codec = HeadCodec(head_dim, value_bits, "mse", value_rescale, "outlier", seed + 1000)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        pool = GraphPool()  # the layers' eager step graphs share one memory pool (they run one after another)
        layers = [StaticTurboQuantLayer(key_codec, value_codec, max_cache_len, window, sinks, pool) if kind == "full_attention"
                  else STATIC_LAYER_TYPE_MAPPING[kind](max_cache_len=max_cache_len, **kw)
                  for kind, kw in zip(layer_types, layer_kwargs)]
        coded = [layer for layer in layers if isinstance(layer, StaticTurboQuantLayer)]
        if coded:
            coded[0].opens_step = True
        super().__init__(layers=layers)
        self.key_codec, self.value_codec = _shared(key_codec), _shared(value_codec)

    def __deepcopy__(self, memo: dict) -> "StaticTurboQuantCache":
        """A copy whose layers have buffers of their own and share the codecs (:meth:`StaticTurboQuantLayer.__deepcopy__`)."""
        return _copy_sharing_codecs(self, memo, (self.key_codec, self.value_codec))
