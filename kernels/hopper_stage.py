"""The int8 stage 1 on Hopper, in Gluon: a wave of programs that loop over row tiles, their products issued
asynchronously.

:func:`~.int8_stage.group_max_kernel` with ``FUSED`` (Triton) runs one program per tile, and each 128-channel step as
one chain: wait for the step's copies, decode the codes, store the levels to shared memory, issue the tensor-core
products, wait for them (Triton makes a ``tl.dot`` asynchronous only when both operands come from pipelined loads; here
one is computed in registers). Sampled on an H100 at 1M × 384 with 100 queries, its warps stalled most on the products'
wait and on each new tile's first copies (docs/gpu.md). :func:`group_max_kernel` computes the same maxima as one wave
of programs (as many as the multiprocessors hold at once: two, by its registers), each keeping a query tile and looping
over row tiles: the copies of queries and codes run ``STAGES - 1`` channel steps ahead through a ring of buffers,
across row tiles, and a step's products (``wgmma``) are waited for only after the next step has decoded into the other
of two level buffers. With ``DECODED`` it does the same over rows already decoded to int8 levels (large batches
decode the rows once), the products reading them straight from the ring. Gluon kernels do not run under
``TRITON_INTERPRET=1``: CI compiles this one for sm_90a and checks that structure in its machine code
(tests/test_hopper_stage.py); on a Hopper GPU the tests compare its maxima with the Triton kernel's.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .int8_stage import ACC_BIAS, ACC_BIAS_FLOAT

#: the asynchronous global → shared copy (``async_load`` in newer Triton, ``async_copy_global_to_shared`` in 3.6)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
#: a barrier of the block's threads (``barrier`` in newer Triton, ``thread_barrier`` in 3.6)
_block_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

#: queries and rows per tile and channels per step of :func:`group_max_kernel`, launched with ``NUM_WARPS`` warps
#: (one warpgroup)
BLOCK_Q = gl.constexpr(128)
BLOCK_N = gl.constexpr(128)
BLOCK_K = gl.constexpr(128)
NUM_WARPS = 4
#: the kernel's layouts: tensor-core products (one warpgroup, 128 × 128 tiles), copies of int8 tiles and of
#: packed code tiles, int8 tiles in shared memory as ``wgmma`` operands, one value per thread of a row tile
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32]))
TILE_LOAD = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
CODE_LOAD = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
OPERAND = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
ONE_D = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


@gluon.jit
def _copy_tile(src_ptr, smem, buf, offs, mask, step, stride):
    """Start the asynchronous copy of channel step ``step`` of an int8 tile (rows ``offs`` of ``src_ptr``, ``stride``
    bytes apart, where ``mask``, else zeros) into ``smem`` buffer ``buf``."""
    channel = step * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, TILE_LOAD))
    _async_load(smem.index(buf), src_ptr + offs.to(gl.int64)[:, None] * stride + channel[None, :], mask=mask[:, None])


@gluon.jit
def _issue_step(q_ptr, codes_ptr, q_smem, c_smem, offs_q, q_mask, first_tile, lanes, n, g, total, stride_q,
                stride_rows, NBYTES: gl.constexpr, STEPS: gl.constexpr, STAGES: gl.constexpr,
                RESIDENT_Q: gl.constexpr, DECODED: gl.constexpr):
    """Start the asynchronous copies of the program's step ``g`` (row tile ``first_tile + (g // STEPS) · lanes``,
    channel step ``g % STEPS``): its code tile (``DECODED``: its tile of int8 levels) and, unless the queries are
    resident (``RESIDENT_Q``), its query tile into ring buffer ``g % STAGES``; nothing from ``total`` on (the copy
    group is committed either way)."""
    buf = g % STAGES
    live = g < total
    step = g % STEPS
    first_row = (first_tile + (g // STEPS) * lanes) * BLOCK_N
    if not RESIDENT_Q:
        _copy_tile(q_ptr, q_smem, buf, offs_q, q_mask & live, step, stride_q)
    if DECODED:
        rows = first_row + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, TILE_LOAD))
        _copy_tile(codes_ptr, c_smem, buf, rows, (rows < n) & live, step, stride_rows)
    else:
        rows = first_row + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CODE_LOAD))
        byte = step * (BLOCK_K // 2) + gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, CODE_LOAD))
        c_ptrs = codes_ptr + rows.to(gl.int64)[:, None] * stride_rows + byte[None, :]
        _async_load(c_smem.index(buf), c_ptrs, mask=(rows < n)[:, None] & (byte < NBYTES)[None, :] & live)
    async_copy.commit_group()


@gluon.jit
def _wave_share(nq, n):
    """This program's query tile, first row tile, the lanes (programs per query tile) and its number of row tiles:
    program ``p`` takes query tile ``p % n_q_tiles`` and row tiles ``p // n_q_tiles``, ``+ lanes``, …"""
    n_q_tiles = gl.cdiv(nq, BLOCK_Q)
    lanes = gl.num_programs(0) // n_q_tiles
    first_tile = gl.program_id(0) // n_q_tiles
    return gl.program_id(0) % n_q_tiles, first_tile, lanes, gl.cdiv(gl.cdiv(n, BLOCK_N) - first_tile, lanes)


@gluon.jit
def _query_terms(q_tile, nq, qfac_ptr, abs_sum_ptr, unit_ptr, FAST_MAX_ABS_SUM: gl.constexpr):
    """Whether the query tile's products are read by subtraction (every query's ``abs_sum`` at most
    ``FAST_MAX_ABS_SUM``) and each query's factor ``unit / qfac[q]`` ``(BLOCK_Q,)`` from products to scores."""
    offs_q = q_tile * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, MMA))
    q_mask = offs_q < nq
    fast = gl.max(gl.load(abs_sum_ptr + offs_q, mask=q_mask, other=0), axis=0) <= FAST_MAX_ABS_SUM
    return fast, gl.load(unit_ptr) / gl.load(qfac_ptr + offs_q, mask=q_mask, other=1.0)


@gluon.jit
def _row_terms(scale_ptr, bias_ptr, row_tile, n, HAS_BIAS: gl.constexpr):
    """The scales and biases (zeros without ``HAS_BIAS``) ``(BLOCK_N,)`` of row tile ``row_tile``, one value per
    thread (loaded before the tile's products, spread over the products' layout after them)."""
    rows = row_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=ONE_D)
    scale = gl.load(scale_ptr + rows, mask=rows < n, other=0.0)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + rows, mask=rows < n, other=0.0)
    else:
        bias = gl.full([BLOCK_N], 0.0, gl.float32, layout=ONE_D)
    return scale, bias


@gluon.jit
def _store_maxima(acc, fast, per_query, scale, bias, q_tile, row_tile, nq, n, out_ptr, stride_out,
                  HAS_BIAS: gl.constexpr, GROUP_N: gl.constexpr):
    """Store the tile's group maxima: the products ``acc`` (int32 from ``ACC_BIAS``, layout :data:`MMA`) scaled to
    scores (:func:`_query_terms`, :func:`_row_terms`), rows past ``n`` ignored, each query's best per group of
    ``GROUP_N`` rows into ``out``."""
    if fast:
        products = acc.to(gl.float32, bitcast=True) - ACC_BIAS_FLOAT
    else:
        products = (acc - ACC_BIAS).to(gl.float32)
    rows = row_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    scores = products * gl.convert_layout(scale, gl.SliceLayout(0, MMA))[None, :]
    if HAS_BIAS:
        scores = scores * per_query[:, None] + gl.convert_layout(bias, gl.SliceLayout(0, MMA))[None, :]
    if row_tile * BLOCK_N + BLOCK_N > n:
        scores = gl.where((rows < n)[None, :], scores, float("-inf"))
    GROUPS: gl.constexpr = BLOCK_N // GROUP_N
    best = gl.max(gl.reshape(scores, [BLOCK_Q, GROUPS, GROUP_N]), axis=2)
    OUT: gl.constexpr = best.type.layout
    if not HAS_BIAS:
        best = best * gl.convert_layout(per_query, gl.SliceLayout(1, OUT))[:, None]
    offs_out = q_tile * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, OUT))
    group = row_tile * GROUPS + gl.arange(0, GROUPS, layout=gl.SliceLayout(0, OUT))
    gl.store(out_ptr + offs_out.to(gl.int64)[:, None] * stride_out + group[None, :], best,
             mask=(offs_out < nq)[:, None] & (group * GROUP_N < n)[None, :])


@gluon.jit
def group_max_kernel(
    q_ptr, codes_ptr, scale_ptr, bias_ptr, qfac_ptr, abs_sum_ptr, out_ptr, unit_ptr,
    nq, n, stride_q, stride_rows, stride_out,
    K_PAD: gl.constexpr, NBYTES: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_N: gl.constexpr, STAGES: gl.constexpr,
    RESIDENT_Q: gl.constexpr, ASM: gl.constexpr, FAST_MAX_ABS_SUM: gl.constexpr, DECODED: gl.constexpr,
):
    """:func:`~.int8_stage.group_max_kernel`'s maxima (its arguments less ``grid_ptr``, ``group0`` and ``GROUP_Q``):
    ``out[q, g]`` = max over the rows ``i`` of group ``g`` of ``unit / qfac[q] · scale[i] · ⟨q8, r8_i⟩ + bias[i]``,
    the rows ``r8`` decoded by ``ASM`` from one 4-bit segment of ``NBYTES`` bytes per row (``codes_ptr``, rows
    16-byte aligned; as there with ``FUSED``) or, with ``DECODED``, read as they are, the queries ``q8`` int8 ``(nq,
    K_PAD)``, ``K_PAD`` a multiple of :data:`BLOCK_K`. Tiles of :data:`BLOCK_Q` queries × :data:`BLOCK_N` rows,
    launched with :data:`NUM_WARPS` warps and a multiple of the query tiles as programs: program ``p`` takes query
    tile ``p % n_q_tiles`` and row tiles ``p // n_q_tiles``, ``+ lanes``, … (``lanes`` = programs / query tiles),
    its copies running ``STAGES - 1`` channel steps ahead across row tiles. ``RESIDENT_Q``: the query tile's
    ``K_PAD`` channels are copied to shared memory once per program instead of once per step and row tile.
    ``DECODED``: ``codes_ptr`` holds rows already decoded to int8 levels ``(n, K_PAD)`` (large batches decode the
    rows once; ``NBYTES`` and ``ASM`` unused), copied into the ring like the queries and read from there by
    ``wgmma``."""
    gl.static_assert(STAGES >= 2, "a ring slot is refilled one step after its products were issued")
    STEPS: gl.constexpr = K_PAD // BLOCK_K
    q_tile, first_tile, lanes, my_tiles = _wave_share(nq, n)
    total = my_tiles * STEPS
    q_smem = gl.allocate_shared_memory(gl.int8, [STEPS if RESIDENT_Q else STAGES, BLOCK_Q, BLOCK_K], OPERAND)
    if DECODED:
        c_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], OPERAND)
    else:
        c_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 2],
                                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        levels_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N, BLOCK_K], OPERAND)

    offs_q_load = q_tile * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, TILE_LOAD))
    q_mask_load = offs_q_load < nq
    if RESIDENT_Q:
        for q_step in gl.static_range(STEPS):
            _copy_tile(q_ptr, q_smem, q_step, offs_q_load, q_mask_load, q_step, stride_q)
        async_copy.commit_group()
    for ahead in gl.static_range(STAGES - 1):
        _issue_step(q_ptr, codes_ptr, q_smem, c_smem, offs_q_load, q_mask_load, first_tile, lanes, n, ahead, total,
                    stride_q, stride_rows, NBYTES, STEPS, STAGES, RESIDENT_Q, DECODED)
    fast, per_query = _query_terms(q_tile, nq, qfac_ptr, abs_sum_ptr, unit_ptr, FAST_MAX_ABS_SUM)

    for i in range(my_tiles):
        row_tile = first_tile + i * lanes
        scale, bias = _row_terms(scale_ptr, bias_ptr, row_tile, n, HAS_BIAS)
        acc = gl.full([BLOCK_Q, BLOCK_N], ACC_BIAS, gl.int32, layout=MMA)
        for step in range(STEPS):
            g = i * STEPS + step
            async_copy.wait_group(STAGES - 2)
            if DECODED:
                levels = c_smem.index(g % STAGES)
            else:
                raw = c_smem.index(g % STAGES).load(CODE_LOAD)
                low, high = gl.inline_asm_elementwise(ASM, "=r,=r,r", [raw], dtype=(gl.int8, gl.int8),
                                                      is_pure=True, pack=4)
                levels = levels_smem.index(g % 2)
                levels.store(gl.reshape(gl.join(low, high), [BLOCK_N, BLOCK_K]))
            fence_async_shared()
            _block_barrier()
            if RESIDENT_Q:
                queries = q_smem.index(step)
            else:
                queries = q_smem.index(g % STAGES)
            acc = warpgroup_mma(queries, levels.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            _issue_step(q_ptr, codes_ptr, q_smem, c_smem, offs_q_load, q_mask_load, first_tile, lanes, n,
                        g + STAGES - 1, total, stride_q, stride_rows, NBYTES, STEPS, STAGES, RESIDENT_Q, DECODED)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _store_maxima(acc, fast, per_query, scale, bias, q_tile, row_tile, nq, n, out_ptr, stride_out, HAS_BIAS,
                      GROUP_N)
    async_copy.wait_group(0)
