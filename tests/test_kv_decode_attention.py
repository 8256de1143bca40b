"""Decode attention over codes: ``scan.attend`` (torch, and the Triton kernels under the interpreter) against
the general per-head path :func:`tqvec.kv.attention.compressed_attention` and against exact attention."""
from __future__ import annotations

import copy

import pytest
import torch

from tqvec import scan
from tqvec.kv import TurboQuantLayer, attention
from tqvec.kv.attention import compressed_attention, decode_step
from tqvec.kv.codec import HeadCodec

kernels = pytest.importorskip("tqvec.kernels.attention")
from kernel_env import KERNEL_DEVICE  # noqa: E402
from ptx_emulator import run_ptx  # noqa: E402

pytestmark = pytest.mark.gpu

from tqvec.kernels import unpack  # noqa: E402


def _layer(bits: float, d: int, tokens: int, batch: int = 1, heads: int = 2, window: int = 8, sinks: int = 2,
           split: str = "rotated", seed: int = 0, device: str = "cpu") -> tuple[object, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(batch, heads, tokens, d, generator=g) + 0.5).to(device)
    v = (torch.randn(batch, heads, tokens, d, generator=g) - 0.25).to(device)
    layer = TurboQuantLayer(HeadCodec(d, bits, split=split), HeadCodec(d, bits, split=split, seed=1000), window, sinks,
                            compress_chunk=1)  # short streams: compress whatever leaves the window
    layer.update(k[:, :, :-1], v[:, :, :-1])
    handle, _ = layer.update(k[:, :, -1:], v[:, :, -1:])
    return handle, k, v, g


def _query(handle, group: int, g: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    b, h, _, d = handle.keys.shape
    return (2 * torch.randn(b, h * group, 1, d, generator=g)).to(handle.keys.device, dtype)


@pytest.mark.parametrize("bits", [4, 3.5, 2, 3])
def test_torch_attend_equals_per_head_path(bits):
    handle, _, _, g = _layer(bits, 32, 150)
    q = _query(handle, 4, g)
    step = decode_step(handle, q, None, 32 ** -0.5)
    assert step is not None
    ref = compressed_attention(handle, q, None, 32 ** -0.5)
    out = scan.attend(step).reshape(q.shape)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_torch_attend_with_padding_mask_equals_per_head_path():
    handle, _, _, g = _layer(4, 32, 120, batch=2)
    q = _query(handle, 2, g)
    mask = torch.ones(2, 1, 1, handle.kv_length, dtype=torch.bool)
    mask[1, ..., :37] = False  # row 1 left-padded: a sink and some coded tokens masked out
    ref = compressed_attention(handle, q, mask, 0.2)
    out = scan.attend(decode_step(handle, q, mask, 0.2)).reshape(q.shape)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_attend_is_close_to_exact_attention_at_8_bits():
    """8-bit codes: relative output error below 2 % (per-coordinate 8-bit Lloyd–Max error ≈ 3e-4 of a unit vector's
    energy, so logits move by ~1e-2 at these scales)."""
    handle, k, v, g = _layer(8, 64, 300, heads=2)
    q = _query(handle, 2, g)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    out = scan.attend(decode_step(handle, q, None, 64 ** -0.5)).reshape(q.shape)
    assert ((out - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("bits,d,group,tokens,dtype", [
    (4, 32, 4, 150, torch.float32), (4, 64, 2, 77, torch.float16), (3.5, 32, 1, 40, torch.float32),
    (2, 48, 3, 61, torch.bfloat16), (3, 32, 4, 19, torch.float32), (1, 32, 2, 90, torch.float32),
])
def test_kernels_equal_torch_reference(bits, d, group, tokens, dtype):
    """Triton kernels (on CUDA, or the interpreter on CPU) vs the torch reference. The kernels round the queries, the
    rotation matrices, the levels, the probabilities and the value accumulators (divided by their softmax mass) to
    float16 (relative 2⁻¹¹ each): 3e-3 relative error bound, plus the output dtype's own rounding for float16/bfloat16
    queries (bfloat16: 2⁻⁸)."""
    handle, _, _, g = _layer(bits, d, tokens, batch=2, device=KERNEL_DEVICE)
    q = _query(handle, group, g, dtype)
    mask = torch.ones(2, 1, 1, handle.kv_length, dtype=torch.bool, device=KERNEL_DEVICE)
    mask[0, ..., :5] = False
    for m in (None, mask):
        step = decode_step(handle, q, m, d ** -0.5)
        ref = scan._attend_torch(step).float()
        out = kernels.decode_attention(step).float()
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert ((out - ref).norm() / ref.norm()).item() < 3e-3 + (1e-2 if dtype != torch.float32 else 0)


def test_direct_launches_on_cuda_match_and_follow_alignment():
    """After the first call of a specialization the kernels are launched directly on CUDA (never under the
    interpreter); a query 2 bytes off a 16-byte boundary is a new specialization, not the aligned kernel reused."""
    handle, _, _, g = _layer(4, 64, 120, batch=2, device=KERNEL_DEVICE)
    q = _query(handle, 2, g, torch.float16)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    shifted.copy_(q)
    before = kernels.SPLIT.direct_launches, kernels.COMBINE.direct_launches
    for query in (q, q, q, shifted, shifted):
        step = decode_step(handle, query, None, 64 ** -0.5)
        ref = scan._attend_torch(step).float()
        out = kernels.decode_attention(step).float()
        assert ((out - ref).norm() / ref.norm()).item() < 3e-3 + 1e-2  # float16 queries: as above
    split = kernels.SPLIT.direct_launches - before[0]
    combine = kernels.COMBINE.direct_launches - before[1]
    # CUDA: the split kernel is compiled for the first aligned and the first shifted call and launched directly on the
    # three others; the combine kernel (the same specialization throughout, maybe compiled by an earlier test) on at
    # least the last four
    assert (split, combine >= 4) == ((0, False) if KERNEL_DEVICE == "cpu" else (3, True))


def test_layer_keeps_its_bound_launch_while_its_codes_stay_put(monkeypatch: pytest.MonkeyPatch):
    """A layer's one-token steps reuse one bound launch (:class:`~tqvec.kernels.attention.DecodeLaunch`) while its codes
    grow in place, make a new one when the codes are reallocated (a growth), when the mask's presence or the kernels'
    tuning changes, and match the per-head reference at every step; a batch reorder drops it, and a cache that ran
    steps still deep-copies."""
    g = torch.Generator().manual_seed(3)
    d, heads, group = 32, 2, 2
    layer = TurboQuantLayer(HeadCodec(d, 4), HeadCodec(d, 4, seed=1000), window=8, sinks=2, compress_chunk=4)
    kv = lambda t: (torch.randn(2, heads, t, d, generator=g).to(KERNEL_DEVICE) for _ in range(2))  # noqa: E731
    layer.update(*kv(40))  # 30 tokens coded, in a store of exactly that capacity
    launches, capacities = [], []
    for step in range(11):
        handle, _ = layer.update(*kv(1))
        capacities.append(layer.key_store.capacity)
        q = _query(handle, group, g)
        mask = None
        if step >= 8:  # padding from here on: a launch that takes a validity row
            mask = torch.ones(2, 1, 1, handle.kv_length, dtype=torch.bool, device=KERNEL_DEVICE)
            mask[1, ..., :3] = False
        if step == 10:
            monkeypatch.setattr(kernels, "NUM_WARPS", kernels.NUM_WARPS * 2)
        out = attention._kernel_decode(handle, q, mask, d ** -0.5)
        ref = compressed_attention(handle, q, mask, d ** -0.5)
        assert ((out - ref).norm() / ref.norm()).item() < 3e-3
        launches.append(attention._LAUNCHES[layer][2])
    # the window (8 tokens) reaches 12 at steps 3 and 7: the first compression grows the store, the second fills it in
    # place (same launch); the mask at step 8 and the tuning at step 10 need new launches
    assert capacities[2] < capacities[3] == capacities[7]
    assert [i for i in range(1, 11) if launches[i] is not launches[i - 1]] == [3, 8, 10]
    with pytest.raises(ValueError, match="do not match"):
        launches[-1](_query(handle, 4, g).reshape(2, heads, 4, d), handle.keys, handle.values, handle.n_codes, None)
    assert copy.deepcopy(layer).key_store.length == layer.key_store.length
    layer.batch_select_indices(torch.tensor([1, 0], device=KERNEL_DEVICE))
    assert layer not in attention._LAUNCHES


def test_a_launch_that_copies_a_tensor_says_so():
    """A step whose sinks are not contiguous is bound to a copy of them: ``copied``, so a cache does not keep it."""
    handle, _, _, g = _layer(4, 32, 60, batch=2, device=KERNEL_DEVICE)
    step = decode_step(handle, _query(handle, 2, g), None, 0.1)
    assert not kernels.DecodeLaunch(step).copied
    strided = step.sink_keys.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert kernels.DecodeLaunch(scan.DecodeAttention(**{**step.__dict__, "sink_keys": strided})).copied


def test_decode_step_declines_what_it_cannot_run():
    handle, _, _, g = _layer(3.5, 32, 60, split="outlier")
    step = decode_step(handle, _query(handle, 2, g), None, 0.1)  # two channel groups: served on the CPU only
    assert step is not None and len(step.key_segments) == 1
    if torch.cuda.is_available():  # the Triton kernels read one group per side
        handle, _, _, g = _layer(3.5, 32, 60, split="outlier", device="cuda")
        assert decode_step(handle, _query(handle, 2, g), None, 0.1) is None
    handle, _, _, g = _layer(4, 32, 60)
    assert decode_step(handle, torch.randn(1, 4, 2, 32), None, 0.1) is None  # two query tokens


def test_attend_rejects_a_wrong_mask():
    handle, _, _, g = _layer(4, 32, 60)
    step = decode_step(handle, _query(handle, 2, g), torch.ones(1, 1, 1, handle.kv_length, dtype=torch.bool), 0.1)
    bad = scan.DecodeAttention(**{**step.__dict__, "valid": torch.ones(1, 5, dtype=torch.bool)})
    with pytest.raises(ValueError, match="valid"):
        scan.attend(bad)


def test_nibble_pair_asm_decodes_every_code():
    """The PTX decoder of 4-bit levels, executed by a small emulator: bit-exact float16 levels of both nibbles of every
    byte lane, all 256 byte values (runs on the GPU only on CUDA; this checks its arithmetic on CPU)."""
    levels = HeadCodec(128, 4).groups[0].quantizer.table("cpu").levels[0]
    asm = unpack.nibble_pair_asm(levels)
    assert asm
    expected = levels[:16].half().view(torch.int16).int() & 0xFFFF
    halves = lambda word: [word & 0xFFFF, word >> 16]  # noqa: E731
    for first in range(256):
        data = [(first + i * 67) % 256 for i in range(4)]  # every byte value in every lane
        lo0, lo1, hi0, hi1 = run_ptx(asm, {"$4": sum(v << (8 * i) for i, v in enumerate(data))}, ["$0", "$1", "$2", "$3"])
        assert halves(lo0) + halves(lo1) == [int(expected[v & 15]) for v in data]
        assert halves(hi0) + halves(hi1) == [int(expected[v >> 4]) for v in data]


def test_nibble_pair_asm_declines_an_asymmetric_codebook():
    levels = HeadCodec(128, 4).groups[0].quantizer.table("cpu").levels[0].clone()
    levels[3] += 1e-2
    assert unpack.nibble_pair_asm(levels) == ""


def test_nibble_pair_asm_declines_rocm(monkeypatch: pytest.MonkeyPatch):
    """PTX does not run on AMD GPUs: a ROCm build of torch gets the table-gather paths."""
    levels = HeadCodec(128, 4).groups[0].quantizer.table("cpu").levels[0]
    assert unpack.nibble_pair_asm(levels)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert unpack.nibble_pair_asm(levels) == ""
