"""The fastest eager decode step any KV cache could give a transformers model: no cache and no attention.

:func:`bound_cache` keeps no keys or values (:class:`LengthOnlyLayer`: only how many tokens it has seen) and
:data:`NO_ATTENTION` (registered by :func:`register`) returns the step's queries as its output without reading
anything, and gives no mask. A model run with both does everything a step does except storing and attending: its
projections, rotary embedding, norms, MLP, logits and the Python around them. A step of any real cache and attention
costs at least that much more than nothing, so a cache's decode speed-up over DynamicCache is at most DynamicCache's
ms/step over this one's, measured side by side (``tqvec.bench.kv_e2e``'s decode part). The outputs are meaningless;
only the time is used.

Example::

    register()
    model.set_attn_implementation(NO_ATTENTION)
    cache = bound_cache(model.config.num_hidden_layers)
    token = model(input_ids=ids, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface

#: the attention implementation's name (``model.set_attn_implementation``)
NO_ATTENTION = "tqvec-bench-no-attention"


class LengthOnlyLayer(DynamicLayer):
    """A cache layer that stores nothing: ``update`` counts the tokens and returns the step's own keys and values."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.length += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0


def bound_cache(layers: int) -> Cache:
    """A cache of ``layers`` :class:`LengthOnlyLayer` layers."""
    return Cache(layers=[LengthOnlyLayer() for _ in range(layers)])


def no_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """``query`` ``(b, heads, q, d)`` as the attention output ``(b, q, heads, d)`` (a view: no kernel launch)."""
    return query.transpose(1, 2), None


def no_mask(*args, **kwargs) -> None:
    """No attention mask."""
    return None


def register() -> None:
    """Register :func:`no_attention` and :func:`no_mask` under :data:`NO_ATTENTION` (again: no effect)."""
    AttentionInterface.register(NO_ATTENTION, no_attention)
    AttentionMaskInterface.register(NO_ATTENTION, no_mask)
