"""A static cache's one-token step as two custom operators, so ``torch.compile`` traces a decode step in one graph.

``torch.ops.tqvec.static_append`` writes the step's key and value into a :class:`~tqvec.kv.static.StaticTurboQuantLayer`
(its buffers are a mutated argument, so compiled graphs keep the write before every read), and
``torch.ops.tqvec.static_attend`` returns the step's attention output over that layer. The cache calls them while a
graph is being traced (``torch.compiler.is_compiling()``) and their bodies directly otherwise: eagerly, an operator's
dispatch cost more than the step's kernels on the H200. Dynamo treats both as opaque:
it does not trace into the Triton launchers behind them (which it fails to), and a compiled graph calls them where
the eager code would. Each works on the buffers it is given (:meth:`StaticTurboQuantLayer.with_buffers
<tqvec.kv.static.StaticTurboQuantLayer.with_buffers>`): a compiled graph may hand it copies of the layer's and copy
the result back. What is not a buffer (quantizers, which an operator cannot take as an argument, and the layer's sizes)
comes from a live layer of the same specification (:meth:`StaticTurboQuantLayer.spec
<tqvec.kv.static.StaticTurboQuantLayer.spec>`; such layers share their codec objects), named by a key that layers of
equal specification share: a compiled step then serves every cache built with the same arguments without recompiling.
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .static import StaticTurboQuantLayer

#: one key per layer specification, in order of first registration (under _LOCK)
_KEYS: dict[tuple, int] = {}
_LOCK = threading.Lock()
#: the live layers of each key (:func:`register`); a layer leaves with its last reference
_LAYERS: dict[int, weakref.WeakSet[StaticTurboQuantLayer]] = {}


def register(layer: StaticTurboQuantLayer) -> int:
    """The key that names ``layer``'s specification in the operators' calls (the same for every layer of an equal
    :meth:`~tqvec.kv.static.StaticTurboQuantLayer.spec`)."""
    with _LOCK:
        key = _KEYS.setdefault(layer.spec(), len(_KEYS))
        _LAYERS.setdefault(key, weakref.WeakSet()).add(layer)
    return key


def _layer(key: int) -> StaticTurboQuantLayer:
    """A live layer registered under ``key`` (any: layers of one specification share their codecs and differ only in
    their buffers, which the operators are given)."""
    for layer in list(_LAYERS.get(key, ())):
        return layer
    raise RuntimeError("a static cache operator was called for a layer that no longer exists")


@torch.library.custom_op("tqvec::static_append", mutates_args=("buffers",))
def static_append(key: torch.Tensor, value: torch.Tensor, buffers: list[torch.Tensor], layer: int) -> None:
    """Write one token's ``key`` / ``value`` ``(b, h, 1, d)`` into a layer of the specification named ``layer``;
    ``buffers`` are that layer's buffers (:meth:`StaticTurboQuantLayer.buffers`), which the write changes in place."""
    _layer(layer).with_buffers(buffers).write_one(key, value)


@static_append.register_fake
def _(key: torch.Tensor, value: torch.Tensor, buffers: list[torch.Tensor], layer: int) -> None:
    return None


@torch.library.custom_op("tqvec::static_attend", mutates_args=())
def static_attend(query: torch.Tensor, mask: torch.Tensor | None, buffers: list[torch.Tensor], layer: int,
                  scaling: float) -> torch.Tensor:
    """Attention output ``(b, hq, 1, d)`` (``query``'s dtype) of a one-token ``query`` ``(b, hq, 1, d)`` over a layer of
    the specification named ``layer`` (``buffers``: its buffers, read); ``mask``: boolean ``(b, 1, 1, max_cache_len)`` or None."""
    from .attention import static_attention  # noqa: PLC0415 - attention imports the static cache

    return static_attention(_layer(layer).with_buffers(buffers), query, mask, scaling)


@static_attend.register_fake
def _(query: torch.Tensor, mask: torch.Tensor | None, buffers: list[torch.Tensor], layer: int,
      scaling: float) -> torch.Tensor:
    return torch.empty_like(query)
