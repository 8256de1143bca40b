"""Triton kernels that write KV codes in one launch: a static KV cache's one-token step (:mod:`tqvec.kv.static`), where
the token is written into its sink or window-ring slot and the ring's oldest token is encoded into the codes when it
leaves, one launch per side; and a chunk of tokens encoded into a code store (:func:`encode_chunk`, what
:meth:`CodeStore.append <tqvec.kv.store.CodeStore.append>` runs on CUDA).

The torch path of :meth:`StaticTurboQuantLayer.write_one <tqvec.kv.static.StaticTurboQuantLayer.write_one>` takes
some twenty small operations per side (gathers, ``where``, the rotation GEMM, the encode kernel, the rescale, the
scatters); replayed from a CUDA graph each still costs a launch. Here :func:`append_kernel` does a side's work in one
program, reading ``[total, codes_end]`` on the device: rotation (float32 products, ``ieee`` precision), normalization,
quantization, packing and the rescaled norm as :func:`~.encode_kernel.encode_kernel` computes them (its segment helpers
are reused); :func:`advance_kernel` then moves the lengths on (a separate launch: every program of a side must read
them first).

Served: one segment whose width divides 8 (1, 2, 4 or 8 bits) and a square rotation (the rotated dimension equal to the
head dimension, as Haar rotations are); :func:`serves` says so.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqvec.quantizer import TurboQuantizer

from .encode_kernel import _pack_segment, _segment_alignment
from .launch import Launcher, cdiv, pow2
from .ops import interpreting, segment_args


@triton.jit
def _encode_rows(centered, mask, r_mask, c, c_mask, rot_ptr, row_ptrs, packed_ptrs, scale_ptrs, bounds_ptr, levels_ptr,
                 D: tl.constexpr, S0_CH: tl.constexpr, S0_DIM: tl.constexpr, S0_BITS: tl.constexpr,
                 S0_NBYTES: tl.constexpr, S0_BYTE: tl.constexpr, RESCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr):
    """Encode the centered rows ``(BLOCK_N, BLOCK_D)`` float32 (``mask`` their valid entries): ``y = centered · rot``
    (written to the scratch rows ``row_ptrs``, which the segment helpers read back), codes of ``y / ‖y‖`` to
    ``packed_ptrs``, scale ``‖y‖`` (or ``‖y‖ / ⟨ŷ, y/‖y‖⟩`` with ``RESCALE``) as float16 to ``scale_ptrs``."""
    rot = tl.load(rot_ptr + c[:, None] * D + c[None, :], mask=c_mask[:, None] & c_mask[None, :], other=0.0)
    y = tl.dot(centered, rot, input_precision="ieee")
    tl.store(row_ptrs[:, None] + c[None, :], y, mask=mask)
    tl.debug_barrier()  # the segment helpers read the rotated rows back from memory
    norm = tl.sqrt(tl.sum(tl.where(mask, y * y, 0.0), axis=1))
    divisor = tl.where(norm > 0, norm, 1.0)
    _pack_segment(row_ptrs, r_mask, divisor, packed_ptrs, bounds_ptr, S0_CH, S0_DIM, S0_BITS, S0_NBYTES, S0_BYTE,
                  BLOCK_N, BLOCK_B)
    scale = norm
    if RESCALE:
        align = _segment_alignment(tl.zeros((BLOCK_N,), dtype=tl.float32), row_ptrs, r_mask, divisor, bounds_ptr,
                                   levels_ptr, S0_CH, S0_DIM, S0_BITS, BLOCK_D)
        scale = tl.where(align > 0, norm / tl.maximum(align, 1e-30), norm)
    tl.store(scale_ptrs, scale.to(tl.float16), mask=r_mask)


@triton.jit
def append_kernel(x_ptr, ring_ptr, sink_ptr, mean_ptr, rot_ptr, scratch_ptr, bounds_ptr, levels_ptr, packed_ptr,
                  scales_ptr, lengths_ptr, rows, n_sinks, window, capacity, stride_x,
                  D: tl.constexpr, ROW_BYTES: tl.constexpr, S0_CH: tl.constexpr, S0_DIM: tl.constexpr,
                  S0_BITS: tl.constexpr, S0_NBYTES: tl.constexpr, S0_BYTE: tl.constexpr, RESCALE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr):
    """One side of a one-token step for all ``rows`` = batch × KV heads (one program).

    ``x`` ``(rows, D)`` (row stride ``stride_x``) is the new token at position ``total``: it goes to sink slot
    ``total`` if ``total < n_sinks``, else to ring slot ``total mod window``, whose occupant (position
    ``total − window``) is first encoded into codes token ``codes_end − n_sinks`` when it is the oldest window token
    (``total − window == codes_end``): ``y = (occupant − mean) · rot``, codes of ``y / ‖y‖``, scale ``‖y‖`` (or
    ``‖y‖ / ⟨ŷ, y/‖y‖⟩`` with ``RESCALE``). Buffers row-major: ring ``(rows, window, D)``, sinks ``(rows, n_sinks, D)``,
    mean ``(rows, D)`` float32, rot ``(D, D)`` float32, scratch ``(rows, D)`` float32, packed ``(rows, capacity,
    ROW_BYTES)``, scales ``(rows, capacity)`` float16."""
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_D)
    r_mask = r < rows
    c_mask = c < D
    mask = r_mask[:, None] & c_mask[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    total = tl.load(lengths_ptr)
    codes_end = tl.load(lengths_ptr + 1)
    r64 = r.to(tl.int64)
    if total < n_sinks:
        tl.store(sink_ptr + (r64[:, None] * n_sinks + total) * D + c[None, :], x, mask=mask)
    else:
        slot_ptrs = ring_ptr + (r64[:, None] * window + total % window) * D + c[None, :]
        if total - window == codes_end:
            occupant = tl.load(slot_ptrs, mask=mask, other=0.0).to(tl.float32)
            occupant -= tl.load(mean_ptr + r[:, None] * D + c[None, :], mask=mask, other=0.0)
            token = r64 * capacity + codes_end - n_sinks
            _encode_rows(occupant, mask, r_mask, c, c_mask, rot_ptr, scratch_ptr + r * D, packed_ptr + token * ROW_BYTES,
                         scales_ptr + token, bounds_ptr, levels_ptr, D, S0_CH, S0_DIM, S0_BITS, S0_NBYTES, S0_BYTE,
                         RESCALE, BLOCK_N, BLOCK_D, BLOCK_B)
        tl.store(slot_ptrs, x, mask=mask)


# sizes that change with the chunk, the window and the store: not specialized (no recompilation mid-generation)
@triton.jit(do_not_specialize=["rows", "tokens", "start", "capacity", "stride_bh", "stride_t"])
def encode_chunk_kernel(x_ptr, mean_ptr, rot_ptr, scratch_ptr, bounds_ptr, levels_ptr, packed_ptr, scales_ptr, rows,
                        tokens, start, capacity, stride_bh, stride_t,
                        D: tl.constexpr, ROW_BYTES: tl.constexpr, S0_CH: tl.constexpr, S0_DIM: tl.constexpr,
                        S0_BITS: tl.constexpr, S0_NBYTES: tl.constexpr, S0_BYTE: tl.constexpr, RESCALE: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program ``i``: rows ``[i·BLOCK_N, …)`` of the ``rows`` = (batch × KV heads) × ``tokens`` head vectors of ``x``
    (row ``bh·tokens + j`` at ``x + bh·stride_bh + j·stride_t``, channels contiguous) encoded as ``x − mean[bh]`` into
    token ``start + j`` of row ``bh`` of the store: packed ``(b·h, capacity, ROW_BYTES)``, scales ``(b·h, capacity)``
    float16 (mean ``(b·h, D)`` float32, rot ``(D, D)`` float32, scratch ``(rows, D)`` float32)."""
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_D)
    r_mask = r < rows
    c_mask = c < D
    mask = r_mask[:, None] & c_mask[None, :]
    bh = (r // tokens).to(tl.int64)
    j = (r % tokens).to(tl.int64)
    x = tl.load(x_ptr + (bh * stride_bh + j * stride_t)[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
    x -= tl.load(mean_ptr + bh[:, None] * D + c[None, :], mask=mask, other=0.0)
    token = bh * capacity + start + j
    _encode_rows(x, mask, r_mask, c, c_mask, rot_ptr, scratch_ptr + r.to(tl.int64) * D, packed_ptr + token * ROW_BYTES,
                 scales_ptr + token, bounds_ptr, levels_ptr, D, S0_CH, S0_DIM, S0_BITS, S0_NBYTES, S0_BYTE, RESCALE,
                 BLOCK_N, BLOCK_D, BLOCK_B)


@triton.jit
def advance_kernel(lengths_ptr, n_sinks, window):
    """``[total, codes_end] → [total + 1, codes_end + evicted]`` after :func:`append_kernel` ran on both sides."""
    total = tl.load(lengths_ptr)
    codes_end = tl.load(lengths_ptr + 1)
    evicted = (total >= n_sinks) & (total - window == codes_end)
    tl.store(lengths_ptr, total + 1)
    tl.store(lengths_ptr + 1, codes_end + evicted.to(tl.int64))


APPEND = Launcher(append_kernel)
ADVANCE = Launcher(advance_kernel)
ENCODE_CHUNK = Launcher(encode_chunk_kernel)
#: head vectors per program of :func:`encode_chunk_kernel` (16 under the interpreter)
CHUNK_ROWS = 32
_CONSTEXPRS: dict[tuple, dict[str, object]] = {}
_ADVANCE_CONSTEXPRS: dict[str, object] = {"num_warps": 1}


def serves(quantizer: TurboQuantizer) -> bool:
    """True when :func:`append_kernel` and :func:`encode_chunk_kernel` encode ``quantizer``'s codes: one segment of 1,
    2, 4 or 8 bits and a square rotation."""
    segments = quantizer.layout.segments
    return len(segments) == 1 and 8 % segments[0][1] == 0 and quantizer.rotated_dim == quantizer.dim


def _constexprs(quantizer: TurboQuantizer, rows: int, interpret: bool) -> dict[str, object]:
    layout = quantizer.layout
    key = (layout, quantizer.rescale, rows, interpret)
    if key not in _CONSTEXPRS:
        seg = segment_args(layout)
        block_d = pow2(layout.dim)
        _CONSTEXPRS[key] = dict(
            D=layout.dim, ROW_BYTES=layout.row_bytes, S0_CH=seg["S0_CH"], S0_DIM=seg["S0_DIM"], S0_BITS=seg["S0_BITS"],
            S0_NBYTES=seg["S0_NBYTES"], S0_BYTE=seg["S0_BYTE"], RESCALE=quantizer.rescale,
            BLOCK_N=max(16, pow2(rows)), BLOCK_D=max(16, block_d), BLOCK_B=max(8, pow2(layout.row_bytes)), num_warps=4)
    return _CONSTEXPRS[key]


def append_side(x: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor, mean: torch.Tensor, rotation: torch.Tensor,
                quantizer: TurboQuantizer, packed: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor) -> None:
    """Launch :func:`append_kernel` for one side: ``x`` ``(b, h, 1, d)`` the new token; ``ring`` ``(b, h, window, d)``,
    ``sinks`` ``(b, h, n_sinks, d)``, ``mean`` ``(b, h, d)`` float32, ``rotation`` ``(d, d)`` float32 (``q @ rotation``
    rotates), ``packed`` ``(b, h, capacity, row_bytes)`` uint8, ``scales`` ``(b, h, capacity)`` float16 (all contiguous,
    written in place); ``lengths`` int64 ``[total, codes_end]`` (read only: :func:`advance` moves it on)."""
    b, h, window, d = ring.shape
    rows = x.reshape(b * h, d)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    interpret = interpreting()
    scratch = torch.empty((b * h, d), dtype=torch.float32, device=x.device)
    APPEND((1,), (rows, ring, sinks, mean, rotation, scratch, quantizer.boundary_table(x.device),
                  quantizer.table(x.device).levels, packed, scales, lengths, b * h, sinks.shape[2], window,
                  packed.shape[2], rows.stride(0)), _constexprs(quantizer, b * h, interpret), interpret)


def encode_chunk(x: torch.Tensor, mean: torch.Tensor, rotation: torch.Tensor, quantizer: TurboQuantizer,
                 packed: torch.Tensor, scales: torch.Tensor, start: int) -> None:
    """Encode ``x`` ``(b, h, t, d)`` (float16/bfloat16/float32, channels contiguous) as ``x − mean`` into tokens
    ``[start, start + t)`` of a code store, in one launch: ``mean`` ``(b, h, d)`` float32, ``rotation`` ``(d, d)``
    float32 (``q @ rotation`` rotates), ``packed`` ``(b, h, capacity, row_bytes)`` uint8 and ``scales`` ``(b, h,
    capacity)`` float16, contiguous, written in place (``start + t ≤ capacity``). The codes are the quantizer's
    ``encode`` of the centered rows up to the rotation's float32 rounding order (a level may flip where a coordinate
    lies on a decision boundary). ``quantizer`` must be one :func:`serves`; nothing is checked for NaN or ±inf.

    Raises ``ValueError`` if ``mean`` is not a contiguous float32 ``(b, h, d)`` tensor."""
    b, h, t, d = x.shape
    if mean.dtype != torch.float32 or tuple(mean.shape) != (b, h, d) or not mean.is_contiguous():
        raise ValueError(f"mean must be contiguous float32 {(b, h, d)}, got {mean.dtype} {tuple(mean.shape)}")
    if x.stride(3) != 1 or x.stride(0) != h * x.stride(1):
        x = x.contiguous()
    interpret = interpreting()
    rows = b * h * t
    block = 16 if interpret else CHUNK_ROWS
    scratch = torch.empty((rows, d), dtype=torch.float32, device=x.device)
    ENCODE_CHUNK((cdiv(rows, block),), (x, mean, rotation, scratch, quantizer.boundary_table(x.device),
                                        quantizer.table(x.device).levels, packed, scales, rows, t, start,
                                        packed.shape[2], x.stride(1), x.stride(2)),
                 _constexprs(quantizer, block, interpret), interpret)


def advance(lengths: torch.Tensor, n_sinks: int, window: int) -> None:
    """Launch :func:`advance_kernel`: the step's token is counted, and the evicted one (if any) is in the codes."""
    ADVANCE((1,), (lengths, n_sinks, window), _ADVANCE_CONSTEXPRS, interpreting())
