"""The native CPU decode attention (tqvec._fastscan.decode_step) against the torch path of tqvec.scan.attend.

Both compute the same softmax over the same coded and exact tokens (the native kernel with exact float tables,
torch by decoding the codes): outputs agree to float32 rounding of sums over the context (tolerance 1e-4 relative to
the output's scale).
"""
from __future__ import annotations

import pytest
import torch

from tqvec import TurboQuantizer, _fastscan, scan
from tqvec.kv.attention import compressed_attention, decode_step
from tqvec.kv.cache import TurboQuantLayer
from tqvec.kv.codec import HeadCodec

pytestmark = pytest.mark.skipif(not _fastscan.available(), reason="the native extension is not built")
HEAD_DIM, KV_HEADS, QUERY_HEADS = 64, 2, 6


def _step(bits: float, batch: int, context: int, window: int, seed: int,
          value_bits: float | None = None) -> scan.DecodeAttention:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=gen) + 0.5
    values = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=gen)
    query = torch.randn(batch, QUERY_HEADS, 1, HEAD_DIM, generator=gen)
    layer = TurboQuantLayer(HeadCodec(HEAD_DIM, bits), HeadCodec(HEAD_DIM, value_bits or bits, seed=1000), window)
    layer.update(keys[:, :, :-1], values[:, :, :-1])
    handle, _ = layer.update(keys[:, :, -1:], values[:, :, -1:])
    step = decode_step(handle, query, None, HEAD_DIM ** -0.5)
    assert step is not None and step.n_codes > 0
    return step


def _both(step: scan.DecodeAttention) -> tuple[torch.Tensor, torch.Tensor]:
    before = _fastscan.cpu_kernel()
    try:
        _fastscan.set_cpu_kernel("torch")
        reference = scan.attend(step)
        _fastscan.set_cpu_kernel("auto")
        native = scan.attend(step)
    finally:
        _fastscan.set_cpu_kernel(before)
    return reference, native


@pytest.mark.parametrize("bits", [1, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8])  # fractional: two channel groups (segments)
def test_native_decode_attention_equals_torch(bits: float) -> None:
    reference, native = _both(_step(bits, batch=2, context=300, window=16, seed=int(bits * 10)))
    assert native.shape == reference.shape == (2, KV_HEADS, QUERY_HEADS // KV_HEADS, HEAD_DIM)
    assert torch.allclose(native, reference, rtol=0, atol=1e-4 * reference.abs().max().item())


@pytest.mark.parametrize("key_bits,value_bits", [(4, 1), (1, 2), (2, 4), (4, 3), (2.5, 3.5), (3.5, 4)])
def test_native_decode_attention_mixes_key_and_value_widths(key_bits: float, value_bits: float) -> None:
    """Keys and values of different widths (each byte one look-up of 2, 4 or 8 levels, or 3-bit codes across bytes;
    fractional rates: two segments whose kinds differ between the sides, or two on one side and one on the other)
    agree with the torch path."""
    reference, native = _both(_step(key_bits, batch=2, context=300, window=16, seed=int(key_bits * 10 + value_bits),
                                    value_bits=value_bits))
    assert torch.allclose(native, reference, rtol=0, atol=1e-4 * reference.abs().max().item())


@pytest.mark.parametrize("bits", [4, 3, 2.5, 8])  # one segment by vectors, a run of 3-bit codes, two segments, rows
def test_native_decode_attention_masks_tokens(bits: float) -> None:
    """Masked coded tokens, and a batch row whose coded tokens are all masked, agree with the torch path."""
    step = _step(bits, batch=2, context=200, window=8, seed=3)
    valid = torch.ones(2, step.sink_keys.shape[2] + step.n_codes + step.window_keys.shape[2], dtype=torch.bool)
    valid[0, 10:150] = False
    valid[1, step.sink_keys.shape[2]:step.sink_keys.shape[2] + step.n_codes] = False
    reference, native = _both(scan.DecodeAttention(**{**step.__dict__, "valid": valid}))
    assert torch.allclose(native, reference, rtol=0, atol=1e-4 * reference.abs().max().item())
    unmasked, _ = _both(step)
    assert not torch.allclose(reference, unmasked, atol=1e-3)  # the mask changed the answer


def _native_step(step: scan.DecodeAttention, **change) -> torch.Tensor:
    """:func:`_fastscan.decode_step` on ``step``'s tensors, with ``change`` replacing some of its arguments."""
    segments = lambda parts: [(c.packed, c.scale, c.table.native_plan(), c.table.layout.dim) for c in parts]  # noqa: E731
    args = {"queries": step.queries.float() * step.scaling, "key_rotation": step.key_rotation,
            "value_back": step.value_back, "keys": segments(step.key_parts), "values": segments(step.value_parts),
            "n": step.n_codes, "key_mean": step.key_mean, "value_mean": step.value_mean,
            "sinks": (step.sink_keys, step.sink_values), "window": (step.window_keys, step.window_values),
            "valid": step.valid}
    return _fastscan.decode_step(**{**args, **change})


def test_native_decode_attention_rejects_bad_shapes() -> None:
    step = _step(4, batch=1, context=50, window=4, seed=5)
    plan = step.keys.table.native_plan()
    keys = [(step.keys.packed, step.keys.scale, plan, HEAD_DIM)]
    assert torch.allclose(_native_step(step), _both(step)[0], atol=1e-5)
    with pytest.raises(ValueError, match="scales must be"):
        _native_step(step, keys=[(step.keys.packed, step.keys.scale[:, :, :5], plan, HEAD_DIM)], n=10)
    with pytest.raises(ValueError, match="codes must be"):
        _native_step(step, n=step.keys.packed.shape[2] + 1)
    with pytest.raises(ValueError, match="fewer channels"):  # two segments of HEAD_DIM channels: wider than the rotation
        _native_step(step, keys=keys * 2)
    with pytest.raises(ValueError, match="key_rotation must be"):
        _native_step(step, key_rotation=step.key_rotation[:32])
    with pytest.raises(ValueError, match="value_back must be"):
        _native_step(step, value_back=step.value_back.expand(3, -1, -1))
    with pytest.raises(ValueError, match="means must be"):
        _native_step(step, key_mean=step.key_mean[:, :, :8])
    with pytest.raises(ValueError, match="exact keys and values"):
        _native_step(step, window=(step.window_keys, step.window_values[:, :, :1]))
    with pytest.raises(ValueError, match="valid must be"):
        _native_step(step, valid=torch.ones(1, 3, dtype=torch.bool))


def test_native_decode_attention_masks_every_token_to_zero() -> None:
    """A batch row with every token masked (coded and exact) gets a zero output, as in the torch path."""
    step = _step(4, batch=2, context=100, window=8, seed=7)
    valid = torch.ones(2, step.sink_keys.shape[2] + step.n_codes + step.window_keys.shape[2], dtype=torch.bool)
    valid[1] = False
    reference, native = _both(scan.DecodeAttention(**{**step.__dict__, "valid": valid}))
    assert torch.equal(native[1], torch.zeros_like(native[1])) and torch.equal(reference[1], native[1])
    assert native[0].abs().sum() > 0


@pytest.mark.parametrize("bits", [2.5, 3.5])
def test_grouped_decode_step_equals_the_per_head_reference(bits: float) -> None:
    """Fractional rates code the outlier channels (a per-head order) apart from the rest: the one-step attention over
    both groups (natively and in torch) equals the per-head path's, which scores each group on its own."""
    step = _step(bits, batch=2, context=300, window=16, seed=int(bits * 10))
    assert len(step.key_segments) == len(step.value_segments) == 1 and step.key_rotation.dim() == 3
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, KV_HEADS, 300, HEAD_DIM, generator=gen) + 0.5
    keys[..., 7] *= 6  # a loud channel, which the outlier group takes first
    values = torch.randn(2, KV_HEADS, 300, HEAD_DIM, generator=gen)
    query = torch.randn(2, QUERY_HEADS, 1, HEAD_DIM, generator=gen)
    layer = TurboQuantLayer(HeadCodec(HEAD_DIM, bits, rescale=True), HeadCodec(HEAD_DIM, bits, seed=1000), 16)
    layer.update(keys[:, :, :-1], values[:, :, :-1])
    handle, _ = layer.update(keys[:, :, -1:], values[:, :, -1:])
    assert not torch.equal(layer.key_perm[0], torch.arange(HEAD_DIM))
    reference = compressed_attention(handle, query, None, HEAD_DIM ** -0.5)
    torch_path, native = _both(decode_step(handle, query, None, HEAD_DIM ** -0.5))
    for out in (torch_path, native):
        got = out.reshape(reference.shape)
        assert torch.allclose(got, reference, rtol=0, atol=1e-4 * reference.abs().max().item())


@pytest.mark.parametrize("dim,bits", [(64, 2.5), (37, 3), (45, 2.5), (40, 3.5)])
def test_native_decode_attention_reads_mixed_and_partial_three_bit_layouts(dim: int, bits: float) -> None:
    """One plan that mixes 3-bit codes (decoded 8 channels per 3 bytes) with others (a fractional rate in one
    quantizer), and 3-bit channels past the last whole group of 8: the native output equals the softmax over the
    decoded levels (no rotation, no exact tokens)."""
    quantizer = TurboQuantizer(dim, bits, seed=3)
    gen = torch.Generator().manual_seed(5)
    heads, group, n = 2, 3, 50
    codes = quantizer.encode(torch.randn(heads * n, dim, generator=gen))
    table, width = quantizer.table("cpu"), quantizer.layout.dim
    packed = codes.packed.view(1, heads, n, -1)
    scale = torch.rand(1, heads, n, generator=gen) + 0.5
    queries = torch.randn(1, heads, group, width, generator=gen)
    segments = [(packed, scale, table.native_plan(), width)]
    identity, zeros, none = torch.eye(width), torch.zeros(1, heads, width), torch.zeros(1, heads, 0, width)
    out = _fastscan.decode_step(queries, identity, identity, segments, segments, n, zeros, zeros, (none, none),
                                (none, none), None)
    levels = scan.dequantize(codes.packed, table).view(1, heads, n, width)
    logits = queries @ levels.transpose(2, 3) * scale[:, :, None, :]
    weights = torch.softmax(logits, -1)
    assert torch.allclose(out, weights @ (levels * scale[..., None]), rtol=1e-4, atol=1e-4)


def test_bound_step_reads_tokens_written_after_binding() -> None:
    """A :class:`_fastscan.BoundDecodeStep` reads its code buffers in place: tokens written after binding count in a
    later call with a larger ``n``, which equals an unbound :func:`_fastscan.decode_step` over the same tokens."""
    tq = TurboQuantizer(HEAD_DIM, 4, seed=0)
    gen = torch.Generator().manual_seed(11)
    capacity, first = 40, 25
    codes = tq.encode(torch.randn(KV_HEADS * capacity, HEAD_DIM, generator=gen))
    packed = codes.packed.view(1, KV_HEADS, capacity, -1)
    scales = codes.scales.half().view(1, KV_HEADS, capacity)
    buffers = torch.zeros_like(packed), torch.zeros_like(scales)
    buffers[0][:, :, :first], buffers[1][:, :, :first] = packed[:, :, :first], scales[:, :, :first]
    coded = [(buffers[0], buffers[1], tq.table("cpu").native_plan(), HEAD_DIM)]
    eye, mean = torch.eye(HEAD_DIM), torch.zeros(1, KV_HEADS, HEAD_DIM)
    none = torch.zeros(1, KV_HEADS, 0, HEAD_DIM)
    window = torch.randn(1, KV_HEADS, 3, HEAD_DIM, generator=gen), torch.randn(1, KV_HEADS, 3, HEAD_DIM, generator=gen)
    queries = torch.randn(1, KV_HEADS, 3, HEAD_DIM, generator=gen)
    bound = _fastscan.BoundDecodeStep(eye, eye, coded, coded, mean, mean, (none, none))
    before = bound(queries, first, window, None)
    buffers[0][:, :, first:], buffers[1][:, :, first:] = packed[:, :, first:], scales[:, :, first:]
    after = bound(queries, capacity, window, None)
    unbound = _fastscan.decode_step(queries, eye, eye, coded, coded, capacity, mean, mean, (none, none), window, None)
    assert torch.equal(after, unbound)
    assert not torch.allclose(after, before, atol=1e-3)  # the new tokens changed the answer
    with pytest.raises(ValueError, match=r"bound to \(1, 2\)"):
        bound(queries.expand(2, -1, -1, -1), capacity, window, None)


@pytest.mark.parametrize("bits", [4, 2.5])
def test_cache_steps_through_bound_native_steps_equal_torch(bits: float) -> None:
    """One-token steps of a cache layer on the CPU run through the layer's bound native step, bound again when the
    codes' buffers grow: each step's output equals the torch path's over the same tokens."""
    from tqvec.kv import attention  # noqa: PLC0415 - the module under test

    gen = torch.Generator().manual_seed(int(bits * 10))
    layer = TurboQuantLayer(HeadCodec(HEAD_DIM, bits), HeadCodec(HEAD_DIM, bits, seed=1000), 4)
    layer.update(torch.randn(1, KV_HEADS, 40, HEAD_DIM, generator=gen), torch.randn(1, KV_HEADS, 40, HEAD_DIM, generator=gen))
    bindings = []
    for _ in range(80):
        handle, _ = layer.update(torch.randn(1, KV_HEADS, 1, HEAD_DIM, generator=gen),
                                 torch.randn(1, KV_HEADS, 1, HEAD_DIM, generator=gen))
        query = torch.randn(1, QUERY_HEADS, 1, HEAD_DIM, generator=gen)
        assert attention._native_decodes(handle, query)
        native = attention._native_decode(handle, query, None, HEAD_DIM ** -0.5)
        if not bindings or bindings[-1] is not attention._NATIVE_STEPS[layer][1]:
            bindings.append(attention._NATIVE_STEPS[layer][1])
        reference, _ = _both(decode_step(handle, query, None, HEAD_DIM ** -0.5))
        assert torch.allclose(native, reference.reshape(native.shape), rtol=0, atol=1e-4 * reference.abs().max().item())
    assert 1 < len(bindings) < 80  # bound again on growth, not at every step
    attention.forget_launch(layer)
    assert layer not in attention._NATIVE_STEPS
