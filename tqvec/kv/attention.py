"""The ``tqvec`` attention: softmax(q·Kᵀ·scale)·V with K and V read from TurboQuant codes.

For one KV head with ``g`` query heads (GQA) and ``q`` query tokens, the ``g·q`` queries are scored

* against the compressed tokens through :func:`tqvec.scan.scores` (the shared dispatch point: torch on
  CPU, the Triton scan on CUDA), one call per channel group, on the permuted, rotated queries. The codes
  hold centered keys ``k − μ``, so these are scores ``q·(k − μ)``;
* against the full-precision tokens as ``q·k − q·μ`` (the same shift, which softmax ignores).

Values: the codes hold ``v − μ_v`` in the rotated domain, so ``Σ p_i v_i`` is computed as
``Πᵀ(Σ p_i s_i ŷ_i)`` per group (code blocks dequantized transiently, ``scan.BLOCK_ROWS`` rows at a
time, never the whole cache) plus ``μ_v·Σ p_i`` plus the full-precision window's ``Σ p_j v_j``.
On CUDA the value combination runs in :mod:`tqvec.kernels.attention` when that module provides it.

Masks: the registered mask function always materializes the boolean ``(b, 1, q, kv)`` mask
(transformers' ``sdpa_mask`` without the causal skip), whose columns are absolute cache positions.
Layers whose cache is a plain tensor (sliding-window layers, or another cache class) fall back to
transformers' SDPA attention.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import scan
from .cache import CompressedKV
from .store import CodeStore

NAME = "tqvec"


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


def _head_values(store: CodeStore, perm: torch.Tensor | None, probs: torch.Tensor, batch: int, head: int) -> torch.Tensor:
    """``Σ_i probs[:, i] · (v_i − μ)`` ``(m, d)`` over one head's compressed values; ``probs`` ``(m, n)`` float32."""
    m, n = probs.shape
    parts = []
    for gi, group in enumerate(store.codec.groups):
        quantizer = group.quantizer
        table = quantizer.table(probs.device)
        acc = probs.new_zeros((m, quantizer.rotated_dim))
        for start in range(0, n, scan.BLOCK_ROWS):
            stop = min(start + scan.BLOCK_ROWS, n)
            codes = store.codes(gi, batch, head, start, stop)
            acc += (probs[:, start:stop] * codes.scales) @ scan.dequantize(codes.packed, table)
        parts.append(quantizer.rotation.inverse(acc))
    out = torch.cat(parts, dim=1)
    if perm is None:
        return out
    return torch.empty_like(out).index_copy_(1, perm[head], out)


def compressed_attention(handle: CompressedKV, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention output ``(b, hq, q, d)`` float32 for ``query`` ``(b, hq, q, d)``.

    ``mask``: boolean ``(b, 1, q, kv_length)`` (True = attend) or None (attend to everything).
    """
    layer = handle.layer
    b, hq, q_len, d = query.shape
    h_kv = handle.keys.shape[1]
    group = hq // h_kv
    n_codes = handle.n_codes
    queries = query.float().reshape(b, h_kv, group * q_len, d)
    keys, values = handle.keys.float(), handle.values.float()
    shift = 0.0 if layer.key_mean is None else torch.einsum("bhmd,bhd->bhm", queries, layer.key_mean)[..., None]
    window = queries @ keys.transpose(2, 3) - shift  # (b, h_kv, g·q, t)
    if n_codes:
        coded = torch.stack([torch.stack([_head_scores(handle, queries[bi, hj], bi, hj) for hj in range(h_kv)])
                             for bi in range(b)])
        logits = torch.cat([coded, window], dim=3) * scaling
    else:
        logits = window * scaling
    if mask is not None:
        if mask.shape[-1] != handle.kv_length:
            raise ValueError(f"mask covers {mask.shape[-1]} keys, the cache holds {handle.kv_length}")
        allowed = mask.expand(b, 1, q_len, -1).unsqueeze(2).expand(b, 1, group, q_len, -1).reshape(b, 1, group * q_len, -1)
        logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=3).nan_to_num(0.0)
    out = probs[..., n_codes:] @ values
    if n_codes:
        mass = probs[..., :n_codes].sum(dim=3, keepdim=True)
        out = out + mass * layer.value_mean[:, :, None]
        out = out + torch.stack([torch.stack([
            _head_values(layer.value_store, layer.value_perm, probs[bi, hj, :, :n_codes], bi, hj)
            for hj in range(h_kv)]) for bi in range(b)])
    return out.reshape(b, hq, q_len, d)


def tqvec_attention_forward(module: torch.nn.Module, query: torch.Tensor, key, value, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` ``(b, hq, q, d)`` → ``((b, q, hq, d), None)``."""
    if not isinstance(key, CompressedKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("tqvec attention is inference-only (dropout must be 0)")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    out = compressed_attention(key, query, attention_mask, scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def tqvec_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA boolean mask, always materialized (tqvec attention has no implicit causal mode)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ``"tqvec"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``."""
    AttentionInterface.register(NAME, tqvec_attention_forward)
    AttentionMaskInterface.register(NAME, tqvec_mask)
