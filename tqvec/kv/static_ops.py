"""A static cache's one-token step as two custom operators, so ``torch.compile`` traces a decode step in one graph.

``torch.ops.tqvec.static_append`` writes the step's key and value into a :class:`~tqvec.kv.static.StaticTurboQuantLayer`
(its buffers are a mutated argument, so compiled graphs keep the write before every read), and
``torch.ops.tqvec.static_attend`` returns the step's attention output over that layer. Dynamo treats both as opaque:
it does not trace into the Triton launchers behind them (which it fails to), and a compiled graph calls them where
the eager code would. Each names its layer by a key in a registry of live layers (a layer holds quantizers, which an
operator cannot take as an argument) and works on the buffers it is given (:meth:`StaticTurboQuantLayer.with_buffers
<tqvec.kv.static.StaticTurboQuantLayer.with_buffers>`): a compiled graph may hand it copies of the layer's and copy
the result back.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .static import StaticTurboQuantLayer

#: live layers by key (:func:`register`); an entry goes with its layer
_LAYERS: weakref.WeakValueDictionary[int, StaticTurboQuantLayer] = weakref.WeakValueDictionary()


def register(layer: StaticTurboQuantLayer) -> int:
    """The key that names ``layer`` in the operators' calls (its ``id``, valid while it lives)."""
    _LAYERS[id(layer)] = layer
    return id(layer)


def _layer(key: int) -> StaticTurboQuantLayer:
    layer = _LAYERS.get(key)
    if layer is None:
        raise RuntimeError("a static cache operator was called for a layer that no longer exists")
    return layer


@torch.library.custom_op("tqvec::static_append", mutates_args=("buffers",))
def static_append(key: torch.Tensor, value: torch.Tensor, buffers: list[torch.Tensor], layer: int) -> None:
    """Write one token's ``key`` / ``value`` ``(b, h, 1, d)`` into the layer named ``layer``; ``buffers`` are that
    layer's buffers (:meth:`StaticTurboQuantLayer.buffers`), which the write changes in place."""
    _layer(layer).with_buffers(buffers).write_one(key, value)


@static_append.register_fake
def _(key: torch.Tensor, value: torch.Tensor, buffers: list[torch.Tensor], layer: int) -> None:
    return None


@torch.library.custom_op("tqvec::static_attend", mutates_args=())
def static_attend(query: torch.Tensor, mask: torch.Tensor | None, buffers: list[torch.Tensor], layer: int,
                  scaling: float) -> torch.Tensor:
    """Attention output ``(b, hq, 1, d)`` (``query``'s dtype) of a one-token ``query`` ``(b, hq, 1, d)`` over the layer
    named ``layer`` (``buffers``: its buffers, read); ``mask``: boolean ``(b, 1, 1, max_cache_len)`` or None."""
    from .attention import static_attention  # noqa: PLC0415 - attention imports the static cache

    return static_attention(_layer(layer).with_buffers(buffers), query, mask, scaling)


@static_attend.register_fake
def _(query: torch.Tensor, mask: torch.Tensor | None, buffers: list[torch.Tensor], layer: int,
      scaling: float) -> torch.Tensor:
    return torch.empty_like(query)
