"""Triton decode attention over TurboQuant K/V codes (split-sequence "flash decoding").

One decode step of one layer: for each (batch row ``b``, KV head ``h``) the ``G`` query heads that
share the KV head (GQA) attend to

* ``n`` *coded* tokens: keys ``k_i − μ_k = s^k_i · ŷ^k_i · B_k`` and values ``v_i − μ_v = s^v_i · ŷ^v_i · B_v``
  (``ŷ`` the codebook levels in a quantizer's rotated domain, ``s`` the per-token scale, ``B`` the inverse
  rotation as a ``(D, head_dim)`` matrix); codes in the :mod:`tqvec.packing` layout, one quantizer
  (at most two segments) per side;
* up to two runs of *exact* tokens (attention sinks and the recent window), float16/bfloat16/float32.

Three kernels, no ``(heads, tokens)`` score matrix in memory:

0. :func:`query_kernel`, grid ``(b·h·G,)``: ``q̃`` and the unrotated ``log2(e)·scaling·q`` the combine needs.
1. :func:`split_kernel`, grid ``(b·h, splits)``: each program scores a contiguous slice of the coded
   tokens with ``tl.dot`` (float16 operands, float32 accumulation) against the rotated, pre-scaled
   queries ``q̃ = log2(e) · scaling · Π_k q``, runs an online base-2 softmax and accumulates
   ``Σ p_i s^v_i ŷ^v_i``; it writes the slice's running max ``m``, sum ``l`` and accumulator.
2. :func:`combine_kernel`, grid ``(b·h, G)``: merges the slices (log-sum-exp), maps the accumulator back
   with ``B_v`` and adds ``μ_v · l``, attends exactly to the sink and window tokens (scores
   ``q·k − q·μ_k``, the same shift the codes carry), merges both parts and writes the output.

Coded logits are ``q̃ · s^k_i ŷ^k_i = log2(e)·scaling·⟨q, k_i − μ_k⟩``; the exact part subtracts
``⟨q, μ_k⟩`` too, so both parts share one softmax. A per-token validity mask (padding) may be given.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from tqvec.packing import Layout

from .ops import MIN_BLOCK_D, interpreting, segment_args
from .unpack import nibble_asm, nibble_values, segment_values

if TYPE_CHECKING:
    from tqvec.scan import CodeTable, DecodeAttention

LOG2E = 1.4426950408889634


@triton.jit
def _decode(row_ptrs, row_mask, levels_ptr, BYTE: tl.constexpr, DIM: tl.constexpr, BITS: tl.constexpr,
            NBYTES: tl.constexpr, NIB: tl.constexpr, PAD: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """``(BLOCK_N, PAD)`` float16 levels of one (virtual) segment.

    ``NIB`` 0 / 4: the low / high nibbles of the segment's ``DIM`` bytes (one channel per byte, no
    reshuffling in registers), levels gathered from the table or, when ``ASM`` is given, by the PTX byte
    permutes of :func:`nibble_asm` (four codes per instruction); ``NIB`` −1: a layout segment read by
    :func:`segment_values`.
    """
    if NIB >= 0:
        v = nibble_values(row_ptrs, row_mask, BYTE, 0, DIM, PAD, levels_ptr, NIB, ASM)
    else:
        v = segment_values(row_ptrs, row_mask, BYTE, 0, levels_ptr, DIM, BITS, NBYTES, False, BLOCK_N, PAD)
    return v.to(tl.float16)


@triton.jit
def _load_q(q_ptr, g, g_mask, CH: tl.constexpr, DIM: tl.constexpr, PAD: tl.constexpr, D: tl.constexpr):
    """Rotated queries ``(BLOCK_G, PAD)`` float16, channels ``CH .. CH + DIM`` (zero past ``DIM``)."""
    c = tl.arange(0, PAD)
    q = tl.load(q_ptr + g[:, None] * D + CH + c[None, :], mask=g_mask[:, None] & (c < DIM)[None, :], other=0.0)
    return q.to(tl.float16)


@triton.jit
def query_kernel(q_ptr, rot_ptr, qx_ptr, q_rot_ptr, stride_q, factor,
                 DH: tl.constexpr, D: tl.constexpr, DH_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """Program ``row``: ``qx[row] = factor · q[row]`` ``(DH,)`` and ``q_rot[row] = qx[row] · rot`` ``(D,)``, float32;
    ``rot`` ``(DH, D)`` float32 (the keys' rotation, channels in kernel order)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, DH_PAD)
    r = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + row * stride_q + c, mask=c < DH, other=0.0).to(tl.float32) * factor
    tl.store(qx_ptr + row * DH + c, q, mask=c < DH)
    rot = tl.load(rot_ptr + c[:, None] * D + r[None, :], mask=(c < DH)[:, None] & (r < D)[None, :], other=0.0)
    tl.store(q_rot_ptr + row * D + r, tl.sum(q[:, None] * rot, axis=0), mask=r < D)


@triton.jit(do_not_specialize=["n", "n_splits"])  # n grows by one per decode step: no recompiles
def split_kernel(
    q_ptr, kp_ptr, ks_ptr, vp_ptr, vs_ptr, k_levels_ptr, v_levels_ptr, valid_ptr,
    m_ptr, l_ptr, acc_ptr,
    n, tokens_per_split, n_heads, n_splits,
    stride_kp_b, stride_kp_h, stride_kp_t, stride_ks_b, stride_ks_h,
    stride_vp_b, stride_vp_h, stride_vp_t, stride_vs_b, stride_vs_h, stride_valid_b,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    K0_CH: tl.constexpr, K0_DIM: tl.constexpr, K0_BITS: tl.constexpr, K0_NBYTES: tl.constexpr, K0_BYTE: tl.constexpr,
    K0_ROW: tl.constexpr, K0_NIB: tl.constexpr, K0_PAD: tl.constexpr,
    K1_CH: tl.constexpr, K1_DIM: tl.constexpr, K1_BITS: tl.constexpr, K1_NBYTES: tl.constexpr, K1_BYTE: tl.constexpr,
    K1_ROW: tl.constexpr, K1_NIB: tl.constexpr, K1_PAD: tl.constexpr,
    V0_CH: tl.constexpr, V0_DIM: tl.constexpr, V0_BITS: tl.constexpr, V0_NBYTES: tl.constexpr, V0_BYTE: tl.constexpr,
    V0_ROW: tl.constexpr, V0_NIB: tl.constexpr, V0_PAD: tl.constexpr,
    V1_CH: tl.constexpr, V1_DIM: tl.constexpr, V1_BITS: tl.constexpr, V1_NBYTES: tl.constexpr, V1_BYTE: tl.constexpr,
    V1_ROW: tl.constexpr, V1_NIB: tl.constexpr, V1_PAD: tl.constexpr,
    HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr,
    K0_ASM: tl.constexpr, K1_ASM: tl.constexpr, V0_ASM: tl.constexpr, V1_ASM: tl.constexpr,
):
    """Program ``(bh, split)``: coded tokens ``[split·tokens_per_split, …)`` of head ``bh`` → ``m``, ``l`` ``(G,)``
    and the rotated-domain accumulator ``(G, D)`` of that slice (``-inf`` / 0 / 0 when it is empty)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    g = tl.arange(0, BLOCK_G)
    g_mask = g < G
    q_base = q_ptr + bh.to(tl.int64) * G * D
    q0 = _load_q(q_base, g, g_mask, K0_CH, K0_DIM, K0_PAD, D)
    if K1_DIM > 0:
        q1 = _load_q(q_base, g, g_mask, K1_CH, K1_DIM, K1_PAD, D)
    kp_base = kp_ptr + b.to(tl.int64) * stride_kp_b + h.to(tl.int64) * stride_kp_h
    vp_base = vp_ptr + b.to(tl.int64) * stride_vp_b + h.to(tl.int64) * stride_vp_h
    ks_base = ks_ptr + b.to(tl.int64) * stride_ks_b + h.to(tl.int64) * stride_ks_h
    vs_base = vs_ptr + b.to(tl.int64) * stride_vs_b + h.to(tl.int64) * stride_vs_h
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc0 = tl.zeros((BLOCK_G, V0_PAD), tl.float32)
    acc1 = tl.zeros((BLOCK_G, V1_PAD), tl.float32)
    start = split * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, n)
    for t0 in range(start, stop, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < stop
        k_rows = kp_base + t.to(tl.int64) * stride_kp_t
        k = _decode(k_rows, t_mask, k_levels_ptr + K0_ROW * 256, K0_BYTE, K0_DIM, K0_BITS, K0_NBYTES, K0_NIB, K0_PAD,
                    BLOCK_N, K0_ASM)
        s = tl.dot(q0, tl.trans(k))
        if K1_DIM > 0:
            k = _decode(k_rows, t_mask, k_levels_ptr + K1_ROW * 256, K1_BYTE, K1_DIM, K1_BITS, K1_NBYTES, K1_NIB,
                        K1_PAD, BLOCK_N, K1_ASM)
            s += tl.dot(q1, tl.trans(k))
        s = s * tl.load(ks_base + t, mask=t_mask, other=0.0).to(tl.float32)[None, :]
        ok = t_mask
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + b.to(tl.int64) * stride_valid_b + t, mask=t_mask, other=0) != 0)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        pv = (p * tl.load(vs_base + t, mask=t_mask, other=0.0).to(tl.float32)[None, :]).to(tl.float16)
        v_rows = vp_base + t.to(tl.int64) * stride_vp_t
        v = _decode(v_rows, t_mask, v_levels_ptr + V0_ROW * 256, V0_BYTE, V0_DIM, V0_BITS, V0_NBYTES, V0_NIB, V0_PAD,
                    BLOCK_N, V0_ASM)
        acc0 = acc0 * alpha[:, None] + tl.dot(pv, v)
        if V1_DIM > 0:
            v = _decode(v_rows, t_mask, v_levels_ptr + V1_ROW * 256, V1_BYTE, V1_DIM, V1_BITS, V1_NBYTES, V1_NIB,
                        V1_PAD, BLOCK_N, V1_ASM)
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, v)
        m = m_new
    slot = (bh.to(tl.int64) * n_splits + split) * G
    tl.store(m_ptr + slot + g, m, mask=g_mask)
    tl.store(l_ptr + slot + g, l, mask=g_mask)
    c0 = tl.arange(0, V0_PAD)
    tl.store(acc_ptr + (slot + g[:, None]) * D + V0_CH + c0[None, :], acc0, mask=g_mask[:, None] & (c0 < V0_DIM)[None, :])
    if V1_DIM > 0:
        c1 = tl.arange(0, V1_PAD)
        tl.store(acc_ptr + (slot + g[:, None]) * D + V1_CH + c1[None, :], acc1,
                 mask=g_mask[:, None] & (c1 < V1_DIM)[None, :])


@triton.jit
def _exact_run(
    q, qmu, m, l, acc, k_ptr, v_ptr, valid_ptr, length, pos0, stride_k_t, stride_v_t, d_mask,
    HAS_VALID: tl.constexpr, DH: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Online softmax of one query over ``length`` exact tokens (cache positions ``pos0 …``): updated ``(m, l, acc)``."""
    c = tl.arange(0, DH)
    for e0 in range(0, length, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_mask = e < length
        k = tl.load(k_ptr + e[:, None] * stride_k_t + c[None, :], mask=e_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(v_ptr + e[:, None] * stride_v_t + c[None, :], mask=e_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) - qmu
        ok = e_mask
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + pos0 + e, mask=e_mask, other=0) != 0)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m = m_new
    return m, l, acc


@triton.jit(do_not_specialize=["n_splits", "n_sinks", "n_window", "n_codes"])
def combine_kernel(
    qx_ptr, m_ptr, l_ptr, acc_ptr, back_ptr, k_mean_ptr, v_mean_ptr,
    sk_ptr, sv_ptr, wk_ptr, wv_ptr, valid_ptr, out_ptr,
    n_heads, n_splits, n_sinks, n_window, n_codes,
    stride_sk_b, stride_sk_h, stride_sk_t, stride_sv_b, stride_sv_h, stride_sv_t,
    stride_wk_b, stride_wk_h, stride_wk_t, stride_wv_b, stride_wv_h, stride_wv_t, stride_valid_b,
    G: tl.constexpr, D: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr,
    HAS_VALID: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Program ``(bh, g)``, one query head: merge its coded slices, map them back (``back`` ``(D, DH)``), add the
    exact tokens, write ``out[bh, g]`` ``(DH,)`` in ``out``'s dtype. ``qx`` ``(b·h·G, DH)`` float32 is ``log2(e)·scaling·q``."""
    bh = tl.program_id(0)
    gq = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    row = bh.to(tl.int64) * G + gq
    c = tl.arange(0, DH_PAD)
    d_mask = c < DH
    # coded part: log-sum-exp merge of the slices, then back to head channels BLOCK_R rotated channels at a time
    s = tl.arange(0, BLOCK_S)
    slots = (bh.to(tl.int64) * n_splits + s) * G + gq
    m_s = tl.load(m_ptr + slots, mask=s < n_splits, other=float("-inf"))
    m_c = tl.max(m_s, axis=0)
    m_c_safe = tl.where(m_c == float("-inf"), 0.0, m_c)
    w = tl.exp2(m_s - m_c_safe)
    l_c = tl.sum(w * tl.load(l_ptr + slots, mask=s < n_splits, other=0.0), axis=0)
    coded = l_c * tl.load(v_mean_ptr + bh.to(tl.int64) * DH + c, mask=d_mask, other=0.0)
    for r0 in range(0, D, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        part = tl.load(acc_ptr + slots[:, None] * D + r[None, :], mask=(s < n_splits)[:, None] & (r < D)[None, :], other=0.0)
        back = tl.load(back_ptr + r[:, None] * DH + c[None, :], mask=(r < D)[:, None] & d_mask[None, :], other=0.0)
        acc_r = tl.sum(w[:, None] * part, axis=0)
        coded += tl.sum(acc_r[:, None] * back, axis=0)
    # exact part: sinks, then the window (cache positions 0 … and n_sinks + n_codes …)
    q = tl.load(qx_ptr + row * DH + c, mask=d_mask, other=0.0)
    qmu = tl.sum(q * tl.load(k_mean_ptr + bh.to(tl.int64) * DH + c, mask=d_mask, other=0.0), axis=0)
    m_e = tl.max(tl.full((1,), float("-inf"), tl.float32), axis=0)
    l_e = tl.sum(tl.zeros((1,), tl.float32), axis=0)
    acc_e = tl.zeros((DH_PAD,), tl.float32)
    valid_row = valid_ptr + b.to(tl.int64) * stride_valid_b
    m_e, l_e, acc_e = _exact_run(
        q, qmu, m_e, l_e, acc_e, sk_ptr + b.to(tl.int64) * stride_sk_b + h.to(tl.int64) * stride_sk_h,
        sv_ptr + b.to(tl.int64) * stride_sv_b + h.to(tl.int64) * stride_sv_h, valid_row, n_sinks, 0,
        stride_sk_t, stride_sv_t, d_mask, HAS_VALID, DH_PAD, BLOCK_E)
    m_e, l_e, acc_e = _exact_run(
        q, qmu, m_e, l_e, acc_e, wk_ptr + b.to(tl.int64) * stride_wk_b + h.to(tl.int64) * stride_wk_h,
        wv_ptr + b.to(tl.int64) * stride_wv_b + h.to(tl.int64) * stride_wv_h, valid_row, n_window, n_sinks + n_codes,
        stride_wk_t, stride_wv_t, d_mask, HAS_VALID, DH_PAD, BLOCK_E)
    m = tl.maximum(m_c, m_e)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_c = tl.exp2(m_c - m_safe)
    w_e = tl.exp2(m_e - m_safe)
    total = w_c * l_c + w_e * l_e
    out = (w_c * coded + w_e * acc_e) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * DH + c, out.to(out_ptr.dtype.element_ty), mask=d_mask)


# ---------------------------------------------------------------------------------------------- launcher
#: coded tokens per tile of :func:`split_kernel`
BLOCK_N = 128
#: aim for this many split programs per SM (enough to hide the code loads' latency)
PROGRAMS_PER_SM = 8
NUM_WARPS = 4
NUM_STAGES = 2
#: on CUDA, decode 4-bit codes with PTX byte permutes (:func:`nibble_asm`) instead of a table gather
ASM_DECODE = True
#: rotated channels / exact tokens per step of :func:`combine_kernel`, and its warps (H200, batch 1, 32k tokens,
#: graph-replayed, cold L2: 21.0 µs with 4 warps, 24.8 with 8; 64 rows against 32 or 128 rows: 21.0, 23.6, 21.7)
COMBINE_ROWS = 64
COMBINE_WARPS = 4
#: at most this many slices per head (the combine kernel merges them in one tile)
MAX_SPLITS = 128
_SM_COUNT: dict[int, int] = {}


def _nibble_split(layout: Layout) -> bool:
    """One 4-bit segment over an even number of channels: read as low / high nibbles (channels permuted)."""
    return len(layout.segments) == 1 and layout.segments[0][1] == 4 and layout.dim % 2 == 0


def channel_order(layout: Layout) -> torch.Tensor:
    """Rotated channel held by each kernel channel: evens then odds for nibble-split layouts, else the identity."""
    d = layout.dim
    if _nibble_split(layout):
        return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    return torch.arange(d)


_ORDERED: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()


def _in_kernel_order(matrix: torch.Tensor, layout: Layout, dim: int) -> torch.Tensor:
    """``matrix`` float32 with its rotated-channel axis ``dim`` in :func:`channel_order` (cached per tensor)."""
    key = (id(matrix), matrix.device, layout, dim)
    hit = _ORDERED.get(key)
    if hit is None or hit[0] is not matrix:
        order = channel_order(layout).to(matrix.device)
        hit = _ORDERED[key] = (matrix, matrix.float().index_select(dim, order).contiguous())
        while len(_ORDERED) > 64:
            _ORDERED.popitem(last=False)
    return hit[1]


def _asm(table: CodeTable, prefix: str, use: bool) -> dict[str, str]:
    """``{prefix}{0,1}_ASM`` constexprs: :func:`nibble_asm` for a nibble-split layout (cached on ``table``), else ``""``."""
    if not (use and _nibble_split(table.layout)):
        return {f"{prefix}0_ASM": "", f"{prefix}1_ASM": ""}
    key = "tqvec.kernels.attention.asm"
    if key not in table._luts:
        table._luts[key] = (nibble_asm(table.levels[0], 0), nibble_asm(table.levels[0], 4))
    low, high = table._luts[key]
    return {f"{prefix}0_ASM": low, f"{prefix}1_ASM": high}


@functools.lru_cache(maxsize=64)
def _segments(layout: Layout, prefix: str) -> dict[str, int]:
    """Constexprs ``{prefix}{0,1}_{CH,DIM,BITS,NBYTES,BYTE,ROW,NIB,PAD}`` of the kernel's (at most two) segments:
    the low and high nibbles of a nibble-split layout, else the layout's own (:func:`~.ops.segment_args`)."""
    if _nibble_split(layout):
        half = layout.dim // 2
        out = {f"{prefix}{s}_{k}": v for s, nib in enumerate((0, 4))
               for k, v in dict(CH=s * half, DIM=half, BITS=4, NBYTES=half, BYTE=0, ROW=0, NIB=nib).items()}
    else:
        out = segment_args(layout, prefix) | {f"{prefix}{s}_NIB": -1 for s in range(2)}
    for s in range(2):  # channels per tl.dot: at least MIN_BLOCK_D (16 miscompiled on the H200)
        out[f"{prefix}{s}_PAD"] = max(MIN_BLOCK_D, triton.next_power_of_2(max(out[f"{prefix}{s}_DIM"], 1)))
    return out


def _n_splits(device: torch.device, heads: int, n: int, interpret: bool) -> int:
    """Slices per head: about ``PROGRAMS_PER_SM`` programs per SM, at least one tile of tokens each."""
    if interpret:
        return max(1, min(3, triton.cdiv(n, 16)))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * _SM_COUNT[index], heads), triton.cdiv(n, BLOCK_N), MAX_SPLITS))


def decode_attention(a: DecodeAttention) -> torch.Tensor:
    """Output ``(b, h, G, head_dim)`` in ``a.queries.dtype`` of one decode step (see the module docstring)."""
    interpret = interpreting()
    q = a.queries
    b, h, G, dh = q.shape
    keys, values = a.keys, a.values
    D = keys.table.layout.dim
    if values.table.layout.dim != D:
        raise ValueError("keys and values must share the rotated dimension")
    dev = q.device
    block_n = 16 if interpret else BLOCK_N
    q_rows = q.reshape(b * h * G, dh)
    if q_rows.stride(1) != 1:
        q_rows = q_rows.contiguous()
    qx = torch.empty(b * h * G, dh, dtype=torch.float32, device=dev)
    q_rot = torch.empty(b * h * G, D, dtype=torch.float32, device=dev)
    query_kernel[(b * h * G,)](q_rows, _in_kernel_order(a.key_rotation, keys.table.layout, 1), qx, q_rot,
                               q_rows.stride(0), a.scaling * LOG2E, DH=dh, D=D, DH_PAD=triton.next_power_of_2(dh),
                               D_PAD=triton.next_power_of_2(D), num_warps=8)
    back = _in_kernel_order(a.value_back, values.table.layout, 0)
    n = a.n_codes
    splits = _n_splits(dev, b * h, n, interpret) if n else 1
    per_split = triton.cdiv(triton.cdiv(max(n, 1), splits), block_n) * block_n
    splits = triton.cdiv(max(n, 1), per_split)
    m = torch.empty(b * h, splits, G, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(b * h, splits, G, D, dtype=torch.float32, device=dev)
    valid = a.valid
    has_valid = valid is not None
    if has_valid and valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)
    codes_valid = valid[:, a.sink_keys.shape[2]:] if has_valid else m
    kp, ks, vp, vs = keys.packed, keys.scale, values.packed, values.scale
    split_kernel[(b * h, splits)](
        q_rot, kp, ks, vp, vs, keys.table.levels, values.table.levels, codes_valid, m, l, acc, n, per_split, h, splits,
        kp.stride(0), kp.stride(1), kp.stride(2), ks.stride(0), ks.stride(1),
        vp.stride(0), vp.stride(1), vp.stride(2), vs.stride(0), vs.stride(1), codes_valid.stride(0) if has_valid else 0,
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, **_segments(keys.table.layout, "K"),
        **_segments(values.table.layout, "V"), HAS_VALID=has_valid, BLOCK_N=block_n,
        **_asm(keys.table, "K", ASM_DECODE and not interpret), **_asm(values.table, "V", ASM_DECODE and not interpret),
        num_warps=NUM_WARPS, num_stages=1 if interpret else NUM_STAGES,
    )
    out = torch.empty(b, h, G, dh, dtype=q.dtype, device=dev)
    sk, sv, wk, wv = a.sink_keys, a.sink_values, a.window_keys, a.window_values
    combine_kernel[(b * h, G)](
        qx, m, l, acc, back, a.key_mean.float().contiguous(), a.value_mean.float().contiguous(),
        sk, sv, wk, wv, valid if has_valid else m, out, h, splits, sk.shape[2], wk.shape[2], n,
        sk.stride(0), sk.stride(1), sk.stride(2), sv.stride(0), sv.stride(1), sv.stride(2),
        wk.stride(0), wk.stride(1), wk.stride(2), wv.stride(0), wv.stride(1), wv.stride(2),
        valid.stride(0) if has_valid else 0,
        G=G, D=D, DH=dh, DH_PAD=max(16, triton.next_power_of_2(dh)), HAS_VALID=has_valid,
        BLOCK_S=max(16, triton.next_power_of_2(splits)), BLOCK_R=16 if interpret else COMBINE_ROWS,
        BLOCK_E=16 if interpret else COMBINE_ROWS, num_warps=COMBINE_WARPS,
    )
    return out
