"""The single-query int8 stage 1 (tqvec.kernels.dp4a_stage): its PTX on a CPU emulator, and whole searches against the
torch reference (on CUDA, or through Triton's interpreter, which takes the gathered-levels path)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_env import KERNEL_DEVICE, needs_kernels
from ptx_emulator import run_ptx
from test_kernels import assert_topk_equal, dev, make_case

from tqvec import TurboQuantizer, scan
from tqvec.kernels import ops
from tqvec.kernels.dp4a_stage import dp4a_asm, nibble_levels_asm

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.gpu]


def _byte_word(values: list[int]) -> int:
    return sum((v & 0xFF) << (8 * i) for i, v in enumerate(values))


@pytest.mark.parametrize("which", ["search table", "arbitrary"])
def test_dp4a_asm_adds_the_products_of_every_code(which: str) -> None:
    """The PTX (emulated): ``$0 = $4 + Σ_c level[code_c] · q_c`` bit-exact, every code in every channel position, signed
    query bytes from -128 to 127, for the search table's grid levels and for an unordered, unsymmetric set."""
    if which == "search table":
        levels = ops._int8_grid(TurboQuantizer(128, 4, seed=0).table("cpu"))[0][0, :16]
    else:
        levels = torch.tensor([5, -127, 0, 33, 127, -1, 64, -64, 2, 99, -50, 7, -8, 120, -120, 1], dtype=torch.float32)
    asm = dp4a_asm(levels)
    grid = [int(v) for v in levels.tolist()]
    gen = torch.Generator().manual_seed(0)
    for first in range(16):
        codes = [(first + 5 * c) % 16 for c in range(8)]  # every code at every channel over the 16 words
        query = torch.randint(-128, 128, (8,), generator=gen).tolist()
        acc = int(torch.randint(-(1 << 30), 1 << 30, (1,), generator=gen))
        word = sum(code << (4 * c) for c, code in enumerate(codes))
        (got,) = run_ptx(asm, {"$1": word, "$2": _byte_word(query[:4]), "$3": _byte_word(query[4:]), "$4": acc}, ["$0"])
        expected = acc + sum(grid[code] * q for code, q in zip(codes, query))
        assert got == expected & 0xFFFFFFFF


def test_nibble_levels_asm_decodes_every_byte() -> None:
    """The tensor-core operand decoder (emulated): int8 levels of the low and the high nibble of every byte value in
    every lane, bit-exact."""
    levels = ops._int8_grid(TurboQuantizer(128, 4, seed=0).table("cpu"))[0][0, :16]
    asm = nibble_levels_asm(levels)
    grid = [int(v) & 0xFF for v in levels.tolist()]
    for first in range(256):
        data = [(first + i * 67) % 256 for i in range(4)]
        low, high = run_ptx(asm, {"$2": _byte_word(data)}, ["$0", "$1"])
        assert low == _byte_word([grid[v & 15] for v in data])
        assert high == _byte_word([grid[v >> 4] for v in data])


def test_dp4a_asm_rejects_levels_off_the_grid() -> None:
    with pytest.raises(ValueError, match="integers"):
        dp4a_asm(torch.full((16,), 0.5))
    with pytest.raises(ValueError, match="integers"):
        nibble_levels_asm(torch.arange(16.0) * 10)


def test_dp4a_asm_declines_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert dp4a_asm(torch.arange(16.0)) == "" and nibble_levels_asm(torch.arange(16.0)) == ""


def test_single_4bit_queries_take_the_dp4a_stage() -> None:
    """One query over one 4-bit segment of a multiple of 8 channels; not other widths, odd channel counts, batches,
    or with the setting off."""
    assert ops.tile_config(1, TurboQuantizer(40, 4, seed=0).layout).dp4a
    assert not ops.tile_config(1, TurboQuantizer(36, 4, seed=0).layout).dp4a
    assert not ops.tile_config(1, TurboQuantizer(40, 3.5, seed=0).layout).dp4a
    assert not ops.tile_config(1, TurboQuantizer(40, 4, mode="prod", seed=0).layout).dp4a
    assert not ops.tile_config(2, TurboQuantizer(40, 4, seed=0).layout).dp4a
    with ops.configured(matvec_dp4a=False):
        assert ops.tile_config(1, TurboQuantizer(40, 4, seed=0).layout).matvec


@needs_kernels
@pytest.mark.parametrize("dim,n,bias", [(40, 75, True), (64, 1500, False), (64, 1500, True)])
def test_dp4a_search_matches_the_reference(dim: int, n: int, bias: bool) -> None:
    """Whole searches with the int8 stage 1 (the default tiling's kind, with 16-row groups on every device): a ragged
    word step at 40 channels (5 words in steps of 4), several tiles per program, a last partial tile; at 1,500 rows
    the stage must choose 13 of 94 groups, so its estimates decide."""
    tq, cpu_block, dev_block, rotated, _ = make_case(4, "mse", dim, n=n, nq=3, bias=bias)
    assert ops.tile_config(1, tq.layout).dp4a
    config = ops.TileConfig(1, 16, 4, tiles=2, dp4a=True)
    ref = scan.scores(rotated, cpu_block, tq.table("cpu"))
    expected = scan.search(rotated, cpu_block, tq.table("cpu"), 5)
    got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 5, config=config)
    assert_topk_equal(got, expected, ref)
    one = ops.search(dev(rotated[1:2]), dev_block, tq.table(KERNEL_DEVICE), 5)
    assert_topk_equal(one, (expected[0][1:2], expected[1][1:2]), ref[1:2])


@needs_kernels
@pytest.mark.parametrize("bits,mode", [(2, "mse"), (3.5, "prod")])
def test_a_dp4a_config_on_other_codes_takes_the_matvec_kernel(bits: float, mode: str) -> None:
    """A dp4a tiling passed for codes the stage cannot read (2 bits; QJL signs) still answers right."""
    tq, cpu_block, dev_block, rotated, projected = make_case(bits, mode, 64, n=300, nq=2, bias=True)
    config = ops.TileConfig(1, 16, 4, tiles=2, dp4a=True)
    got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 5, dev(projected), config=config)
    ref = scan.scores(rotated, cpu_block, tq.table("cpu"), projected)
    assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 5, projected), ref)


@needs_kernels
def test_dp4a_stage_reads_unaligned_codes_through_the_matvec_kernel() -> None:
    """Codes whose rows are not whole aligned 32-bit words (a view one byte into a wider buffer) still search right."""
    tq, cpu_block, dev_block, rotated, _ = make_case(4, "mse", 64, n=1500, nq=1, bias=False)
    wide = torch.zeros(len(dev_block), dev_block.packed.shape[1] + 1, dtype=torch.uint8, device=dev_block.packed.device)
    wide[:, 1:] = dev_block.packed
    shifted = scan.CodeBlock(wide[:, 1:], dev_block.scale)
    assert ops._code_words(shifted) is None
    config = ops.TileConfig(1, 16, 4, tiles=2, dp4a=True)
    got = ops.search(dev(rotated), shifted, tq.table(KERNEL_DEVICE), 5, config=config)
    ref = scan.scores(rotated, cpu_block, tq.table("cpu"))
    assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 5), ref)
