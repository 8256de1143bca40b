"""Shared steps of the real-model KV tests (tests/test_kv_model.py, tests/test_kv_gemma.py): a model loaded with the
tqvec attention, its pydoc reference (prefill 512 + 256 tokens read in chunks of 32 by the full cache), and one
cache's quality against it."""
from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import Cache, DynamicCache

from tqvec.kv import evaluate as ev

PREFILL, TOKENS = 512, 768


def load_with_tqvec_attention(name: str):
    """``(model, tokenizer)`` of ``tqvec.kv.evaluate.MODELS[name]`` with the ``tqvec`` attention selected (seeded)."""
    torch.manual_seed(0)
    model, tokenizer = ev.MODELS[name]()
    model.set_attn_implementation("tqvec")
    return model, tokenizer


def pydoc_reference(model, tokenizer) -> tuple[torch.Tensor, ev.Prefix, torch.Tensor]:
    """``(ids, prefix, reference log-probs)`` of the first ``TOKENS`` pydoc tokens, prefilled ``PREFILL``."""
    ids = ev.text_ids(tokenizer, "pydoc", TOKENS)
    prefix = ev.Prefix.run(model, ids[:, :PREFILL])
    return ids, prefix, ev.chunked_logprobs(model, ids, prefix, lambda: DynamicCache(config=model.config))


def quality(model, reference: tuple[torch.Tensor, ev.Prefix, torch.Tensor],
            make: Callable[[], Cache]) -> tuple[dict[str, float], dict[str, float]]:
    """``(cache's, full cache's)`` perplexity, KL and top-1 agreement (:func:`tqvec.kv.evaluate.compare`) on the
    tokens after the prefill, the cache made by ``make``."""
    ids, prefix, full = reference
    targets = ids[0, PREFILL:]
    return ev.compare(full, ev.chunked_logprobs(model, ids, prefix, make), targets), ev.compare(full, full, targets)
