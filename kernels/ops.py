"""Launchers for the Triton kernels behind :func:`tqvec.scan.scores`, :func:`tqvec.scan.search` and encode.

Same semantics and return types as the CPU reference in :mod:`tqvec.scan`. Tensors must be on CUDA,
or on the CPU with ``TRITON_INTERPRET=1`` (Triton's interpreter, for tests).

Search runs in two stages and never writes the ``(nq, n)`` score matrix:

1. :func:`~.scan_kernel.tile_kernel` scores every query against every group of ``block_n`` rows on
   tensor cores (float16 operands, float32 accumulation; each query is first scaled by
   ``1 / max|q|`` so float16 keeps 11 significant bits) and writes only each query's maximum per
   group: an ``(nq, n / block_n)`` matrix. A single query over one 4-bit segment of a multiple of 8 channels goes
   through :mod:`.dp4a_stage` instead (int8 levels and query, ``dp4a`` products on CUDA cores,
   :attr:`SearchSettings.matvec_dp4a`); other single 4-bit queries through :func:`~.scan_kernel.matvec_kernel`
   (float32 products on CUDA cores, same output; its levels exact, or float16 from byte permutes,
   :attr:`SearchSettings.matvec_permutes`; so are the 2-16-query tiles' levels with
   :attr:`SearchSettings.tile_permutes`). Large batches
   (:data:`INT8_MIN_QUERIES`) go through :mod:`.int8_stage` instead: rows decoded once per search to int8
   levels, queries scaled by ``127 / max|q|`` and rounded to int8, int32 products on tensor cores; over one 4-bit
   segment, batches of more than :data:`INT8_FUSED_MIN_QUERIES` and fewer than :data:`INT8_FUSED_MAX_QUERIES`
   decode each code tile in registers instead (:attr:`SearchSettings.int8_fused`); on Hopper GPUs both forms run in
   Gluon over two or more 128-channel steps, decoded rows where their width is a multiple of 128
   (:mod:`.hopper_stage`, :attr:`SearchSettings.int8_hopper`); rows of one channel step
   (:data:`INT8_ONE_STEP_CHANNELS`) run one wave of programs that loop over row tiles
   (:attr:`SearchSettings.int8_row_loop`).
2. :func:`~.topk.row_topk` (Triton, exact up to the order of ties; see :mod:`.topk`) picks the
   ``k + GROUP_MARGIN`` best groups per query, and :func:`~.scan_kernel.refine_kernel` rescores their
   rows in exact float32, keeping each refined slice's best ``k`` (rounded up to a power of two); a last
   :func:`~.topk.keys_topk` over those gives the answer, sorted, equal scores by lower row first.
   ``torch.topk`` replaces them where ``k + GROUP_MARGIN`` exceeds :data:`~.topk.MAX_K_PAD`, or with
   :attr:`SearchSettings.triton_topk` off (then every refined score is a candidate).

The groups holding the true top-k always have one of the k largest exact group maxima; the margin
absorbs the rounding of stage 1 (float16 queries or levels: relative error ≲ 2⁻¹⁰ of Σ|q_c·ŷ_c|; int8: each query coordinate
and level within half a step of its 255-step grid), so results equal the
float32 reference except where more than ``GROUP_MARGIN`` groups sit within that rounding of the
k-th score (near-ties).

On CUDA, the second search with the same key (query shape, k, tiling, settings, and the database tensors'
addresses, shapes and strides) captures the whole search in a CUDA graph; later calls with that key
copy the queries in and replay it, which removes the launches' host overhead (docs/gpu.md). At most
:attr:`SearchSettings.graph_cache_size` graphs are kept (least recently used dropped); :func:`clear_graphs` frees
them. Concurrent searches from several threads are safe (:class:`~.graphs.GraphCache` serializes replays).

:class:`SearchSettings` (read with :func:`settings`, changed for a block with :func:`configured`) switch graphs,
the Triton top-k, the byte-permute decoding and the int8 stages; they live in a context variable, so a change applies
to the calling thread only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tqvec.packing import Layout
from tqvec.scan import CodeBlock, CodeTable

from . import topk as topk_kernels
from .dp4a_stage import CHANNELS_PER_WORD, dp4a_asm, dp4a_group_max_kernel, int8_queries_kernel, nibble_levels_asm
from .encode_kernel import encode_kernel
from .graphs import GraphCache, capture_graph
from .int8_stage import FAST_CONVERSION_MAX_ABS_SUM, decode_kernel, group_max_kernel, group_max_loop_kernel
from .launch import Launcher, cdiv, multiprocessors, pow2, resident_blocks
from .scan_kernel import half_queries_kernel, matvec_kernel, refine_kernel, tile_kernel
from .unpack import one_4bit_segment, table_nibble_pair_asm

try:  # Gluon as in Triton 3.6 on; without it the fused int8 stage 1 runs the Triton kernel on every GPU
    from . import hopper_stage
except (ImportError, AttributeError):
    hopper_stage = None

__all__ = ["SearchSettings", "capture_graph", "clear_graphs", "configured", "encode", "scores", "search", "settings"]

#: extra groups rescored beyond k per query (absorbs stage-1 float16 rounding)
GROUP_MARGIN = 8
#: stage-1 group maxima held at once (floats); larger query batches are split
MAX_GROUP_SCORES = 1 << 28
#: single-query searches over 4-bit segments of at most this many channels run stage 1 on CUDA cores
#: (:func:`~.scan_kernel.matvec_kernel`): faster than the tensor-core tile kernel at d = 128 to 768 with gathered
#: levels, and to 1536 with levels decoded by byte permutes (:attr:`SearchSettings.matvec_permutes`: 1.6-1.8x the
#: tile kernel at d = 1536); the tile kernel was faster at nq = 4 and at 2 bits (H200, bench/results/gpu_scan_runs)
MATVEC_MAX_DIM = 768
MATVEC_PERMUTES_MAX_DIM = 1536
#: tiling of the single-query int8 stage 1 (:mod:`.dp4a_stage`), by row width: rows of at least
#: ``DP4A_WIDE_WORDS`` 32-bit code words (256 channels) run tiles of 32 rows x 32 words, 16 tiles per program; narrower
#: rows 64 rows x 16 words, 4 tiles. H200, 4 bits, stage 1 alone: 1M x 384 / 768 / 1536 rows at 50-51% of the copy
#: bandwidth, 4M x 1536 68%, 10M x 128 72% (the float32 matvec: 21-35%; bench/results/gpu_scan_runs/*-dp4a)
DP4A_WIDE_WORDS = 32
#: most programs along a CUDA grid's second axis (the row tiles of the single-query kernels, which take more tiles per
#: program where needed)
MAX_GRID_Y = 65535
#: rows per program of :func:`~.scan_kernel.refine_kernel` (chosen groups are refined in such slices)
REFINE_ROWS = 128
#: query batches of at least this many run stage 1 on int8 tensor cores (:mod:`.int8_stage`: rows decoded once per
#: search, not once per query tile), or of :data:`INT8_MIN_QUERIES_NARROW` where the rows have at most
#: :data:`INT8_NARROW_DIM` channels. H200, 1M rows, 4 bits, whole searches: at d = 384-1536 int8 is 1.05-1.08x
#: faster at 256 queries and float16 1.5x at 100; at d = 128 float16 is 1.25x faster at 256, even at 512, and int8
#: 1.17x at 1,000 (bench/results/gpu_scan_runs/915cc1c-int8)
INT8_MIN_QUERIES = 256
INT8_MIN_QUERIES_NARROW = 1000
INT8_NARROW_DIM = 192
#: decoded int8 rows held at once by the int8 stage 1 (bytes; rows are decoded and scanned chunk by chunk)
INT8_CHUNK_BYTES = 1 << 27
#: rows per group of the int8 stage's maxima above :data:`INT8_NARROW_DIM` channels (128 at or below it): H200, 1M rows,
#: 4 bits, 10,000 queries, whole searches 1.19x / 1.13x faster than with 128 at d = 1536 / 768 (half the rows to
#: refine), 0.96x at d = 128 (bench/results/gpu_scan_runs/0a5915a-int8-groups)
INT8_GROUP_ROWS = 64
#: rows per int8 tile (at least the configuration's group of ``block_n`` rows, a multiple of it; 256 measured 3x
#: slower), channels per ``tl.dot`` step, query tiles that share a band of row tiles, pipelined load stages
INT8_TILE_ROWS = 128
INT8_BLOCK_K = 64
INT8_GROUP_Q = 16
INT8_STAGES = 3
#: rows of at most this many channels take the int8 stage in one channel step (decoded rows: 64 or 128 channels a
#: step instead of :data:`INT8_BLOCK_K`), through :func:`~.int8_stage.group_max_loop_kernel` with
#: :attr:`SearchSettings.int8_row_loop`: H100, 1M x 128, 4 bits, whole searches 1.14x faster at 100 queries and 1.29x
#: at 10,000 than one program per tile (bench/results/gpu_scan_runs/edca7ac-row-loop)
INT8_ONE_STEP_CHANNELS = 128
#: its pipelined load stages (3: no faster, and one block fewer per multiprocessor)
ROW_LOOP_STAGES = 2
#: the fused int8 stage 1 (:attr:`SearchSettings.int8_fused`, one 4-bit segment) serves batches of more than
#: ``INT8_FUSED_MIN_QUERIES`` and fewer than ``INT8_FUSED_MAX_QUERIES`` (larger ones decode the rows once): H200, 1M rows,
#: whole searches of 100 queries 1.16x / 1.62x / 1.99x / 2.27x faster than the float16 tiles at d = 128 / 384 / 768 /
#: 1536; of 10,000 queries 1.03-1.32x slower than decoding the rows once (bench/results/gpu_scan_runs/*-dp4a)
INT8_FUSED_MIN_QUERIES = 16
INT8_FUSED_MAX_QUERIES = 512
#: its rows per tile, channels per ``tl.dot`` step, pipelined load stages (1M rows, 100 queries: 64 channels or 2 stages
#: 1.1-1.3x slower; 2-8 row tiles per program no faster, bench/results/gpu_scan_runs/*-dp4a)
FUSED_TILE_ROWS = 128
FUSED_BLOCK_K = 128
FUSED_STAGES = 3
#: fewest 128-channel steps for which the int8 stage 1 (fused or over decoded rows) runs the Gluon kernel on Hopper
#: (:attr:`SearchSettings.int8_hopper`)
HOPPER_MIN_STEPS = 2
#: its ring of shared-memory buffers over rows decoded to int8 (:func:`~.hopper_stage.group_max_kernel`, ``DECODED``)
HOPPER_DECODED_STAGES = 3
#: its programs copy their query tile to shared memory once (not once per step and row tile) when it has at most this
#: many channel steps (then it takes no more shared memory than the ring of query buffers of either form's 3 stages)
HOPPER_RESIDENT_QUERY_STEPS = FUSED_STAGES
#: fewest channels per ``tl.dot`` step of the tile kernel: with 16, Triton 3.6 computed wrong tensor-core scores on
#: the H200 (relative error ~1 for 4-bit codes, float16 and float32 operands alike; 32 and 64 exact)
MIN_BLOCK_D = 32


@dataclass(frozen=True)
class TileConfig:
    """Stage-1 / scores tiling: queries and rows per tile, channels per ``tl.dot`` step, operand order
    (rows as the MMA's M side), row tiles per program, 4-bit pair table (float16 stage 1 only).

    ``matvec``: search stage 1 by :func:`~.scan_kernel.matvec_kernel` instead: one query per program,
    ``block_n`` rows per tile, ``block_d`` code bytes per step, ``tiles`` tiles per program.

    ``num_stages`` stays 1: software pipelining of the dependent code/level loads was much slower on the H200
    (docs/gpu.md).

    ``int8``: search stage 1 by :mod:`.int8_stage` instead (rows decoded to int8 once, or per tile in registers:
    ``block_q`` × :data:`INT8_TILE_ROWS` or :data:`FUSED_TILE_ROWS` tiles on int8 tensor cores, maxima per group of
    ``block_n`` rows); codes with QJL signs keep the float16 tiles.

    ``dp4a``: search stage 1 of one query over one 4-bit segment by :mod:`.dp4a_stage` instead: ``block_n`` rows per
    tile, ``block_d`` 32-bit code words per step, ``tiles`` tiles per program (codes it cannot read — other layouts,
    QJL signs, rows that are not whole aligned 32-bit words — take the ``matvec`` kernel with the same rows and
    tiles).
    """

    block_q: int
    block_n: int
    block_d: int
    rows_as_m: bool = False
    tiles: int = 1
    pair_lut: bool = False
    num_warps: int = 4
    num_stages: int = 1
    matvec: bool = False
    int8: bool = False
    dp4a: bool = False

    def __post_init__(self) -> None:
        if not (self.matvec or self.dp4a) and self.block_d < MIN_BLOCK_D:
            raise ValueError(f"block_d must be at least {MIN_BLOCK_D} (see MIN_BLOCK_D), got {self.block_d}")


@dataclass(frozen=True)
class SearchSettings:
    """How :func:`search` runs.

    Attributes
    ----------
    cuda_graphs : bool
        Replay repeated CUDA searches from captured graphs (module docstring).
    triton_topk : bool
        Select groups and the final top-k with :mod:`.topk`'s Triton kernels (off: ``torch.topk``) …
    triton_topk_max_queries : int
        … except the group choice (and a final top-k over all refined scores) of more queries per search chunk than
        this, where ``torch.topk`` was faster on the H200 than the passes of :func:`~.topk.topk_kernel`
        (bench/results/gpu_topk.md). A group choice that :func:`~.topk.filter_serves` and the final top-k over each
        refined slice's best keys stay in Triton for any number of queries.
    graph_cache_size : int
        Captured graphs kept (least recently used dropped).
    matvec_permutes : bool
        A single query's stage 1 over one 4-bit segment with a symmetric codebook decodes its levels by PTX byte
        permutes, as float16 (:func:`~.unpack.nibble_pair_asm`); off: float32 levels gathered from the table.
    tile_permutes : bool
        The same for the float16 tile kernel's stage 1 over 2-16 queries (rows as the MMA's M side); off: levels from
        the pair table. (Not used with 128-query tiles: there the two half-width products were slower on the H200.)
    matvec_dp4a : bool
        A single query's stage 1 over one 4-bit segment of a multiple of 8 channels runs as int8 dot products
        (:mod:`.dp4a_stage`); off: the float32 :func:`~.scan_kernel.matvec_kernel` (``matvec_permutes`` applies).
    int8_fused : bool
        The int8 tensor-core stage 1 over one 4-bit segment decodes each code tile in registers
        (:func:`~.int8_stage.group_max_kernel` with ``FUSED``); off: rows are decoded to a buffer first, chunk by
        chunk.
    int8_row_loop : bool
        The int8 stage 1 over rows of one channel step (:data:`INT8_ONE_STEP_CHANNELS`) runs one wave of programs
        that each keep a query tile and loop over row tiles (:func:`~.int8_stage.group_max_loop_kernel`); off: one
        program per tile.
    int8_hopper : bool
        On Hopper GPUs (compute capability 9.0) the int8 stage 1 over at least :data:`HOPPER_MIN_STEPS` channel
        steps of 128 runs :func:`~.hopper_stage.group_max_kernel` (Gluon: products issued asynchronously, copies
        running ahead across row tiles), on code tiles (fused) and on decoded rows whose width (the channels
        rounded up to 64) is a multiple of 128; off: the Triton kernel.
    """

    cuda_graphs: bool = True
    triton_topk: bool = True
    triton_topk_max_queries: int = 1000
    graph_cache_size: int = 8
    matvec_permutes: bool = True
    tile_permutes: bool = True
    matvec_dp4a: bool = True
    int8_fused: bool = True
    int8_row_loop: bool = True
    int8_hopper: bool = True


_SETTINGS: ContextVar[SearchSettings] = ContextVar("tqvec_search_settings", default=SearchSettings())  # noqa: B039 - frozen
_GRAPHS = GraphCache()


def settings() -> SearchSettings:
    """The :class:`SearchSettings` in force in this thread (or asyncio context)."""
    return _SETTINGS.get()


@contextmanager
def configured(**changes: bool | int) -> Iterator[SearchSettings]:
    """Change :class:`SearchSettings` fields for the ``with`` block, in this thread only.

    Raises
    ------
    TypeError
        A name that is not a field of :class:`SearchSettings`.

    Example::

        with configured(triton_topk=False):
            values, rows = search(queries, block, table, k=10)
    """
    token = _SETTINGS.set(dataclasses.replace(_SETTINGS.get(), **changes))
    try:
        yield _SETTINGS.get()
    finally:
        _SETTINGS.reset(token)


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_device(t: torch.Tensor) -> None:
    if not (t.is_cuda or interpreting()):
        raise ValueError("tqvec.kernels needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")


def segment_args(layout: Layout, prefix: str = "S") -> dict[str, int]:
    """Constexprs ``{prefix}{0,1}_{CH,DIM,BITS,NBYTES,BYTE,ROW}`` of the (at most two) non-empty segments."""
    segments, channel, byte = [], 0, 0
    for row, ((dim, bits), nbytes) in enumerate(zip(layout.segments, layout.segment_bytes)):
        if dim and bits:
            segments.append((channel, dim, bits, nbytes, byte, row))
        channel += dim
        byte += nbytes
    if len(segments) > 2:
        raise ValueError(f"kernels support at most two non-empty segments, got {layout.segments}")
    segments += [(0, 0, 1, 0, 0, 0)] * (2 - len(segments))
    names = ("CH", "DIM", "BITS", "NBYTES", "BYTE", "ROW")
    return {f"{prefix}{s}_{name}": value for s, seg in enumerate(segments) for name, value in zip(names, seg)}


def _pow2_clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, pow2(max(1, x))))


def tile_config(nq: int, layout: Layout, exact: bool = False, n: int = 0) -> TileConfig:
    """Default tiling for ``nq`` queries over ``layout`` and ``n`` rows (small tiles under the interpreter).

    ``exact``: float32 operands (``scores``), whose tiles need four times the shared memory of the
    float16 search tiles, so fewer channels per step. A single-query search over one 4-bit segment of a multiple
    of 8 channels runs stage 1 as int8 dot products (``dp4a``); over other narrow 4-bit segments on CUDA cores in
    float32 (``matvec``), with more tiles per program on large ``n``
    (measured on the H200 at 1M and 10M rows); a search of many queries on int8 tensor cores (``int8``, from
    :data:`INT8_MIN_QUERIES` queries, or :data:`INT8_MIN_QUERIES_NARROW` for rows of at most
    :data:`INT8_NARROW_DIM` channels; over one 4-bit segment between :data:`INT8_FUSED_MIN_QUERIES` and
    :data:`INT8_FUSED_MAX_QUERIES` queries, exclusive, decoding in registers).
    """
    return _tile_config(nq, layout, exact, n > MANY_ROWS, settings(), interpreting())


#: rows beyond which the single-query CUDA-core stage 1 takes more tiles per program
MANY_ROWS = 1 << 21


@functools.lru_cache(maxsize=256)
def _tile_config(nq: int, layout: Layout, exact: bool, many_rows: bool, now: SearchSettings,
                 interpret: bool) -> TileConfig:
    """:func:`tile_config` (cached: a search's host time before its graph replays is part of its latency)."""
    widest = max(d for d, _ in layout.segments)
    four_bit = {b for d, b in layout.segments if d and b} == {4}
    if not exact and nq == 1 and _dp4a_layout(layout) and now.matvec_dp4a:
        if interpret:
            return TileConfig(1, 16, 4, tiles=2, dp4a=True)
        if widest // CHANNELS_PER_WORD >= DP4A_WIDE_WORDS:
            return TileConfig(1, 32, 32, tiles=16, dp4a=True)
        return TileConfig(1, 64, min(16, pow2(widest // CHANNELS_PER_WORD)), tiles=4, dp4a=True)
    permutes = now.matvec_permutes and len(layout.segments) == 1
    if not exact and nq == 1 and four_bit and widest <= (MATVEC_PERMUTES_MAX_DIM if permutes else MATVEC_MAX_DIM):
        if interpret:
            return TileConfig(1, 16, 8, tiles=2, matvec=True)
        if permutes:  # 4 KiB of codes per step (16 bytes per thread measured 1.3-2x slower), H200 1M and 10M rows
            return TileConfig(1, 64, 64, tiles=64 if many_rows else 16, matvec=True)
        return TileConfig(1, 32, 64, tiles=128 if many_rows else 32, matvec=True)
    fusable = not exact and one_4bit_segment(layout) and now.int8_fused
    int8 = not exact and (nq >= (INT8_MIN_QUERIES_NARROW if layout.dim <= INT8_NARROW_DIM else INT8_MIN_QUERIES)
                          or (fusable and INT8_FUSED_MIN_QUERIES < nq < INT8_FUSED_MAX_QUERIES))
    if interpret:
        return TileConfig(block_q=16, block_n=32, block_d=_pow2_clamp(widest, MIN_BLOCK_D, 32), int8=int8)
    block_q = _pow2_clamp(nq, 16, 128)
    if nq <= 16:
        return TileConfig(16, 128, _pow2_clamp(widest, MIN_BLOCK_D, 64 if exact else 128), rows_as_m=True,
                          pair_lut=not exact and widest > 128)
    if exact:
        return TileConfig(block_q, 128, _pow2_clamp(widest, MIN_BLOCK_D, 32), num_warps=8)
    # H200, N = 1M, 4 bits: two tiles of 128 rows per program with the pair table beat one of 256 rows by 1.1-1.25x
    # at d = 384 to 1536, nq = 100 and 10,000 (bench/results/gpu_scan_runs), and 8 warps with 4 tiles at d = 128
    group_rows = INT8_GROUP_ROWS if int8 and layout.dim > INT8_NARROW_DIM else 128
    return TileConfig(block_q, group_rows, _pow2_clamp(widest, MIN_BLOCK_D, 64 if widest > 128 else 128), tiles=2,
                      pair_lut=True, num_warps=4, int8=int8)


_DUMMIES: dict[torch.device, torch.Tensor] = {}


def _dummy(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``t``, or a 1-byte stand-in for a pointer the kernel never reads (Triton rejects empty tensors)."""
    if t is not None and t.numel():
        return t
    if like.device not in _DUMMIES:
        _DUMMIES[like.device] = torch.zeros(1, dtype=torch.uint8, device=like.device)
    return _DUMMIES[like.device]


def _scale_bias(block: CodeBlock) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block's per-row scales and biases (or ``None``) as contiguous float32, as the kernels read them."""
    return block.scale.float().contiguous(), None if block.bias is None else block.bias.float().contiguous()


def _operands(block: CodeBlock, projected: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Row-side kernel arguments, contiguous where the kernel assumes it."""
    if block.signs is not None and projected is None:
        raise ValueError("codes carry QJL signs: projected queries (S·q) are required")
    scale, bias = _scale_bias(block)
    return {
        "packed_ptr": _dummy(block.packed, scale),
        "scale_ptr": scale,
        "bias_ptr": _dummy(bias, scale),
        "signs_ptr": _dummy(block.signs, scale),
        "sign_scale_ptr": _dummy(None if block.sign_scale is None else block.sign_scale.float().contiguous(), scale),
    }


def _row_strides(block: CodeBlock) -> dict[str, int]:
    return {"stride_packed": block.packed.stride(0) if block.packed.numel() else 0,
            "stride_signs": block.signs.stride(0) if block.signs is not None else 0}


def _flags(block: CodeBlock, projected: torch.Tensor | None) -> dict[str, int]:
    return {"P_DIM": projected.shape[1] if block.signs is not None else 0, "HAS_BIAS": block.bias is not None}


def _pair_lut(table: CodeTable) -> torch.Tensor:
    """``(n_segments, 256)`` int32, cached on ``table``: entry ``b`` packs float16 ``level[b & 15]`` (low
    16 bits) and ``level[b >> 4]`` (high 16 bits), the two 4-bit channels of byte ``b``."""
    key = "tqvec.kernels.pair_lut"
    if key not in table._luts:
        byte = torch.arange(256, device=table.levels.device)
        bits = table.levels.half().view(torch.int16).to(torch.int32) & 0xFFFF
        table._luts[key] = (bits[:, byte & 15] | (bits[:, byte >> 4] << 16)).contiguous()
    return table._luts[key]


def _launch_tiles(
    queries: torch.Tensor, projected: torch.Tensor | None, qfac: torch.Tensor, block: CodeBlock,
    table: CodeTable, out: torch.Tensor, cfg: TileConfig, group_max: bool,
) -> object:
    """Run :func:`tile_kernel` over all (query tile, row tile) pairs, writing ``out``; returns the compiled kernel."""
    nq, n = queries.shape[0], len(block)
    n_q_tiles = cdiv(nq, cfg.block_q)
    grid = (n_q_tiles * cdiv(n, cfg.block_n * cfg.tiles),)
    p = queries if projected is None else projected
    segments = [(d, b) for d, b in table.layout.segments if d and b]
    resident = len(segments) == 1 and segments[0][0] <= cfg.block_d and block.signs is None
    half = queries.dtype == torch.float16
    return tile_kernel[grid](
        queries, p, **_operands(block, projected), levels_ptr=table.levels,
        lut_ptr=_pair_lut(table) if half and cfg.pair_lut else table.levels, qfac_ptr=qfac, out_ptr=out,
        nq=nq, n=n, n_q_tiles=n_q_tiles, stride_q=queries.stride(0), stride_p=p.stride(0),
        **_row_strides(block), stride_out=out.stride(0), **segment_args(table.layout), **_flags(block, projected),
        GROUP_MAX=group_max, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, TILES=cfg.tiles,
        Q_RESIDENT=resident, PAIR_LUT=half and cfg.pair_lut, DOT_DTYPE=tl.float16 if half else tl.float32,
        PRECISION="tf32" if half else "tf32x3", ROWS_AS_M=cfg.rows_as_m,
        ASM=_permute_asm(table, settings().tile_permutes) if half and cfg.pair_lut and cfg.rows_as_m and not resident else "",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _float_queries(queries: torch.Tensor, projected: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_device(queries)
    q = queries.float().contiguous()
    return q, None if projected is None else projected.float().contiguous()


def scores(
    queries: torch.Tensor, block: CodeBlock, table: CodeTable, projected: torch.Tensor | None = None,
    *, config: TileConfig | None = None,
) -> torch.Tensor:
    """All scores ``(nq, n)`` float32 of rotated ``queries`` ``(nq, D)`` against ``block`` (float32 accuracy)."""
    q, p = _float_queries(queries, projected)
    out = torch.empty(q.shape[0], len(block), dtype=torch.float32, device=q.device)
    if out.numel():
        cfg = config or tile_config(q.shape[0], table.layout, exact=True)
        _launch_tiles(q, p, q.new_ones(1), block, table, out, cfg, group_max=False)
    return out


def _half_queries(q: torch.Tensor, p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Queries (and projections) scaled per row by ``qfac = 1 / max|·|`` and cast to float16, and ``qfac``
    (one launch of :func:`~.scan_kernel.half_queries_kernel`)."""
    nq, d = q.shape
    p_dim = 0 if p is None else p.shape[1]
    qh = torch.empty(nq, d, dtype=torch.float16, device=q.device)
    ph = None if p is None else torch.empty(nq, p_dim, dtype=torch.float16, device=q.device)
    qfac = torch.empty(nq, dtype=torch.float32, device=q.device)
    if nq:
        half_queries_kernel[(nq,)](q, q if p is None else p, qh, qh if ph is None else ph, qfac, q.stride(0),
                                   0 if p is None else p.stride(0), D=d, P_DIM=p_dim,
                                   BLOCK=pow2(max(d, p_dim)), num_warps=4)
    return qh, ph, qfac


def _refine_rows(group_rows: int) -> int:
    """Rows per :func:`~.scan_kernel.refine_kernel` program for groups of ``group_rows`` rows."""
    return math.gcd(group_rows, 32 if interpreting() else REFINE_ROWS)


def _refine(
    q: torch.Tensor, p: torch.Tensor | None, groups: torch.Tensor, block: CodeBlock, table: CodeTable, group_rows: int,
    local_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact scores and row numbers ``(nq, slices · rows)`` of each query's chosen row groups ``groups``
    ``(nq, n_groups)`` of ``group_rows`` rows (``-inf`` / ``-1`` past the last row), refined in slices of
    :func:`_refine_rows` rows. ``local_k`` (a power of two below that): instead the best
    ``local_k`` of each slice as :mod:`.topk` keys ``(nq, slices · local_k)`` int64, and ``None``."""
    rows = _refine_rows(group_rows)
    if group_rows > rows:  # refine each chosen group as group_rows / rows slices
        parts = group_rows // rows
        groups = (groups[:, :, None] * parts + torch.arange(parts, device=groups.device)).flatten(1)
    nq, kg = groups.shape
    if local_k:
        out, ids = torch.empty(nq, kg * local_k, dtype=torch.int64, device=q.device), None
    else:
        out = torch.empty(nq, kg * rows, dtype=torch.float32, device=q.device)
        ids = torch.empty(nq, kg * rows, dtype=torch.int64, device=q.device)
    pp = q if p is None else p
    refine_kernel[(nq, kg)](
        q, pp, groups, **_operands(block, p), levels_ptr=table.levels, out_ptr=out, ids_ptr=out if ids is None else ids,
        n=len(block), n_groups_per_query=kg, stride_q=q.stride(0), stride_p=pp.stride(0), **_row_strides(block),
        **segment_args(table.layout), **_flags(block, p), BLOCK_N=rows,
        BLOCK_B=_pow2_clamp(max(table.layout.segment_bytes), 8, 16 if interpreting() else 64),
        LOCAL_K=local_k, BITONIC=topk_kernels.bitonic(), num_warps=4,
    )
    return out, ids


def _permute_asm(table: CodeTable, enabled: bool) -> str:
    """:func:`~.unpack.table_nibble_pair_asm` for the float16 search stages: ``""`` unless ``enabled`` (a
    :class:`SearchSettings` switch) and the kernels are compiled (not interpreted)."""
    return table_nibble_pair_asm(table) if enabled and not interpreting() else ""


def _tiles_per_program(groups: int, cfg: TileConfig) -> int:
    """``cfg.tiles``, or more where ``groups`` row tiles would need more than :data:`MAX_GRID_Y` programs."""
    return max(cfg.tiles, cdiv(groups, MAX_GRID_Y))


def _launch_matvec(
    q: torch.Tensor, p: torch.Tensor | None, block: CodeBlock, table: CodeTable, out: torch.Tensor, cfg: TileConfig,
) -> None:
    """:func:`~.scan_kernel.matvec_kernel`: exact group maxima ``out`` ``(nq, cdiv(n, cfg.block_n))``."""
    pp = q if p is None else p
    tiles = _tiles_per_program(out.shape[1], cfg)
    matvec_kernel[(q.shape[0], cdiv(out.shape[1], tiles))](
        q, pp, **_operands(block, p), levels_ptr=table.levels, out_ptr=out, n=len(block), stride_q=q.stride(0),
        stride_p=pp.stride(0), **_row_strides(block), stride_out=out.stride(0), **segment_args(table.layout),
        **_flags(block, p), BLOCK_N=cfg.block_n, BLOCK_B=_pow2_clamp(max(table.layout.segment_bytes), 1, cfg.block_d),
        TILES=tiles, ASM=_permute_asm(table, settings().matvec_permutes), num_warps=cfg.num_warps,
    )


def group_maxima(
    q: torch.Tensor, p: torch.Tensor | None, block: CodeBlock, table: CodeTable, cfg: TileConfig,
) -> torch.Tensor:
    """Search stage 1: ``(nq, cdiv(n, cfg.block_n))`` float32, each query's best score per group of rows.

    With ``cfg.matvec`` exact (levels as float16 with byte permutes); else estimates: the int8 stages (``cfg.dp4a``,
    ``cfg.int8``) from int8 levels and queries, the float16 tiles from float16 queries scaled by ``qfac = 1 / max|q|``
    (their products divided by it again).
    """
    out = torch.empty(q.shape[0], cdiv(len(block), cfg.block_n), dtype=torch.float32, device=q.device)
    words = _code_words(block) if cfg.dp4a and _dp4a_serves(block, table) else None
    if words is not None:
        _dp4a_group_maxima(q, words, block, table, out, cfg)
    elif cfg.dp4a:
        _launch_matvec(q, p, block, table, out, dataclasses.replace(cfg, block_d=64, dp4a=False, matvec=True))
    elif cfg.matvec:
        _launch_matvec(q, p, block, table, out, cfg)
    elif cfg.int8 and block.signs is None:
        _int8_group_maxima(q, block, table, out, cfg)
    else:
        qh, ph, qfac = _half_queries(q, p)
        _launch_tiles(qh, ph, qfac, block, table, out, cfg, group_max=True)
    return out


def _int8_grid(table: CodeTable) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's levels on the int8 grid, ``round(levels · 127 / L)`` float32 ``(n_segments, 256)`` with ``L`` the
    largest level magnitude, and ``(1,)`` the grid's unit ``L / 127`` (both on the table's device, cached on it)."""
    key = "tqvec.kernels.int8_grid"
    if key not in table._luts:
        largest = table.levels.abs().amax().clamp_min(1e-30)
        table._luts[key] = torch.round(table.levels * (127 / largest)).contiguous()
        table._luts[key + ".unit"] = (largest / 127).reshape(1).contiguous()
    return table._luts[key], table._luts[key + ".unit"]


def _int8_queries(q: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(nq, channels)`` int8 ``q8 = ⌊q · qfac + 1/2⌋`` (zero past ``q``'s channels), ``qfac = 127 / max|q|`` and
    ``Σ|q8|`` int32 per query (one launch of :func:`~.dp4a_stage.int8_queries_kernel`)."""
    nq = q.shape[0]
    q8 = torch.empty(nq, channels, dtype=torch.int8, device=q.device)
    qfac = torch.empty(nq, dtype=torch.float32, device=q.device)
    abs_sum = torch.empty(nq, dtype=torch.int32, device=q.device)
    if nq:
        int8_queries_kernel[(nq,)](q, q8, qfac, abs_sum, q.stride(0), q8.stride(0), D=q.shape[1], CHANNELS=channels,
                                   BLOCK=pow2(channels), num_warps=4)
    return q8, qfac, abs_sum


def _dp4a_layout(layout: Layout) -> bool:
    """True when :mod:`.dp4a_stage` can read rows of ``layout``: one 4-bit segment of a multiple of 8 channels."""
    return one_4bit_segment(layout) and layout.segments[0][0] % CHANNELS_PER_WORD == 0


def _dp4a_serves(block: CodeBlock, table: CodeTable) -> bool:
    """True when :mod:`.dp4a_stage` can read these codes: a :func:`_dp4a_layout`, no QJL signs."""
    return block.signs is None and _dp4a_layout(table.layout)


def _code_words(block: CodeBlock) -> torch.Tensor | None:
    """``block.packed`` viewed as int32 words ``(n, row_bytes / 4)`` (no copy), or ``None`` where its rows are not
    whole aligned words."""
    packed = block.packed
    if packed.shape[1] % 4 or packed.stride(1) != 1 or packed.stride(0) % 4 or packed.data_ptr() % 4:
        return None
    return packed.view(torch.int32)


def _table_int8_asm(table: CodeTable, builder: Callable[[torch.Tensor], str]) -> str:
    """``builder`` (:func:`~.dp4a_stage.dp4a_asm` or :func:`~.dp4a_stage.nibble_levels_asm`) of the table's first 16
    levels on the int8 grid, cached on the table; ``""`` under the interpreter. Like
    :func:`~.unpack.table_nibble_pair_asm`, the first call reads the levels on the host."""
    if interpreting():
        return ""
    key = f"tqvec.kernels.{builder.__name__}"
    if key not in table._luts:
        table._luts[key] = builder(_int8_grid(table)[0][0, :16])
    return table._luts[key]


def _dp4a_group_maxima(
    q: torch.Tensor, words: torch.Tensor, block: CodeBlock, table: CodeTable, out: torch.Tensor, cfg: TileConfig,
) -> None:
    """Stage 1 by :func:`~.dp4a_stage.dp4a_group_max_kernel`: ``out`` ``(nq, cdiv(n, cfg.block_n))`` = each query's
    best int8 estimate per group (as :func:`_int8_group_maxima`)."""
    n_words = words.shape[1]
    q8, qfac, _ = _int8_queries(q, n_words * CHANNELS_PER_WORD)
    q_words = q8.view(torch.int32)
    grid, unit = _int8_grid(table)
    scale, bias = _scale_bias(block)
    tiles = _tiles_per_program(out.shape[1], cfg)
    dp4a_group_max_kernel[(q.shape[0], cdiv(out.shape[1], tiles))](
        q_words, words, scale, _dummy(bias, scale), qfac, grid, unit, out, len(block), q_words.stride(0),
        words.stride(0), out.stride(0), WORDS=n_words, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n,
        BLOCK_W=cfg.block_d, TILES=tiles, ASM=_table_int8_asm(table, dp4a_asm), num_warps=cfg.num_warps,
    )


def _int8_group_maxima(q: torch.Tensor, block: CodeBlock, table: CodeTable, out: torch.Tensor, cfg: TileConfig) -> None:
    """Stage 1 on int8 tensor cores (:mod:`.int8_stage`): ``out`` ``(nq, cdiv(n, cfg.block_n))`` = each query's best
    estimate per group. One 4-bit segment (with :attr:`SearchSettings.int8_fused`): code tiles
    decoded in registers; else rows decoded in chunks of at most :data:`INT8_CHUNK_BYTES`."""
    now = settings()
    fused = now.int8_fused and one_4bit_segment(table.layout) and q.shape[0] < INT8_FUSED_MAX_QUERIES
    if interpreting():
        block_k = 32
    elif fused or q.shape[1] > INT8_ONE_STEP_CHANNELS:
        block_k = FUSED_BLOCK_K if fused else INT8_BLOCK_K
    else:
        block_k = _pow2_clamp(q.shape[1], INT8_BLOCK_K, INT8_ONE_STEP_CHANNELS)
    tile_rows = max(cfg.block_n, 32 if interpreting() else (FUSED_TILE_ROWS if fused else INT8_TILE_ROWS))
    channels = cdiv(q.shape[1], block_k) * block_k
    q8, qfac, abs_sum = _int8_queries(q, channels)
    grid, unit = _int8_grid(table)
    scale, bias = _scale_bias(block)
    nq, n = q.shape[0], len(block)
    launch = {"K_PAD": channels, "NBYTES": table.layout.row_bytes, "HAS_BIAS": bias is not None, "BLOCK_Q": cfg.block_q,
              "BLOCK_N": tile_rows, "GROUP_N": cfg.block_n, "FUSED": fused,
              "ASM": _table_int8_asm(table, nibble_levels_asm) if fused else "",
              "FAST_MAX_ABS_SUM": FAST_CONVERSION_MAX_ABS_SUM, "num_warps": cfg.num_warps}
    row_loop = now.int8_row_loop and channels == block_k
    if row_loop:
        launch.update(STAGES=1 if interpreting() else ROW_LOOP_STAGES, num_stages=1)
    else:
        launch.update(BLOCK_K=block_k, GROUP_Q=INT8_GROUP_Q,
                      num_stages=1 if interpreting() else (FUSED_STAGES if fused else INT8_STAGES))

    def group_maxima(rows: torch.Tensor, count: int, group0: int, row_scale: torch.Tensor, row_bias: torch.Tensor) -> None:
        """Stage 1 over ``count`` rows at ``rows`` (codes or decoded levels), their maxima from group ``group0``."""
        args = (q8, rows, row_scale, row_bias, qfac, abs_sum, grid, out, unit, nq, count, group0, q8.stride(0),
                rows.stride(0), out.stride(0))
        if row_loop:
            _row_loop_group_maxima(args, q8.device, cdiv(nq, cfg.block_q), launch)
        else:
            group_max_kernel[(cdiv(nq, cfg.block_q) * cdiv(count, tile_rows),)](*args, **launch)

    bias_ptr = _dummy(bias, scale)
    steps = channels // block_k
    if fused and _hopper_fused_serves(q8, block.packed, steps, (cfg.block_q, tile_rows, block_k)):
        _hopper_launch((q8, block.packed, scale, bias_ptr, qfac, abs_sum, out, unit, nq, n, q8.stride(0),
                        block.packed.stride(0), out.stride(0)),
                       K_PAD=channels, NBYTES=launch["NBYTES"], HAS_BIAS=bias is not None, GROUP_N=cfg.block_n,
                       STAGES=FUSED_STAGES, ASM=launch["ASM"], DECODED=False)
        return
    if fused:
        group_maxima(block.packed, n, 0, scale, bias_ptr)
        return
    chunk = min(cdiv(n, tile_rows), max(1, INT8_CHUNK_BYTES // (channels * tile_rows))) * tile_rows
    decoded = torch.zeros(chunk, channels, dtype=torch.int8, device=q.device)
    on_hopper = _hopper_decoded_serves(q8, channels, cfg.block_n, tile_rows)
    decode_n = 32 if interpreting() else 64
    for first in range(0, n, chunk):
        rows = min(chunk, n - first)
        packed = block.packed[first: first + rows]
        decode_kernel[(cdiv(rows, decode_n),)](
            packed, grid, decoded, rows, packed.stride(0), decoded.stride(0), **segment_args(table.layout),
            BLOCK_N=decode_n, BLOCK_D=_pow2_clamp(max(d for d, _ in table.layout.segments), 8, 64), num_warps=4,
        )
        row_bias = bias_ptr if bias is None else bias[first:]
        if on_hopper:
            _hopper_launch((q8, decoded, scale[first:], row_bias, qfac, abs_sum, out[:, first // cfg.block_n:], unit,
                            nq, rows, q8.stride(0), decoded.stride(0), out.stride(0)),
                           K_PAD=channels, NBYTES=channels, HAS_BIAS=bias is not None, GROUP_N=cfg.block_n,
                           STAGES=HOPPER_DECODED_STAGES, ASM="", DECODED=True)
        else:
            group_maxima(decoded, rows, first // cfg.block_n, scale[first:], row_bias)


def _on_hopper(q8: torch.Tensor) -> bool:
    """Whether the Gluon kernels of :mod:`.hopper_stage` can serve stage 1 for the int8 queries ``q8``: Gluon
    importable, a Hopper GPU (compute capability 9.0, not the interpreter), :attr:`SearchSettings.int8_hopper`."""
    return (hopper_stage is not None and not interpreting() and settings().int8_hopper and q8.is_cuda
            and torch.cuda.get_device_capability(q8.device) == (9, 0))


def _hopper_fused_serves(q8: torch.Tensor, codes: torch.Tensor, steps: int, tiling: tuple[int, int, int]) -> bool:
    """Whether the fused int8 stage 1 runs :func:`~.hopper_stage.group_max_kernel`: :func:`_on_hopper`, at least
    :data:`HOPPER_MIN_STEPS` channel steps, the kernel's ``tiling`` (queries, rows, channels per step) and code rows
    16-byte aligned (its copies move 16 bytes at a time)."""
    return (_on_hopper(q8) and steps >= HOPPER_MIN_STEPS
            and tiling == (hopper_stage.BLOCK_Q.value, hopper_stage.BLOCK_N.value, hopper_stage.BLOCK_K.value)
            and codes.stride(0) % 16 == 0 and codes.data_ptr() % 16 == 0)


def _hopper_decoded_serves(q8: torch.Tensor, channels: int, group_n: int, tile_rows: int) -> bool:
    """Whether the int8 stage 1 over decoded rows runs :func:`~.hopper_stage.group_max_kernel` (``DECODED``):
    :func:`_on_hopper`, ``channels`` (the decoded rows' width) at least :data:`HOPPER_MIN_STEPS` of the kernel's
    channel steps and a multiple of one, and groups of ``group_n`` rows that its row tiles and the chunks (whole
    tiles of ``tile_rows`` rows) hold whole."""
    if not _on_hopper(q8):
        return False
    block_k, block_n = hopper_stage.BLOCK_K.value, hopper_stage.BLOCK_N.value
    return (channels % block_k == 0 and channels // block_k >= HOPPER_MIN_STEPS and block_n % group_n == 0
            and tile_rows % group_n == 0)


def _hopper_launch(args: tuple, **constants: object) -> None:
    """Launch :func:`~.hopper_stage.group_max_kernel` on ``args`` (``q8`` first, ``nq`` and ``n`` ninth and tenth) and
    its ``constants`` (``RESIDENT_Q``, ``FAST_MAX_ABS_SUM`` and the warps added here) as one wave
    (:func:`_wave_lanes`), at most one program per query tile and row tile."""
    q8, nq, n = args[0], args[8], args[9]
    constants.update(RESIDENT_Q=constants["K_PAD"] // hopper_stage.BLOCK_K.value <= HOPPER_RESIDENT_QUERY_STEPS,
                     FAST_MAX_ABS_SUM=FAST_CONVERSION_MAX_ABS_SUM, num_warps=hopper_stage.NUM_WARPS)
    q_tiles = cdiv(nq, hopper_stage.BLOCK_Q.value)
    kernel = hopper_stage.group_max_kernel
    lanes = min(cdiv(n, hopper_stage.BLOCK_N.value), _wave_lanes(kernel, args, constants, q8.device, q_tiles))
    kernel[(q_tiles * lanes,)](*args, **constants)


#: blocks per multiprocessor of the one-wave kernels, by kernel, device and launch settings
_RESIDENT_BLOCKS: dict[tuple, int] = {}


def _wave_lanes(kernel: triton.runtime.JITFunction, args: tuple, constants: dict, device: torch.device,
                q_tiles: int) -> int:
    """Lanes (programs per query tile, at least one) of ``kernel`` launched on ``args`` and ``constants`` as one wave
    over ``q_tiles`` query tiles: as many programs as the multiprocessors of ``device`` hold at once
    (:func:`~.launch.resident_blocks` of the compiled kernel, compiled once per launch settings)."""
    key = (kernel, device, *sorted(constants.items()))
    if key not in _RESIDENT_BLOCKS:
        _RESIDENT_BLOCKS[key] = resident_blocks(kernel.warmup(*args, grid=(1,), **constants), device)
    return max(1, multiprocessors(device) * _RESIDENT_BLOCKS[key] // q_tiles)


def _row_loop_group_maxima(args: tuple, device: torch.device, q_tiles: int, launch: dict) -> None:
    """Launch :func:`~.int8_stage.group_max_loop_kernel` on ``args`` (:func:`~.int8_stage.group_max_kernel`'s runtime
    arguments, ``q_tiles`` query tiles) as one wave (:func:`_wave_lanes`; two lanes under the interpreter)."""
    lanes = 2 if interpreting() else _wave_lanes(group_max_loop_kernel, (*args, 1), launch, device, q_tiles)
    group_max_loop_kernel[(q_tiles * lanes,)](*args, lanes, **launch)


def _topk_block() -> int | None:
    """Candidates per block of the :mod:`.topk` kernels (small under the interpreter, which is slow at sorting)."""
    return 32 if interpreting() else None


def select_groups(group_max: torch.Tensor, kg: int) -> torch.Tensor:
    """Indices ``(nq, kg)`` int64 of each row's ``kg ≤ n_groups`` largest group maxima (order unspecified)."""
    now = settings()
    nq = group_max.shape[0]
    if now.triton_topk and topk_kernels.supported(kg) and (
            nq <= now.triton_topk_max_queries or topk_kernels.filter_serves(nq, kg)):
        return topk_kernels.row_topk(group_max, kg, block=_topk_block())[1]
    return torch.topk(group_max, kg, dim=1, sorted=False).indices


def refined_topk(
    q: torch.Tensor, p: torch.Tensor | None, groups: torch.Tensor, block: CodeBlock, table: CodeTable, group_rows: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refine the chosen ``groups`` (see :func:`_refine`) and return the ``min(k, candidates)`` best per query,
    best first: ``(values float32, rows int64)``.

    With the Triton top-k, each refined slice keeps only its best ``k_pad(k)`` as keys and one
    :func:`~.topk.keys_topk` pass finishes (same answer: a query's top ``k`` holds at most ``k`` rows of any slice);
    else every refined score goes to :func:`~.topk.row_topk` or ``torch.topk``.
    """
    now = settings()
    if now.triton_topk and topk_kernels.k_pad(k) < _refine_rows(group_rows):
        keys, _ = _refine(q, p, groups, block, table, group_rows, local_k=topk_kernels.k_pad(k))
        return topk_kernels.keys_topk(keys, k, block=_topk_block())
    candidates, ids = _refine(q, p, groups, block, table, group_rows)
    kc = min(k, candidates.shape[1])
    if now.triton_topk and q.shape[0] <= now.triton_topk_max_queries and topk_kernels.supported(kc):
        return topk_kernels.row_topk(candidates, kc, ids, block=_topk_block())
    best, pos = torch.topk(candidates, kc, dim=1)
    return best, ids.gather(1, pos)


def search(
    queries: torch.Tensor, block: CodeBlock, table: CodeTable, k: int, projected: torch.Tensor | None = None,
    *, config: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` scores per query: ``(values (nq, k) float32, rows (nq, k) int64)``, best first.

    Rows index ``block``; when ``k > n`` the tail is ``-inf`` / ``-1``. See the module docstring.
    """
    q, p = _float_queries(queries, projected)
    nq, n = q.shape[0], len(block)
    if nq == 0 or n == 0 or k == 0:
        return _pad(torch.empty(nq, 0, device=q.device), torch.empty(nq, 0, dtype=torch.int64, device=q.device), k)
    cfg = config or tile_config(nq, table.layout, n=n)
    now = settings()
    if not (q.is_cuda and now.cuda_graphs):
        return _search(q, p, block, table, k, cfg)
    inputs = (q,) if p is None else (q, p)

    def run(q: torch.Tensor, p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _search(q, p, block, table, k, cfg)

    values, rows = _GRAPHS.run(_graph_key(q, p, block, table, k, cfg, now), run, inputs, now.graph_cache_size,
                               keep=table)
    return values, rows


def _search(
    q: torch.Tensor, p: torch.Tensor | None, block: CodeBlock, table: CodeTable, k: int, cfg: TileConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-stage search on float32 contiguous queries (``nq, n, k > 0``)."""
    nq, n = q.shape[0], len(block)
    n_groups = cdiv(n, cfg.block_n)
    kg = min(n_groups, k + GROUP_MARGIN)
    chunk = max(1, MAX_GROUP_SCORES // n_groups)
    parts = []
    for q0 in range(0, nq, chunk):
        q1 = min(nq, q0 + chunk)
        qc, pc = q[q0:q1], None if p is None else p[q0:q1]
        groups = select_groups(group_maxima(qc, pc, block, table, cfg), kg)
        parts.append(refined_topk(qc, pc, groups, block, table, cfg.block_n, k))
    values, rows = parts[0] if len(parts) == 1 else (torch.cat([v for v, _ in parts]), torch.cat([r for _, r in parts]))
    return _pad(values, rows, k)


def clear_graphs() -> None:
    """Drop every captured search graph (and the memory its buffers hold)."""
    _GRAPHS.clear()


def _graph_key(
    q: torch.Tensor, p: torch.Tensor | None, block: CodeBlock, table: CodeTable, k: int, cfg: TileConfig,
    now: SearchSettings,
) -> tuple:
    described = block.cache.get("graph_key")
    if described is None:  # a block's tensors stay for its life (frozen): described once
        described = block.cache["graph_key"] = tuple(_described(t) for t in (
            block.packed, block.scale, block.bias, block.signs, block.sign_scale))
    # the table by identity (the graph holds it): its look-up tables are read by address and its PTX decoders carry
    # its levels as immediates
    return (q.device, tuple(q.shape), None if p is None else tuple(p.shape), k, cfg, table.layout, now,
            id(table), _described(table.levels)) + described


def _described(t: torch.Tensor | None) -> tuple | None:
    """What a graph that reads ``t`` depends on: address, shape, strides, dtype."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _pad(values: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ``(nq, m ≤ k)`` results to ``k`` columns with ``-inf`` / ``-1``."""
    missing = k - values.shape[1]
    if missing == 0:
        return values, rows
    return (torch.nn.functional.pad(values, (0, missing), value=float("-inf")),
            torch.nn.functional.pad(rows, (0, missing), value=-1))


def boundary_table(boundaries: Sequence[torch.Tensor | None], device: torch.device | str) -> torch.Tensor:
    """``(n_segments, 256)`` float32: row ``s`` holds segment ``s``'s ascending decision boundaries (zero-padded)."""
    table = torch.zeros(len(boundaries), 256, dtype=torch.float32)
    for s, b in enumerate(boundaries):
        if b is not None:
            table[s, : len(b)] = torch.as_tensor(b, dtype=torch.float32)
    return table.to(device)


ENCODE = Launcher(encode_kernel)


@functools.lru_cache(maxsize=64)
def _encode_constexprs(layout: Layout, interpret: bool) -> dict[str, object]:
    """:func:`~.encode_kernel.encode_kernel`'s compile-time arguments for ``layout`` (one dict per configuration)."""
    return dict(D=layout.dim, **segment_args(layout), BLOCK_N=16 if interpret else 64,
                BLOCK_D=_pow2_clamp(layout.dim, 16, 32 if interpret else 128),
                BLOCK_B=_pow2_clamp(max(layout.segment_bytes), 8, 16 if interpret else 64), num_warps=4)


def encode(rotated: torch.Tensor, table: CodeTable, boundaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize and pack rotated vectors ``Πx`` ``(n, D)`` (float16/32; Π orthogonal, so ‖Πx‖ = ‖x‖).

    ``boundaries`` is :func:`boundary_table`. Returns ``packed`` ``(n, row_bytes)`` uint8 codes of
    ``u = Πx / ‖Πx‖``, ``norms`` ``(n,)`` float32 ‖Πx‖ and ``alignment`` ``(n,)`` float32 ⟨ŷ, u⟩.
    """
    _check_device(rotated)
    layout = table.layout
    if rotated.ndim != 2 or rotated.shape[1] != layout.dim:
        raise ValueError(f"rotated must be (n, {layout.dim}), got {tuple(rotated.shape)}")
    x = rotated if rotated.dtype in (torch.float16, torch.float32) else rotated.float()
    x = x.contiguous()
    n = x.shape[0]
    packed = torch.zeros(n, layout.row_bytes, dtype=torch.uint8, device=x.device)
    norms = torch.empty(n, dtype=torch.float32, device=x.device)
    alignment = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return packed, norms, alignment
    interpret = interpreting()
    constexprs = _encode_constexprs(layout, interpret)
    ENCODE((cdiv(n, constexprs["BLOCK_N"]),), (x, boundaries, table.levels, _dummy(packed, norms), norms, alignment, n,
                                                x.stride(0), max(layout.row_bytes, 1)), constexprs, interpret)
    return packed, norms, alignment

