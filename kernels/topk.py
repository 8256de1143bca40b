"""Row-wise top-k selection in Triton, for the search's group choice and its final answer.

Each candidate becomes one int64 key whose order is (value, then lower id first): the high 32 bits
are the float32 value's bits mapped to an order-preserving signed integer, the low 32 bits
``2³² − 1 − id`` (id ``-1``, a row past the end, ranks last among equal values). ``tl.topk`` (a
bitonic top-k, Triton ≥ 3.2) then selects on keys alone, and the winners' values and ids are decoded
from them, so the selection is exact, ties included: the ``k`` largest values, equal values broken
by lower id (``-0.0`` ranks below ``+0.0``). Values must be NaN-free; ``-inf`` is allowed.

:func:`topk_kernel` runs one program per (row, split): it streams ``TILES`` blocks of ``BLOCK``
candidates, keeps the running ``K_PAD`` best keys, and writes them for a next pass, or, in the last
pass (one split per row), decodes the best ``k_out`` of them. :func:`row_topk` chains passes: the
first splits each row over many programs (so that 100 queries × 8192 group maxima use 800 programs,
not 100), each further pass merges ``K_PAD`` keys per split.

Rows of many queries take one program each (:func:`filtered_topk_kernel`): a floor that at least ``k`` of the
row's candidates reach, rising as the row streams by, lets through only the few candidates that can be among the
best; those are gathered and selected once (all of them, if more than ``FILTER_CAP`` pass). No sort runs over the
rest, where the passes above sort every block.

In the search, the refine kernel keeps each refined slice's best ``K_PAD`` as keys (:func:`best_keys`), so
the final answer is one :func:`keys_topk` pass over ``(k + 8) · K_PAD`` keys instead of a top-k over all
``(k + 8) · 128`` refined scores.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import cdiv, pow2

#: largest power-of-two key count kept per program (k or k + GROUP_MARGIN beyond it: torch.topk)
MAX_K_PAD = 1024
#: candidates per block (at least 2 · K_PAD, so that each pass shrinks its rows at least twofold): ``BLOCK``, or
#: ``BLOCK_FEW`` for fewer than ``SMALL_NQ`` rows. H200, 18 of 7,813 group maxima × 100 queries: 0.024 ms at 512,
#: 0.035 at 1024, 0.028 at 256; 18 of 31,250 × 1 query: 0.015 ms at 1024, 0.023 at 512
BLOCK = 512
BLOCK_FEW = 1024
#: at most this many programs per row in a pass (queries below ``SMALL_NQ``: ``MAX_SPLITS_FEW``)
MAX_SPLITS = 32
MAX_SPLITS_FEW = 128
SMALL_NQ = 8
#: a pass over at most this many blocks runs as one program per row
SERIAL_BLOCKS = 4

#: :func:`filtered_topk_kernel` serves rows without ids of at least ``FILTER_MIN_ROWS`` rows and ``k_pad(k)`` up to
#: ``FILTER_MAX_K_PAD``: candidates per block, strips (at least ``k_pad(k)``), and candidates passed on per row to the
#: one selection (beyond: every candidate, merged block by block). H100, 1M rows, 100 and 10,000 queries: 32 strips
#: 1-5% faster than 64 or 128; 256 passed no faster; on real data's group maxima at most 115 of 15,051 pass
#: (bench/results/gpu_scan_runs/30bc81d-filter)
FILTER_MIN_ROWS = SMALL_NQ
FILTER_MAX_K_PAD = 64
FILTER_BLOCK = 4096
FILTER_STRIPS = 32
FILTER_CAP = 512

#: run ``tl.topk`` under the interpreter too (slow: tests of a few tiny shapes set it)
INTERPRET_BITONIC = False


@triton.jit
def _keys(values, ids):
    """int64 keys ordered by float32 ``values`` then by lower int64 ``ids`` (ids in ``-1 .. 2³² − 2``)."""
    bits = values.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    low = tl.full(ids.shape, 4294967295, tl.int64) - (ids.to(tl.int64) & 4294967295)
    return (ordered.to(tl.int64) << 32) | low


@triton.jit
def _decode(keys):
    """Values (float32) and ids (int64, ``-1`` for id ``2³² − 1``) of :func:`_keys` keys."""
    high = (keys >> 32).to(tl.int32)
    values = (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    ids = tl.full(keys.shape, 4294967295, tl.int64) - (keys & 4294967295)
    ids = tl.where(ids == 4294967295, -1, ids)
    return values, ids


@triton.jit
def _top(keys, K_PAD: tl.constexpr, BITONIC: tl.constexpr):
    """The ``K_PAD`` largest of distinct ``keys`` (padding ``INT64_MIN`` aside), sorted descending.

    ``BITONIC``: ``tl.topk``. Else ``K_PAD`` rounds of max-and-remove, for the interpreter, whose
    ``tl.topk`` (an xor reduction per step, run element by element in Python) takes seconds per block.
    """
    if BITONIC:
        top = tl.topk(keys, K_PAD)
    else:
        pos = tl.arange(0, K_PAD)
        top = tl.full([K_PAD], -9223372036854775808, tl.int64)
        for i in tl.static_range(K_PAD):
            m = tl.max(keys, axis=0)
            top = tl.where(pos == i, m, top)
            keys = tl.where(keys == m, -9223372036854775808, keys)
    return top


@triton.jit
def best_keys(values, ids, mask, K_PAD: tl.constexpr, BITONIC: tl.constexpr):
    """The ``K_PAD`` best :func:`_keys` of the candidates ``values`` / ``ids`` ``(BLOCK ≥ K_PAD,)`` where ``mask``,
    sorted descending (``INT64_MIN`` past the last candidate)."""
    return _top(tl.where(mask, _keys(values, ids), -9223372036854775808), K_PAD, BITONIC)


@triton.jit
def _merge(best, keys, K_PAD: tl.constexpr, BITONIC: tl.constexpr):
    """The ``K_PAD`` largest of running keys ``best`` ``(K_PAD,)`` and a block of ``keys``, sorted descending."""
    top = _top(keys, K_PAD, BITONIC)
    both = tl.reshape(tl.join(best, top), [2 * K_PAD])
    return _top(both, K_PAD, BITONIC)


@triton.jit
def _store_final(best, out_val_ptr, out_idx_ptr, row, stride_out, k_out, WRITE_VALUES: tl.constexpr,
                 K_PAD: tl.constexpr):
    """Decode the first ``k_out`` of the sorted keys ``best`` into ``out_val[row]`` / ``out_idx[row]``."""
    values, ids = _decode(best)
    pos = tl.arange(0, K_PAD)
    keep = pos < k_out
    tl.store(out_idx_ptr + row * stride_out + pos, ids, mask=keep)
    if WRITE_VALUES:
        tl.store(out_val_ptr + row * stride_out + pos, tl.where(best == -9223372036854775808, float("-inf"), values),
                 mask=keep)


@triton.jit
def topk_kernel(
    val_ptr, ids_ptr, keys_ptr, out_keys_ptr, out_val_ptr, out_idx_ptr,
    length, stride_in, stride_ids, stride_out, k_out,
    KEYS_IN: tl.constexpr, HAS_IDS: tl.constexpr, FINAL: tl.constexpr, WRITE_VALUES: tl.constexpr,
    K_PAD: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, BITONIC: tl.constexpr,
):
    """Best ``K_PAD`` keys of candidates ``[s · TILES · BLOCK, (s + 1) · TILES · BLOCK)`` of row ``r``, program (r, s).

    Candidates: float32 ``val[r, c]`` with ids ``ids[r, c]`` (``HAS_IDS``) or ``c``, or (``KEYS_IN``) keys
    ``keys[r, c]``; ``c < length``. Not ``FINAL``: keys to ``out_keys[r, s · K_PAD ..]`` (stride
    ``stride_out``). ``FINAL``: ids of the best ``k_out`` to ``out_idx[r, :k_out]`` and, with
    ``WRITE_VALUES``, their values to ``out_val[r, :k_out]``, best first.
    """
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    best = tl.full([K_PAD], -9223372036854775808, tl.int64)
    for t in range(TILES):
        cols = (split * TILES + t) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < length
        if KEYS_IN:
            keys = tl.load(keys_ptr + row * stride_in + cols, mask=mask, other=-9223372036854775808)
        else:
            values = tl.load(val_ptr + row * stride_in + cols, mask=mask, other=float("-inf"))
            if HAS_IDS:
                ids = tl.load(ids_ptr + row * stride_ids + cols, mask=mask, other=-1)
            else:
                ids = cols
            keys = tl.where(mask, _keys(values, ids), -9223372036854775808)
        if TILES == 1:
            best = _top(keys, K_PAD, BITONIC)
        else:
            best = _merge(best, keys, K_PAD, BITONIC)
    if FINAL:
        _store_final(best, out_val_ptr, out_idx_ptr, row, stride_out, k_out, WRITE_VALUES, K_PAD)
    else:
        tl.store(out_keys_ptr + row * stride_out + split * K_PAD + tl.arange(0, K_PAD), best)


@triton.jit
def _column_block(values_row, start, length, BLOCK: tl.constexpr):
    """Columns ``start .. start + BLOCK`` of a row at ``values_row``: ``(cols, inside, values)``, ``-inf`` past
    ``length``."""
    cols = start + tl.arange(0, BLOCK)
    inside = cols < length
    return cols, inside, tl.load(values_row + cols, mask=inside, other=float("-inf"))


@triton.jit
def filtered_topk_kernel(
    val_ptr, passed_ptr, out_val_ptr, out_idx_ptr, length, stride_in, stride_out, k_out,
    K_PAD: tl.constexpr, STRIPS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, BITONIC: tl.constexpr,
):
    """The best ``k_out ≤ K_PAD`` of row ``r``'s candidates ``val[r, :length]`` (float32, ids the columns), program r:
    values to ``out_val[r, :k_out]``, ids to ``out_idx[r, :k_out]``, best first (as :func:`topk_kernel` with
    ``FINAL``).

    The columns seen so far fall into ``STRIPS ≥ k_out`` strips (column mod ``STRIPS``); the ``k_out``-th largest of
    the strips' maxima is a floor that ``k_out`` distinct candidates reach, so the ``k_out`` best are at or above it.
    It only rises as blocks of ``BLOCK`` stream by, and each block passes its columns at or above the current floor to
    ``passed[r, :CAP]`` (int32 scratch). The best ``k_out`` keys of the passed columns are the row's; if more than
    ``CAP`` pass, every block is merged instead.
    """
    row = tl.program_id(0).to(tl.int64)
    values_row = val_ptr + row * stride_in
    passed_row = passed_ptr + row * CAP
    strips = tl.full([STRIPS], float("-inf"), tl.float32)
    count = tl.sum(tl.zeros([STRIPS], tl.int32), axis=0)
    for start in range(0, length, BLOCK):
        cols, inside, values = _column_block(values_row, start, length, BLOCK)
        strips = tl.maximum(strips, tl.max(tl.reshape(values, [BLOCK // STRIPS, STRIPS]), axis=0))
        reached = tl.sum((strips[None, :] >= strips[:, None]).to(tl.int32), axis=1)  # strips at or above each one
        floor = tl.max(tl.where(reached >= k_out, strips, float("-inf")), axis=0)
        through = inside & (values >= floor)
        slot = count + tl.cumsum(through.to(tl.int32), axis=0) - 1
        tl.store(passed_row + slot, cols, mask=through & (slot < CAP))
        count += tl.sum(through.to(tl.int32), axis=0)
    tl.debug_barrier()
    if count <= CAP:
        pos = tl.arange(0, CAP)
        have = pos < count
        cols = tl.load(passed_row + pos, mask=have, other=0)
        values = tl.load(values_row + cols, mask=have, other=float("-inf"))
        best = best_keys(values, cols, have, K_PAD, BITONIC)
    else:
        best = tl.full([K_PAD], -9223372036854775808, tl.int64)
        for start in range(0, length, BLOCK):
            cols, inside, values = _column_block(values_row, start, length, BLOCK)
            best = _merge(best, tl.where(inside, _keys(values, cols), -9223372036854775808), K_PAD, BITONIC)
    _store_final(best, out_val_ptr, out_idx_ptr, row, stride_out, k_out, True, K_PAD)


def bitonic() -> bool:
    """Select with ``tl.topk`` (always on the GPU; under the interpreter only with ``INTERPRET_BITONIC``)."""
    return INTERPRET_BITONIC or os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def k_pad(k: int) -> int:
    """Keys kept per program for a top-``k`` (a power of two ≥ 2)."""
    return max(2, pow2(k))


def supported(k: int) -> bool:
    """Whether :func:`row_topk` runs a top-``k`` in Triton (else it falls back to ``torch.topk``)."""
    return k_pad(k) <= MAX_K_PAD


def _plan(length: int, nq: int, block: int, kp: int) -> tuple[int, int]:
    """``(splits, tiles)`` of one pass over rows of ``length`` candidates in blocks of ``block``."""
    n_blocks = cdiv(length, block)
    if n_blocks <= SERIAL_BLOCKS:
        return 1, n_blocks
    most = MAX_SPLITS_FEW if nq < SMALL_NQ else MAX_SPLITS
    tiles = cdiv(n_blocks, most)
    splits = cdiv(n_blocks, tiles)
    if 2 * splits * kp > length:  # the next pass would not be shorter by half: finish here
        return 1, n_blocks
    return splits, tiles


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8


def row_topk(
    values: torch.Tensor, k: int, ids: torch.Tensor | None = None, *, block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``values`` ``(nq, length)`` float32 (NaN-free), the ``min(k, length)`` largest, best first:
    ``(values, ids)``; ids are ``ids[row, column]`` (int64, ``-1`` allowed) or the columns; equal values
    rank the lower id first. Same as ``torch.topk`` up to the order of ties.

    ``block``: candidates per program block (tests use small ones).
    """
    nq, length = values.shape
    kc = min(k, length)
    if kc == 0 or nq == 0:
        return values[:, :kc], torch.empty(nq, kc, dtype=torch.int64, device=values.device)
    if not supported(kc):
        best, pos = torch.topk(values, kc, dim=1)
        return best, pos if ids is None else ids.gather(1, pos)
    if ids is None and filter_serves(nq, kc):
        return _filtered(values, kc, block)
    return _passes(values, ids, None, kc, block)


def filter_serves(nq: int, k: int) -> bool:
    """Whether :func:`row_topk` of ``nq`` rows without ids takes :func:`filtered_topk_kernel` for a top-``k``."""
    return nq >= FILTER_MIN_ROWS and k_pad(k) <= FILTER_MAX_K_PAD


def _filtered(values: torch.Tensor, kc: int, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_topk` of ``values`` ``(nq, length)`` by :func:`filtered_topk_kernel` (``kc ≥ 1``, ids the columns)."""
    nq, length = values.shape
    kp = k_pad(kc)
    block = max(block or FILTER_BLOCK, kp)
    out_val = torch.empty(nq, kc, dtype=torch.float32, device=values.device)
    out_idx = torch.empty(nq, kc, dtype=torch.int64, device=values.device)
    cap = max(kp, min(FILTER_CAP, pow2(length)))  # rows of fewer candidates never pass more than they hold
    passed = torch.empty(nq, cap, dtype=torch.int32, device=values.device)
    filtered_topk_kernel[(nq,)](values, passed, out_val, out_idx, length, values.stride(0), kc, kc, K_PAD=kp,
                                STRIPS=min(max(FILTER_STRIPS, kp), block), BLOCK=block, CAP=cap, BITONIC=bitonic(),
                                num_warps=_warps(block))
    return out_val, out_idx


def keys_topk(keys: torch.Tensor, k: int, *, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_topk` of candidates given as :func:`_keys` ``(nq, length)`` int64 (``INT64_MIN``: no candidate,
    decoded as ``-inf`` / ``-1``), for ``k`` with :func:`supported`: ``(values float32, ids int64)``, best first."""
    nq, length = keys.shape
    kc = min(k, length)
    if not supported(kc):
        raise ValueError(f"keys_topk needs k_pad(k) <= {MAX_K_PAD}, got k = {k}")
    if kc == 0 or nq == 0:
        return (torch.empty(nq, kc, dtype=torch.float32, device=keys.device),
                torch.empty(nq, kc, dtype=torch.int64, device=keys.device))
    return _passes(None, None, keys, kc, block)


def _passes(
    values: torch.Tensor | None, ids: torch.Tensor | None, keys: torch.Tensor | None, kc: int, block: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run :func:`topk_kernel` passes over float32 ``values`` (with ``ids``) or over ``keys`` until one program per row
    remains; ``(values, ids)`` of the best ``kc ≥ 1`` per row."""
    first_in = keys if values is None else values
    nq, length = first_in.shape
    device = first_in.device
    kp = k_pad(kc)
    block = max(block or (BLOCK_FEW if nq < SMALL_NQ else BLOCK), 2 * kp)
    out_val = torch.empty(nq, kc, dtype=torch.float32, device=device)
    out_idx = torch.empty(nq, kc, dtype=torch.int64, device=device)
    src_keys, first = keys, values is not None
    while True:
        splits, tiles = _plan(length, nq, block, kp)
        final = splits == 1
        out_keys = out_idx if final else torch.empty(nq, splits * kp, dtype=torch.int64, device=device)
        topk_kernel[(nq, splits)](
            out_val if values is None else values, out_idx if ids is None else ids,
            out_idx if src_keys is None else src_keys, out_keys, out_val, out_idx, length,
            values.stride(0) if first else src_keys.stride(0), 0 if ids is None else ids.stride(0),
            kc if final else splits * kp, kc,
            KEYS_IN=not first, HAS_IDS=ids is not None and first, FINAL=final, WRITE_VALUES=True,
            K_PAD=kp, BLOCK=block, TILES=tiles, BITONIC=bitonic(), num_warps=_warps(block),
        )
        if final:
            return out_val, out_idx
        src_keys, first, length = out_keys, False, splits * kp
