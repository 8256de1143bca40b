"""The ``tqvec`` attention: softmax(q·Kᵀ·scale)·V with K and V read from TurboQuant codes.

Which path a call of :func:`tqvec_attention_forward` takes:

* nothing compressed yet (a prefill): transformers' SDPA over the sinks and the full-precision tokens;
* several query tokens over compressed tokens (the second and later chunks of a chunked prefill,
  ``generate(..., prefill_chunk_size=N)``, or a multi-token step): :func:`dense_attention`, below;
* one query token: :func:`decode_step` / :func:`tqvec.scan.attend` where they apply, else
  :func:`compressed_attention` (the per-head reference).

Dense path (:func:`dense_attention`): the layer's codes are decoded back into one preallocated
``(b, h_kv, kv_length, d)`` buffer per side in the query's dtype (:meth:`CodeStore.decode
<tqvec.kv.store.CodeStore.decode>`: ``scan.dequantize`` of the levels, the inverse rotation, the stored scale,
the channel order and the centering mean undone, in float32 slices of a bounded number of rows), between the sinks
and the full-precision tokens, and SDPA runs on it: no ``(b, h, q, kv)`` logits and no per-head loop, and a
transient of one layer's dense K and V in the model dtype (on CUDA with a mask and GQA, the KV heads repeated as
transformers does, since SDPA's fused CUDA kernels take GQA only without a mask). The decoded key ``k̂`` satisfies
``q·k̂ = q·μ + score(q)`` for the score :func:`_head_scores` computes (``key_rescale`` lives in the stored
scale; ``prod`` keys decode with their QJL term, which is linear in the codes, so they too are represented
exactly), so the path equals the reference up to float rounding and the model dtype's rounding of ``k̂`` and
``v̂``. Causality without a mask (query ``i`` sees keys ``[0, kv_length − q + i]``): ``causal_lower_right`` where
CUDA's flash kernel runs it (no mask), otherwise one boolean ``(q, kv)`` mask shared by batch rows and heads (on
the CPU SDPA's flash kernel takes it, and GQA, without forming the logits).

Reference path (:func:`compressed_attention`): for one KV head with ``g`` query heads (GQA) and ``q`` query
tokens, the ``g·q`` queries are scored

* against the compressed tokens through :func:`tqvec.scan.scores` (the shared dispatch point: torch on
  CPU, the Triton scan on CUDA), one call per channel group, on the permuted, rotated queries. The codes
  hold centered keys ``k − μ``, so these are scores ``q·(k − μ)``;
* against the full-precision tokens (sinks and window) as ``q·k − q·μ`` (the same shift, which softmax
  ignores). Mask columns are cache positions: sinks, then codes, then the window.

Values: the codes hold ``v − μ_v`` in the rotated domain, so ``Σ p_i v_i`` is computed as
``Πᵀ(Σ p_i s_i ŷ_i)`` per group (code blocks dequantized transiently, ``scan.BLOCK_ROWS`` rows at a
time, never the whole cache) plus ``μ_v·Σ p_i`` plus the full-precision window's ``Σ p_j v_j``.
The same torch code runs on CUDA (the scores then come from the Triton scan behind scan.scores).

Decode steps (one query token, ``mse`` keys) go instead through :func:`tqvec.scan.attend` (:func:`decode_step`
builds its input), or on the CPU with the native kernel through the layer's bound step (:func:`_native_decode`):
an online softmax over the codes on CPU (the native kernel, or torch in code blocks), where the
channel groups of a fractional rate are segments side by side in the rotated space (the per-head channel order and
each group's rotation folded into one matrix per head); on CUDA (one quantizer per side) two fused split-sequence
Triton kernels (:mod:`tqvec.kernels.attention`) that read the codes, the sinks and the window once. No per-head
Python loop either way.

Masks: the registered mask function is transformers' ``sdpa_mask`` with its causal skip, so a causal
prefill without padding gets no mask and runs SDPA's causal path (no ``(b, 1, q, kv)`` boolean mask);
mask columns are absolute cache positions. transformers materializes the mask of a chunk that follows cached
tokens (its skip covers ``q == kv`` and one-token steps only); the dense path hands it to SDPA as it is.
Layers whose cache is a plain tensor (sliding-window layers, or another cache class) fall back to
transformers' SDPA attention.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import scan
from ..quantizer import TurboQuantizer
from .cache import CompressedKV
from .codec import HeadCodec
from .static import StaticKV, StaticTurboQuantLayer
from .step_graphs import replayable
from .store import ENCODE_ROWS, CodeStore, restore_channels

NAME = "tqvec"
#: value code rows (over all heads) dequantized at once on CUDA (the CPU uses ``scan.BLOCK_ROWS``)
CUDA_VALUE_ROWS = 1 << 20
#: code rows (over all heads) decoded per float32 slice by :func:`dense_kv` on CUDA (the CPU uses
#: ``store.ENCODE_ROWS``): bounds the decode's float32 transient (docs/kv-cpu.md, chunked prefill)
CUDA_DECODE_ROWS = 1 << 16
#: rotation → {device: (forward (d, D), inverse (D, d)) float32}
_ROTATION_MATRICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: cache layer → (anchors, settings, its decode launch): :func:`_bound_step`. Kept beside the layer rather than on it,
#: so copying or pickling a cache does not meet the compiled kernels; an entry goes with its layer
_LAUNCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: cache layer → (anchors, its bound native step): :func:`_native_decode`, kept beside the layer as :data:`_LAUNCHES` is
_NATIVE_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: (id of a codec, id of a layer's channel order (h, d) or of None, device) → that codec's grouped matrices with the
#: order folded in (:func:`_codec_rotations`); an entry is dropped when its codec or its order is freed
_PERMUTED_ROTATIONS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _head_scores(handle: CompressedKV, queries: torch.Tensor, batch: int, head: int) -> torch.Tensor:
    """Scores ``(m, n_codes)`` of ``queries`` ``(m, d)`` float32 against one head's compressed keys."""
    layer = handle.layer
    perm = layer.key_perm
    q = queries if perm is None else queries[:, perm[head]]
    out = None
    for gi, group in enumerate(layer.key_codec.groups):
        quantizer = group.quantizer
        rotated, projected = quantizer.rotate_queries(q[:, group.start:group.stop])
        codes = layer.key_store.codes(gi, batch, head, 0, handle.n_codes)
        s = scan.scores(rotated, quantizer.code_block(codes), quantizer.table(rotated.device), projected)
        out = s if out is None else out + s
    return out


def _values(store: CodeStore, perm: torch.Tensor | None, probs: torch.Tensor) -> torch.Tensor:
    """``Σ_i probs[..., i] · (v_i − μ)`` ``(b, h, m, d)`` over the compressed values; ``probs`` ``(b, h, m, n)`` float32.

    All heads at once, ``scan.BLOCK_ROWS`` (CPU) or ``CUDA_VALUE_ROWS`` code rows (over all heads)
    dequantized at a time.
    """
    b, h, m, n = probs.shape
    step = max(1, (CUDA_VALUE_ROWS if probs.is_cuda else scan.BLOCK_ROWS) // (b * h))
    parts = []
    for gi, group in enumerate(store.codec.groups):
        quantizer = group.quantizer
        table = quantizer.table(probs.device)
        acc = probs.new_zeros((b, h, m, quantizer.rotated_dim))
        for start in range(0, n, step):
            stop = min(start + step, n)
            packed, scales = store.rows(gi, start, stop)
            levels = scan.dequantize(packed, table).view(b, h, stop - start, -1)
            acc += (probs[..., start:stop] * scales[:, :, None, :]) @ levels
        parts.append(quantizer.rotation.inverse(acc.reshape(b * h * m, -1)).reshape(b, h, m, -1))
    out = torch.cat(parts, dim=3)
    return out if perm is None else restore_channels(out, perm)


def _rotation_matrices(quantizer: TurboQuantizer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantizer``'s forward ``(d, D)`` and inverse ``(D, d)`` rotations as float32 matrices (cached)."""
    rotation = quantizer.rotation
    cache = _ROTATION_MATRICES.setdefault(rotation, {})
    if device not in cache:
        cache[device] = (rotation.forward(torch.eye(quantizer.dim, device=device)).contiguous(),
                         rotation.inverse(torch.eye(quantizer.rotated_dim, device=device)).contiguous())
    return cache[device]


def _codec_rotations(codec: HeadCodec, perm: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward ``(d, D)`` and back ``(D, d)`` matrices of ``codec``'s groups, block-diagonal over the groups' rotated
    channels side by side (``D`` their sum); with a per-head channel order ``perm`` ``(h, d)`` folded in, ``(h, d, D)``
    and ``(h, D, d)``: ``q @ forward`` meets the permuted groups' codes, ``acc @ back`` returns to head channels."""
    pairs = [_rotation_matrices(g.quantizer, device) for g in codec.groups]
    if perm is None and len(pairs) == 1:
        return pairs[0]
    key = (id(codec), id(perm), device)
    if key not in _PERMUTED_ROTATIONS:
        forward = torch.block_diag(*(f for f, _ in pairs))
        back = torch.block_diag(*(i for _, i in pairs))
        if perm is not None:
            inverse = torch.argsort(perm, dim=1).to(device)  # head channel c sits at permuted position inverse[c]
            forward, back = forward[inverse], back[:, inverse].permute(1, 0, 2).contiguous()
        _PERMUTED_ROTATIONS[key] = (forward, back)
        for owner in (codec, perm):  # the entry goes with either: an id is not reused while its entry exists
            if owner is not None:
                weakref.finalize(owner, _PERMUTED_ROTATIONS.pop, key, None)
    return _PERMUTED_ROTATIONS[key]


def decode_step(handle: CompressedKV, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> scan.DecodeAttention | None:
    """The :class:`tqvec.scan.DecodeAttention` of a one-token step, or None where it does not apply (several query
    tokens, which :func:`tqvec_attention_forward` sends to :func:`dense_attention`; one-token steps with QJL keys, or
    with channel groups on CUDA, which run :func:`compressed_attention`'s per-head path)."""
    if not _decodes(handle, query):
        return None
    return _decode_attention(handle, query, _valid(mask, query), scaling)


def _decodes(handle: CompressedKV, query: torch.Tensor) -> bool:
    """Whether :func:`decode_step` serves this step."""
    layer = handle.layer
    codecs = (layer.key_codec, layer.value_codec)
    grouped = any(len(c.groups) != 1 for c in codecs)
    return not (query.shape[2] != 1 or handle.n_codes == 0 or any(c.mode != "mse" for c in codecs)
                or (grouped and query.is_cuda))


def _valid(mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """A one-token step's boolean mask ``(b, 1, 1, kv_length)`` as the kernels' validity rows ``(b, kv_length)``."""
    return None if mask is None else mask[:, 0, 0, :].expand(query.shape[0], -1)


def _bound_step(layer: object, anchors: tuple, settings: tuple, make: Callable[[], scan.DecodeAttention],
                query: torch.Tensor, window_keys: torch.Tensor, window_values: torch.Tensor, n_codes: int,
                valid: torch.Tensor | None) -> torch.Tensor:
    """Output ``(b, hq, 1, d)`` of a one-token step of ``query`` ``(b, hq, 1, d)`` through ``layer``'s
    :class:`tqvec.kernels.attention.DecodeLaunch` (the other arguments as a call of it takes them). The launch is kept
    (in :data:`_LAUNCHES`) while the tensors ``anchors`` are the same objects, ``settings`` (with the query's shape)
    are equal and the kernels' tuning constants unchanged; else one is made from ``make()``, kept unless it holds
    copies of the step's tensors (:attr:`DecodeLaunch.copied <tqvec.kernels.attention.DecodeLaunch>`)."""
    from ..kernels import attention as kernel  # noqa: PLC0415 - Triton is optional

    b, hq, _, d = query.shape
    settings = (b, hq, d, *settings)
    held = _LAUNCHES.get(layer)
    if held is not None and held[1] == settings and held[2].tuning == kernel.tuning() and _same(held[0], anchors):
        launch = held[2]
    else:
        launch = kernel.DecodeLaunch(make())
        if launch.copied:
            _LAUNCHES.pop(layer, None)
        else:
            _LAUNCHES[layer] = (anchors, settings, launch)
    h_kv = window_keys.shape[1]
    return launch(query.reshape(b, h_kv, hq // h_kv, d), window_keys, window_values, n_codes, valid).reshape(query.shape)


def _same(held: tuple, anchors: tuple) -> bool:
    """Whether a bound step's anchors are still the very tensors (and field lists) ``anchors`` holds."""
    return all(x is y for x, y in zip(held, anchors))


def _anchors(handle: CompressedKV) -> tuple:
    """What a layer's bound step (:func:`_kernel_decode`, :func:`_native_decode`) reads in place or converted once:
    the layer's code fields, sinks and means, each replaced (never written over) when the layer changes it."""
    layer = handle.layer
    return (layer.key_store.fields, layer.value_store.fields, handle.sink_keys, handle.sink_values, layer.key_mean,
            layer.value_mean)


def forget_launch(layer: object) -> None:
    """Drop ``layer``'s bound launch (:func:`_bound_step`) and native step (:func:`_native_decode`) now: called when
    the layer replaces its codes outside a step (a batch reorder, a reset), so the old buffers are not kept alive
    until the layer's next one-token step."""
    _LAUNCHES.pop(layer, None)
    _NATIVE_STEPS.pop(layer, None)


def _kernel_decode(handle: CompressedKV, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Output ``(b, hq, 1, d)`` of a one-token step that :func:`decode_step` serves, by the Triton kernels (CUDA, or the
    interpreter) through the layer's bound launch (:func:`_bound_step`): made again when the cache reallocates its
    codes (a growth, a batch reorder, a reset) or its sinks, or when the query's shape, the mask's presence, the
    scaling or the kernels' tuning constants change. Between, the codes grow in place and the launch reads ``n_codes``
    per step."""
    valid = _valid(mask, query)
    return _bound_step(handle.layer, _anchors(handle), (valid is None, scaling), lambda: _decode_attention(handle, query, valid, scaling),
                       query, handle.keys, handle.values, handle.n_codes, valid)


def _native_decodes(handle: CompressedKV, query: torch.Tensor) -> bool:
    """Whether :func:`_native_decode` serves this step: one that :func:`decode_step` serves, on the CPU, where
    :func:`tqvec.scan.attend` would take the native kernel."""
    return scan.native_attends(query) and _decodes(handle, query)


def _native_decode(handle: CompressedKV, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Output ``(b, hq, 1, d)`` of a one-token CPU step by the native kernel, through the layer's
    :class:`tqvec._fastscan.BoundDecodeStep`: bound again when the cache replaces its codes (a growth, a batch reorder,
    a reset), its sinks or its means; between, the codes grow in place and each step passes ``n_codes``."""
    layer, anchors = handle.layer, _anchors(handle)
    held = _NATIVE_STEPS.get(layer)
    if held is None or not _same(held[0], anchors):
        held = anchors, scan.bind_native_step(_decode_attention(handle, query, None, scaling))
        _NATIVE_STEPS[layer] = held
    b, hq, _, d = query.shape
    h_kv = handle.keys.shape[1]
    out = held[1](query.reshape(b, h_kv, hq // h_kv, d).float() * scaling, handle.n_codes, (handle.keys, handle.values),
                  _valid(mask, query))
    return out.to(query.dtype).reshape(query.shape)


def _decode_attention(handle: CompressedKV, query: torch.Tensor, valid: torch.Tensor | None, scaling: float,
                      ring: torch.Tensor | None = None) -> scan.DecodeAttention:
    """The :class:`tqvec.scan.DecodeAttention` of one query token over ``handle``'s tokens: the first channel group's
    codes, the others as segments; ``valid`` ``(b, kv_length)`` or None; ``ring`` as :class:`tqvec.scan.DecodeAttention`
    takes it."""
    layer = handle.layer
    b, hq, _, d = query.shape
    h_kv = handle.keys.shape[1]
    k_fwd, _ = _codec_rotations(layer.key_codec, layer.key_perm, query.device)
    _, v_back = _codec_rotations(layer.value_codec, layer.value_perm, query.device)
    coded = lambda store, codec, gi: scan.CodedHeads(  # noqa: E731
        store.fields[gi]["packed"], store.fields[gi]["scales"], codec.groups[gi].quantizer.table(query.device))
    keys = [coded(layer.key_store, layer.key_codec, gi) for gi in range(len(layer.key_codec.groups))]
    values = [coded(layer.value_store, layer.value_codec, gi) for gi in range(len(layer.value_codec.groups))]
    return scan.DecodeAttention(
        queries=query.reshape(b, h_kv, hq // h_kv, d), scaling=scaling, key_rotation=k_fwd, value_back=v_back,
        keys=keys[0], values=values[0], n_codes=handle.n_codes, key_segments=tuple(keys[1:]),
        value_segments=tuple(values[1:]),
        key_mean=layer.key_mean, value_mean=layer.value_mean, sink_keys=handle.sink_keys, sink_values=handle.sink_values,
        window_keys=handle.keys, window_values=handle.values, valid=valid, ring=ring)


def static_decode_step(handle: StaticKV, query: torch.Tensor, mask: torch.Tensor | None,
                       scaling: float) -> scan.DecodeAttention:
    """The :class:`tqvec.scan.DecodeAttention` of a one-token step over a static cache's buffers, lengths read on the
    device (``ring``): fixed shapes, no host synchronization (the CUDA kernel reads it; on the CPU the attention takes
    :meth:`StaticKV.materialize <tqvec.kv.static.StaticKV.materialize>` instead). ``mask``: boolean
    ``(b, 1, 1, max_cache_len)`` or None (then the layer's all-True row: the kernel's specialization does not depend on
    whether transformers made a mask, which it does while a CUDA graph is being captured)."""
    layer = handle.layer
    whole = CompressedKV(layer, layer.sink_keys, layer.sink_values, layer.capacity, layer.ring_keys, layer.ring_values)
    valid = layer.all_valid if mask is None else mask[:, 0, 0, :].expand(query.shape[0], -1)
    return _decode_attention(whole, query, valid, scaling, ring=layer.lengths)


def prepare_static_step(layer: StaticTurboQuantLayer) -> None:
    """Make, eagerly, every per-device constant a CUDA one-token step of ``layer`` reads and caches: the rotation
    matrices, the decode kernel's copies of them (:func:`tqvec.kernels.attention.prepare`), the code and boundary
    tables. ``torch.compile(mode="reduce-overhead")`` records steps into CUDA graphs, whose memory pool must not hold
    tensors that outlive a step (cudagraph trees refuse them); :meth:`StaticTurboQuantLayer.lazy_initialization
    <tqvec.kv.static.StaticTurboQuantLayer.lazy_initialization>` calls this on CUDA."""
    from ..kernels import attention as kernel  # noqa: PLC0415 - Triton is optional

    b, h, _, d = layer.ring_keys.shape
    kernel.prepare(static_decode_step(StaticKV(layer), layer.ring_keys.new_empty((b, h, 1, d)), None, 1.0))
    for codec in (layer.key_codec, layer.value_codec):
        codec.groups[0].quantizer.boundary_table(layer.device)


def static_attention(layer: StaticTurboQuantLayer, query: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """Output ``(b, hq, 1, d)`` in ``query``'s dtype of a one-token step over a static cache's layer (after the step's
    token was written). CUDA: the decode kernel's ring mode (:func:`static_decode_step`, no host synchronization);
    elsewhere the dynamic cache's paths over :meth:`StaticKV.materialize <tqvec.kv.static.StaticKV.materialize>`.
    ``mask``: boolean ``(b, 1, 1, max_cache_len)`` or None."""
    layer.flush()
    handle = StaticKV(layer)
    if query.is_cuda:
        return _bound_step(layer, tuple(layer.buffers()), (scaling,),
                           lambda: static_decode_step(handle, query, mask, scaling), query, layer.ring_keys,
                           layer.ring_values, layer.capacity, layer.all_valid if mask is None else _valid(mask, query))
    coded = handle.materialize()
    if mask is not None:
        mask = mask[..., :coded.kv_length]
    if coded.n_codes == 0:  # nothing coded yet: exact attention over the sinks and the window
        keys, values = torch.cat([coded.sink_keys, coded.keys], dim=2), torch.cat([coded.sink_values, coded.values], dim=2)
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                                enable_gqa=query.shape[1] != keys.shape[1])
    return scan.attend(decode_step(coded, query, mask, scaling)).reshape(query.shape)


def _replayed_static_step(layer: StaticTurboQuantLayer, query: torch.Tensor, mask: torch.Tensor | None,
                          scaling: float) -> torch.Tensor:
    """A one-token step on CUDA through the layer's recorded graph (:mod:`tqvec.kv.step_graphs`): the write of the
    step's key and value that :meth:`StaticTurboQuantLayer.update` deferred (:attr:`~StaticTurboQuantLayer.pending`),
    then :func:`static_attention`; output ``(b, 1, hq, d)`` (the attention function's layout). The query, key and value
    are the graph's inputs, and the mask's validity rows are read from the buffer the cache's graphs share
    (:meth:`GraphPool.validity <tqvec.kv.step_graphs.GraphPool.validity>`); recorded again when the layer's buffers, the
    mask's presence or buffer, the scaling or the decode kernels' tuning constants change."""
    from ..kernels import attention as kernel  # noqa: PLC0415 - Triton is optional

    (key, value), layer.pending = layer.pending, None
    rows, token = (None, None) if mask is None else layer.graphs.pool.validity(mask, query.shape[0])

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer.write_one(k, v)
        out = static_attention(layer, q, None if rows is None else rows[:, None, None, :], scaling)
        return out.transpose(1, 2).contiguous()

    key_of_step = (layer.buffer_token, token, scaling, kernel.tuning())
    return layer.graphs.run("step", key_of_step, (query, key, value), step,
                            lambda: (*layer.buffers(), *(() if rows is None else (rows,))))


def compressed_attention(handle: CompressedKV, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention output ``(b, hq, q, d)`` float32 for ``query`` ``(b, hq, q, d)`` (the general per-head path).

    The reference that :func:`dense_attention` and :func:`decode_step` are tested against, and the path of one-token
    steps that :func:`decode_step` declines. It forms float32 logits ``(b, h_kv, g·q, kv_length)``.
    ``mask``: boolean ``(b, 1, q, kv_length)`` (True = attend) or None (attend to everything).
    """
    layer = handle.layer
    b, hq, q_len, d = query.shape
    h_kv = handle.keys.shape[1]
    group = hq // h_kv
    n_codes = handle.n_codes
    queries = query.float().reshape(b, h_kv, group * q_len, d)
    n_sinks = handle.n_sinks
    keys = torch.cat([handle.sink_keys, handle.keys], dim=2).float()
    values = torch.cat([handle.sink_values, handle.values], dim=2).float()
    shift = 0.0 if layer.key_mean is None else torch.einsum("bhmd,bhd->bhm", queries, layer.key_mean)[..., None]
    exact = queries @ keys.transpose(2, 3) - shift  # (b, h_kv, g·q, sinks + t)
    if n_codes:
        coded = torch.stack([torch.stack([_head_scores(handle, queries[bi, hj], bi, hj) for hj in range(h_kv)])
                             for bi in range(b)])
        logits = torch.cat([exact[..., :n_sinks], coded, exact[..., n_sinks:]], dim=3) * scaling
    else:
        logits = exact * scaling
    if mask is not None:
        if mask.shape[-1] != handle.kv_length:
            raise ValueError(f"mask covers {mask.shape[-1]} keys, the cache holds {handle.kv_length}")
        allowed = mask.expand(b, 1, q_len, -1).unsqueeze(2).expand(b, 1, group, q_len, -1).reshape(b, 1, group * q_len, -1)
        logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=3).nan_to_num(0.0)
    coded_probs = probs[..., n_sinks:n_sinks + n_codes]
    out = torch.cat([probs[..., :n_sinks], probs[..., n_sinks + n_codes:]], dim=3) @ values
    if n_codes:
        out = out + coded_probs.sum(dim=3, keepdim=True) * layer.value_mean[:, :, None]
        out = out + _values(layer.value_store, layer.value_perm, coded_probs)
    return out.reshape(b, hq, q_len, d)


def dense_kv(handle: CompressedKV, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's keys and values, each ``(b, h_kv, kv_length, d)`` of ``dtype``, in cache-position order: the sinks,
    the ``n_codes`` compressed tokens decoded by :meth:`CodeStore.decode <tqvec.kv.store.CodeStore.decode>` (centering
    and channel permutation undone), then the full-precision tokens.

    Each side is one buffer written in place; the decode's float32 transients are bounded by one slice of
    ``ENCODE_ROWS`` (CPU) or ``CUDA_DECODE_ROWS`` (CUDA) code rows. Requires ``handle.n_codes > 0`` (the centering
    means exist from the first compression on).
    """
    sinks, n_codes = handle.n_sinks, handle.n_codes
    rows = CUDA_DECODE_ROWS if handle.keys.is_cuda else ENCODE_ROWS

    def side(sink: torch.Tensor, store: CodeStore, mean: torch.Tensor, perm: torch.Tensor | None,
             recent: torch.Tensor) -> torch.Tensor:
        b, h, _, d = recent.shape
        dense = recent.new_empty((b, h, handle.kv_length, d), dtype=dtype)
        dense[:, :, :sinks] = sink
        store.decode(dense[:, :, sinks:sinks + n_codes], mean, perm, rows=rows)
        dense[:, :, sinks + n_codes:] = recent
        return dense

    layer = handle.layer
    return (side(handle.sink_keys, layer.key_store, layer.key_mean, layer.key_perm, handle.keys),
            side(handle.sink_values, layer.value_store, layer.value_mean, layer.value_perm, handle.values))


def is_causal_mask(mask: torch.Tensor, q_len: int, kv_length: int) -> bool:
    """True when the boolean ``mask`` ``(b, 1, q_len, kv_length)`` (True = attend) is the bottom-right causal pattern in
    every batch row (no padding): query ``i`` sees exactly keys ``[0, kv_length − q_len + i]``."""
    past = kv_length - q_len
    if not bool(mask[..., :past].all()):
        return False
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=mask.device).tril()
    return bool((mask[..., past:] == causal).all())


def dense_attention(handle: CompressedKV, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention output ``(b, hq, q, d)`` in ``query``'s dtype for ``query`` ``(b, hq, q, d)``: SDPA over
    :func:`dense_kv` (the path for several query tokens over compressed tokens).

    ``mask``: boolean ``(b, 1, q, kv_length)`` (True = attend), or None: causal, aligned bottom right (query ``i``
    sees keys ``[0, kv_length − q + i]``). A mask that is exactly that pattern (:func:`is_causal_mask`: what
    ``generate`` hands the chunks of an unpadded batch) is treated as None. Without a mask, where CUDA's flash kernel runs (half precision) it gets
    ``causal_lower_right``, which it applies with no mask at all; elsewhere SDPA gets one boolean ``(q, kv)`` mask
    shared by batch rows and heads (``causal_lower_right`` would materialize that same mask there, after allocating
    a ``(2, q, kv)`` float32 tensor as its own storage: torch 2.13's ``CausalBias`` is a tensor subclass built with
    those sizes). GQA (``hq`` a multiple of ``h_kv``): ``enable_gqa`` (the CPU flash kernel takes it with a mask),
    except on CUDA with a mask, where SDPA's fused kernels do not take GQA and its math path would form the
    ``(b, hq, q, kv)`` logits: there the KV heads are repeated, as transformers' SDPA attention does. Requires
    ``handle.n_codes > 0``.
    """
    q_len, kv_length = query.shape[2], handle.kv_length
    if mask is not None and is_causal_mask(mask, q_len, kv_length):  # generate()'s mask of an unpadded batch
        mask = None
    keys, values = dense_kv(handle, query.dtype)
    group = query.shape[1] // keys.shape[1]
    gqa = group > 1
    if mask is None and query.is_cuda and can_use_flash_attention(SDPAParams(query, keys, values, None, 0.0, False, gqa)):
        mask = causal_lower_right(q_len, kv_length)
    else:
        if mask is None:
            mask = torch.ones(q_len, kv_length, dtype=torch.bool, device=query.device).tril(kv_length - q_len)
        if gqa and query.is_cuda:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            gqa = False
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                            enable_gqa=gqa)


def _allowed(mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' mask as booleans, True = attend (an additive float mask is 0 where attending)."""
    return mask if mask is None or mask.dtype == torch.bool else mask == 0


def tqvec_attention_forward(module: torch.nn.Module, query: torch.Tensor, key, value, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` ``(b, hq, q, d)`` → ``((b, q, hq, d), None)``."""
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: the tqvec attention does not return attention weights (it never forms "
                         "them over the compressed tokens); call the model with output_attentions=False")
    if isinstance(key, StaticKV):  # a static cache's one-token step (a custom operator when traced: tqvec.kv.static_ops)
        attention_mask = _allowed(attention_mask)
        scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        layer = key.layer
        if layer.pending is not None and replayable(query):  # eager on CUDA: write and attend in the recorded graph
            return _replayed_static_step(layer, query, attention_mask, scaling), None
        if torch.compiler.is_compiling():
            if layer.pending is not None:  # its update ran eagerly (a graph break): write the token before the trace
                _flush_eagerly(layer)
            out = torch.ops.tqvec.static_attend(query, attention_mask, layer.buffers(), layer.op_key, scaling)
        else:  # eager: the operator's body without its dispatch
            out = static_attention(layer, query, attention_mask, scaling)
        return out.transpose(1, 2).contiguous(), None
    if not isinstance(key, CompressedKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if isinstance(key.layer, StaticTurboQuantLayer):  # a static cache's multi-token update: eager, also when compiled
        if attention_mask is not None and attention_mask.shape[-1] > key.kv_length:  # it spans max_cache_len positions
            attention_mask = attention_mask[..., :key.kv_length]
        return _eager_compressed_forward(module, query, key, attention_mask, scaling, dropout, **kwargs)
    return _compressed_forward(module, query, key, attention_mask, scaling, dropout, **kwargs)


def _compressed_forward(module: torch.nn.Module, query: torch.Tensor, key: CompressedKV,
                        attention_mask: torch.Tensor | None, scaling: float | None, dropout: float,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`tqvec_attention_forward` over a :class:`~tqvec.kv.cache.CompressedKV` handle."""
    if dropout:
        raise ValueError("tqvec attention is inference-only (dropout must be 0)")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if key.n_codes == 0:  # nothing compressed yet (a prefill): exact attention over sinks + window
        keys, values = torch.cat([key.sink_keys, key.keys], dim=2), torch.cat([key.sink_values, key.values], dim=2)
        return sdpa_attention_forward(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)
    attention_mask = _allowed(attention_mask)
    if attention_mask is not None and attention_mask.shape[-1] != key.kv_length:
        raise ValueError(f"mask covers {attention_mask.shape[-1]} keys, the cache holds {key.kv_length}")
    if query.shape[2] > 1:  # a prefill chunk or multi-token step over compressed tokens (no mask: causal)
        out = dense_attention(key, query, attention_mask, scaling)
    elif query.is_cuda and _decodes(key, query):
        out = _kernel_decode(key, query, attention_mask, scaling)
    elif _native_decodes(key, query):
        out = _native_decode(key, query, attention_mask, scaling)
    elif (step := decode_step(key, query, attention_mask, scaling)) is not None:
        out = scan.attend(step).reshape(query.shape)
    else:
        out = compressed_attention(key, query, attention_mask, scaling).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


#: :meth:`StaticTurboQuantLayer.flush` run eagerly inside a compiled model
_flush_eagerly = torch.compiler.disable(StaticTurboQuantLayer.flush)

#: :func:`_compressed_forward` run eagerly inside a compiled model (it reads lengths on the host and launches Triton
#: kernels that dynamo does not trace): a static cache's prompt chunks under generate()'s compilation
_eager_compressed_forward = torch.compiler.disable(_compressed_forward)


def tqvec_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA boolean mask, with its causal skip: None where causality alone masks (no padding, and a
    prefill without past tokens or a one-token step), so no ``(b, 1, q, kv)`` mask is materialized there. A prefill
    then runs SDPA's causal path; a one-token step needs no mask; a multi-token step over compressed tokens given no
    mask runs SDPA with a causal mask or bias aligned to the bottom right (:func:`dense_attention`)."""
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register the ``"tqvec"`` attention and mask functions with transformers.

    Adds :func:`tqvec_attention_forward` to ``AttentionInterface`` and :func:`tqvec_mask` to
    ``AttentionMaskInterface`` under :data:`NAME`, so that ``model.set_attn_implementation("tqvec")`` selects them.
    Importing :mod:`tqvec.kv` calls it; calling it again registers the same functions again (no effect).

    Examples
    --------
    >>> from transformers import AttentionInterface
    >>> from tqvec.kv import register
    >>> register()
    >>> "tqvec" in AttentionInterface()
    True
    """
    AttentionInterface.register(NAME, tqvec_attention_forward)
    AttentionMaskInterface.register(NAME, tqvec_mask)
