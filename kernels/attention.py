"""Triton decode attention over TurboQuant K/V codes (split-sequence "flash decoding").

One decode step of one layer: for each (batch row ``b``, KV head ``h``) the ``G`` query heads that
share the KV head (GQA) attend to

* ``n`` *coded* tokens: keys ``k_i − μ_k = s^k_i · ŷ^k_i · B_k`` and values ``v_i − μ_v = s^v_i · ŷ^v_i · B_v``
  (``ŷ`` the codebook levels in a quantizer's rotated domain, ``s`` the per-token scale, ``B`` the inverse
  rotation as a ``(D, head_dim)`` matrix); codes in the :mod:`tqvec.packing` layout, one quantizer
  (at most two segments) per side;
* up to two runs of *exact* tokens (attention sinks and the recent window), float16/bfloat16/float32.

Two kernels, no ``(heads, tokens)`` score matrix in memory:

1. :func:`split_kernel`, grid ``(b·h, splits + 1)``. Program ``(bh, s < splits)`` takes a contiguous slice of the
   coded tokens: it rotates its queries itself (``q̃ = log2(e) · scaling · q · Π_k``, one ``tl.dot``), scores each
   tile of codes with ``tl.dot`` (float16 operands, float32 accumulation), runs an online base-2 softmax,
   accumulates ``Σ p_i s^v_i ŷ^v_i`` and finally maps it back to head channels (``· B_v`` in float16 after dividing
   by ``l``, plus ``μ_v``, times ``l``).
   Program ``(bh, splits)`` attends exactly to the sink and window tokens (scores ``q·k − q·μ_k``: the same shift
   the codes carry, so both share one softmax). Each program writes its partial ``m``, ``l`` and accumulator
   ``(G, head_dim)`` (float32).
2. :func:`combine_kernel`, grid ``(b·h, G, channel chunks)``: the log-sum-exp merge of the ``splits + 1`` partials
   of one query head, written in the output dtype.

Coded logits are ``q̃ · s^k_i ŷ^k_i = log2(e)·scaling·⟨q, k_i − μ_k⟩``. A per-token validity mask (padding) may be given.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from tqvec.packing import Layout

from .launch import BoundLaunch, Launcher, cdiv, multiprocessors, pow2
from .ops import MIN_BLOCK_D, interpreting, segment_args
from .unpack import nibble_pairs, one_4bit_segment, row_bytes, segment_values, table_nibble_pair_asm

if TYPE_CHECKING:
    from tqvec.scan import CodeTable, DecodeAttention

LOG2E = 1.4426950408889634
T = TypeVar("T")


@triton.jit
def _values(row_ptrs, row_mask, levels_ptr, BYTE0: tl.constexpr, DIM0: tl.constexpr, BITS0: tl.constexpr,
            NBYTES0: tl.constexpr, ROW0: tl.constexpr, PAD0: tl.constexpr, BYTE1: tl.constexpr, DIM1: tl.constexpr,
            BITS1: tl.constexpr, NBYTES1: tl.constexpr, ROW1: tl.constexpr, PAD1: tl.constexpr,
            NIBBLES: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Float16 levels ``(BLOCK_N, PAD0)`` and ``(BLOCK_N, PAD1)`` of a side's (at most two) kernel segments.

    ``NIBBLES``: one 4-bit segment of ``2·DIM0`` channels read once as bytes, its low nibbles the first kernel
    segment and its high nibbles the second (:func:`~.unpack.nibble_pairs`); else each segment is read by
    :func:`~.unpack.segment_values` (the second one is 0 when ``DIM1`` is 0).
    """
    if NIBBLES:
        v0, v1 = nibble_pairs(row_bytes(row_ptrs, row_mask, 0, tl.arange(0, PAD0), DIM0), levels_ptr, ASM)
    else:
        v0 = segment_values(row_ptrs, row_mask, BYTE0, 0, levels_ptr + ROW0 * 256, DIM0, BITS0, NBYTES0, False,
                            BLOCK_N, PAD0).to(tl.float16)
        v1 = 0.0
        if DIM1 > 0:
            v1 = segment_values(row_ptrs, row_mask, BYTE1, 0, levels_ptr + ROW1 * 256, DIM1, BITS1, NBYTES1, False,
                                BLOCK_N, PAD1).to(tl.float16)
    return v0, v1


@triton.jit
def _matrix(ptr, row0, col0, n_rows, n_cols, stride, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Block ``ptr[row0 : row0 + ROWS, col0 : col0 + COLS]`` of a row-major matrix, zero past ``n_rows`` × ``n_cols``."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    return tl.load(ptr + (row0 + r)[:, None] * stride + (col0 + c)[None, :], mask=mask, other=0.0)


@triton.jit
def _partials(work_ptr, rows, DH: tl.constexpr):
    """Pointers to the partials in one float32 work buffer of ``rows`` = ``b·h · parts · G`` rows: the accumulators
    ``(rows, DH)``, then ``m`` ``(rows,)``, then ``l`` ``(rows,)``."""
    rows64 = rows.to(tl.int64)
    return work_ptr + rows64 * DH, work_ptr + rows64 * (DH + 1), work_ptr


@triton.jit
def _online_softmax(s, m, l):
    """Fold logits ``s`` ``(BLOCK_G, T)`` (base 2, ``-inf`` = masked) into ``(m, l)``: returns ``(p, alpha, m, l)``."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _exact_run(q, qmu, m, l, acc, k_ptr, v_ptr, valid_ptr, length, pos0, ring_total, ring_first,
               RING: tl.constexpr, HAS_VALID: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr,
               BLOCK_E: tl.constexpr):
    """Online softmax of the queries ``q`` ``(BLOCK_G, DH_PAD)`` over ``length`` exact tokens (row-major ``(length, DH)``
    keys and values; cache positions ``pos0 …``): updated ``(m, l, acc)``. Scores ``q·k − qmu``; products on tensor
    cores (TF32 on CUDA).

    ``RING``: the ``length`` rows are a ring of the newest positions: row ``e`` holds the position
    ``p ∈ [ring_total − length, ring_total)`` with ``p ≡ e (mod length)``, attended when ``p ≥ ring_first``."""
    c = tl.arange(0, DH_PAD)
    for e0 in range(0, length, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_mask = e < length
        mask = e_mask[:, None] & (c < DH)[None, :]
        k = tl.load(k_ptr + e[:, None] * DH + c[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + e[:, None] * DH + c[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) - qmu[:, None]
        ok = e_mask
        pos = pos0 + e
        if RING:
            pos = ring_total - length + (e + length - ring_total % length) % length
            ok = ok & (pos >= ring_first)
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + pos, mask=ok, other=0) != 0)
        p, alpha, m, l = _online_softmax(tl.where(ok[None, :], s, float("-inf")), m, l)
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return m, l, acc


# scalars that change every step or as the cache grows: not specialized (no recompilation)
@triton.jit(do_not_specialize=["n", "tokens_per_split", "n_splits", "n_sinks", "n_window", "kp_cap", "ks_cap", "vp_cap",
                               "vs_cap", "stride_valid_b"])
def split_kernel(
    q_ptr, rot_ptr, back_ptr, k_mean_ptr, v_mean_ptr,
    kp_ptr, ks_ptr, vp_ptr, vs_ptr, k_levels_ptr, v_levels_ptr,
    sk_ptr, sv_ptr, wk_ptr, wv_ptr, valid_ptr, ring_ptr, work_ptr,
    factor, n, tokens_per_split, n_heads, n_splits, n_sinks, n_window, kp_cap, ks_cap, vp_cap, vs_cap, stride_valid_b,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr,
    K_ROW_BYTES: tl.constexpr, V_ROW_BYTES: tl.constexpr,
    K0_CH: tl.constexpr, K0_DIM: tl.constexpr, K0_BITS: tl.constexpr, K0_NBYTES: tl.constexpr, K0_BYTE: tl.constexpr,
    K0_ROW: tl.constexpr, K0_PAD: tl.constexpr,
    K1_CH: tl.constexpr, K1_DIM: tl.constexpr, K1_BITS: tl.constexpr, K1_NBYTES: tl.constexpr, K1_BYTE: tl.constexpr,
    K1_ROW: tl.constexpr, K1_PAD: tl.constexpr, K_NIBBLES: tl.constexpr, K_ASM: tl.constexpr,
    V0_CH: tl.constexpr, V0_DIM: tl.constexpr, V0_BITS: tl.constexpr, V0_NBYTES: tl.constexpr, V0_BYTE: tl.constexpr,
    V0_ROW: tl.constexpr, V0_PAD: tl.constexpr,
    V1_CH: tl.constexpr, V1_DIM: tl.constexpr, V1_BITS: tl.constexpr, V1_NBYTES: tl.constexpr, V1_BYTE: tl.constexpr,
    V1_ROW: tl.constexpr, V1_PAD: tl.constexpr, V_NIBBLES: tl.constexpr, V_ASM: tl.constexpr,
    HAS_VALID: tl.constexpr, RING: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Program ``(bh, split)``: the partial ``m``, ``l`` ``(G,)`` and accumulator ``(G, DH)`` of coded tokens
    ``[split·tokens_per_split, …)`` of head ``bh`` (``split < n_splits``; ``-inf`` / 0 / 0 when empty) or of its
    exact tokens (``split == n_splits``). ``rot`` ``(DH, D)`` and ``back`` ``(D, DH)`` float16, channels in kernel order.
    Row-major operands: queries ``(b·h, G, DH)``; key codes ``(b·h, kp_cap, K_ROW_BYTES)`` uint8 and scales ``(b·h,
    ks_cap)`` (values likewise); sinks ``(b·h, n_sinks, DH)``, window ``(b·h, n_window, DH)``; ``valid`` rows
    ``stride_valid_b`` apart.

    ``RING`` (a static cache): ``ring`` holds int64 ``[total, codes_end]`` (cache positions), read here so one compiled
    launch serves every step: ``n`` becomes ``codes_end − n_sinks``, the sinks hold ``min(total, n_sinks)`` tokens and
    the window is a ring (:func:`_exact_run`)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // n_heads
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, DH_PAD)
    bh64 = bh.to(tl.int64)
    q = _matrix(q_ptr + bh64 * G * DH, 0, 0, G, DH, DH, BLOCK_G, DH_PAD).to(tl.float32) * factor
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    valid_row = valid_ptr + b.to(tl.int64) * stride_valid_b
    total = 0
    codes_end = 0
    if RING:
        total = tl.load(ring_ptr)
        codes_end = tl.load(ring_ptr + 1)
        n = codes_end - n_sinks
    if split < n_splits:
        q16 = q.to(tl.float16)
        q0 = tl.dot(q16, _matrix(rot_ptr, 0, K0_CH, DH, K0_DIM, D, DH_PAD, K0_PAD)).to(tl.float16)
        q1 = q0
        if K1_DIM > 0:
            q1 = tl.dot(q16, _matrix(rot_ptr, 0, K1_CH, DH, K1_DIM, D, DH_PAD, K1_PAD)).to(tl.float16)
        kp_base = kp_ptr + bh64 * kp_cap * K_ROW_BYTES
        vp_base = vp_ptr + bh64 * vp_cap * V_ROW_BYTES
        ks_base = ks_ptr + bh64 * ks_cap
        vs_base = vs_ptr + bh64 * vs_cap
        acc0 = tl.zeros((BLOCK_G, V0_PAD), tl.float32)
        acc1 = tl.zeros((BLOCK_G, V1_PAD), tl.float32)
        start = split * tokens_per_split
        stop = tl.minimum(start + tokens_per_split, n)
        for t0 in range(start, stop, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_mask = t < stop
            k0, k1 = _values(kp_base + t.to(tl.int64) * K_ROW_BYTES, t_mask, k_levels_ptr, K0_BYTE, K0_DIM, K0_BITS,
                             K0_NBYTES, K0_ROW, K0_PAD, K1_BYTE, K1_DIM, K1_BITS, K1_NBYTES, K1_ROW, K1_PAD, K_NIBBLES,
                             K_ASM, BLOCK_N)
            s = tl.dot(q0, tl.trans(k0))
            if K1_DIM > 0:
                s = tl.dot(q1, tl.trans(k1), s)
            s = s * tl.load(ks_base + t, mask=t_mask, other=0.0).to(tl.float32)[None, :]
            ok = t_mask
            if HAS_VALID:
                ok = ok & (tl.load(valid_row + n_sinks + t, mask=t_mask, other=0) != 0)
            p, alpha, m, l = _online_softmax(tl.where(ok[None, :], s, float("-inf")), m, l)
            pv = (p * tl.load(vs_base + t, mask=t_mask, other=0.0).to(tl.float32)[None, :]).to(tl.float16)
            v0, v1 = _values(vp_base + t.to(tl.int64) * V_ROW_BYTES, t_mask, v_levels_ptr, V0_BYTE, V0_DIM, V0_BITS,
                             V0_NBYTES, V0_ROW, V0_PAD, V1_BYTE, V1_DIM, V1_BITS, V1_NBYTES, V1_ROW, V1_PAD, V_NIBBLES,
                             V_ASM, BLOCK_N)
            acc0 = tl.dot(pv, v0, acc0 * alpha[:, None])
            if V1_DIM > 0:
                acc1 = tl.dot(pv, v1, acc1 * alpha[:, None])
        # back to head channels on float16 tensor cores, the accumulators divided by l first (they grow with the
        # slice's softmax mass, float16 would overflow)
        inv_l = 1.0 / tl.where(l > 0, l, 1.0)
        acc = tl.dot((acc0 * inv_l[:, None]).to(tl.float16), _matrix(back_ptr, V0_CH, 0, V0_DIM, DH, DH, V0_PAD, DH_PAD))
        if V1_DIM > 0:
            acc = tl.dot((acc1 * inv_l[:, None]).to(tl.float16), _matrix(back_ptr, V1_CH, 0, V1_DIM, DH, DH, V1_PAD,
                                                                          DH_PAD), acc)
        acc = (acc + tl.load(v_mean_ptr + bh64 * DH + c, mask=c < DH, other=0.0)[None, :]) * l[:, None]
    else:
        qmu = tl.sum(q * tl.load(k_mean_ptr + bh64 * DH + c, mask=c < DH, other=0.0)[None, :], axis=1)
        acc = tl.zeros((BLOCK_G, DH_PAD), tl.float32)
        sink_length = n_sinks
        if RING:
            sink_length = tl.minimum(total, n_sinks)
        m, l, acc = _exact_run(q, qmu, m, l, acc, sk_ptr + bh64 * n_sinks * DH, sv_ptr + bh64 * n_sinks * DH,
                               valid_row, sink_length, 0, 0, 0, False, HAS_VALID, DH, DH_PAD, BLOCK_E)
        m, l, acc = _exact_run(q, qmu, m, l, acc, wk_ptr + bh64 * n_window * DH, wv_ptr + bh64 * n_window * DH,
                               valid_row, n_window, n_sinks + n, total, codes_end, RING, HAS_VALID, DH, DH_PAD,
                               BLOCK_E)
    slot = (bh64 * (n_splits + 1) + split) * G
    m_ptr, l_ptr, acc_ptr = _partials(work_ptr, tl.num_programs(0) * (n_splits + 1) * G, DH)
    tl.store(m_ptr + slot + g, m, mask=g < G)
    tl.store(l_ptr + slot + g, l, mask=g < G)
    tl.store(acc_ptr + (slot + g[:, None]) * DH + c[None, :], acc, mask=(g < G)[:, None] & (c < DH)[None, :])


@triton.jit(do_not_specialize=["n_parts"])
def combine_kernel(work_ptr, out_ptr, n_parts, G: tl.constexpr, DH: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """Program ``(bh, g, chunk)``: log-sum-exp merge of the ``n_parts`` partials of query head ``g`` of ``bh`` (in
    ``work``, as :func:`split_kernel` wrote them) over channels ``chunk·BLOCK_C …``, written to ``out[bh, g]`` in
    ``out``'s dtype (all partials in one tile)."""
    bh = tl.program_id(0)
    m_ptr, l_ptr, acc_ptr = _partials(work_ptr, tl.num_programs(0) * n_parts * G, DH)
    gq = tl.program_id(1)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    slots = (bh.to(tl.int64) * n_parts + s) * G + gq
    m_s = tl.load(m_ptr + slots, mask=s < n_parts, other=float("-inf"))
    m_max = tl.max(m_s, axis=0)
    w = tl.exp2(m_s - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(w * tl.load(l_ptr + slots, mask=s < n_parts, other=0.0), axis=0)
    part = tl.load(acc_ptr + slots[:, None] * DH + c[None, :], mask=(s < n_parts)[:, None] & (c < DH)[None, :], other=0.0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (bh.to(tl.int64) * G + gq) * DH + c, out.to(out_ptr.dtype.element_ty), mask=c < DH)


# ---------------------------------------------------------------------------------------------- launcher
#: coded tokens per tile of :func:`split_kernel`, its warps and software-pipelining stages
BLOCK_N = 128
NUM_WARPS = 4
NUM_STAGES = 2
#: split-kernel programs per SM (coded slices and the exact-token program together: one wave), and a register cap
#: per thread (``maxnreg``; ``None``: the compiler's choice)
PROGRAMS_PER_SM = 4
MAX_REGISTERS: int | None = 128
#: on CUDA, decode 4-bit codes with PTX byte permutes (:func:`~.unpack.nibble_pair_asm`) instead of a table gather
ASM_DECODE = True
#: query rows per program: the GQA group padded to a power of two, at least this many (tensor-core tiles pad smaller
#: ones themselves; fewer padded rows mean less softmax work)
MIN_BLOCK_G = 8
#: exact tokens per step of the exact-token program; output channels per :func:`combine_kernel` program
BLOCK_E = 64
COMBINE_CHANNELS = 32
#: at most this many coded slices per head
MAX_SPLITS = 128


def _nibble_split(layout: Layout) -> bool:
    """One 4-bit segment over an even number of channels: read as low / high nibbles (channels permuted)."""
    return one_4bit_segment(layout) and layout.dim % 2 == 0


def channel_order(layout: Layout) -> torch.Tensor:
    """Rotated channel held by each kernel channel: evens then odds for nibble-split layouts, else the identity."""
    d = layout.dim
    if _nibble_split(layout):
        return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    return torch.arange(d)


#: direct launchers of the two kernels (:class:`~.launch.Launcher`: no per-call argument binding on CUDA)
SPLIT = Launcher(split_kernel)
COMBINE = Launcher(combine_kernel)
_MEMO: OrderedDict[tuple, tuple[tuple, object]] = OrderedDict()
#: :func:`_in_kernel_order`'s copies, by source matrix (identity) and (layout, axis)
_KERNEL_ORDER: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _memo(key: tuple, anchors: tuple, make: Callable[[], T]) -> T:
    """``make()``, cached under ``key`` (which holds the ids of ``anchors``) while those objects are alive and the same
    (least recently used out past 64 entries)."""
    hit = _MEMO.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], anchors)):
        hit = _MEMO[key] = (anchors, make())
        while len(_MEMO) > 64:
            _MEMO.popitem(last=False)
    else:
        _MEMO.move_to_end(key)
    return hit[1]


def _in_kernel_order(matrix: torch.Tensor, layout: Layout, dim: int) -> torch.Tensor:
    """``matrix`` as float16 with its rotated-channel axis ``dim`` in :func:`channel_order`, cached while ``matrix``
    lives (never evicted before: a CUDA graph that recorded a step holds the copy's address)."""
    copies = _KERNEL_ORDER.setdefault(matrix, {})
    if (layout, dim) not in copies:
        copies[layout, dim] = matrix.index_select(dim, channel_order(layout).to(matrix.device)).half().contiguous()
    return copies[layout, dim]


def prepare(a: DecodeAttention) -> None:
    """Make now what :class:`DecodeLaunch` caches for ``a``: its rotation matrices in kernel channel order (float16), its tables'
    PTX decoders (which read the levels on the host).

    A static cache calls it when it allocates its buffers: under ``torch.compile(mode="reduce-overhead")`` a decode
    step is recorded into a CUDA graph, whose memory pool must not hold tensors that outlive the step (cudagraph trees
    refuse them) and during whose capture nothing may be copied to the host: nothing the step caches may be made then.
    The rest of its setup is host arithmetic (constants cached per configuration) and the step's own work
    buffer, which a graph records as such."""
    _in_kernel_order(a.key_rotation, a.keys.table.layout, 1)
    _in_kernel_order(a.value_back, a.values.table.layout, 0)
    for table in (a.keys.table, a.values.table):
        table_nibble_pair_asm(table)


def _asm(table: CodeTable, prefix: str, use: bool) -> dict[str, str]:
    """``{prefix}_ASM``: :func:`~.unpack.nibble_pair_asm` for a nibble-split layout, else ``""``."""
    return {f"{prefix}_ASM": table_nibble_pair_asm(table) if use and _nibble_split(table.layout) else ""}


@functools.lru_cache(maxsize=64)
def _segments(layout: Layout, prefix: str) -> dict[str, int]:
    """Constexprs ``{prefix}{0,1}_{CH,DIM,BITS,NBYTES,BYTE,ROW,PAD}`` and ``{prefix}_NIBBLES`` of the kernel's (at most
    two) segments: the low and high nibbles of a nibble-split layout, else the layout's own (:func:`~.ops.segment_args`)."""
    if _nibble_split(layout):
        half = layout.dim // 2
        out = {f"{prefix}{s}_{k}": v for s in range(2)
               for k, v in dict(CH=s * half, DIM=half, BITS=4, NBYTES=half, BYTE=0, ROW=0).items()}
    else:
        out = segment_args(layout, prefix)
    out[f"{prefix}_NIBBLES"] = _nibble_split(layout)
    for s in range(2):  # channels per tl.dot: at least MIN_BLOCK_D (16 miscompiled on the H200)
        out[f"{prefix}{s}_PAD"] = max(MIN_BLOCK_D, pow2(max(out[f"{prefix}{s}_DIM"], 1)))
    return out


def _split_cap(device: torch.device, heads: int, interpret: bool) -> int:
    """At most this many coded slices per head: ``heads · (slices + 1)`` programs fill ``PROGRAMS_PER_SM`` per SM without
    starting a second wave (at least 1; 3 under the interpreter)."""
    if interpret:
        return 3
    return max(1, min(PROGRAMS_PER_SM * multiprocessors(device) // heads - 1, MAX_SPLITS))


def _split_constexprs(keys: CodeTable, values: CodeTable, G: int, dh: int, has_valid: bool, ring: bool,
                      interpret: bool) -> dict[str, object]:
    """:func:`split_kernel`'s compile-time arguments and launch options (cached per tables, shapes and the module's
    tuning constants)."""
    def make() -> dict[str, object]:
        return dict(
            G=G, BLOCK_G=max(MIN_BLOCK_G, pow2(G)), D=keys.layout.dim, DH=dh, DH_PAD=_dh_pad(dh),
            K_ROW_BYTES=keys.layout.row_bytes, V_ROW_BYTES=values.layout.row_bytes,
            **_segments(keys.layout, "K"), **_asm(keys, "K", ASM_DECODE and not interpret),
            **_segments(values.layout, "V"), **_asm(values, "V", ASM_DECODE and not interpret),
            HAS_VALID=has_valid, RING=ring, BLOCK_N=_block_n(interpret), BLOCK_E=16 if interpret else BLOCK_E,
            num_warps=NUM_WARPS, num_stages=1 if interpret else NUM_STAGES,
            **({} if interpret or MAX_REGISTERS is None else {"maxnreg": MAX_REGISTERS}))
    return _memo(("split", id(keys), id(values), G, dh, has_valid, ring, interpret, tuning()), (keys, values), make)


def tuning() -> tuple:
    """The module's tuning constants now (a :class:`DecodeLaunch` is made under one setting of them)."""
    return BLOCK_N, NUM_WARPS, NUM_STAGES, MAX_REGISTERS, MIN_BLOCK_G, ASM_DECODE, BLOCK_E, PROGRAMS_PER_SM


def _block_n(interpret: bool) -> int:
    """Coded tokens per tile of :func:`split_kernel` (small under the interpreter)."""
    return 16 if interpret else BLOCK_N


#: :func:`split_kernel`'s runtime arguments that change from one decode step to the next (the others are bound once)
STEP_ARGUMENTS = ("q_ptr", "wk_ptr", "wv_ptr", "valid_ptr", "work_ptr", "n", "tokens_per_split", "n_splits", "n_window",
                  "stride_valid_b")


class DecodeLaunch:
    """The two kernels of a layer's decode steps, bound once to what stays put while its cache does not grow: the codes
    and scales (at their capacity), the sinks, the centering means, the rotations, the code tables, the scaling, the
    query shape and whether a validity mask is given (all from the :class:`~tqvec.scan.DecodeAttention` ``a`` it is
    made from). A call passes what moves from step to step and returns the attention output.

    Parameters of a call: ``queries`` ``(b, h, G, head_dim)`` (the shape ``a``'s had; any float dtype), the window
    ``window_keys`` / ``window_values`` ``(b, h, w, head_dim)`` (any ``w``; a static cache's fixed ring), ``n_codes``
    (coded tokens now; a static cache's capacity), ``valid`` ``(b, kv_length)`` bool or None, as ``a.valid`` was.
    Returns ``(b, h, G, head_dim)`` in the queries' dtype. The bound tensors are read at each launch, so the codes
    appended in place (``n_codes`` growing within their capacity) are seen; a cache that reallocates its buffers
    needs a new ``DecodeLaunch``.

    With ``a.ring`` (a static cache) the slices cover the codes' whole capacity and the kernel reads the lengths from
    the device, so every step's launch is the same (no host synchronization: it can be captured in a CUDA graph);
    slices past the codes written so far return empty partials.

    Raises ``ValueError`` for channel groups coded apart (CPU only), keys and values of different rotated dimensions,
    or a call whose shapes or mask presence differ from ``a``'s. ``tuning`` holds the module's tuning constants it was
    made under (:func:`tuning`); ``copied`` says that it holds a copy of some tensor of ``a`` (not contiguous, or
    means not float32), which a cache must then not keep.

    Example::

        launch = DecodeLaunch(step)          # step: a DecodeAttention on CUDA
        out = launch(step.queries, step.window_keys, step.window_values, step.n_codes, step.valid)
    """

    def __init__(self, a: DecodeAttention) -> None:
        if a.key_segments or a.value_segments:
            raise ValueError("channel groups coded apart (key_segments / value_segments) are served on the CPU only")
        keys, values = a.keys, a.values
        if values.table.layout.dim != keys.table.layout.dim:
            raise ValueError("keys and values must share the rotated dimension")
        self.interpret = interpret = interpreting()
        self.shape = b, h, G, dh = tuple(a.queries.shape)
        self.has_valid = a.valid is not None
        self.block_n = _block_n(interpret)
        self.cap = _split_cap(a.queries.device, b * h, interpret)
        self.tuning = tuning()
        held = (keys.packed, keys.scale, values.packed, values.scale, a.sink_keys, a.sink_values, a.key_mean,
                a.value_mean)
        kp, ks, vp, vs, sk, sv = (t.contiguous() for t in held[:6])
        self._dummy = k_mean = a.key_mean.float().contiguous()  # also the pointer of an absent mask or ring
        v_mean = a.value_mean.float().contiguous()
        #: a bound tensor is a copy of the step's (not contiguous, or means not float32): later writes to the cache's
        #: own tensors are not seen, so a cache must not keep this launch
        self.copied = any(b is not t for b, t in zip((kp, ks, vp, vs, sk, sv, k_mean, v_mean), held))
        fixed = dict(
            rot_ptr=_in_kernel_order(a.key_rotation, keys.table.layout, 1),
            back_ptr=_in_kernel_order(a.value_back, values.table.layout, 0), k_mean_ptr=k_mean,
            v_mean_ptr=v_mean, kp_ptr=kp, ks_ptr=ks, vp_ptr=vp, vs_ptr=vs,
            k_levels_ptr=keys.table.levels, v_levels_ptr=values.table.levels, sk_ptr=sk, sv_ptr=sv,
            ring_ptr=k_mean if a.ring is None else a.ring, factor=a.scaling * LOG2E, n_heads=h, n_sinks=sk.shape[2],
            kp_cap=kp.shape[2], ks_cap=ks.shape[2], vp_cap=vp.shape[2], vs_cap=vs.shape[2])
        self._combines: dict[int, BoundLaunch] = {}  # by partials per tile (grows with the slices)
        self._split = SPLIT.bind(fixed, STEP_ARGUMENTS, _split_constexprs(keys.table, values.table, G, dh, self.has_valid,
                                                                         a.ring is not None, interpret), interpret)

    def __call__(self, queries: torch.Tensor, window_keys: torch.Tensor, window_values: torch.Tensor, n_codes: int,
                 valid: torch.Tensor | None) -> torch.Tensor:
        return self.combine(self.split(queries, window_keys, window_values, n_codes, valid))

    def attend(self, a: DecodeAttention) -> torch.Tensor:
        """The call over the moving tensors of ``a`` (a step shaped as the one the launch was made from)."""
        return self(a.queries, a.window_keys, a.window_values, a.n_codes, a.valid)

    def split_step(self, a: DecodeAttention) -> Partials:
        """:meth:`split` over the moving tensors of ``a``."""
        return self.split(a.queries, a.window_keys, a.window_values, a.n_codes, a.valid)

    def split(self, queries: torch.Tensor, window_keys: torch.Tensor, window_values: torch.Tensor, n_codes: int,
              valid: torch.Tensor | None) -> Partials:
        """Launch :func:`split_kernel` (the call's first half; arguments as the call's): its :class:`Partials`."""
        b, h, G, dh = self.shape
        if tuple(queries.shape) != self.shape or (valid is not None) != self.has_valid:
            raise ValueError(f"queries {tuple(queries.shape)} (mask given: {valid is not None}) do not match the bound "
                             f"launch's {self.shape} (mask given: {self.has_valid})")
        q_rows = queries.reshape(b * h, G, dh)
        if not q_rows.is_contiguous():
            q_rows = q_rows.contiguous()
        if not window_keys.is_contiguous():
            window_keys = window_keys.contiguous()
        if not window_values.is_contiguous():
            window_values = window_values.contiguous()
        splits = 0 if n_codes == 0 else min(self.cap, cdiv(n_codes, self.block_n))
        per_split = cdiv(cdiv(max(n_codes, 1), max(splits, 1)), self.block_n) * self.block_n
        splits = cdiv(n_codes, per_split)
        work = torch.empty(b * h * (splits + 1) * G * (dh + 2), dtype=torch.float32, device=queries.device)
        stride = 0
        if valid is None:
            valid = self._dummy
        else:
            if valid.dtype == torch.bool:
                valid = valid.view(torch.uint8)
            if valid.stride(1) != 1:
                valid = valid.contiguous()
            stride = valid.stride(0)
        self._split((b * h, splits + 1), (q_rows, window_keys, window_values, valid, work, n_codes, per_split, splits,
                                          window_keys.shape[2], stride))
        return Partials(work, splits + 1, queries.dtype)

    def combine(self, p: Partials) -> torch.Tensor:
        """Launch :func:`combine_kernel` (the call's second half): the output of the step whose partials ``p`` are."""
        b, h, G, dh = self.shape
        out = torch.empty(self.shape, dtype=p.dtype, device=p.work.device)
        block_c = min(COMBINE_CHANNELS, pow2(dh))
        block_s = max(16, pow2(p.parts))
        launch = self._combines.get(block_s)
        if launch is None:
            launch = self._combines[block_s] = COMBINE.bind({}, ("work_ptr", "out_ptr", "n_parts"), _combine_constexprs(
                G, dh, block_s, block_c), self.interpret)
        launch((b * h, G, cdiv(dh, block_c)), (p.work, out, p.parts))
        return out


@dataclass
class Partials:
    """Per-slice softmax state of one decode step, as :func:`split_kernel` leaves it: ``work`` float32, the accumulators
    ``(b·h · parts · G, head_dim)`` then ``m`` and ``l`` (``parts`` = coded slices + 1 exact part), and the output
    dtype."""

    work: torch.Tensor
    parts: int
    dtype: torch.dtype


@functools.lru_cache(maxsize=64)
def _combine_constexprs(G: int, dh: int, block_s: int, block_c: int) -> dict[str, int]:
    """:func:`combine_kernel`'s compile-time arguments and launch options (one dict per configuration)."""
    return dict(G=G, DH=dh, BLOCK_S=block_s, BLOCK_C=block_c, num_warps=4)


def _dh_pad(dh: int) -> int:
    """Head channels per ``tl.dot`` operand: a power of two, at least ``MIN_BLOCK_D``."""
    return max(MIN_BLOCK_D, pow2(dh))


def decode_attention(a: DecodeAttention) -> torch.Tensor:
    """Output ``(b, h, G, head_dim)`` in ``a.queries.dtype`` of one decode step (see the module docstring); a caller
    that runs many steps over one cache keeps a :class:`DecodeLaunch` instead."""
    return DecodeLaunch(a)(a.queries, a.window_keys, a.window_values, a.n_codes, a.valid)
