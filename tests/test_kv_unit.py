"""Model-free tests of tqvec.kv: attention over codes vs exact attention, GQA, masks, windows, storage."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from tqvec import scan  # noqa: E402
from tqvec.kv import TurboQuantLayer  # noqa: E402
from tqvec.kv.attention import compressed_attention  # noqa: E402
from tqvec.kv.codec import HeadCodec  # noqa: E402


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Reference attention ``(b, hq, q, d)`` with GQA by ``repeat_interleave`` (transformers' repeat_kv)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _layer(bits: float, window: int, mode: str = "mse", split: str = "outlier", sinks: int = 4) -> TurboQuantLayer:
    return TurboQuantLayer(HeadCodec(64, bits, mode, split=split), HeadCodec(64, bits, "mse", split=split, seed=7), window, sinks)


def _data(b: int = 2, hq: int = 6, h: int = 2, t: int = 300, q: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(1, h, 1, 64, generator=g) * 2  # a shared key offset: what centering removes
    k = torch.randn(b, h, t, 64, generator=g) + offset
    v = torch.randn(b, h, t, 64, generator=g)
    return torch.randn(b, hq, q, 64, generator=g), k, v


@pytest.mark.parametrize("bits,mode,tol", [(8, "mse", 0.02), (4, "mse", 0.2), (3.5, "mse", 0.25), (4, "prod", 0.35)])
def test_attention_over_codes_matches_exact(bits: float, mode: str, tol: float) -> None:
    q, k, v = _data()
    layer = _layer(bits, window=16, mode=mode)
    layer.update(k[:, :, :-5], v[:, :, :-5])
    handle, _ = layer.update(k[:, :, -5:], v[:, :, -5:])
    assert handle.n_sinks == 4 and torch.equal(handle.sink_keys, k[:, :, :4])
    # the 5 new tokens push 5 < compress_chunk (16) tokens out of the window: they stay exact for now
    assert handle.n_codes == 300 - 5 - 16 - 4 and layer.key_store.length == 300 - 5 - 16 - 4
    mask = torch.ones(2, 1, 5, 300, dtype=torch.bool).tril(300 - 5)
    out = compressed_attention(handle, q, mask, 64 ** -0.5)
    ref = _exact(q, k, v, mask)
    rel = (out - ref).norm() / ref.norm()
    assert rel < tol, rel


def test_quantization_error_shrinks_with_bits() -> None:
    q, k, v = _data(seed=1)
    errors = []
    for bits in (2, 3, 4, 6):
        layer = _layer(bits, window=0)
        layer.update(k[:, :, :-1], v[:, :, :-1])
        handle, _ = layer.update(k[:, :, -1:], v[:, :, -1:])
        errors.append(float((compressed_attention(handle, q, None, 0.125) - _exact(q, k, v, None)).norm()))
    assert errors == sorted(errors, reverse=True), errors


def test_gqa_query_heads_use_their_own_kv_head() -> None:
    """Zeroing KV head 1's values must change exactly query heads 3..5 (group of 3)."""
    q, k, v = _data(t=40)
    outs = []
    for values in (v, torch.cat([v[:, :1], torch.zeros_like(v[:, 1:])], 1)):
        layer = _layer(8, window=4)
        layer.update(k[:, :, :-1], values[:, :, :-1])
        handle, _ = layer.update(k[:, :, -1:], values[:, :, -1:])
        outs.append(compressed_attention(handle, q, None, 0.125))
    changed = (outs[0] - outs[1]).abs().amax(dim=(0, 2, 3)) > 1e-4
    assert changed.tolist() == [False] * 3 + [True] * 3


def test_masked_keys_are_ignored() -> None:
    """A mask that hides the first 100 tokens gives the attention over the remaining tokens only."""
    q, k, v = _data(t=200, q=1)
    layer = _layer(8, window=8)
    layer.update(k[:, :, :-1], v[:, :, :-1])
    handle, _ = layer.update(k[:, :, -1:], v[:, :, -1:])
    mask = torch.ones(2, 1, 1, 200, dtype=torch.bool)
    mask[:, :, :, :100] = False
    out = compressed_attention(handle, q, mask, 0.125)
    ref = _exact(q, k[:, :, 100:], v[:, :, 100:], None)
    assert torch.allclose(out, ref, atol=0.02)


def test_scores_go_through_the_shared_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = scan.scores
    monkeypatch.setattr(scan, "scores", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    q, k, v = _data(b=1, t=50, q=1)
    layer = _layer(3.5, window=8)  # two channel groups: two scans per KV head
    layer.update(k[:, :, :-1], v[:, :, :-1])
    handle, _ = layer.update(k[:, :, -1:], v[:, :, -1:])
    compressed_attention(handle, q, None, 0.125)
    assert len(calls) == 2 * 2


def test_window_keeps_newest_tokens_exact_and_frees_old_ones() -> None:
    _, k, v = _data(b=1, t=300)
    layer = _layer(4, window=128)
    layer.update(k[:, :, :200], v[:, :, :200])
    assert layer.key_store.length == 68 and layer.keys.shape[2] == 128 and layer.sink_keys.shape[2] == 4
    assert torch.equal(layer.keys, k[:, :, 72:200])
    # the window is its own storage: no view keeps the 200-token prefill alive
    assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()
    every_step = _layer(4, window=128)
    every_step.compress_chunk = 1
    every_step.update(k[:, :, :200], v[:, :, :200])
    for i in range(200, 300):
        for one in (layer, every_step):
            one.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
            assert 128 <= one.keys.shape[2] < 128 + one.compress_chunk
    # one-token steps: tokens leaving the window are compressed 16 at a time (96 of 100 so far), or every step
    assert layer.key_store.length == 68 + 96 and layer.get_seq_length() == 300
    assert torch.equal(layer.keys, k[:, :, 168:300])
    assert every_step.key_store.length == 168 and torch.equal(every_step.keys, k[:, :, 172:300])
    chunked, stepped = (one.key_store.fields[0]["packed"][:, :, :164] for one in (layer, every_step))
    assert (chunked == stepped).float().mean() > 0.99  # the same codes, up to float rounding of batched encodes


def test_nbytes_is_exact_and_compressed() -> None:
    _, k, v = _data(b=1, h=2, t=1000)
    layer = _layer(4, window=0, sinks=0)
    layer.update(k, v)
    per_vector = HeadCodec(64, 4).bytes_per_vector
    assert per_vector == 32 + 2
    assert layer.key_store.used_nbytes() == 1 * 2 * 1000 * per_vector
    stats = 2 * (2 * 64 * 4)  # key and value means, (b, h, d) float32
    assert layer.nbytes() == layer.key_store.nbytes() + layer.value_store.nbytes() + stats
    assert layer.key_store.nbytes() == layer.key_store.used_nbytes()  # first allocation is exact
    assert layer.nbytes() < 0.15 * (k.numel() + v.numel()) * 4


def test_a_short_prefill_of_views_is_held_compactly_so_nbytes_stays_exact() -> None:
    """Values that are views of a fused QKV projection's output (Phi-3) and keys past the sinks (a view of the prompt):
    a prefill shorter than the window keeps its own copies, so the storage held equals ``nbytes``."""
    _, k, v = _data(b=1, t=40)
    fused = torch.cat([k, v, v], dim=-1)  # (b, h, t, 3d): values are a view of it
    layer = _layer(4, window=128, sinks=4)
    layer.update(k, fused[..., k.shape[-1]:2 * k.shape[-1]])
    assert torch.equal(layer.values, v[:, :, 4:]) and torch.equal(layer.keys, k[:, :, 4:])
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (layer.keys, layer.values, layer.sink_keys, layer.sink_values)}
    assert sum(held.values()) == layer.nbytes()


@pytest.mark.parametrize("head_dim, bits, message", [
    (1, 4, "head_dim must be >= 2, got 1"),
    (2, 2.5, "bits=2.5 splits head_dim=2 into groups of 1 and 1 channels, and a group needs 2 at least"),
    (64, 3.01, "bits=3.01 splits head_dim=64 into groups of 1 and 63 channels"),
])
def test_codecs_too_small_to_split_name_head_dim_and_bits(head_dim: int, bits: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HeadCodec(head_dim, bits)


def test_fractional_bits_pick_outlier_channels_by_magnitude() -> None:
    codec = HeadCodec(64, 3.5)
    assert [(g.start, g.stop, g.quantizer.bits) for g in codec.groups] == [(0, 32, 4), (32, 64, 3)]
    x = torch.randn(2, 3, 50, 64)
    x[:, 1, :, 5] *= 30
    perm = codec.choose_permutation(x)
    assert perm.shape == (3, 64) and int(perm[1, 0]) == 5
    assert sorted(perm[0].tolist()) == list(range(64))
    assert len(HeadCodec(64, 3.5, split="rotated").groups) == 1


def test_crop_into_window_codes_and_sinks() -> None:
    _, k, v = _data(b=1, t=100)
    layer = _layer(4, window=10)
    layer.update(k, v)
    assert (layer.sink_keys.shape[2], layer.key_store.length, layer.keys.shape[2]) == (4, 86, 10)
    layer.crop(-5)
    assert (layer.key_store.length, layer.keys.shape[2]) == (86, 5)
    layer.crop(-20)
    assert (layer.key_store.length, layer.keys.shape[2]) == (71, 0)
    assert layer.get_seq_length() == 75
    handle, _ = layer.update(k[:, :, 75:76], v[:, :, 75:76])
    assert handle.n_codes == 71 and handle.kv_length == 76
    layer.crop(-74)
    assert (layer.sink_keys.shape[2], layer.key_store.length, layer.keys.shape[2]) == (2, 0, 0)
    with pytest.raises(ValueError):
        layer.crop(3)


def test_batch_reorder_follows_rows() -> None:
    _, k, v = _data(b=2, t=30)
    layer = _layer(4, window=4)
    layer.update(k, v)
    packed = layer.key_store.fields[0]["packed"].clone()
    layer.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.key_store.fields[0]["packed"], packed.flip(0))
    assert math.isclose(float(layer.key_mean[0, 0, 0]), float(k[1, 0, 4:].mean(0)[0]), rel_tol=1e-5)
