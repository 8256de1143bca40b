"""``TurboQuantCache``: a transformers ``Cache`` whose full-attention layers keep K/V as TurboQuant codes.

Per full-attention layer (:class:`TurboQuantLayer`):

* the first ``sinks`` tokens (attention sinks, default 4) stay in full precision (``sink_keys`` /
  ``sink_values``): the first token draws much of the attention, so its quantization error alone weighs on the
  attention distribution out of proportion;
  With left padding the first positions of a padded row are pads, so that row's sink is compressed;
* the newest ``window`` tokens stay in full precision (``keys`` / ``values``, ``(b, h, t, d)``); tokens
  leaving it are compressed once at least ``compress_chunk`` (default 16) have accumulated, so the window
  holds up to ``window + compress_chunk − 1`` tokens and a one-token decode step usually only appends
  (the encode's launches run on one step in 16);
* older tokens are centered (per (batch row, KV head) means, computed once, from all non-sink tokens
  present when the layer first compresses), channel-permuted (outliers first, see :mod:`tqvec.kv.codec`),
  encoded into a :class:`~tqvec.kv.store.CodeStore`, and their full-precision copies are dropped
  (the window is re-materialized with ``clone`` so no slice keeps the old storage alive).

``update`` returns a :class:`CompressedKV` handle (as both "keys" and "values") that the ``tqvec``
attention (:mod:`tqvec.kv.attention`) reads: the codes of the tokens compressed *before* this call
and the full-precision tokens of this call plus the window. So a prefill attends exactly, and every
later call reads the compressed cache. The handle's full-precision tensors live only for the
duration of the layer's forward.

Sliding-window (and other non-full) layers use transformers' own dynamic layers, uncompressed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs

from . import checks
from .codec import SPLITS, HeadCodec
from .store import CodeStore

KEY_MODES = ("mse", "prod")
#: tokens (over all batch rows and heads: this many rows) reduced per slice by :func:`_channel_moments`
MOMENT_ROWS = 8192


def _channel_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch row, head) channel means ``(b, h, d)`` and per head the centered channel power ``(h, d)`` (float32).

    The power is ``mean_{b, t} (x − mean)²`` (what :meth:`HeadCodec.choose_permutation` ranks), accumulated in
    float64 over token slices of ``MOMENT_ROWS`` rows, so no float32 copy of the whole ``x`` is made.
    """
    b, h, t, d = x.shape
    total = x.new_zeros((b, h, d), dtype=torch.float64)
    squares = x.new_zeros((b, h, d), dtype=torch.float64)
    step = max(1, MOMENT_ROWS // (b * h))
    for start in range(0, t, step):
        block = x[:, :, start:start + step].double()
        total += block.sum(dim=2)
        squares += block.square().sum(dim=2)
    mean = total / t
    power = (squares / t - mean.square()).clamp_min(0).mean(dim=0)
    return mean.float(), power.float()


def _forget_launch(layer: "TurboQuantLayer") -> None:
    """Drop the decode launch the ``tqvec`` attention keeps for ``layer`` (:func:`tqvec.kv.attention.forget_launch`)."""
    from .attention import forget_launch  # noqa: PLC0415 - attention imports this module

    forget_launch(layer)


def _compact(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it when it is a view into a larger storage (which holding ``x`` would keep alive, uncounted by
    ``nbytes``). Traced by ``torch.compile``, ``x`` as it is (dynamo cannot read a storage's size)."""
    if torch.compiler.is_compiling() or x.untyped_storage().nbytes() == x.numel() * x.element_size():
        return x
    return x.clone()


@dataclass
class CompressedKV:
    """What one layer's attention reads in one forward call.

    * ``layer``: the owning :class:`TurboQuantLayer` (codecs, stores, means, permutations);
    * ``sink_keys`` / ``sink_values``: ``(b, h, s, d)`` full-precision tokens ``[0, s)``;
    * ``n_codes``: tokens ``[s, s + n_codes)`` are read from the codes;
    * ``keys`` / ``values``: ``(b, h, t, d)`` full-precision tokens ``[s + n_codes, s + n_codes + t)``.
    """

    layer: "TurboQuantLayer"
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    n_codes: int
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def n_sinks(self) -> int:
        return self.sink_keys.shape[2]

    @property
    def kv_length(self) -> int:
        return self.n_sinks + self.n_codes + self.keys.shape[2]

    def __getattr__(self, name: str):
        """Any tensor attribute means another attention function got the handle: :func:`~tqvec.kv.checks.refuse_tensor_use`."""
        checks.refuse_tensor_use(self, name)


class TurboQuantLayer(CacheLayerMixin):
    """One full-attention layer: TurboQuant codes for old tokens, full precision for the newest ``window``."""

    #: the cache class that builds these layers (named in error messages)
    cache_name = "TurboQuantCache"
    is_sliding = False
    is_croppable = True

    def __init__(self, key_codec: HeadCodec, value_codec: HeadCodec, window: int = 128, sinks: int = 4,
                 compress_chunk: int = 16) -> None:
        super().__init__()
        checks.check_int("window", window, 0)
        checks.check_int("sinks", sinks, 0)
        checks.check_int("compress_chunk", compress_chunk, 1)
        if key_codec.head_dim != value_codec.head_dim:
            raise ValueError(f"key_codec and value_codec must share head_dim, got {key_codec.head_dim} and {value_codec.head_dim}")
        self.key_codec, self.value_codec = key_codec, value_codec
        self.window, self.sinks, self.compress_chunk = int(window), int(sinks), int(compress_chunk)
        self._clear()

    def _clear(self) -> None:
        _forget_launch(self)
        self.keys = self.values = self.sink_keys = self.sink_values = None
        self.key_store, self.value_store = CodeStore(self.key_codec), CodeStore(self.value_codec)
        self.key_mean: torch.Tensor | None = None  # (b, h, d) float32
        self.value_mean: torch.Tensor | None = None
        self.key_perm: torch.Tensor | None = None  # (h, d) int64, outlier channels first
        self.value_perm: torch.Tensor | None = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        b, h, _, d = key_states.shape
        self.keys = self.sink_keys = key_states.new_zeros((b, h, 0, d))
        self.values = self.sink_values = value_states.new_zeros((b, h, 0, value_states.shape[-1]))
        self.is_initialized = True

    # ------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[CompressedKV, CompressedKV]:
        """Append ``(b, h, t, d)`` keys/values; compress what leaves the window; return the read handle twice."""
        if not self.is_initialized:
            checks.check_states(key_states, value_states, self.key_codec.head_dim)
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[-1] != self.keys.shape[-1] or key_states.shape[:2] != self.keys.shape[:2]:
            checks.check_states(key_states, value_states, self.key_codec.head_dim)
            raise ValueError(f"key_states {tuple(key_states.shape)} do not extend the cached (batch, heads, tokens, head_dim) "
                             f"{tuple(self.keys.shape)}")
        if self.keys.shape[2]:
            keys, values = torch.cat([self.keys, key_states], dim=2), torch.cat([self.values, value_states], dim=2)
        else:  # nothing pending (a prefill): no copy
            keys, values = key_states, value_states
        take = min(self.sinks - self.sink_keys.shape[2], keys.shape[2]) if self.key_store.length == 0 else 0
        if take > 0:  # the stream's first tokens become sinks (only before anything is compressed)
            self.sink_keys = torch.cat([self.sink_keys, keys[:, :, :take]], dim=2)
            self.sink_values = torch.cat([self.sink_values, values[:, :, :take]], dim=2)
            keys, values = keys[:, :, take:], values[:, :, take:]
        handle = CompressedKV(self, self.sink_keys, self.sink_values, self.key_store.length, keys, values)
        overflow = keys.shape[2] - self.window
        if overflow >= self.compress_chunk:
            if self.key_mean is None:
                self._init_statistics(keys, values)
            self.key_store.append(keys[:, :, :overflow], self.key_mean, self.key_perm, "key_states")
            self.value_store.append(values[:, :, :overflow], self.value_mean, self.value_perm, "value_states")
            self.keys, self.values = keys[:, :, overflow:].clone(), values[:, :, overflow:].clone()
        else:  # a short prefill's tokens may be views into a larger buffer (fused QKV, the sinks' tail): held compactly
            self.keys, self.values = _compact(keys), _compact(values)
        return handle, handle

    def _init_statistics(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Centering means ``(b, h, d)`` and outlier permutations ``(h, d)`` from all non-sink tokens present now.

        Any shift is exact for attention; with left padding the pad tokens enter these means (the cache does
        not see the padding mask), which raises a padded row's quantization error somewhat.
        """
        self.key_mean, key_power = _channel_moments(keys)
        self.value_mean, value_power = _channel_moments(values)
        if self.key_codec.uses_outliers:
            self.key_perm = torch.argsort(key_power, dim=1, descending=True)
        if self.value_codec.uses_outliers:
            self.value_perm = torch.argsort(value_power, dim=1, descending=True)

    # ------------------------------------------------------------------ sizes
    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sink_keys.shape[2] + self.key_store.length + self.keys.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Exact bytes held: code stores (allocated capacity), full-precision sinks and window, means, permutations."""
        tensors = [self.keys, self.values, self.sink_keys, self.sink_values, self.key_mean, self.value_mean, self.key_perm, self.value_perm]
        own = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return own + self.key_store.nbytes() + self.value_store.nbytes()

    # ------------------------------------------------------------------ edits
    def reset(self) -> None:
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        remove = -tokens_to_remove
        if remove == 0 or not self.is_initialized:
            return
        from_window = min(remove, self.keys.shape[2])
        from_codes = min(remove - from_window, self.key_store.length)
        keep_sinks = self.sink_keys.shape[2] - min(remove - from_window - from_codes, self.sink_keys.shape[2])
        keep = self.keys.shape[2] - from_window
        self.keys, self.values = self.keys[:, :, :keep].clone(), self.values[:, :, :keep].clone()
        self.sink_keys, self.sink_values = self.sink_keys[:, :, :keep_sinks], self.sink_values[:, :, :keep_sinks]
        self.key_store.truncate(self.key_store.length - from_codes)
        self.value_store.truncate(self.value_store.length - from_codes)

    def _index_batch(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        index = index.to(self.keys.device)
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        self.sink_keys, self.sink_values = self.sink_keys.index_select(0, index), self.sink_values.index_select(0, index)
        if self.key_mean is not None:
            self.key_mean, self.value_mean = self.key_mean.index_select(0, index), self.value_mean.index_select(0, index)
        self.key_store.index_batch(index)
        self.value_store.index_batch(index)
        _forget_launch(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_batch(torch.arange(self.keys.shape[0], device=self.keys.device).repeat_interleave(repeats))

    def offload(self) -> None:
        raise NotImplementedError("TurboQuantLayer does not support offloading")

    def prefetch(self) -> None:
        raise NotImplementedError("TurboQuantLayer does not support offloading")


class CodedCache(Cache):
    """What :class:`TurboQuantCache` and :class:`~tqvec.kv.static.StaticTurboQuantCache` share: ``update`` with a clear
    error for a layer the cache was not built for, and ``nbytes``."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """``Cache.update``, with a clear error when the model has more layers than the config the cache was built from."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"config: the cache was built for {len(self.layers)} layers, but the model updates layer {layer_idx}; "
                f"build {type(self).__name__} from the model's own config (model.config)")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        """Bytes held by all layers: a compressed layer's ``nbytes()`` (codes, exact tokens, statistics), a
        transformers layer's keys and values."""
        total = 0
        for layer in self.layers:
            if hasattr(layer, "nbytes"):
                total += layer.nbytes()
            elif getattr(layer, "is_initialized", False):
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
        return total


class TurboQuantCache(CodedCache):
    """TurboQuant KV cache for a transformers model (full-attention layers compressed, others dynamic).

    Use it with the ``"tqvec"`` attention (``model.set_attn_implementation("tqvec")``); a layer's tokens are split
    into full-precision sinks, codes and a full-precision window of the newest tokens (module docstring).

    Parameters
    ----------
    config : transformers ``PretrainedConfig``
        The model's config (``model.config``); its text config's layer types say which layers are compressed.
    key_bits, value_bits : float
        Bits per channel, 1–8; fractional rates split a head's channels between two widths (:mod:`tqvec.kv.codec`).
    key_mode : {"mse", "prod"}
        The keys' quantizer mode (values are always ``mse``).
    window : int
        Newest tokens kept in full precision (≥ 0).
    sinks : int
        First tokens kept in full precision (≥ 0).
    key_rescale : bool, optional
        TurboQuantizer's ``rescale`` for the keys (``mse`` only); default: on for ``mse`` keys. An ``mse`` code
        shrinks each key toward 0 (a conditional mean), which flattens sharp retrieval heads over long contexts;
        the rescale undoes it (docs/kv.md measures the effect on passkey margins and KL).
    value_rescale : bool
        The same for the values (off: the plain ``mse`` scale is the least-squares reconstruction).
    split : {"outlier", "rotated"}
        How a fractional rate splits a head's channels: ``"outlier"`` gives the extra bit to the channels of largest
        magnitude, ``"rotated"`` to a segment of the rotated channels (:mod:`tqvec.kv.codec`).
    seed : int
        Rotation seed (keys ``seed``, values ``seed + 1000``).
    compress_chunk : int
        Tokens leaving the window are compressed in batches of at least this many (≥ 1; 1: every step).

    Raises
    ------
    TypeError
        ``config`` not a ``PretrainedConfig`` (the model itself, None), or an argument of the wrong type (named).
    ValueError
        An argument out of range or an unknown choice (named).

    See Also
    --------
    tqvec.kv.StaticTurboQuantCache : preallocated buffers for a fixed maximum length (integer bits, ``mse`` keys),
        whose decode steps replay CUDA graphs: the faster choice on a GPU (docs/kv.md).

    Examples
    --------
    >>> cache = TurboQuantCache(model.config, key_bits=3.5, value_bits=3.5)  # doctest: +SKIP
    >>> model.set_attn_implementation("tqvec")                               # doctest: +SKIP
    >>> model.generate(**inputs, cache=cache, max_new_tokens=64)            # doctest: +SKIP
    >>> cache.nbytes()                                                       # doctest: +SKIP
    """

    def __init__(self, config, key_bits: float = 4, value_bits: float = 4, *, key_mode: str = "mse",
                 window: int = 128, sinks: int = 4, key_rescale: bool | None = None, value_rescale: bool = False,
                 split: str = "outlier", seed: int = 0, compress_chunk: int = 16) -> None:
        text = checks.text_config(config)
        key_bits, value_bits = checks.check_bits("key_bits", key_bits), checks.check_bits("value_bits", value_bits)
        checks.check_choice("key_mode", key_mode, KEY_MODES)
        if key_mode == "prod" and key_bits < 2:
            raise ValueError(f"key_bits: key_mode='prod' spends one bit per channel on QJL signs and needs key_bits >= 2 "
                             f"(got {key_bits:g}); use key_mode='mse' below 2 bits")
        checks.check_choice("split", split, SPLITS)
        for name, value, low in (("window", window, 0), ("sinks", sinks, 0), ("compress_chunk", compress_chunk, 1),
                                 ("seed", seed, 0)):
            checks.check_int(name, value, low)
        if key_rescale is None:
            key_rescale = key_mode == "mse"
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        key_codec = HeadCodec(head_dim, key_bits, key_mode, key_rescale, split, seed)
        value_codec = HeadCodec(head_dim, value_bits, "mse", value_rescale, split, seed + 1000)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        layers = [TurboQuantLayer(key_codec, value_codec, window, sinks, compress_chunk) if kind == "full_attention"
                  else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw) for kind, kw in zip(layer_types, layer_kwargs)]
        super().__init__(layers=layers)
        self.key_codec, self.value_codec = key_codec, value_codec
