"""Triton kernels: rotated float queries × packed TurboQuant codes.

Score of query ``q`` (QJL projection ``p``) against row ``i`` (see :mod:`tqvec.scan`)::

    score(q, i) = scale[i] · ⟨q, ŷ_i⟩ + sign_scale[i] · ⟨p, s_i⟩ + bias[i]

* :func:`tile_kernel` scores a tile of queries against a tile of rows with ``tl.dot`` and either
  writes the scores or, for search, only each query's maximum over the tile (one float per
  query and group of ``BLOCK_N`` rows).
* :func:`matvec_kernel` is the search's first stage for a single query: float32 products on CUDA cores (levels
  exact, or decoded as float16 by byte permutes for a single 4-bit segment), writing the same per-tile maxima.
* :func:`refine_kernel` rescores, in exact float32, the rows of the groups chosen per query (and may keep
  only each group's best few, as :mod:`.topk` keys).
* :func:`half_queries_kernel` scales and casts the queries for the float16 first stage.

Segments are passed as constexprs: ``S{0,1}_CH`` first channel, ``S{0,1}_DIM`` channels (0 = absent),
``S{0,1}_BITS``, ``S{0,1}_NBYTES``, ``S{0,1}_BYTE`` first byte in the row, ``S{0,1}_ROW`` row of the
``(n_segments, 256)`` levels table.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .topk import best_keys
from .unpack import nibble_pairs, pair_lut_values, row_bytes, segment_matvec, segment_values


@triton.jit
def _decoded(
    row_ptrs, row_mask, levels_ptr, lut_ptr, d0,
    DIM: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr, BYTE: tl.constexpr, SIGNS: tl.constexpr,
    PAIR_LUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Decoded ``(BLOCK_N, BLOCK_D)`` channels ``d0 ..`` of one segment in ``DOT_DTYPE``."""
    if PAIR_LUT and BITS == 4 and not SIGNS:
        v = pair_lut_values(row_ptrs, row_mask, BYTE, d0, lut_ptr, DIM, NBYTES, BLOCK_N, BLOCK_D)
    else:
        v = segment_values(row_ptrs, row_mask, BYTE, d0, levels_ptr, DIM, BITS, NBYTES, SIGNS, BLOCK_N, BLOCK_D)
    return v.to(DOT_DTYPE)


@triton.jit
def _dot(acc, q, v, PRECISION: tl.constexpr, ROWS_AS_M: tl.constexpr):
    """``acc + q · vᵀ`` ``(BLOCK_Q, BLOCK_N)``, or ``acc + v · qᵀ`` when ``ROWS_AS_M``."""
    if ROWS_AS_M:
        acc = tl.dot(v, tl.trans(q), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(q, tl.trans(v), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _segment_dot(
    acc, q_ptr, stride_q, offs_q, q_mask, row_ptrs, row_mask, levels_ptr, lut_ptr,
    CH: tl.constexpr, DIM: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr, BYTE: tl.constexpr,
    SIGNS: tl.constexpr, PAIR_LUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ROWS_AS_M: tl.constexpr, ASM: tl.constexpr,
):
    """``acc`` + queries[:, CH:CH+DIM] · decoded segment, ``BLOCK_D`` channels per step.

    ``ASM`` (a 4-bit segment, :func:`~.unpack.nibble_pair_asm`): each step's ``BLOCK_D / 2`` bytes are decoded by byte
    permutes into the float16 levels of their low nibbles (even channels) and high nibbles (odd channels), which meet
    the even and the odd query channels in two products."""
    if ASM != "" and BITS == 4 and not SIGNS:
        HALF: tl.constexpr = BLOCK_D // 2
        for b0 in range(0, NBYTES, HALF):
            byte = b0 + tl.arange(0, HALF)
            low, high = nibble_pairs(row_bytes(row_ptrs, row_mask, BYTE, byte, NBYTES), levels_ptr, ASM)
            even = 2 * byte
            q_even = tl.load(q_ptr + offs_q[:, None] * stride_q + (CH + even)[None, :],
                             mask=q_mask[:, None] & (even < DIM)[None, :], other=0.0).to(DOT_DTYPE)
            q_odd = tl.load(q_ptr + offs_q[:, None] * stride_q + (CH + even + 1)[None, :],
                            mask=q_mask[:, None] & (even + 1 < DIM)[None, :], other=0.0).to(DOT_DTYPE)
            acc = _dot(acc, q_even, low.to(DOT_DTYPE), PRECISION, ROWS_AS_M)
            acc = _dot(acc, q_odd, high.to(DOT_DTYPE), PRECISION, ROWS_AS_M)
        return acc
    for d0 in range(0, DIM, BLOCK_D):
        channel = d0 + tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + offs_q[:, None] * stride_q + (CH + channel)[None, :],
                    mask=q_mask[:, None] & (channel < DIM)[None, :], other=0.0).to(DOT_DTYPE)
        v = _decoded(row_ptrs, row_mask, levels_ptr, lut_ptr, d0, DIM, BITS, NBYTES, BYTE, SIGNS, PAIR_LUT,
                     BLOCK_N, BLOCK_D, DOT_DTYPE)
        acc = _dot(acc, q, v, PRECISION, ROWS_AS_M)
    return acc


@triton.jit
def _row_vector(values, ROWS_AS_M: tl.constexpr):
    """Broadcast a per-row ``(BLOCK_N,)`` vector against the accumulator's layout."""
    if ROWS_AS_M:
        out = values[:, None]
    else:
        out = values[None, :]
    return out


@triton.jit
def _query_vector(values, ROWS_AS_M: tl.constexpr):
    """Broadcast a per-query ``(BLOCK_Q,)`` vector against the accumulator's layout."""
    if ROWS_AS_M:
        out = values[None, :]
    else:
        out = values[:, None]
    return out


@triton.jit
def _finish(
    acc, out_ptr, bias_ptr, qfac_ptr, offs_q, q_mask, rows, row_mask, tile, stride_out,
    n, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_MAX: tl.constexpr, ROWS_AS_M: tl.constexpr,
):
    """Add the bias and write the tile: scores ``out[q, row]``, or ``out[q, tile]`` = best score per query.

    With ``GROUP_MAX`` the products are first divided by ``qfac[q]``, the factor the queries were scaled by (so a
    zero query, scaled by 1e30, ranks its rows by their bias instead of overflowing it).
    """
    if GROUP_MAX:
        acc = acc / _query_vector(tl.load(qfac_ptr + offs_q, mask=q_mask, other=1.0), ROWS_AS_M)
    if HAS_BIAS:
        acc += _row_vector(tl.load(bias_ptr + rows, mask=row_mask, other=0.0), ROWS_AS_M)
    if GROUP_MAX:
        acc = tl.where(_row_vector(row_mask, ROWS_AS_M), acc, float("-inf"))
        if ROWS_AS_M:
            best = tl.max(acc, axis=0)
        else:
            best = tl.max(acc, axis=1)
        tile_ok = offs_q * 0 + tile * BLOCK_N < n
        tl.store(out_ptr + offs_q.to(tl.int64) * stride_out + tile, best, mask=q_mask & tile_ok)
    elif ROWS_AS_M:
        ptrs = out_ptr + offs_q[None, :].to(tl.int64) * stride_out + rows[:, None]
        tl.store(ptrs, acc, mask=row_mask[:, None] & q_mask[None, :])
    else:
        ptrs = out_ptr + offs_q[:, None].to(tl.int64) * stride_out + rows[None, :]
        tl.store(ptrs, acc, mask=q_mask[:, None] & row_mask[None, :])


@triton.jit
def tile_kernel(
    q_ptr, p_ptr, packed_ptr, scale_ptr, bias_ptr, signs_ptr, sign_scale_ptr, levels_ptr, lut_ptr, qfac_ptr, out_ptr,
    nq, n, n_q_tiles, stride_q, stride_p, stride_packed, stride_signs, stride_out,
    S0_CH: tl.constexpr, S0_DIM: tl.constexpr, S0_BITS: tl.constexpr, S0_NBYTES: tl.constexpr,
    S0_BYTE: tl.constexpr, S0_ROW: tl.constexpr,
    S1_CH: tl.constexpr, S1_DIM: tl.constexpr, S1_BITS: tl.constexpr, S1_NBYTES: tl.constexpr,
    S1_BYTE: tl.constexpr, S1_ROW: tl.constexpr,
    P_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_MAX: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr,
    Q_RESIDENT: tl.constexpr, PAIR_LUT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ROWS_AS_M: tl.constexpr, ASM: tl.constexpr,
):
    """``TILES`` consecutive tiles of ``BLOCK_N`` rows against one tile of ``BLOCK_Q`` queries.

    The 1-D grid runs query tiles fastest, so concurrent programs share code tiles in L2.
    ``Q_RESIDENT`` (one segment of at most ``BLOCK_D`` channels, no QJL signs): the query tile is
    loaded once and stays in registers across the row tiles. ``PAIR_LUT``: 4-bit float16 levels come
    from a 256-entry table of level pairs, one load per byte, or with ``ASM`` (not with ``Q_RESIDENT``) from byte
    permutes (:func:`_segment_dot`). ``GROUP_MAX``: write each query's best
    score of row tile ``t`` to ``out[q, t]`` (``out`` is ``(nq, cdiv(n, BLOCK_N))``); else
    ``out[q, row]``. ``P_DIM > 0`` adds the QJL sign term.
    """
    pid = tl.program_id(0)
    offs_q = (pid % n_q_tiles) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_mask = offs_q < nq
    if Q_RESIDENT:
        channel = tl.arange(0, BLOCK_D)
        q_tile = tl.load(q_ptr + offs_q[:, None] * stride_q + (S0_CH + channel)[None, :],
                         mask=q_mask[:, None] & (channel < S0_DIM)[None, :], other=0.0).to(DOT_DTYPE)
    for t in range(TILES):
        tile = (pid // n_q_tiles) * TILES + t
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n
        row_ptrs = packed_ptr + rows.to(tl.int64) * stride_packed
        if ROWS_AS_M:
            acc = tl.zeros((BLOCK_N, BLOCK_Q), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.float32)
        if Q_RESIDENT:
            v = _decoded(row_ptrs, row_mask, levels_ptr + S0_ROW * 256, lut_ptr + S0_ROW * 256, 0,
                         S0_DIM, S0_BITS, S0_NBYTES, S0_BYTE, False, PAIR_LUT, BLOCK_N, BLOCK_D, DOT_DTYPE)
            acc = _dot(acc, q_tile, v, PRECISION, ROWS_AS_M)
        else:
            if S0_DIM > 0:
                acc = _segment_dot(acc, q_ptr, stride_q, offs_q, q_mask, row_ptrs, row_mask,
                                   levels_ptr + S0_ROW * 256, lut_ptr + S0_ROW * 256,
                                   S0_CH, S0_DIM, S0_BITS, S0_NBYTES, S0_BYTE, False, PAIR_LUT, BLOCK_N, BLOCK_D,
                                   DOT_DTYPE, PRECISION, ROWS_AS_M, ASM)
            if S1_DIM > 0:
                acc = _segment_dot(acc, q_ptr, stride_q, offs_q, q_mask, row_ptrs, row_mask,
                                   levels_ptr + S1_ROW * 256, lut_ptr + S1_ROW * 256,
                                   S1_CH, S1_DIM, S1_BITS, S1_NBYTES, S1_BYTE, False, PAIR_LUT, BLOCK_N, BLOCK_D,
                                   DOT_DTYPE, PRECISION, ROWS_AS_M, "")
        acc = acc * _row_vector(tl.load(scale_ptr + rows, mask=row_mask, other=0.0), ROWS_AS_M)
        if P_DIM > 0:
            sign_acc = tl.zeros(acc.shape, dtype=tl.float32)
            sign_acc = _segment_dot(sign_acc, p_ptr, stride_p, offs_q, q_mask,
                                    signs_ptr + rows.to(tl.int64) * stride_signs, row_mask, levels_ptr, lut_ptr,
                                    0, P_DIM, 1, (P_DIM + 7) // 8, 0, True, False, BLOCK_N, BLOCK_D,
                                    DOT_DTYPE, PRECISION, ROWS_AS_M, "")
            acc += sign_acc * _row_vector(tl.load(sign_scale_ptr + rows, mask=row_mask, other=0.0), ROWS_AS_M)
        _finish(acc, out_ptr, bias_ptr, qfac_ptr, offs_q, q_mask, rows, row_mask, tile, stride_out,
                n, BLOCK_N, HAS_BIAS, GROUP_MAX, ROWS_AS_M)


@triton.jit
def _row_scores(
    q_ptrs, p_ptrs, rows, row_mask, packed_ptr, scale_ptr, bias_ptr, signs_ptr, sign_scale_ptr, levels_ptr,
    stride_packed, stride_signs,
    S0_CH: tl.constexpr, S0_DIM: tl.constexpr, S0_BITS: tl.constexpr, S0_NBYTES: tl.constexpr,
    S0_BYTE: tl.constexpr, S0_ROW: tl.constexpr,
    S1_CH: tl.constexpr, S1_DIM: tl.constexpr, S1_BITS: tl.constexpr, S1_NBYTES: tl.constexpr,
    S1_BYTE: tl.constexpr, S1_ROW: tl.constexpr,
    P_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, ASM: tl.constexpr,
):
    """Float32 scores ``(BLOCK_N,)`` of one query (``q_ptrs``, QJL projection ``p_ptrs``) against ``rows``: exact, or with
    ``ASM`` (a single 4-bit segment, :func:`~.unpack.nibble_pair_asm`) from float16 levels."""
    row_ptrs = packed_ptr + rows.to(tl.int64) * stride_packed
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if S0_DIM > 0:
        acc = segment_matvec(acc, q_ptrs + S0_CH, row_ptrs, row_mask, S0_BYTE, levels_ptr + S0_ROW * 256,
                             S0_DIM, S0_BITS, S0_NBYTES, False, BLOCK_N, BLOCK_B, ASM)
    if S1_DIM > 0:
        acc = segment_matvec(acc, q_ptrs + S1_CH, row_ptrs, row_mask, S1_BYTE, levels_ptr + S1_ROW * 256,
                             S1_DIM, S1_BITS, S1_NBYTES, False, BLOCK_N, BLOCK_B, "")
    acc = acc * tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    if P_DIM > 0:
        sign_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        sign_acc = segment_matvec(sign_acc, p_ptrs, signs_ptr + rows.to(tl.int64) * stride_signs, row_mask, 0,
                                  levels_ptr, P_DIM, 1, (P_DIM + 7) // 8, True, BLOCK_N, BLOCK_B, "")
        acc += sign_acc * tl.load(sign_scale_ptr + rows, mask=row_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0)
    return tl.where(row_mask, acc, float("-inf"))


@triton.jit
def matvec_kernel(
    q_ptr, p_ptr, packed_ptr, scale_ptr, bias_ptr, signs_ptr, sign_scale_ptr, levels_ptr, out_ptr,
    n, stride_q, stride_p, stride_packed, stride_signs, stride_out,
    S0_CH: tl.constexpr, S0_DIM: tl.constexpr, S0_BITS: tl.constexpr, S0_NBYTES: tl.constexpr,
    S0_BYTE: tl.constexpr, S0_ROW: tl.constexpr,
    S1_CH: tl.constexpr, S1_DIM: tl.constexpr, S1_BITS: tl.constexpr, S1_NBYTES: tl.constexpr,
    S1_BYTE: tl.constexpr, S1_ROW: tl.constexpr,
    P_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, TILES: tl.constexpr,
    ASM: tl.constexpr,
):
    """Search stage 1 for one (or a few) queries, on CUDA cores in float32: ``out[query, t]`` = the best score of
    row tile ``t`` (rows ``t · BLOCK_N`` … ``(t + 1) · BLOCK_N``), for ``TILES`` consecutive tiles; with ``ASM`` (one
    4-bit segment, :func:`~.unpack.nibble_pair_asm`) the levels are decoded as float16 by byte permutes.

    Program ``(query, j)``; the query axis runs fastest, so the queries of a tile share its codes in L2.
    """
    query = tl.program_id(0)
    q_ptrs = q_ptr + query.to(tl.int64) * stride_q
    p_ptrs = p_ptr + query.to(tl.int64) * stride_p
    for t in range(TILES):
        tile = tl.program_id(1) * TILES + t
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _row_scores(q_ptrs, p_ptrs, rows, rows < n, packed_ptr, scale_ptr, bias_ptr, signs_ptr, sign_scale_ptr,
                          levels_ptr, stride_packed, stride_signs,
                          S0_CH, S0_DIM, S0_BITS, S0_NBYTES, S0_BYTE, S0_ROW, S1_CH, S1_DIM, S1_BITS, S1_NBYTES,
                          S1_BYTE, S1_ROW, P_DIM, HAS_BIAS, BLOCK_N, BLOCK_B, ASM)
        if tile * BLOCK_N < n:
            tl.store(out_ptr + query.to(tl.int64) * stride_out + tile, tl.max(acc, axis=0))


@triton.jit
def refine_kernel(
    q_ptr, p_ptr, groups_ptr, packed_ptr, scale_ptr, bias_ptr, signs_ptr, sign_scale_ptr, levels_ptr, out_ptr,
    ids_ptr, n, n_groups_per_query, stride_q, stride_p, stride_packed, stride_signs,
    S0_CH: tl.constexpr, S0_DIM: tl.constexpr, S0_BITS: tl.constexpr, S0_NBYTES: tl.constexpr,
    S0_BYTE: tl.constexpr, S0_ROW: tl.constexpr,
    S1_CH: tl.constexpr, S1_DIM: tl.constexpr, S1_BITS: tl.constexpr, S1_NBYTES: tl.constexpr,
    S1_BYTE: tl.constexpr, S1_ROW: tl.constexpr,
    P_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    LOCAL_K: tl.constexpr, BITONIC: tl.constexpr,
):
    """Exact float32 scores of one query against one chosen group of ``BLOCK_N`` rows.

    Program ``(query, j)`` reads group ``groups[query, j]``. ``LOCAL_K`` 0: writes the scores to
    ``out[query, j * BLOCK_N : (j + 1) * BLOCK_N]`` and the row numbers to the same slots of ``ids``
    (``-inf`` / ``-1`` for rows past ``n``). Else writes only the best ``LOCAL_K < BLOCK_N`` of them as
    :mod:`.topk` keys (int64: score, then lower row) to ``out[query, j * LOCAL_K ..]``, sorted descending
    (``BITONIC``: see :func:`.topk.bitonic`); ``ids`` is unused.
    """
    query = tl.program_id(0)
    j = tl.program_id(1)
    slot = query.to(tl.int64) * n_groups_per_query + j
    rows = tl.load(groups_ptr + slot) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n
    acc = _row_scores(q_ptr + query.to(tl.int64) * stride_q, p_ptr + query.to(tl.int64) * stride_p, rows, row_mask,
                      packed_ptr, scale_ptr, bias_ptr, signs_ptr, sign_scale_ptr, levels_ptr, stride_packed, stride_signs,
                      S0_CH, S0_DIM, S0_BITS, S0_NBYTES, S0_BYTE, S0_ROW, S1_CH, S1_DIM, S1_BITS, S1_NBYTES,
                      S1_BYTE, S1_ROW, P_DIM, HAS_BIAS, BLOCK_N, BLOCK_B, "")
    if LOCAL_K > 0:
        tl.store(out_ptr + slot * LOCAL_K + tl.arange(0, LOCAL_K), best_keys(acc, rows, row_mask, LOCAL_K, BITONIC))
    else:
        tl.store(out_ptr + slot * BLOCK_N + tl.arange(0, BLOCK_N), acc)
        tl.store(ids_ptr + slot * BLOCK_N + tl.arange(0, BLOCK_N), tl.where(row_mask, rows, -1))


@triton.jit
def half_queries_kernel(
    q_ptr, p_ptr, qh_ptr, ph_ptr, qfac_ptr, stride_q, stride_p,
    D: tl.constexpr, P_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    """One query per program: ``qfac = 1 / max(max|q|, max|p|, 1e-30)``; float16 ``q · qfac`` ``(nq, D)`` and
    ``p · qfac`` ``(nq, P_DIM)`` (``P_DIM`` 0: no projection)."""
    row = tl.program_id(0).to(tl.int64)
    channel = tl.arange(0, BLOCK)
    q = tl.load(q_ptr + row * stride_q + channel, mask=channel < D, other=0.0)
    peak = tl.max(tl.abs(q), axis=0)
    if P_DIM > 0:
        p = tl.load(p_ptr + row * stride_p + channel, mask=channel < P_DIM, other=0.0)
        peak = tl.maximum(peak, tl.max(tl.abs(p), axis=0))
    qfac = 1.0 / tl.maximum(peak, 1e-30)
    tl.store(qh_ptr + row * D + channel, (q * qfac).to(tl.float16), mask=channel < D)
    if P_DIM > 0:
        tl.store(ph_ptr + row * P_DIM + channel, (p * qfac).to(tl.float16), mask=channel < P_DIM)
    tl.store(qfac_ptr + row, qfac)
