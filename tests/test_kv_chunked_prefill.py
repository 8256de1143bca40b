"""Several query tokens over compressed tokens (chunked prefill): the dense path against the per-head reference.

:func:`tqvec.kv.attention.dense_attention` decodes the layer's codes into dense K/V and runs SDPA; the per-head
:func:`~tqvec.kv.attention.compressed_attention` scores the codes directly. Both compute the same attention (the
decoded key's dot with a query is the scan's score plus ``q·μ``), so in float32 they agree to float rounding.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kv_models import tiny_llama  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from tqvec import _fastscan  # noqa: E402
from tqvec.kv import TurboQuantCache, TurboQuantLayer, attention  # noqa: E402
from tqvec.kv.attention import _head_scores, _values, compressed_attention, dense_attention, dense_kv  # noqa: E402
from tqvec.kv.cache import CompressedKV  # noqa: E402
from tqvec.kv.codec import HeadCodec  # noqa: E402

D = 64


def _handle(bits: float, window: int, sinks: int, *, key_mode: str = "mse", split: str = "outlier", b: int = 2,
            h: int = 2, cached: int = 276, q: int = 24, dtype: torch.dtype = torch.float32,
            seed: int = 0) -> tuple[CompressedKV, torch.Generator]:
    """A layer holding ``cached`` tokens (codes, sinks, window) and the handle of a ``q``-token call on it.

    Keys carry a per-head offset (what centering removes) and one loud channel (what the outlier split moves first),
    so a decode that dropped the mean or the permutation would be far off.
    """
    g = torch.Generator().manual_seed(seed)
    t = cached + q
    k = torch.randn(b, h, t, D, generator=g) + 2 * torch.randn(1, h, 1, D, generator=g)
    k[..., 5] *= 8
    v = torch.randn(b, h, t, D, generator=g) - 0.5
    layer = TurboQuantLayer(HeadCodec(D, bits, key_mode, key_mode == "mse", split, seed=1),
                            HeadCodec(D, bits, "mse", split=split, seed=7), window, sinks)
    layer.update(k[:, :, :cached].to(dtype), v[:, :, :cached].to(dtype))
    handle, _ = layer.update(k[:, :, cached:].to(dtype), v[:, :, cached:].to(dtype))
    assert handle.n_codes > 0 and handle.kv_length == t
    return handle, g


def _causal(b: int, q: int, kv: int) -> torch.Tensor:
    """transformers' boolean ``(b, 1, q, kv)`` mask of a ``q``-token chunk after ``kv − q`` cached tokens."""
    return torch.ones(b, 1, q, kv, dtype=torch.bool).tril(kv - q)


CASES = [  # (window, sinks, group, padded): every value of each, in pairs
    (0, 0, 1, False), (16, 4, 3, True), (0, 4, 3, False), (16, 0, 1, True),
]


@pytest.mark.parametrize("bits", [2, 4, 2.5, 3.5])
@pytest.mark.parametrize("window,sinks,group,padded", CASES)
def test_dense_path_equals_the_per_head_reference(bits: float, window: int, sinks: int, group: int, padded: bool) -> None:
    """float32: relative error ~1e-6 (two summation orders of the same float32 sums), bound 1e-4. Fractional bits
    use the outlier split (two channel groups and a channel permutation per head); no mask means causal, aligned
    bottom right."""
    handle, g = _handle(bits, window, sinks)
    b, kv, q = 2, handle.kv_length, 24
    query = 2 * torch.randn(b, 2 * group, q, D, generator=g)
    mask = _causal(b, q, kv)
    if padded:
        mask[1, ..., :37] = False  # row 1 left-padded: sinks and some coded tokens masked out
    out = dense_attention(handle, query, mask if padded else None, D ** -0.5)
    ref = compressed_attention(handle, query, mask, D ** -0.5)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-4, rel
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits,key_mode,split", [(3, "prod", "outlier"), (2.5, "prod", "outlier"), (3.5, "mse", "rotated")])
def test_dense_path_covers_qjl_keys_and_the_rotated_split(bits: float, key_mode: str, split: str) -> None:
    """``prod`` keys decode with their QJL term, which is linear in the codes: the decoded key's dot with a query is
    the unbiased estimate the reference scores, so QJL keys take the dense path too, with the same bound."""
    handle, g = _handle(bits, 16, 4, key_mode=key_mode, split=split)
    query = 2 * torch.randn(2, 6, 24, D, generator=g)
    out = dense_attention(handle, query, None, D ** -0.5)
    ref = compressed_attention(handle, query, _causal(2, 24, handle.kv_length), D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("key_mode", ["mse", "prod"])
def test_decoded_keys_score_like_the_codes_and_values_like_the_reference(key_mode: str) -> None:
    """``q·k̂ = q·μ + _head_scores`` token by token (mse keys with ``key_rescale``, which lives in the stored scale;
    prod keys with the QJL term), ``v̂ − μ_v`` equals the reference's value sum under one-hot weights, and the sinks
    and the full-precision tokens are copied where they belong."""
    handle, g = _handle(3.5, 16, 4, key_mode=key_mode)
    layer, s, n = handle.layer, handle.n_sinks, handle.n_codes
    assert layer.key_codec.groups[0].quantizer.rescale == (key_mode == "mse")
    keys, values = dense_kv(handle, torch.float32)
    assert keys.shape == values.shape == (2, 2, handle.kv_length, D)
    assert torch.equal(keys[:, :, :s], handle.sink_keys) and torch.equal(keys[:, :, s + n:], handle.keys)
    assert torch.equal(values[:, :, :s], handle.sink_values) and torch.equal(values[:, :, s + n:], handle.values)
    queries = torch.randn(5, D, generator=g)
    for bi in range(2):
        for hj in range(2):
            decoded = queries @ keys[bi, hj, s:s + n].T
            expected = _head_scores(handle, queries, bi, hj) + (queries @ layer.key_mean[bi, hj])[:, None]
            torch.testing.assert_close(decoded, expected, rtol=1e-4, atol=1e-4)
    one_hot = torch.eye(n).expand(2, 2, n, n)
    centered = _values(layer.value_store, layer.value_perm, one_hot)
    torch.testing.assert_close(values[:, :, s:s + n] - layer.value_mean[:, :, None], centered, rtol=1e-4, atol=1e-5)


def test_a_purely_causal_mask_is_recognized() -> None:
    """generate() hands an unpadded chunk the causal pattern as a materialized mask; the dense path drops it (so CUDA's
    flash kernel runs with GQA, no mask and no repeated heads). Padding, or one cell off, keeps the mask."""
    q, kv = 24, 300
    assert attention.is_causal_mask(_causal(2, q, kv), q, kv)
    padded = _causal(2, q, kv)
    padded[1, :, :, :3] = False
    future = _causal(2, q, kv)
    future[0, 0, 0, kv - q + 1] = True
    hidden = _causal(2, q, kv)
    hidden[0, 0, q - 1, kv - 1] = False
    for mask in (padded, future, hidden):
        assert not attention.is_causal_mask(mask, q, kv)
    handle, g = _handle(4, 16, 4)
    query = torch.randn(2, 2, q, D, generator=g)
    torch.testing.assert_close(dense_attention(handle, query, _causal(2, q, kv), 0.125),
                               dense_attention(handle, query, None, 0.125), rtol=0, atol=0)


def test_store_decode_refuses_a_wrong_buffer() -> None:
    """``CodeStore.decode`` names the mismatch: another head count, or tokens past the stored ones."""
    handle, _ = _handle(4, 16, 4)
    store, n = handle.layer.key_store, handle.layer.key_store.length
    with pytest.raises(ValueError, match="does not match the store"):
        store.decode(torch.empty(2, 3, n, D))
    with pytest.raises(ValueError, match="run past"):
        store.decode(torch.empty(2, 2, 8, D), start=n - 4)


def test_bfloat16_model_dtype() -> None:
    """bfloat16 cache and queries: the dense K/V and SDPA are bfloat16 (8 significant bits, unit roundoff 2⁻⁸ ≈ 0.4 %),
    the reference float32 on the same codes; the query, K, V and output roundings give ~0.5 % relative error, bound
    2 %."""
    handle, g = _handle(3.5, 16, 4, dtype=torch.bfloat16)
    query = (2 * torch.randn(2, 6, 24, D, generator=g)).bfloat16()
    keys, _ = dense_kv(handle, torch.bfloat16)
    assert keys.dtype == torch.bfloat16
    out = dense_attention(handle, query, None, D ** -0.5)
    ref = compressed_attention(handle, query, _causal(2, 24, handle.kv_length), D ** -0.5)
    assert out.dtype == torch.bfloat16
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.02, rel


@pytest.mark.parametrize("key_mode,bits", [("mse", 4), ("mse", 3.5), ("prod", 3)])
def test_dispatch(monkeypatch: pytest.MonkeyPatch, key_mode: str, bits: float) -> None:
    """Several query tokens over codes run the dense path (QJL keys too), never the per-head one; one query token
    keeps ``decode_step`` (``mse`` keys, channel groups included on the CPU; through the layer's bound native step
    where the native kernel serves the CPU) or the per-head path (QJL keys, which ``decode_step`` declines)."""
    handle, g = _handle(bits, 16, 4, key_mode=key_mode)
    one_token = "_native_decode" if _fastscan.available() and _fastscan.cpu_kernel() != "torch" else "decode_step"
    calls = []
    for name in ("dense_attention", "compressed_attention", "decode_step", "_native_decode"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, name=name, real=real: calls.append(name) or real(*a))
    module = torch.nn.Module()
    attention.tqvec_attention_forward(module, torch.randn(2, 4, 8, D, generator=g), handle, handle, None)
    assert calls == ["dense_attention"]
    calls.clear()
    attention.tqvec_attention_forward(module, torch.randn(2, 4, 1, D, generator=g), handle, handle, None)
    declined = key_mode == "prod"
    assert calls == (["decode_step", "compressed_attention"] if declined else [one_token])


def _peak_bytes(fn) -> tuple[int, int]:
    """(peak live bytes, largest single allocation) of the CPU allocations made while ``fn()`` runs (torch.profiler's
    allocation and free events, in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = largest = 0
    for e in events:
        live += e.nbytes()
        peak, largest = max(peak, live), max(largest, e.nbytes())
    return peak, largest


def test_chunk_over_a_long_context_forms_no_logits() -> None:
    """A 256-token chunk over 4,100 cached tokens (h_kv 2, group 4, d 64): the per-head path allocates the float32
    logits ``(b, h_kv, g·q, kv)`` (35.7 MB here) and more; the dense path stays below half of that (measured:
    ~13 MB, for the decoded K and V (4.5 MB), SDPA's float copy of the (q, kv) mask (4.5 MB) and one decode
    slice), and none of its allocations is a quarter of the logits."""
    handle, g = _handle(4, 0, 4, b=1, cached=4100, q=256)
    query = torch.randn(1, 8, 256, D, generator=g)
    kv = handle.kv_length
    logits = 1 * 2 * (4 * 256) * kv * 4
    ref_peak, ref_largest = _peak_bytes(lambda: compressed_attention(handle, query, _causal(1, 256, kv), 0.125))
    assert ref_peak >= logits and ref_largest >= logits  # the measurement sees the reference's logits
    for mask in (None, _causal(1, 256, kv)):
        peak, largest = _peak_bytes(lambda mask=mask: dense_attention(handle, query, mask, 0.125))
        assert peak < logits / 2 and largest < logits / 4, (peak, largest, logits)


def _generate(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor, bits: float, key_mode: str, **kwargs):
    cache = TurboQuantCache(model.config, key_bits=bits, value_bits=bits, key_mode=key_mode, window=8, sinks=2)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, cache=cache,
                              output_scores=True, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("bits,key_mode", [(4, "mse"), (3.5, "prod")])
def test_chunked_generate_equals_the_per_head_reference(monkeypatch: pytest.MonkeyPatch, bits: float, key_mode: str) -> None:
    """``generate(prefill_chunk_size=16)`` on a left-padded batch gives the tokens (and, to float rounding, the
    scores) of the same chunked generate with the per-head path forced.

    Equality with an unchunked generate is not expected below 8 bits: an unchunked prefill attends over exact K/V
    (nothing is compressed before the call), while every later chunk attends over the codes of the earlier ones.
    """
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 100), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, :13] = 0
    calls = []
    real = attention.dense_attention
    monkeypatch.setattr(attention, "dense_attention", lambda *a: calls.append(a[1].shape[2]) or real(*a))
    out = _generate(model, ids, mask, bits, key_mode, prefill_chunk_size=16)
    assert set(calls) == {16, 4}  # the chunks after the first compression took the dense path (the last: 100 mod 16)
    monkeypatch.setattr(attention, "dense_attention", lambda h, q, m, s: compressed_attention(h, q, m, s).to(q.dtype))
    ref = _generate(model, ids, mask, bits, key_mode, prefill_chunk_size=16)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_at_8_bits_is_close_to_the_unchunked_one() -> None:
    """At 8 bits the codes the later chunks read are nearly exact: the next-token logits after a chunked prefill stay
    within 3e-3 of the unchunked prefill's (measured: 5e-4; 4-bit codes move them by 9e-3, 2-bit by 3e-2)."""
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 100), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 100, dtype=torch.long)
    whole = _generate(model, ids, mask, 8, "mse")
    chunked = _generate(model, ids, mask, 8, "mse", prefill_chunk_size=16)
    torch.testing.assert_close(chunked.scores[0], whole.scores[0], rtol=0, atol=3e-3)
