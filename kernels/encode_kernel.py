"""Triton kernel: rotated vectors → norms, codebook indices packed per :mod:`tqvec.packing`, alignment.

Input rows are ``y = Π x`` (an orthogonal rotation, so ``‖y‖ = ‖x‖``); the kernel quantizes
``u = y / ‖y‖`` (``u = 0`` for ``y = 0``) channel by channel against each segment's ascending decision
boundaries (index = number of boundaries strictly below the value, as ``torch.bucketize``), packs the
indices little-endian, and returns ``‖y‖`` and ``⟨ŷ, u⟩`` (the ``rescale`` denominator).

Segments are constexprs as in :mod:`.scan_kernel`: ``S{0,1}_CH, _DIM (0 = absent), _BITS, _NBYTES,
_BYTE, _ROW`` (row of the ``(n_segments, 256)`` boundary and level tables).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bucket(values, bounds_ptr, BITS: tl.constexpr):
    """Binary search: number of the ``2**BITS - 1`` ascending boundaries strictly below each value (int32)."""
    code = tl.zeros(values.shape, dtype=tl.int32)
    for s in tl.static_range(BITS):
        candidate = code + (1 << (BITS - 1 - s))
        bound = tl.load(bounds_ptr + candidate - 1)
        code = tl.where(values > bound, candidate, code)
    return code


@triton.jit
def _pack_segment(
    x_ptrs, row_mask, norm, out_ptrs, bounds_ptr,
    CH: tl.constexpr, DIM: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr, BYTE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Write the segment's ``NBYTES`` bytes of every row; byte ``k`` gathers the codes of the channels it overlaps."""
    MAX_CHANNELS: tl.constexpr = (8 + BITS - 1) // BITS + 1
    for b0 in range(0, NBYTES, BLOCK_B):
        byte = b0 + tl.arange(0, BLOCK_B)
        byte_mask = byte < NBYTES
        first = byte * 8 // BITS
        out = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.int32)
        for j in tl.static_range(MAX_CHANNELS):
            channel = first + j
            start = channel * BITS - byte * 8
            valid = byte_mask & (channel < DIM) & (start < 8)
            x = tl.load(x_ptrs[:, None] + (CH + channel)[None, :], mask=row_mask[:, None] & valid[None, :], other=0.0)
            code = _bucket(x.to(tl.float32) / norm[:, None], bounds_ptr, BITS)
            shifted = (code << tl.maximum(start, 0)[None, :]) >> tl.maximum(-start, 0)[None, :]
            out |= tl.where(valid[None, :], shifted & 255, 0)
        tl.store(out_ptrs[:, None] + (BYTE + byte)[None, :], out.to(tl.uint8),
                 mask=row_mask[:, None] & byte_mask[None, :])


@triton.jit
def _segment_alignment(
    acc, x_ptrs, row_mask, norm, bounds_ptr, levels_ptr,
    CH: tl.constexpr, DIM: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``acc`` ``(BLOCK_N,)`` + Σ_channels u · level(code(u)) over one segment."""
    for d0 in range(0, DIM, BLOCK_D):
        channel = d0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (channel < DIM)[None, :]
        u = tl.load(x_ptrs[:, None] + (CH + channel)[None, :], mask=mask, other=0.0).to(tl.float32) / norm[:, None]
        level = tl.load(levels_ptr + _bucket(u, bounds_ptr, BITS))
        acc += tl.sum(tl.where(mask, u * level, 0.0), axis=1)
    return acc


@triton.jit
def encode_kernel(
    x_ptr, bounds_ptr, levels_ptr, packed_ptr, norm_ptr, align_ptr, n, stride_x, stride_packed,
    D: tl.constexpr,
    S0_CH: tl.constexpr, S0_DIM: tl.constexpr, S0_BITS: tl.constexpr, S0_NBYTES: tl.constexpr,
    S0_BYTE: tl.constexpr, S0_ROW: tl.constexpr,
    S1_CH: tl.constexpr, S1_DIM: tl.constexpr, S1_BITS: tl.constexpr, S1_NBYTES: tl.constexpr,
    S1_BYTE: tl.constexpr, S1_ROW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Encode ``BLOCK_N`` rows of ``x`` ``(n, D)``: packed codes, ``norm`` ``(n,)``, ``align`` ``(n,)``."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n
    x_ptrs = x_ptr + rows.to(tl.int64) * stride_x
    sumsq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        channel = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptrs[:, None] + channel[None, :], mask=row_mask[:, None] & (channel < D)[None, :], other=0.0)
        sumsq += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
    norm = tl.sqrt(sumsq)
    divisor = tl.where(norm > 0, norm, 1.0)
    out_ptrs = packed_ptr + rows.to(tl.int64) * stride_packed
    align = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if S0_DIM > 0:
        _pack_segment(x_ptrs, row_mask, divisor, out_ptrs, bounds_ptr + S0_ROW * 256,
                      S0_CH, S0_DIM, S0_BITS, S0_NBYTES, S0_BYTE, BLOCK_N, BLOCK_B)
        align = _segment_alignment(align, x_ptrs, row_mask, divisor, bounds_ptr + S0_ROW * 256,
                                   levels_ptr + S0_ROW * 256, S0_CH, S0_DIM, S0_BITS, BLOCK_D)
    if S1_DIM > 0:
        _pack_segment(x_ptrs, row_mask, divisor, out_ptrs, bounds_ptr + S1_ROW * 256,
                      S1_CH, S1_DIM, S1_BITS, S1_NBYTES, S1_BYTE, BLOCK_N, BLOCK_B)
        align = _segment_alignment(align, x_ptrs, row_mask, divisor, bounds_ptr + S1_ROW * 256,
                                   levels_ptr + S1_ROW * 256, S1_CH, S1_DIM, S1_BITS, BLOCK_D)
    tl.store(norm_ptr + rows, norm, mask=row_mask)
    tl.store(align_ptr + rows, align, mask=row_mask)
