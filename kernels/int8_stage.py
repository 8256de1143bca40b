"""Triton kernels of the search's first stage on int8 tensor cores, for query batches.

Rows and queries are signed bytes on common grids (levels · 127 / L, L the largest level magnitude of the table;
q · 127 / max|q|), multiplied with int32 accumulation:

* :func:`decode_kernel` writes the int8 levels ``(rows, K_PAD)`` of a chunk of packed rows (channels in query
  order, the padding channels left as they are: zero): with thousands of queries, decoding each code tile once per
  query tile (as the float16 :func:`~.scan_kernel.tile_kernel` does) would bound the search;
* :func:`group_max_kernel` multiplies int8 query tiles by the decoded rows, or (``FUSED``, one 4-bit segment, smaller
  batches) by code tiles decoded in registers (:func:`~.dp4a_stage.nibble_levels_asm`), and writes each query's best
  score estimate per group of ``GROUP_N`` rows (the products divided by the queries' scale factor, so a zero query
  ranks its groups by their bias), as :func:`~.scan_kernel.tile_kernel` does with ``GROUP_MAX`` up to the two 8-bit
  roundings;
* :func:`group_max_loop_kernel` gives the same maxima where a tile is one channel step (at most 128 channels): a
  program keeps its query tile and loops over row tiles, their loads software-pipelined, so the query tile is read
  once per program instead of once per tile and a row tile's loads overlap the previous tile's products.

The products become floats without the int32-to-float conversion instruction (an eighth of the float32 rate on the
H200's multiprocessors, and one per query and row): the accumulator starts at :data:`ACC_BIAS`, the bits of the
float32 1.5 · 2^23, so while a product Σ stays within ±2^22 the accumulator's bits read as the float 1.5 · 2^23 + Σ
exactly and one subtraction gives Σ. A query tile takes that path when every query's ``Σ|q8|`` is at most
:data:`FAST_CONVERSION_MAX_ABS_SUM` (the levels are at most 127 in magnitude, so ``|Σ| ≤ 127 · Σ|q8| < 2^22``); else
the accumulator less the bias is converted. Both give the same floats.

Segments are passed as constexprs as in :mod:`.scan_kernel`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .unpack import segment_values

#: the accumulator's start, int32 bits of the float32 1.5 · 2^23 (module docstring) ...
ACC_BIAS = tl.constexpr(0x4B400000)
#: ... that float
ACC_BIAS_FLOAT = tl.constexpr(12582912.0)
#: the largest ``Σ|q8|`` of a query whose products convert by subtraction: 127 · Σ|q8| < 2^22
FAST_CONVERSION_MAX_ABS_SUM = (1 << 22) // 127


@triton.jit
def _decode_segment(row_ptrs, row_mask, out_ptrs, levels_ptr, CH: tl.constexpr, DIM: tl.constexpr, BITS: tl.constexpr,
                    NBYTES: tl.constexpr, BYTE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store the grid levels of one segment's channels at ``out_ptrs + CH + channel``."""
    for d0 in range(0, DIM, BLOCK_D):
        channel = d0 + tl.arange(0, BLOCK_D)
        v = segment_values(row_ptrs, row_mask, BYTE, d0, levels_ptr, DIM, BITS, NBYTES, False, BLOCK_N, BLOCK_D)
        tl.store(out_ptrs[:, None] + (CH + channel)[None, :], v.to(tl.int8), mask=row_mask[:, None] & (channel < DIM)[None, :])


@triton.jit
def decode_kernel(
    packed_ptr, levels_ptr, out_ptr, n, stride_packed, stride_out,
    S0_CH: tl.constexpr, S0_DIM: tl.constexpr, S0_BITS: tl.constexpr, S0_NBYTES: tl.constexpr,
    S0_BYTE: tl.constexpr, S0_ROW: tl.constexpr,
    S1_CH: tl.constexpr, S1_DIM: tl.constexpr, S1_BITS: tl.constexpr, S1_NBYTES: tl.constexpr,
    S1_BYTE: tl.constexpr, S1_ROW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rows ``BLOCK_N · program ..`` of the ``n`` packed rows as int8 grid levels: ``out[row, channel]`` =
    ``levels[segment, code]`` (``levels`` float32 ``(n_segments, 256)`` holding integers in [-127, 127])."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n
    row_ptrs = packed_ptr + rows.to(tl.int64) * stride_packed
    out_ptrs = out_ptr + rows.to(tl.int64) * stride_out
    if S0_DIM > 0:
        _decode_segment(row_ptrs, row_mask, out_ptrs, levels_ptr + S0_ROW * 256, S0_CH, S0_DIM, S0_BITS, S0_NBYTES,
                        S0_BYTE, BLOCK_N, BLOCK_D)
    if S1_DIM > 0:
        _decode_segment(row_ptrs, row_mask, out_ptrs, levels_ptr + S1_ROW * 256, S1_CH, S1_DIM, S1_BITS, S1_NBYTES,
                        S1_BYTE, BLOCK_N, BLOCK_D)


@triton.jit
def _tile_of(pid, nq, n, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_Q: tl.constexpr):
    """``(query tile, row tile)`` of program ``pid``: ``GROUP_Q`` query tiles run fastest within a band of row tiles,
    so that concurrent programs share both operands in L2."""
    n_q_tiles = tl.cdiv(nq, BLOCK_Q)
    n_row_tiles = tl.cdiv(n, BLOCK_N)
    band = pid // (GROUP_Q * n_row_tiles)
    first_q = band * GROUP_Q
    q_tiles = tl.minimum(n_q_tiles - first_q, GROUP_Q)
    q_tile = first_q + (pid % (GROUP_Q * n_row_tiles)) % q_tiles
    row_tile = (pid % (GROUP_Q * n_row_tiles)) // q_tiles
    return q_tile, row_tile


@triton.jit
def _fast_conversion(offs_q, q_mask, abs_sum_ptr, FAST_MAX_ABS_SUM: tl.constexpr):
    """Whether every query of the tile has ``Σ|q8| ≤ FAST_MAX_ABS_SUM`` (``abs_sum_ptr``): its products convert by
    subtraction (:func:`_products`)."""
    return tl.max(tl.load(abs_sum_ptr + offs_q, mask=q_mask, other=0), axis=0) <= FAST_MAX_ABS_SUM


@triton.jit
def _products(acc, fast):
    """The int32 products ``acc`` ``(BLOCK_Q, BLOCK_N)`` (started at :data:`ACC_BIAS`) as float32: by one subtraction
    where ``fast`` (:func:`_fast_conversion`), else converted."""
    if fast:
        products = acc.to(tl.float32, bitcast=True) - ACC_BIAS_FLOAT
    else:
        products = (acc - ACC_BIAS).to(tl.float32)
    return products


@triton.jit
def _per_query(offs_q, q_mask, qfac_ptr, unit_ptr):
    """Each query's positive factor ``unit / qfac[q]`` ``(BLOCK_Q,)`` from products to scores."""
    return tl.load(unit_ptr) / tl.load(qfac_ptr + offs_q, mask=q_mask, other=1.0)


@triton.jit
def _group_best(scores, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr):
    """Each query's best of ``scores`` ``(BLOCK_Q, BLOCK_N)`` per group of ``GROUP_N`` rows: ``(BLOCK_Q,)`` where the
    tile is one group, else ``(BLOCK_Q, BLOCK_N // GROUP_N)``."""
    if GROUP_N == BLOCK_N:
        return tl.max(scores, axis=1)
    else:
        return tl.max(tl.reshape(scores, (BLOCK_Q, BLOCK_N // GROUP_N, GROUP_N)), axis=2)


@triton.jit
def _store_group_maxima(products, per_query, offs_q, q_mask, rows, row_mask, row_tile, scale_ptr, bias_ptr, out_ptr,
                        stride_out, group0, n, HAS_BIAS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUP_N: tl.constexpr):
    """Scale the products ``(BLOCK_Q, BLOCK_N)`` float32 to score estimates (``per_query[q] · scale[i] · product +
    bias[i]``, :func:`_per_query`) and store each query's best per group of ``GROUP_N`` rows at ``out[q, group0 +
    group]``. Without bias the positive per-query factor multiplies the maxima instead of every product (the order is
    the same); only the last tile masks the rows past ``n``."""
    scores = products * tl.load(scale_ptr + rows, mask=row_mask, other=0.0)[None, :]
    if HAS_BIAS:
        scores = scores * per_query[:, None] + tl.load(bias_ptr + rows, mask=row_mask, other=0.0)[None, :]
    if row_tile * BLOCK_N + BLOCK_N > n:
        best = _group_best(tl.where(row_mask[None, :], scores, float("-inf")), BLOCK_Q, BLOCK_N, GROUP_N)
    else:
        best = _group_best(scores, BLOCK_Q, BLOCK_N, GROUP_N)
    out_ptrs = out_ptr + offs_q.to(tl.int64) * stride_out + group0
    if GROUP_N == BLOCK_N:
        if not HAS_BIAS:
            best = best * per_query
        tl.store(out_ptrs + row_tile, best, mask=q_mask)
    else:
        GROUPS: tl.constexpr = BLOCK_N // GROUP_N
        if not HAS_BIAS:
            best = best * per_query[:, None]
        group = row_tile * GROUPS + tl.arange(0, GROUPS)
        tl.store(out_ptrs[:, None] + group[None, :], best, mask=q_mask[:, None] & (group * GROUP_N < n)[None, :])


@triton.jit
def _code_tile_levels(row_ptrs, row_mask, k0, grid_ptr, NBYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """Int8 levels ``(BLOCK_N, BLOCK_K)`` of channels ``k0 …`` of 4-bit rows of ``NBYTES`` bytes (masked rows and bytes
    past the row: the level of code 0), by :func:`~.dp4a_stage.nibble_levels_asm`'s ``ASM``, else gathered from the
    float32 grid."""
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    raw = tl.load(row_ptrs[:, None] + byte[None, :], mask=row_mask[:, None] & (byte < NBYTES)[None, :], other=0)
    if ASM != "":
        low, high = tl.inline_asm_elementwise(ASM, "=r,=r,r", [raw], dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        code = raw.to(tl.int32)
        low = tl.load(grid_ptr + (code & 15)).to(tl.int8)
        high = tl.load(grid_ptr + (code >> 4)).to(tl.int8)
    return tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))


@triton.jit
def group_max_kernel(
    q_ptr, rows_ptr, scale_ptr, bias_ptr, qfac_ptr, abs_sum_ptr, grid_ptr, out_ptr, unit_ptr,
    nq, n, group0, stride_q, stride_rows, stride_out,
    K_PAD: tl.constexpr, NBYTES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_Q: tl.constexpr, FUSED: tl.constexpr, ASM: tl.constexpr,
    FAST_MAX_ABS_SUM: tl.constexpr,
):
    """``out[q, group0 + g]`` = max over rows ``i`` of group ``g`` (rows ``g · GROUP_N ..``) of
    ``unit / qfac[q] · scale[i] · ⟨q8, r8_i⟩ + bias[i]`` for the ``n`` rows and the queries ``q8`` ``(nq, K_PAD)``
    int8, ``q8 ≈ qfac · q`` (``unit`` read from ``unit_ptr``: the grid's step in level units; ``abs_sum_ptr``: each
    query's ``Σ|q8|``, see :func:`_products`, ``FAST_MAX_ABS_SUM`` normally :data:`FAST_CONVERSION_MAX_ABS_SUM`). A
    program computes a tile of ``BLOCK_Q`` queries × ``BLOCK_N`` rows, ``BLOCK_N / GROUP_N`` groups; programs run
    ``GROUP_Q`` query tiles fastest within a band of row tiles (:func:`_tile_of`).

    The rows ``r8``: decoded int8 levels ``(n, K_PAD)`` at ``rows_ptr``; or with ``FUSED`` the packed codes of one
    4-bit segment, ``NBYTES`` bytes per row, each tile decoded in registers to the int8 grid levels (``grid_ptr``: 16
    float32 integers, read only without ``ASM``, :func:`~.dp4a_stage.nibble_levels_asm`).
    """
    q_tile, row_tile = _tile_of(tl.program_id(0), nq, n, BLOCK_Q, BLOCK_N, GROUP_Q)
    offs_q = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rows = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    q_mask = offs_q < nq
    row_mask = rows < n
    channel = tl.arange(0, BLOCK_K)
    q_ptrs = q_ptr + offs_q.to(tl.int64)[:, None] * stride_q + channel[None, :]
    row_ptrs = rows_ptr + rows.to(tl.int64) * stride_rows
    acc = tl.full((BLOCK_Q, BLOCK_N), ACC_BIAS, dtype=tl.int32)
    for k0 in range(0, K_PAD, BLOCK_K):
        a = tl.load(q_ptrs + k0, mask=q_mask[:, None], other=0)
        if FUSED:
            b = _code_tile_levels(row_ptrs, row_mask, k0, grid_ptr, NBYTES, BLOCK_N, BLOCK_K, ASM)
        else:
            b = tl.load(row_ptrs[:, None] + (k0 + channel)[None, :], mask=row_mask[:, None], other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    products = _products(acc, _fast_conversion(offs_q, q_mask, abs_sum_ptr, FAST_MAX_ABS_SUM))
    _store_group_maxima(products, _per_query(offs_q, q_mask, qfac_ptr, unit_ptr), offs_q, q_mask, rows, row_mask,
                        row_tile, scale_ptr, bias_ptr, out_ptr, stride_out, group0, n, HAS_BIAS, BLOCK_Q, BLOCK_N, GROUP_N)


@triton.jit
def group_max_loop_kernel(
    q_ptr, rows_ptr, scale_ptr, bias_ptr, qfac_ptr, abs_sum_ptr, grid_ptr, out_ptr, unit_ptr,
    nq, n, group0, stride_q, stride_rows, stride_out, lanes,
    K_PAD: tl.constexpr, NBYTES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_N: tl.constexpr, FUSED: tl.constexpr, ASM: tl.constexpr, FAST_MAX_ABS_SUM: tl.constexpr,
    STAGES: tl.constexpr,
):
    """:func:`group_max_kernel`'s maxima (same arguments; a tile is one channel step of ``K_PAD`` channels) from
    ``lanes`` programs per query tile: program ``p`` takes query tile ``p % n_q_tiles`` and row tiles ``p //
    n_q_tiles``, ``+ lanes``, ``+ 2 · lanes``, … in turn, its query tile loaded once and the row tiles' loads
    software-pipelined over ``STAGES`` stages. Launched with as many programs as the multiprocessors hold at once
    (``lanes`` per query tile), the programs of a row tile run side by side and share it in L2."""
    n_q_tiles = tl.cdiv(nq, BLOCK_Q)
    q_tile = tl.program_id(0) % n_q_tiles
    offs_q = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_mask = offs_q < nq
    channel = tl.arange(0, K_PAD)
    queries = tl.load(q_ptr + offs_q.to(tl.int64)[:, None] * stride_q + channel[None, :], mask=q_mask[:, None], other=0)
    fast = _fast_conversion(offs_q, q_mask, abs_sum_ptr, FAST_MAX_ABS_SUM)
    per_query = _per_query(offs_q, q_mask, qfac_ptr, unit_ptr)
    for row_tile in tl.range(tl.program_id(0) // n_q_tiles, tl.cdiv(n, BLOCK_N), lanes, num_stages=STAGES):
        rows = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n
        row_ptrs = rows_ptr + rows.to(tl.int64) * stride_rows
        if FUSED:
            b = _code_tile_levels(row_ptrs, row_mask, 0, grid_ptr, NBYTES, BLOCK_N, K_PAD, ASM)
        else:
            b = tl.load(row_ptrs[:, None] + channel[None, :], mask=row_mask[:, None], other=0)
        acc = tl.dot(queries, tl.trans(b), tl.full((BLOCK_Q, BLOCK_N), ACC_BIAS, dtype=tl.int32), out_dtype=tl.int32)
        _store_group_maxima(_products(acc, fast), per_query, offs_q, q_mask, rows, row_mask, row_tile, scale_ptr,
                            bias_ptr, out_ptr, stride_out, group0, n, HAS_BIAS, BLOCK_Q, BLOCK_N, GROUP_N)
