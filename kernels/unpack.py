"""Triton helpers that read the packed layout of :mod:`tqvec.packing` in registers.

A *segment* is passed as constexprs ``(DIM, BITS, NBYTES)`` plus a runtime byte offset: ``DIM``
channels of ``BITS`` bits, ``NBYTES = ceil(DIM * BITS / 8)`` bytes per row. Channel ``j``'s code is
stream bits ``[j*BITS, (j+1)*BITS)``, least significant bit first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from tqvec.packing import Layout
    from tqvec.scan import CodeTable


@triton.jit
def _spread_bytes(raw, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(BLOCK_N, BLOCK_D * BITS // 8)`` int32 bytes → ``(BLOCK_N, BLOCK_D)`` codes, for BITS in {1, 2, 4, 8}."""
    if BITS == 8:
        codes = raw
    elif BITS == 4:
        codes = tl.reshape(tl.join(raw & 15, raw >> 4), (BLOCK_N, BLOCK_D))
    elif BITS == 2:
        # join adds a new minor axis: join(join(c0, c2), join(c1, c3))[i, a, b] = c[2a + b]
        codes = tl.join(tl.join(raw & 3, (raw >> 4) & 3), tl.join((raw >> 2) & 3, raw >> 6))
        codes = tl.reshape(codes, (BLOCK_N, BLOCK_D))
    else:
        even = tl.join(tl.join(raw & 1, (raw >> 4) & 1), tl.join((raw >> 2) & 1, (raw >> 6) & 1))
        odd = tl.join(tl.join((raw >> 1) & 1, (raw >> 5) & 1), tl.join((raw >> 3) & 1, raw >> 7))
        codes = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_D))
    return codes


@triton.jit
def row_bytes(row_ptrs, row_mask, byte0, offs, NBYTES: tl.constexpr):
    """Bytes ``byte0 + offs`` of each row as loaded (uint8) ``(BLOCK_N, len(offs))``; masked rows and ``offs`` past
    ``NBYTES`` read 0."""
    mask = row_mask[:, None] & (offs < NBYTES)[None, :]
    return tl.load(row_ptrs[:, None] + (byte0 + offs)[None, :], mask=mask, other=0)


@triton.jit
def _load_bytes(row_ptrs, row_mask, byte0, offs, NBYTES: tl.constexpr):
    """:func:`row_bytes` as int32."""
    return row_bytes(row_ptrs, row_mask, byte0, offs, NBYTES).to(tl.int32)


@triton.jit
def _zero_past_dim(values, d0, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """``values`` ``(BLOCK_N, BLOCK_D)`` of channels ``d0 .. d0 + BLOCK_D`` with the channels past ``DIM`` set to 0."""
    channel = d0 + tl.arange(0, BLOCK_D)
    return tl.where((channel < DIM)[None, :], values, 0.0)


@triton.jit
def unpack_codes(
    row_ptrs,
    row_mask,
    byte0,
    d0,
    DIM: tl.constexpr,
    BITS: tl.constexpr,
    NBYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Codes ``(BLOCK_N, BLOCK_D)`` int32 of channels ``d0 .. d0 + BLOCK_D`` of one segment.

    ``row_ptrs`` ``(BLOCK_N,)`` point at the first byte of each packed row, ``byte0`` is the
    segment's first byte in the row. Channels past ``DIM`` and masked rows read as code 0.
    """
    if BITS == 1 or BITS == 2 or BITS == 4 or BITS == 8:
        CHUNK_BYTES: tl.constexpr = BLOCK_D * BITS // 8
        raw = _load_bytes(row_ptrs, row_mask, byte0, d0 * BITS // 8 + tl.arange(0, CHUNK_BYTES), NBYTES)
        codes = _spread_bytes(raw, BITS, BLOCK_N, BLOCK_D)
    else:
        channel = d0 + tl.arange(0, BLOCK_D)
        bit = channel * BITS
        byte = bit // 8
        mask = row_mask[:, None] & (channel < DIM)[None, :]
        ptrs = row_ptrs[:, None] + (byte0 + byte)[None, :]
        low = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        high = tl.load(ptrs + 1, mask=mask & (byte + 1 < NBYTES)[None, :], other=0).to(tl.int32)
        codes = ((low | (high << 8)) >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
    return codes


@triton.jit
def segment_values(
    row_ptrs,
    row_mask,
    byte0,
    d0,
    levels_ptr,
    DIM: tl.constexpr,
    BITS: tl.constexpr,
    NBYTES: tl.constexpr,
    SIGNS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Decoded values ``(BLOCK_N, BLOCK_D)`` float32 (see :func:`lookup`); channels past ``DIM`` are 0."""
    codes = unpack_codes(row_ptrs, row_mask, byte0, d0, DIM, BITS, NBYTES, BLOCK_N, BLOCK_D)
    return _zero_past_dim(lookup(codes, levels_ptr, BITS, SIGNS), d0, DIM, BLOCK_D)


@triton.jit
def lookup(codes, levels_ptr, BITS: tl.constexpr, SIGNS: tl.constexpr):
    """Float32 values of int32 ``codes`` (any shape): codebook levels, or ±1 QJL signs when ``SIGNS``.

    1- and 2-bit levels are selected in registers; wider codes gather from the (L1-resident) table.
    """
    if SIGNS:
        values = (codes * 2 - 1).to(tl.float32)
    elif BITS == 1:
        values = tl.where(codes != 0, tl.load(levels_ptr + 1), tl.load(levels_ptr))
    elif BITS == 2:
        low = tl.where((codes & 1) != 0, tl.load(levels_ptr + 1), tl.load(levels_ptr))
        high = tl.where((codes & 1) != 0, tl.load(levels_ptr + 3), tl.load(levels_ptr + 2))
        values = tl.where(codes >= 2, high, low)
    else:
        values = tl.load(levels_ptr + codes)
    return values


@triton.jit
def segment_matvec(
    acc,
    q_ptrs,
    row_ptrs,
    row_mask,
    byte0,
    levels_ptr,
    DIM: tl.constexpr,
    BITS: tl.constexpr,
    NBYTES: tl.constexpr,
    SIGNS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    ASM: tl.constexpr,
):
    """``acc`` ``(BLOCK_N,)`` + ⟨query, decoded segment of each row⟩ in float32 on CUDA cores.

    ``q_ptrs`` points at the query's first channel of the segment. For BITS in {1, 2, 4, 8}: ``BLOCK_B``
    bytes per step, whose ``8 // BITS`` codes each meet the matching strided query channels, with no
    reshapes (reading int32 words instead was slower on the H200); other widths decode
    ``BLOCK_B`` channels per step with :func:`segment_values`. Channels past ``DIM`` meet query 0.

    ``ASM`` (4-bit codes only, :func:`nibble_pair_asm` of the segment's levels): levels decoded by byte permutes as
    float16 (rounded to 11 significant bits) instead of gathered as float32, products and sums in float32.
    """
    if BITS == 4 and ASM != "":
        part = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
        for b0 in range(0, NBYTES, BLOCK_B):
            byte = b0 + tl.arange(0, BLOCK_B)
            low, high = nibble_pairs(row_bytes(row_ptrs, row_mask, byte0, byte, NBYTES), levels_ptr, ASM)
            q_even = tl.load(q_ptrs + 2 * byte, mask=2 * byte < DIM, other=0.0)
            q_odd = tl.load(q_ptrs + 2 * byte + 1, mask=2 * byte + 1 < DIM, other=0.0)
            part += low.to(tl.float32) * q_even[None, :] + high.to(tl.float32) * q_odd[None, :]
        acc += tl.sum(part, axis=1)
    elif BITS == 1 or BITS == 2 or BITS == 4 or BITS == 8:
        PER: tl.constexpr = 8 // BITS
        for b0 in range(0, NBYTES, BLOCK_B):
            byte = b0 + tl.arange(0, BLOCK_B)
            raw = _load_bytes(row_ptrs, row_mask, byte0, byte, NBYTES)
            part = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
            for s in tl.static_range(PER):
                channel = byte * PER + s
                q = tl.load(q_ptrs + channel, mask=channel < DIM, other=0.0)
                part += lookup((raw >> (s * BITS)) & ((1 << BITS) - 1), levels_ptr, BITS, SIGNS) * q[None, :]
            acc += tl.sum(part, axis=1)
    else:
        for d0 in range(0, DIM, BLOCK_B):
            channel = d0 + tl.arange(0, BLOCK_B)
            q = tl.load(q_ptrs + channel, mask=channel < DIM, other=0.0)
            v = segment_values(row_ptrs, row_mask, byte0, d0, levels_ptr, DIM, BITS, NBYTES, SIGNS, BLOCK_N, BLOCK_B)
            acc += tl.sum(v * q[None, :], axis=1)
    return acc


@triton.jit
def pair_lut_values(
    row_ptrs,
    row_mask,
    byte0,
    d0,
    lut_ptr,
    DIM: tl.constexpr,
    NBYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Float16 levels ``(BLOCK_N, BLOCK_D)`` of a 4-bit segment, one table load per byte.

    ``lut_ptr`` holds 256 int32: entry ``b`` packs float16 ``level[b & 15]`` (low half) and
    ``level[b >> 4]`` (high half), the two channels stored in byte ``b``.
    """
    CHUNK_BYTES: tl.constexpr = BLOCK_D // 2
    pair = tl.load(lut_ptr + _load_bytes(row_ptrs, row_mask, byte0, d0 // 2 + tl.arange(0, CHUNK_BYTES), NBYTES))
    low = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    high = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return _zero_past_dim(tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_D)), d0, DIM, BLOCK_D)


def lop3_lut(f) -> int:
    """``lop3`` truth table of the three-input bitwise function ``f(a, b, c)``."""
    return f(0xF0, 0xCC, 0xAA) & 0xFF


def one_4bit_segment(layout: Layout) -> bool:
    """True when ``layout`` is one segment of 4-bit codes, the rows the byte-permute decoders read."""
    return len(layout.segments) == 1 and layout.segments[0][1] == 4


def nibble_pair_asm(levels: torch.Tensor) -> str:
    """PTX for ``tl.inline_asm_elementwise(pack=4)`` with two float16 outputs: 4 uint8 bytes in ``$4`` → the levels of
    their low nibbles in ``$0`` (elements 0, 1), ``$1`` (2, 3) and of their high nibbles in ``$2``, ``$3``; ``""`` when
    not applicable (and on ROCm builds of torch, whose GPUs take no PTX).

    Needs a symmetric 16-level codebook (``level[c] = −level[15 − c]`` in float16; ``level[8 + j] ≥ 0``). Each code's
    magnitude index ``j`` (``c − 8``, or ``7 − c`` below 8) is formed for all eight nibbles at once, in place; ``prmt``
    looks up the low and the high bytes of ``level[8 + j]`` in 8-byte tables, four nibbles per selector word (two
    words); codes below 8 get the sign bit in their high bytes, and four byte permutes pair the bytes into float16
    levels: 18 instructions per 8 levels.
    """
    if torch.version.hip is not None:
        return ""
    half = levels[:16].to(torch.float16).cpu()
    if half.numel() != 16 or not torch.equal(half, -half.flip(0)) or bool((half[8:] < 0).any()):
        return ""
    bits = [int(v) & 0xFFFF for v in half[8:].view(torch.int16).tolist()]
    word = lambda values: sum((v & 0xFF) << (8 * i) for i, v in enumerate(values))  # noqa: E731
    lo0, lo1 = word(bits[:4]), word(bits[4:])
    hi0, hi1 = word([b >> 8 for b in bits[:4]]), word([b >> 8 for b in bits[4:]])
    return (
        "{ .reg .b32 n, m, j, k, u, a, b, c, d, x, y, z, t, s; "
        # n: 8 in the nibbles of codes below 8 (negative levels); j = (c ^ 7·[c < 8]) & 7 for the nibbles of $4, in
        # place: selector words j (bytes 0, 1: nibbles c0 d0 c1 d1) and k (bytes 2, 3)
        f"lop3.b32 n, $4, 0x88888888, 0, {lop3_lut(lambda a, b, c: ~a & b):#x}; shr.b32 m, n, 3; sub.u32 m, n, m; "
        f"lop3.b32 j, $4, m, 0x77777777, {lop3_lut(lambda a, b, c: (a ^ b) & c):#x}; shr.b32 k, j, 16; "
        f"mov.b32 a, {lo0:#x}; mov.b32 b, {lo1:#x}; mov.b32 c, {hi0:#x}; mov.b32 d, {hi1:#x}; "
        "prmt.b32 x, a, b, j; prmt.b32 y, c, d, j; prmt.b32 z, a, b, k; prmt.b32 t, c, d, k; "
        # sign bits: byte i of y / t is the high byte of nibble i of j / k; n << 4 holds low nibbles' flags at bit 7
        # of their bytes, n the high nibbles'
        "shl.b32 u, n, 4; prmt.b32 s, u, n, 0x5140; "
        f"lop3.b32 y, y, s, 0x80808080, {lop3_lut(lambda a, b, c: a | (b & c)):#x}; prmt.b32 s, u, n, 0x7362; "
        f"lop3.b32 t, t, s, 0x80808080, {lop3_lut(lambda a, b, c: a | (b & c)):#x}; "
        "prmt.b32 $0, x, y, 0x6240; prmt.b32 $1, z, t, 0x6240; prmt.b32 $2, x, y, 0x7351; prmt.b32 $3, z, t, 0x7351; }"
    )


@triton.jit
def nibble_pairs(raw, levels_ptr, ASM: tl.constexpr):
    """Float16 levels of the low and of the high nibbles of uint8 ``raw`` (any shape; a 4-bit segment's bytes: channels
    ``2·byte`` and ``2·byte + 1``), by :func:`nibble_pair_asm`'s ``ASM`` when given, else gathered from ``levels_ptr``."""
    if ASM != "":
        low, high = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [raw], dtype=(tl.float16, tl.float16), is_pure=True,
                                              pack=4)
    else:
        code = raw.to(tl.int32)
        low = tl.load(levels_ptr + (code & 15)).to(tl.float16)
        high = tl.load(levels_ptr + (code >> 4)).to(tl.float16)
    return low, high


def table_nibble_pair_asm(table: CodeTable) -> str:
    """:func:`nibble_pair_asm` of ``table``'s levels, cached on the table; ``""`` unless its layout is one 4-bit segment.

    The first call reads the levels on the host, which CUDA graph capture forbids: code that a graph may record calls
    it beforehand (:func:`tqvec.kernels.attention.prepare`)."""
    key = "tqvec.kernels.nibble_pair_asm"
    if key not in table._luts:
        table._luts[key] = nibble_pair_asm(table.levels[0]) if one_4bit_segment(table.layout) else ""
    return table._luts[key]
