"""Triton kernels (tqvec.kernels.ops) against the torch reference of tqvec.scan and the CPU encoder.

Runs on CUDA when present, else on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set
by tests/support/kernel_env.py when no GPU is visible). Shapes are small and ragged: row
counts are not multiples of the interpreter's 32-row tiles and channel counts not multiples of its
32-channel steps. Tolerances: float32 scores to 1e-4 relative (the kernels accumulate in float32, so
the observed error is ~1e-7); top-k rows must equal the reference except between tied scores.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_env import INTERPRET, KERNEL_DEVICE, needs_kernels

from tqvec import TurboQuantizer, scan
from tqvec.kernels import ops
from tqvec.kernels.unpack import nibble_pair_asm
from tqvec.packing import unpack

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.gpu, needs_kernels]
RTOL = 1e-4
# (bits, mode, dim): every width 1–8, fractional rates, prod mode incl. its 0-bit segment at 1 bit
LAYOUTS = [(1, "mse", 40), (2, "mse", 64), (3, "mse", 40), (4, "mse", 40), (5, "mse", 24), (6, "mse", 40),
           (7, "mse", 24), (8, "mse", 40), (2.5, "mse", 40), (3.5, "mse", 64), (1, "prod", 40),
           (2, "prod", 32), (3.5, "prod", 40), (5, "prod", 24)]


def make_case(bits: float, mode: str, dim: int, n: int, nq: int, bias: bool, seed: int = 0):
    """Quantizer, CPU and kernel-device code blocks, rotated queries and projections (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    tq = TurboQuantizer(dim, bits, mode=mode, seed=seed)
    codes = tq.encode(torch.randn(n, dim, generator=gen) * 3)
    b = torch.randn(n, generator=gen) if bias else None
    rotated, projected = tq.rotate_queries(torch.randn(nq, dim, generator=gen))
    cpu_block = tq.code_block(codes, b)
    dev_block = tq.code_block(codes.to(KERNEL_DEVICE), None if b is None else b.to(KERNEL_DEVICE))
    return tq, cpu_block, dev_block, rotated, projected


def dev(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(KERNEL_DEVICE)


def assert_scores_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape and got.dtype == torch.float32
    scale = ref.abs().max().clamp_min(1e-30)
    assert ((got.cpu() - ref).abs().max() / scale).item() < RTOL


def assert_topk_equal(
    got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor], all_scores: torch.Tensor,
) -> None:
    """Values equal to RTOL; rows equal, or tied with the reference row's score."""
    gv, gr = (t.cpu() for t in got)
    rv, rr = ref
    assert gv.shape == rv.shape and gr.dtype == torch.int64
    finite = torch.isfinite(rv)
    assert torch.equal(torch.isfinite(gv), finite)
    assert torch.equal(gr[~finite], torch.full_like(gr[~finite], -1))
    scale = rv[finite].abs().max().clamp_min(1e-30)
    assert ((gv[finite] - rv[finite]).abs().max() / scale).item() < RTOL
    rows = gr.clamp_min(0)
    picked = all_scores.gather(1, rows)
    same = (gr == rr) | ((picked - all_scores.gather(1, rr.clamp_min(0))).abs() <= RTOL * scale)
    assert bool(same[finite].all())


@pytest.mark.parametrize("bits,mode,dim", LAYOUTS)
def test_scores_and_search_match_reference(bits: float, mode: str, dim: int) -> None:
    """Every layout the quantizer produces; 75 rows (ragged last tile), bias on odd widths."""
    bias = int(bits * 2) % 2 == 1 or mode == "prod"
    tq, cpu_block, dev_block, rotated, projected = make_case(bits, mode, dim, n=75, nq=5, bias=bias)
    table = tq.table("cpu")
    ref = scan.scores(rotated, cpu_block, table, projected)
    assert_scores_close(ops.scores(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), dev(projected)), ref)
    got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 7, dev(projected))
    assert_topk_equal(got, scan.search(rotated, cpu_block, table, 7, projected), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_query_dtypes(dtype: torch.dtype) -> None:
    """Low-precision queries are scored as their float32 values, like the reference."""
    tq, cpu_block, dev_block, rotated, _ = make_case(4, "mse", 40, n=50, nq=3, bias=True)
    q = rotated.to(dtype)
    ref = scan.scores(q, cpu_block, tq.table("cpu"))
    assert_scores_close(ops.scores(dev(q), dev_block, tq.table(KERNEL_DEVICE)), ref)
    got = ops.search(dev(q), dev_block, tq.table(KERNEL_DEVICE), 5)
    assert_topk_equal(got, scan.search(q, cpu_block, tq.table("cpu"), 5), ref)


@pytest.mark.parametrize("n", [0, 5, 33])
def test_k_larger_than_n_pads(n: int) -> None:
    tq, cpu_block, dev_block, rotated, projected = make_case(3, "prod", 24, n=n, nq=2, bias=False)
    values, rows = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 40, dev(projected))
    assert values.shape == rows.shape == (2, 40)
    assert bool(torch.isinf(values[:, n:]).all()) and bool((rows[:, n:] == -1).all())
    if n:
        ref = scan.scores(rotated, cpu_block, tq.table("cpu"), projected)
        assert_topk_equal((values, rows), scan.search(rotated, cpu_block, tq.table("cpu"), 40, projected), ref)


CONFIGS = [ops.TileConfig(16, 32, 64, rows_as_m=True, tiles=3, pair_lut=True),
           ops.TileConfig(32, 16, 64, rows_as_m=False, tiles=2, pair_lut=True),
           ops.TileConfig(16, 32, 32, rows_as_m=False, tiles=4)]


@pytest.mark.parametrize("config", CONFIGS, ids=["rows-as-m", "queries-as-m", "many-steps"])
@pytest.mark.parametrize("bits,mode,dim", [(4, "mse", 40), (3.5, "prod", 32)])
def test_tilings(config: ops.TileConfig, bits: float, mode: str, dim: int) -> None:
    """Resident query tiles, 4-bit pair table, several row tiles per program, both operand orders."""
    tq, cpu_block, dev_block, rotated, projected = make_case(bits, mode, dim, n=101, nq=20, bias=True)
    ref = scan.scores(rotated, cpu_block, tq.table("cpu"), projected)
    got_scores = ops.scores(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), dev(projected), config=config)
    assert_scores_close(got_scores, ref)
    got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 6, dev(projected), config=config)
    assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 6, projected), ref)
    # stage 1 alone: float16 group maxima (products of the scaled queries, scaled back), within float16 rounding
    qh, ph, qfac = ops._half_queries(dev(rotated), dev(projected))
    n_tiles = -(-len(cpu_block) // config.block_n)
    group_max = torch.full((20, n_tiles), float("nan"), device=KERNEL_DEVICE)
    ops._launch_tiles(qh, ph, qfac, dev_block, tq.table(KERNEL_DEVICE), group_max, config, True)
    padded = torch.nn.functional.pad(ref, (0, n_tiles * config.block_n - ref.shape[1]), value=float("-inf"))
    expected = padded.view(20, n_tiles, config.block_n).amax(2)
    assert ((group_max.cpu() - expected).abs().max() / expected.abs().max()).item() < 5e-3


def test_tile_config_rejects_narrow_steps() -> None:
    """16-channel dot steps miscompiled on the H200 (MIN_BLOCK_D); tiny dimensions pad up to 32 channels."""
    with pytest.raises(ValueError, match="block_d"):
        ops.TileConfig(16, 32, 16)
    tq = TurboQuantizer(12, 4, seed=0)
    assert ops.tile_config(100, tq.layout).block_d >= ops.MIN_BLOCK_D
    assert ops.tile_config(3, tq.layout, exact=True).block_d >= ops.MIN_BLOCK_D


MATVEC_LAYOUTS = [(2, "mse", 64), (3, "mse", 40), (4, "mse", 40), (3.5, "prod", 40)]


@pytest.mark.parametrize("bits,mode,dim", MATVEC_LAYOUTS)
def test_matvec_search(bits: float, mode: str, dim: int) -> None:
    """CUDA-core first stage (the single-query default at 4 bits), two queries, several tiles per program."""
    tq, cpu_block, dev_block, rotated, projected = make_case(bits, mode, dim, n=75, nq=2, bias=True)
    with ops.configured(matvec_dp4a=False):
        assert ops.tile_config(1, tq.layout).matvec == (bits == 4)
    ref = scan.scores(rotated, cpu_block, tq.table("cpu"), projected)
    config = ops.TileConfig(1, 16, 8, tiles=3, matvec=True)
    got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 7, dev(projected), config=config)
    assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 7, projected), ref)


@pytest.mark.parametrize("dim", [128, 384, 1536])
def test_single_queries_decode_by_byte_permutes(dim: int) -> None:
    """With the int8 stage off (:attr:`SearchSettings.matvec_dp4a`), on CUDA a single 4-bit query's stage 1 takes the
    byte-permute decoder (the search codebooks are symmetric, which it needs: its arithmetic is checked in
    test_kv_decode_attention), up to MATVEC_PERMUTES_MAX_DIM channels; with that setting off too, gathered levels up
    to MATVEC_MAX_DIM."""
    tq = TurboQuantizer(dim, 4, seed=0)
    assert nibble_pair_asm(tq.table("cpu").levels[0])
    with ops.configured(matvec_dp4a=False):
        assert ops.tile_config(1, tq.layout).matvec
        with ops.configured(matvec_permutes=False):
            assert ops.tile_config(1, tq.layout).matvec == (dim <= ops.MATVEC_MAX_DIM)
        assert not ops.tile_config(1, TurboQuantizer(dim, 3.5, seed=0).layout).matvec


def test_search_in_query_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Query batches split when the group maxima would exceed MAX_GROUP_SCORES."""
    monkeypatch.setattr(ops, "MAX_GROUP_SCORES", 6)
    tq, cpu_block, dev_block, rotated, _ = make_case(2.5, "mse", 40, n=70, nq=7, bias=False)
    ref = scan.scores(rotated, cpu_block, tq.table("cpu"))
    got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 4)
    assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 4), ref)


def test_signs_need_projected_queries() -> None:
    tq, _, dev_block, rotated, _ = make_case(2, "prod", 32, n=10, nq=1, bias=False)
    with pytest.raises(ValueError, match="projected"):
        ops.scores(dev(rotated), dev_block, tq.table(KERNEL_DEVICE))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 2.5, 3.5])
def test_encode_matches_quantizer(bits: float) -> None:
    """Packed codes equal the CPU encoder's (a code may differ only at a decision boundary); norms and
    the rescale denominator ⟨ŷ, u⟩ match."""
    tq = TurboQuantizer(40, bits, seed=1, rescale=True)
    x = torch.randn(53, 40, generator=torch.Generator().manual_seed(2)) * 2
    x[3] = 0  # a zero vector encodes as u = 0
    ref = tq.encode(x)
    packed, norms, alignment = ops.encode(dev(tq.rotation.forward(x)), tq.table(KERNEL_DEVICE),
                                          ops.boundary_table(tq._boundaries, KERNEL_DEVICE))
    assert packed.dtype == torch.uint8 and packed.shape == ref.packed.shape
    differ = (unpack(packed.cpu(), tq.layout) != unpack(ref.packed, tq.layout)).float().mean().item()
    assert differ <= 1e-3
    torch.testing.assert_close(norms.cpu(), torch.linalg.vector_norm(x, dim=1), rtol=1e-5, atol=1e-6)
    scales = torch.where(alignment > 0, norms / alignment.clamp_min(1e-30), norms).cpu()
    torch.testing.assert_close(scales, ref.scales, rtol=1e-4, atol=1e-6)


def test_encode_prod_layout_and_float16() -> None:
    """prod mode packs its bits − 1 mse codes (none at 1 bit); float16 input is accepted."""
    for bits in (1, 3):
        tq = TurboQuantizer(32, bits, mode="prod", seed=0)
        x = torch.randn(20, 32, generator=torch.Generator().manual_seed(bits))
        ref = tq.encode(x)
        packed, _, _ = ops.encode(dev(tq.rotation.forward(x).half()), tq.table(KERNEL_DEVICE),
                                  ops.boundary_table(tq._boundaries, KERNEL_DEVICE))
        assert packed.shape == ref.packed.shape
        differ = (unpack(packed.cpu(), tq.layout) != unpack(ref.packed, tq.layout)).float().mean().item()
        assert differ <= 0.02  # float16 input moves values near boundaries


def int8_stage_bound(rotated: torch.Tensor, cpu_block: scan.CodeBlock, table: scan.CodeTable) -> torch.Tensor:
    """Bound on |int8 estimate − exact score| ``(nq, n)``: with query coordinates ``qfac · q_c`` and levels
    ``ŷ_c · 127 / L`` each rounded by at most 1/2, the estimate ``L/127 / qfac · scale · Σ q8_c · r8_c`` errs by at
    most ``|scale| / qfac · (Σ|ŷ_c| / 2 + L/254 · Σ qfac·|q_c| + L/508 · D)``."""
    d = rotated.shape[1]
    levels = scan.scores(torch.eye(d), scan.CodeBlock(cpu_block.packed, torch.ones(len(cpu_block))), table)  # (d, n)
    largest = table.levels.abs().max()
    qfac = 127 / rotated.abs().amax(1)
    per_row = levels.abs().sum(0) / 2 + largest / 508 * d
    in_grid_units = per_row + largest / 254 * (qfac[:, None] * rotated.abs()).sum(1, keepdim=True)
    return cpu_block.scale.abs() * in_grid_units / qfac[:, None]


STAGE1_PATHS = {"decoded": ({"int8_fused": False}, {"int8": True}), "fused": ({}, {"int8": True}),
                "dp4a": ({}, {"dp4a": True, "tiles": 2}), "float16": ({}, {"pair_lut": True})}


def stage1_config(stage: str, group: int) -> tuple[dict, ops.TileConfig]:
    """Settings changes and tiling that run search stage 1 by ``stage`` (a key of STAGE1_PATHS), ``group`` rows per
    group."""
    changes, tiling = STAGE1_PATHS[stage]
    return changes, ops.TileConfig(1 if "dp4a" in tiling else 16, group, 4 if "dp4a" in tiling else 32, **tiling)


@pytest.mark.parametrize("bits,mode,dim,group,stage", [
    (4, "mse", 40, 32, "decoded"), (4, "mse", 40, 32, "fused"), (4, "mse", 40, 16, "fused"),
    (4, "mse", 40, 16, "dp4a"), (4, "mse", 64, 32, "dp4a"), (3.5, "mse", 64, 16, "decoded"),
    (5, "mse", 24, 16, "decoded"), (1, "mse", 40, 32, "decoded")])
def test_int8_stage_one(monkeypatch: pytest.MonkeyPatch, bits: float, mode: str, dim: int, group: int,
                        stage: str) -> None:
    """Stage 1 on int8 levels and queries: tensor-core tiles over rows decoded in chunks (several, the last ragged) or
    decoded in registers (``fused``: 40 channels, so the last 32-channel step runs past the row), or ``dp4a`` products
    on CUDA cores; group maxima (one or two groups per 32-row tile) within the
    rounding bound of both operands, and the search's answer equal to the reference."""
    monkeypatch.setattr(ops, "INT8_CHUNK_BYTES", 3 * 32 * 64)
    tq, cpu_block, dev_block, rotated, _ = make_case(bits, mode, dim, n=300, nq=20, bias=True)
    table = tq.table("cpu")
    changes, config = stage1_config(stage, group)
    with ops.configured(**changes):
        group_max = ops.group_maxima(dev(rotated), None, dev_block, tq.table(KERNEL_DEVICE), config).cpu()
        got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 7, config=config)
    ref = scan.scores(rotated, cpu_block, table)
    n_groups = group_max.shape[1]
    pad = (0, n_groups * group - ref.shape[1])
    expected = torch.nn.functional.pad(ref, pad, value=float("-inf")).view(20, n_groups, group).amax(2)
    bound = torch.nn.functional.pad(int8_stage_bound(rotated, cpu_block, table), pad).view(20, n_groups, group).amax(2)
    assert bool(((group_max - expected).abs() <= bound + RTOL * expected.abs().max()).all())
    assert_topk_equal(got, scan.search(rotated, cpu_block, table, 7), ref)


@pytest.mark.parametrize("stage", ["decoded", "fused"])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_stage_turns_products_into_the_same_floats_either_way(monkeypatch: pytest.MonkeyPatch, stage: str,
                                                                    bias: bool) -> None:
    """The int8 tiles read their products as floats by one subtraction where every query of the tile keeps them
    within ±2^22, else by converting them: with the subtraction switched off (a limit of -1) the group maxima are
    the same floats."""
    tq, _, dev_block, rotated, _ = make_case(4, "mse", 40, n=300, nq=20, bias=bias)
    changes, config = stage1_config(stage, 16)
    with ops.configured(**changes):
        fast = ops.group_maxima(dev(rotated), None, dev_block, tq.table(KERNEL_DEVICE), config).cpu()
        monkeypatch.setattr(ops, "FAST_CONVERSION_MAX_ABS_SUM", -1)
        converted = ops.group_maxima(dev(rotated), None, dev_block, tq.table(KERNEL_DEVICE), config).cpu()
    assert torch.isfinite(fast).all() and torch.equal(fast, converted)


HOPPER = (not INTERPRET and ops.hopper_stage is not None and torch.cuda.is_available()
          and torch.cuda.get_device_capability() == (9, 0))


@pytest.mark.skipif(not HOPPER, reason="the Gluon stage 1 runs on Hopper GPUs (CI compiles it: test_hopper_stage.py)")
@pytest.mark.parametrize("stage,dim,nq,n,bias,group,limit,multiprocessors,chunk_tiles", [
    ("fused", 256, 17, 1000, False, 64, None, 1, None), ("fused", 256, 17, 1000, True, 128, -1, None, None),
    ("fused", 320, 100, 777, True, 64, None, None, None), ("fused", 320, 100, 777, False, 128, -1, 1, None),
    ("fused", 384, 200, 1300, True, 64, -1, 1, None), ("fused", 768, 100, 513, False, 64, None, 1, None),
    ("decoded", 256, 17, 1000, False, 64, None, 1, None), ("decoded", 384, 200, 1300, True, 64, -1, 1, 3),
    ("decoded", 768, 100, 513, False, 128, None, 1, 2), ("decoded", 512, 300, 777, True, 128, -1, None, None)])
def test_hopper_stage_equals_triton_kernel(monkeypatch: pytest.MonkeyPatch, stage: str, dim: int, nq: int, n: int,
                                           bias: bool, group: int, limit: int | None, multiprocessors: int | None,
                                           chunk_tiles: int | None) -> None:
    """On Hopper the int8 stage 1 over two or more 128-channel steps runs a Gluon kernel of
    :mod:`tqvec.kernels.hopper_stage`, on code tiles (``fused``) or on rows decoded in chunks (``decoded``; chunks of
    ``chunk_tiles`` row tiles, the last ragged): its group maxima are the same floats as the Triton kernel's, with the
    products read by subtraction or (a limit of -1) converted, and the search's answer is the reference's. 320
    channels (fused): the last step runs past the row; 200-300 queries: two or three query tiles; ragged last row
    tiles; where launched as if the GPU had one multiprocessor, each program loops over several row tiles and its
    copies run ahead across them (at 768 channels the query tile's too, not held in shared memory)."""
    if limit is not None:
        monkeypatch.setattr(ops, "FAST_CONVERSION_MAX_ABS_SUM", limit)
    if multiprocessors is not None:
        monkeypatch.setattr(ops, "multiprocessors", lambda device: multiprocessors)
    if chunk_tiles is not None:
        monkeypatch.setattr(ops, "INT8_CHUNK_BYTES", chunk_tiles * ops.INT8_TILE_ROWS * dim)
    served = []
    check = f"_hopper_{stage}_serves"
    serves = getattr(ops, check)
    monkeypatch.setattr(ops, check, lambda *args: served.append(serves(*args)) or served[-1])
    tq, cpu_block, dev_block, rotated, _ = make_case(4, "mse", dim, n=n, nq=nq, bias=bias)
    config = ops.TileConfig(128, group, 32, int8=True)
    maxima = {}
    for hopper in (True, False):
        with ops.configured(int8_hopper=hopper, int8_fused=stage == "fused"):
            maxima[hopper] = ops.group_maxima(dev(rotated), None, dev_block, tq.table(KERNEL_DEVICE), config).cpu()
            got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 7, config=config)
        assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 7),
                          scan.scores(rotated, cpu_block, tq.table("cpu")))
    assert served[0] and not served[-1]
    assert torch.isfinite(maxima[True]).all() and torch.equal(maxima[True], maxima[False])


@pytest.mark.parametrize("stage", ["decoded", "fused"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("limit", [None, -1])
def test_int8_row_loop_equals_one_program_per_tile(monkeypatch: pytest.MonkeyPatch, stage: str, bias: bool, group: int,
                                                   limit: int | None) -> None:
    """Rows of one channel step (24 channels: one 32-channel step under the interpreter) take the row-tile loop
    (:func:`~tqvec.kernels.int8_stage.group_max_loop_kernel`: two query tiles, two lanes each, the last of 10 row
    tiles ragged): its group maxima are the same floats as one program per tile gives, with the products read by
    subtraction or (a limit of -1) converted, and the search's answer is the reference's."""
    monkeypatch.setattr(ops, "INT8_CHUNK_BYTES", 3 * 32 * 64)
    if limit is not None:
        monkeypatch.setattr(ops, "FAST_CONVERSION_MAX_ABS_SUM", limit)
    tq, cpu_block, dev_block, rotated, _ = make_case(4, "mse", 24, n=300, nq=20, bias=bias)
    changes, config = stage1_config(stage, group)
    maxima = {}
    for row_loop in (True, False):
        with ops.configured(**changes, int8_row_loop=row_loop):
            maxima[row_loop] = ops.group_maxima(dev(rotated), None, dev_block, tq.table(KERNEL_DEVICE), config).cpu()
            got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 7, config=config)
        assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 7),
                          scan.scores(rotated, cpu_block, tq.table("cpu")))
    assert torch.isfinite(maxima[True]).all() and torch.equal(maxima[True], maxima[False])


@pytest.mark.parametrize("stage", ["decoded", "fused"])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("dim", [256, 512])
def test_int8_stage_products_are_exact_on_both_sides_of_the_limit(stage: str, group: int, dim: int) -> None:
    """The largest products either way: ``dim`` channels of the largest level (127 on the grid) times queries of
    ``dim`` equal coordinates (127 each), ±127² · dim. At 256 channels (Σ|q8| = 32,512, under the limit of 33,026)
    they reach ±4,129,024, just under 2^22, and take the subtraction; at 512 (Σ|q8| = 65,024) they reach ±8,258,048,
    which the subtraction would get wrong, and take the conversion. The group maxima, without bias (the per-query
    factor then scales the maxima), in groups of part of a tile (16 rows) or a whole one (32 under the interpreter),
    equal the exact scores ±dim · L · scale to float32 rounding, whichever their sign."""
    assert 256 * 127 <= ops.FAST_CONVERSION_MAX_ABS_SUM < 512 * 127
    tq = TurboQuantizer(dim, 4, seed=0)
    table = tq.table(KERNEL_DEVICE)
    largest = tq.table("cpu").levels.abs().max().item()
    top = int(tq.table("cpu").levels[0, :16].argmax())
    packed = torch.full((40, dim // 2), top * 17, dtype=torch.uint8)  # both nibbles of every byte: the top code
    scale = torch.linspace(0.5, 2.0, 40)
    block = scan.CodeBlock(dev(packed), dev(scale))
    queries = torch.stack([torch.ones(dim), -torch.ones(dim)])
    changes, config = stage1_config(stage, group)
    with ops.configured(**changes):
        got = ops.group_maxima(dev(queries), None, block, table, config).cpu()
    exact = dim * largest * scale.double()  # (40,) the all-ones query's scores; the other's are their negatives
    pad = got.shape[1] * group - len(exact)
    expected = torch.stack([torch.nn.functional.pad(sign * exact, (0, pad), value=float("-inf")).view(-1, group).amax(1)
                            for sign in (1, -1)])
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("stage", sorted(STAGE1_PATHS))
def test_stage1_ranks_a_zero_query_by_bias(stage: str) -> None:
    """A zero query scores every row by its bias alone: stage 1 divides its products by the query's scale factor
    (127 / 1e-30 or 1 / 1e-30 for a zero query) instead of multiplying the bias by it, which overflowed to ±inf
    ties."""
    tq, cpu_block, dev_block, rotated, _ = make_case(4, "mse", 40, n=300, nq=2, bias=True)
    block = scan.CodeBlock(cpu_block.packed, cpu_block.scale, cpu_block.bias * 1e9)
    rotated[0] = 0
    changes, config = stage1_config(stage, 16)
    with ops.configured(**changes):
        got = ops.search(dev(rotated), scan.CodeBlock(*(dev(t) for t in (block.packed, block.scale, block.bias))),
                         tq.table(KERNEL_DEVICE), 5, config=config)
    assert got[1][0].cpu().tolist() == torch.topk(block.bias, 5).indices.tolist()


@pytest.mark.parametrize("config", [ops.TileConfig(1, 16, 4, tiles=1, dp4a=True),
                                    ops.TileConfig(1, 16, 8, tiles=1, matvec=True)])
def test_single_query_kernels_take_more_tiles_past_the_grid_limit(monkeypatch: pytest.MonkeyPatch,
                                                                  config: ops.TileConfig) -> None:
    """Row tiles sit on the grid's second axis (at most 65,535 programs): beyond it each program takes more tiles."""
    monkeypatch.setattr(ops, "MAX_GRID_Y", 4)
    tq, cpu_block, dev_block, rotated, _ = make_case(4, "mse", 64, n=300, nq=2, bias=True)  # 19 tiles of 16 rows
    assert ops._tiles_per_program(19, config) == 5
    got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 5, config=config)
    ref = scan.scores(rotated, cpu_block, tq.table("cpu"))
    assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 5), ref)


@pytest.mark.parametrize("on_gpu", [False, True])
def test_int8_config_and_signs_fallback(monkeypatch: pytest.MonkeyPatch, on_gpu: bool) -> None:
    """Batches of INT8_MIN_QUERIES (INT8_MIN_QUERIES_NARROW on narrow rows) pick the int8 stage, exact scores never;
    one 4-bit segment from INT8_FUSED_MIN_QUERIES + 1 (the fused stage), other layouts not; the GPU's int8
    configurations take groups of INT8_GROUP_ROWS rows on wide rows, 128 on narrow ones and on float16 tiles; codes
    with QJL signs keep the float16 tiles under an int8 configuration."""
    if on_gpu:  # the configurations a GPU gets (the interpreter's are small)
        monkeypatch.setattr(ops, "interpreting", lambda: False)
    wide, narrow = TurboQuantizer(ops.INT8_NARROW_DIM + 8, 4, seed=0), TurboQuantizer(ops.INT8_NARROW_DIM, 4, seed=0)
    fractional = TurboQuantizer(ops.INT8_NARROW_DIM + 8, 3.5, seed=0)
    assert ops.tile_config(ops.INT8_FUSED_MIN_QUERIES + 1, wide.layout).int8
    assert ops.tile_config(ops.INT8_FUSED_MIN_QUERIES + 1, narrow.layout).int8
    assert ops.tile_config(ops.INT8_FUSED_MAX_QUERIES - 1, narrow.layout).int8
    assert not ops.tile_config(ops.INT8_FUSED_MAX_QUERIES, narrow.layout).int8  # float16 tiles until the narrow limit
    assert not ops.tile_config(ops.INT8_FUSED_MIN_QUERIES, wide.layout).int8
    assert not ops.tile_config(ops.INT8_MIN_QUERIES - 1, fractional.layout).int8
    assert ops.tile_config(ops.INT8_MIN_QUERIES, fractional.layout).int8
    with ops.configured(int8_fused=False):
        assert ops.tile_config(ops.INT8_MIN_QUERIES, wide.layout).int8
        assert not ops.tile_config(ops.INT8_MIN_QUERIES - 1, wide.layout).int8
        assert not ops.tile_config(ops.INT8_MIN_QUERIES_NARROW - 1, narrow.layout).int8
        assert ops.tile_config(ops.INT8_MIN_QUERIES_NARROW, narrow.layout).int8
    assert not ops.tile_config(ops.INT8_MIN_QUERIES_NARROW, narrow.layout, exact=True).int8
    if on_gpu:
        assert ops.tile_config(ops.INT8_MIN_QUERIES, wide.layout).block_n == ops.INT8_GROUP_ROWS
        assert ops.tile_config(ops.INT8_MIN_QUERIES - 1, fractional.layout).block_n == 128
        assert ops.tile_config(ops.INT8_MIN_QUERIES_NARROW, narrow.layout).block_n == 128
        return
    tq, cpu_block, dev_block, rotated, projected = make_case(3.5, "prod", 40, n=101, nq=20, bias=True)
    ref = scan.scores(rotated, cpu_block, tq.table("cpu"), projected)
    got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 6, dev(projected),
                     config=ops.TileConfig(16, 32, 32, int8=True))
    assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 6, projected), ref)
