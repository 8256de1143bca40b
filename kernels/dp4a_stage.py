"""Single-query search stage 1 over one 4-bit segment by int8 dot products on CUDA cores (``dp4a``).

A row's codes are read as 32-bit words, eight 4-bit channels each. :func:`dp4a_asm` turns a word into the int8 levels
of its eight channels with byte permutes (``prmt``: four channels per permute, from the 16 levels held as immediates)
and adds their products with the query's eight int8 channels to an int32 accumulator with two ``dp4a``: 13
instructions per eight channels, against 18 for the float16 decoding of :func:`~.unpack.nibble_pair_asm` before its
eight float32 products. Levels and queries sit on the 8-bit grids of :mod:`.int8_stage` (levels · 127 / L, L the
largest level magnitude; q · 127 / max|q|), so the estimates are those of the int8 tensor-core stage and
:data:`~.ops.GROUP_MARGIN` covers them the same way. Without the PTX (the interpreter, ROCm) the levels are gathered
from the table and multiplied in int32: same integers, same results.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .unpack import lop3_lut

#: channels per 32-bit code word
CHANNELS_PER_WORD = 8


def _grid_words(levels: torch.Tensor) -> tuple[int, int, int, int]:
    """The 16 int8 grid levels as four 32-bit immediates (levels 0-3, 4-7, 8-11, 12-15, byte ``i`` = level ``i``).

    Raises
    ------
    ValueError
        ``levels`` are not 16 integers in [-127, 127].
    """
    values = levels.detach().cpu().double().flatten()
    if values.numel() != 16 or not torch.equal(values, values.round()) or bool((values.abs() > 127).any()):
        raise ValueError(f"levels must be 16 integers in [-127, 127], got {values.tolist()}")
    octets = [int(v) & 0xFF for v in values.tolist()]
    return tuple(sum(b << (8 * i) for i, b in enumerate(octets[j: j + 4])) for j in range(0, 16, 4))


def _decode_ptx(levels: torch.Tensor, word: str) -> str:
    """PTX (registers declared inside) leaving in ``v`` the int8 levels of codes 0-3 of the 32-bit ``word`` (eight
    4-bit codes, code ``c`` in bits ``4c …``; byte ``i`` of ``v`` = level of code ``i``) and in ``w`` those of codes
    4-7. Per four codes, two ``prmt`` look up ``level[c & 7]`` and ``level[8 + (c & 7)]`` in 8-byte tables, a third
    (sign-replicate selectors) turns each code's bit 3 into a byte mask, and a ``lop3`` picks by it."""
    low0, low1, high0, high1 = _grid_words(levels)
    pick = lop3_lut(lambda a, b, c: (a & ~c) | (b & c))
    # mask selectors: byte i of the mask replicates the sign bit of the byte that holds bit 3 of code i — codes 0, 2
    # (4, 6) in bytes 0, 1 (2, 3) of u = word << 4, codes 1, 3 (5, 7) in bytes 0, 1 (2, 3) of the word (pool bytes 4-7)
    return (
        ".reg .b32 l0, l1, h0, h1, s, k, u, a, b, m, v, w; "
        f"mov.b32 l0, {low0:#x}; mov.b32 l1, {low1:#x}; mov.b32 h0, {high0:#x}; mov.b32 h1, {high1:#x}; "
        f"and.b32 s, {word}, 0x77777777; shl.b32 u, {word}, 4; shr.b32 k, s, 16; "
        f"prmt.b32 a, l0, l1, s; prmt.b32 b, h0, h1, s; prmt.b32 m, u, {word}, 0xD9C8; lop3.b32 v, a, b, m, {pick:#x}; "
        f"prmt.b32 a, l0, l1, k; prmt.b32 b, h0, h1, k; prmt.b32 m, u, {word}, 0xFBEA; lop3.b32 w, a, b, m, {pick:#x}; "
    )


def _ptx_block(levels: torch.Tensor, word: str, tail: str) -> str:
    """``{ decoder of word; tail }`` (:func:`_decode_ptx`), or ``""`` on ROCm builds of torch, whose GPUs take no PTX."""
    return "" if torch.version.hip is not None else "{ " + _decode_ptx(levels, word) + tail + " }"


def dp4a_asm(levels: torch.Tensor) -> str:
    """PTX for ``tl.inline_asm_elementwise(pack=1)``: ``$0 = $4 + Σ_c level[code_c] · q_c`` over the eight 4-bit codes
    of the word ``$1`` (channel ``c`` in bits ``4c … 4c + 3``) and the int8 query channels 0-3 in ``$2``, 4-7 in
    ``$3`` (byte ``i`` = channel ``i``); ``""`` on ROCm builds of torch, whose GPUs take no PTX.

    ``levels``: the 16 levels on the int8 grid (integers in [-127, 127], any order or sign), decoded by
    :func:`_decode_ptx`; two ``dp4a`` multiply and add: 13 instructions per word.

    Raises
    ------
    ValueError
        ``levels`` are not 16 integers in [-127, 127].
    """
    return _ptx_block(levels, "$1", ".reg .b32 t; dp4a.s32.s32 t, v, $2, $4; dp4a.s32.s32 $0, w, $3, t;")


def nibble_levels_asm(levels: torch.Tensor) -> str:
    """PTX for ``tl.inline_asm_elementwise(pack=4)`` with two int8 outputs: 4 uint8 bytes in ``$2`` → the int8 levels of
    their low nibbles in ``$0`` and of their high nibbles in ``$1`` (byte ``i`` of each from input byte ``i``); ``""``
    on ROCm. :func:`_decode_ptx`, then two ``prmt`` regroup the levels: 13 instructions per 8 levels.

    Raises
    ------
    ValueError
        ``levels`` are not 16 integers in [-127, 127].
    """
    return _ptx_block(levels, "$2", "prmt.b32 $0, v, w, 0x6420; prmt.b32 $1, v, w, 0x7531;")


@triton.jit
def _signed_byte(word, i: tl.constexpr):
    """Byte ``i`` of int32 ``word`` as a signed integer."""
    return (((word >> (8 * i)) & 0xFF) ^ 0x80) - 0x80


@triton.jit
def _word_products(acc, codes, q_low, q_high, grid_ptr, ASM: tl.constexpr):
    """``acc`` + the int32 products of the code words ``codes`` with the query words ``q_low``, ``q_high`` (int32,
    same shape: channels 0-3 and 4-7 of each word's eight)."""
    if ASM != "":
        acc = tl.inline_asm_elementwise(ASM, "=r,r,r,r,r", [codes, q_low, q_high, acc], dtype=tl.int32, is_pure=True,
                                        pack=1)
    else:
        for c in tl.static_range(4):
            acc += tl.load(grid_ptr + ((codes >> (4 * c)) & 15)).to(tl.int32) * _signed_byte(q_low, c)
            acc += tl.load(grid_ptr + ((codes >> (4 * c + 16)) & 15)).to(tl.int32) * _signed_byte(q_high, c)
    return acc


@triton.jit
def dp4a_group_max_kernel(
    q_ptr, words_ptr, scale_ptr, bias_ptr, qfac_ptr, grid_ptr, unit_ptr, out_ptr,
    n, stride_q, stride_words, stride_out,
    WORDS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, TILES: tl.constexpr,
    ASM: tl.constexpr,
):
    """Program ``(query, j)``: for ``TILES`` consecutive tiles ``t`` of ``BLOCK_N`` rows, ``out[query, t]`` = the best
    over the tile's rows ``i`` of ``unit / qfac[query] · scale[i] · ⟨q8, r8_i⟩ + bias[i]`` (``q8 ≈ qfac · q``).

    ``q_ptr``: the int8 queries viewed as int32 words ``(nq, 2 · WORDS)``; ``words_ptr``: the rows' codes as int32
    words ``(n, WORDS)`` (one 4-bit segment, channel ``8w + c`` in bits ``4c …`` of word ``w``); ``grid_ptr``: the 16
    levels on the int8 grid (float32 integers, read only without ``ASM``), ``unit`` their step. ``BLOCK_W`` words per
    step. The query axis runs fastest, so the queries of a tile share its codes in L2.
    """
    query = tl.program_id(0).to(tl.int64)
    q_row = q_ptr + query * stride_q
    per_query = tl.load(unit_ptr) / tl.load(qfac_ptr + query)
    for t in range(TILES):
        tile = tl.program_id(1) * TILES + t
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n
        row_ptrs = words_ptr + rows.to(tl.int64) * stride_words
        acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32)
        for w0 in range(0, WORDS, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            w_mask = w < WORDS
            codes = tl.load(row_ptrs[:, None] + w[None, :], mask=row_mask[:, None] & w_mask[None, :], other=0)
            q_low = tl.broadcast_to(tl.load(q_row + 2 * w, mask=w_mask, other=0)[None, :], (BLOCK_N, BLOCK_W))
            q_high = tl.broadcast_to(tl.load(q_row + 2 * w + 1, mask=w_mask, other=0)[None, :], (BLOCK_N, BLOCK_W))
            acc = _word_products(acc, codes, q_low, q_high, grid_ptr, ASM)
        scores = tl.sum(acc, axis=1).to(tl.float32) * (per_query * tl.load(scale_ptr + rows, mask=row_mask, other=0.0))
        if HAS_BIAS:
            scores += tl.load(bias_ptr + rows, mask=row_mask, other=0.0)
        if tile * BLOCK_N < n:
            tl.store(out_ptr + query * stride_out + tile, tl.max(tl.where(row_mask, scores, float("-inf")), axis=0))


@triton.jit
def int8_queries_kernel(q_ptr, q8_ptr, qfac_ptr, abs_sum_ptr, stride_q, stride_q8, D: tl.constexpr,
                        CHANNELS: tl.constexpr, BLOCK: tl.constexpr):
    """One query per program: ``qfac = 127 / max(max|q|, 1e-30)``, ``q8[:CHANNELS]`` = ``⌊q · qfac + 1/2⌋`` as int8
    (zero past the ``D`` channels of ``q``) and ``abs_sum`` = ``Σ|q8|`` as int32 (what bounds the query's products)."""
    row = tl.program_id(0).to(tl.int64)
    channel = tl.arange(0, BLOCK)
    q = tl.load(q_ptr + row * stride_q + channel, mask=channel < D, other=0.0)
    qfac = 127.0 / tl.maximum(tl.max(tl.abs(q), axis=0), 1e-30)
    q8 = tl.floor(q * qfac + 0.5).to(tl.int8)
    tl.store(q8_ptr + row * stride_q8 + channel, q8, mask=channel < CHANNELS)
    tl.store(qfac_ptr + row, qfac)
    tl.store(abs_sum_ptr + row, tl.sum(tl.abs(q8.to(tl.int32)), axis=0))
