"""The packed code layout (tqvec.packing, version 1), checked against an independent numpy reference."""
from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqvec.packing import Layout, layout_for_bytes, pack, pack_signs, read_tail, split_channels, unpack, unpack_signs, write_tail

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def reference_pack(indices: np.ndarray, layout: Layout) -> np.ndarray:
    """The documented layout written bit by bit: per segment, channel j's index fills stream bits
    [j*b, (j+1)*b) LSB first; stream bit i is bit i % 8 of byte i // 8; each segment padded to bytes."""
    n = indices.shape[0]
    out = np.zeros((n, layout.row_bytes), dtype=np.uint8)
    channel, byte0 = 0, 0
    for dim, bits in layout.segments:
        for j in range(dim):
            for k in range(bits):
                i = j * bits + k
                out[:, byte0 + i // 8] |= (((indices[:, channel + j] >> k) & 1) << (i % 8)).astype(np.uint8)
        channel += dim
        byte0 += math.ceil(dim * bits / 8)
    return out


def random_indices(layout: Layout, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cols = [rng.integers(0, 1 << b, size=(n, d)) if b else np.zeros((n, d), dtype=np.int64) for d, b in layout.segments]
    return np.concatenate(cols, axis=1).astype(np.int64) if cols else np.zeros((n, 0), dtype=np.int64)


layouts = st.one_of(
    st.builds(lambda d, b: Layout(((d, b),)), st.integers(0, 67), st.integers(1, 8)),
    st.builds(split_channels, st.integers(1, 67), st.sampled_from([1, 1.5, 2, 2.5, 3, 3.5, 4, 5.25, 7.5, 8])),
    st.builds(lambda d1, b1, d2, b2: Layout(((d1, b1), (d2, b2))),
              st.integers(0, 33), st.integers(0, 8), st.integers(0, 33), st.integers(1, 8)),
)


@settings(max_examples=300, deadline=None)
@given(layout=layouts, n=st.integers(0, 5), seed=st.integers(0, 2**32 - 1))
def test_pack_matches_reference_and_round_trips(layout: Layout, n: int, seed: int) -> None:
    """pack == bitwise reference; unpack(pack(i)) == i exactly; row size is the padded byte count."""
    indices = random_indices(layout, n, seed)
    packed = pack(torch.from_numpy(indices), layout)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (n, layout.row_bytes)
    np.testing.assert_array_equal(packed.numpy(), reference_pack(indices, layout))
    unpacked = unpack(packed, layout)
    assert unpacked.dtype == torch.int64
    np.testing.assert_array_equal(unpacked.numpy(), indices)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [1, 7, 13, 64, 101])
def test_round_trip_every_bit_width_all_codes(dim: int, bits: int) -> None:
    """Every code value 0..2^b−1 appears in every channel position, odd dims included, and survives exactly."""
    layout = Layout(((dim, bits),))
    n = 1 << bits
    indices = (np.arange(n)[:, None] + np.arange(dim)[None, :]) % n
    packed = pack(torch.from_numpy(indices), layout)
    assert packed.shape == (n, math.ceil(dim * bits / 8))
    np.testing.assert_array_equal(unpack(packed, layout).numpy(), indices)


def test_known_bytes() -> None:
    """Hand-computed bytes for the documented little-endian order, incl. a 3-bit code straddling bytes."""
    assert pack(torch.tensor([[1, 0, 3, 2]]), Layout(((4, 2),))).tolist() == [[0b10110001]]
    assert pack(torch.tensor([[0xA, 0x5]]), Layout(((2, 4),))).tolist() == [[0x5A]]
    # 3-bit codes 5, 6, 7: stream bits 101 011 111 (LSB first) -> byte0 = 0b11110101, byte1 = 0b1
    assert pack(torch.tensor([[5, 6, 7]]), Layout(((3, 3),))).tolist() == [[0b11110101, 0b1]]
    # two segments are padded separately: 3 one-bit codes then one 8-bit code
    assert pack(torch.tensor([[1, 1, 0, 200]]), Layout(((3, 1), (1, 8)))).tolist() == [[0b011, 200]]


@pytest.mark.parametrize("bits", [0, 0.5, 1, 2.5, 3.5, 7.9, 8])
@pytest.mark.parametrize("dim", [1, 50, 64, 127])
def test_split_channels_rate(dim: int, bits: float) -> None:
    """First round(frac·dim) channels at ceil(bits), the rest at floor(bits); realised rate within 1/(2·dim)."""
    layout = split_channels(dim, bits)
    assert layout.dim == dim
    assert abs(layout.bits_per_row / dim - bits) <= 0.5 / dim + 1e-12
    assert all(b in (math.floor(bits), math.floor(bits) + 1) for _, b in layout.segments)
    assert [b for _, b in layout.segments] == sorted((b for _, b in layout.segments), reverse=True)


@pytest.mark.parametrize("bits", [-1, 8.5, 9])
def test_split_channels_rejects_bits(bits: float) -> None:
    with pytest.raises(ValueError, match="bits"):
        split_channels(16, bits)


@pytest.mark.parametrize("segment", [(-1, 2), (4, 9), (4, -1)])
def test_layout_rejects_invalid_segments(segment: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="invalid segment"):
        Layout((segment,))


def test_pack_unpack_reject_bad_shapes() -> None:
    layout = Layout(((10, 3),))
    with pytest.raises(ValueError, match="indices"):
        pack(torch.zeros(2, 9, dtype=torch.int64), layout)
    with pytest.raises(ValueError, match="packed"):
        unpack(torch.zeros(2, layout.row_bytes + 1, dtype=torch.uint8), layout)
    with pytest.raises(ValueError, match="packed"):
        unpack(torch.zeros(2, layout.row_bytes, dtype=torch.int32), layout)


def test_segment_table() -> None:
    layout = Layout(((5, 3), (0, 2), (7, 2), (4, 0)))
    assert layout.row_bytes == 2 + 0 + 2 + 0
    assert layout.segment_table() == [(0, 5, 3, 0), (5, 7, 2, 2)]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 6), m=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_sign_bits_round_trip(n: int, m: int, seed: int) -> None:
    """QJL sign bits: 1 = non-negative (so 0.0 maps to +1), ceil(m/8) bytes per row."""
    values = torch.from_numpy(np.random.default_rng(seed).standard_normal((n, m)).astype(np.float32))
    values[values.abs() < 0.1] = 0.0
    packed = pack_signs(values)
    assert tuple(packed.shape) == (n, math.ceil(m / 8))
    expected = np.where(values.numpy() >= 0, 1.0, -1.0)
    np.testing.assert_array_equal(unpack_signs(packed, m).numpy(), expected)


def set_padding_bits(packed: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A copy of ``packed`` with every padding bit of every segment set to 1."""
    out = packed.clone()
    byte = 0
    for (dim, bits), nbytes in zip(layout.segments, layout.segment_bytes):
        if nbytes and 8 * nbytes > dim * bits:
            used_in_last = dim * bits - 8 * (nbytes - 1)
            out[:, byte + nbytes - 1] |= (0xFF << used_in_last) & 0xFF
        byte += nbytes
    return out


def test_spare_bits() -> None:
    """Padding bits of the last segment that holds bytes (0-bit and empty segments hold none)."""
    assert Layout(((50, 1),)).spare_bits == 6
    assert Layout(((4, 2), (46, 1))).spare_bits == 2
    assert Layout(((64, 1),)).spare_bits == 0
    assert Layout(((10, 3), (0, 2))).spare_bits == 2  # 30 bits in 4 bytes
    assert Layout(((3, 5), (6, 0))).spare_bits == 1  # 15 bits in 2 bytes; the 0-bit segment holds no byte
    assert Layout(((5, 0),)).spare_bits == 0


@settings(max_examples=200, deadline=None)
@given(layout=layouts, n=st.integers(0, 5), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_tail_code_round_trip_leaves_codes_alone(layout: Layout, n: int, seed: int, data: st.DataObject) -> None:
    """A tail code reads back exactly, changes only the top bits of the last byte, and unpack ignores it;
    writing again replaces it."""
    if layout.spare_bits == 0:
        return
    bits = data.draw(st.integers(1, layout.spare_bits))
    indices = random_indices(layout, n, seed)
    reference = reference_pack(indices, layout)
    rng = np.random.default_rng(seed + 1)
    packed = pack(torch.from_numpy(indices), layout)
    for _ in range(2):
        values = torch.from_numpy(rng.integers(0, 1 << bits, size=n))
        assert write_tail(packed, values, layout, bits) is packed
        assert torch.equal(read_tail(packed, layout, bits), values)
        np.testing.assert_array_equal(unpack(packed, layout).numpy(), indices)
        got = packed.numpy()
        np.testing.assert_array_equal(got[:, :-1], reference[:, :-1])
        low = (1 << (8 - bits)) - 1
        np.testing.assert_array_equal(got[:, -1] & low, reference[:, -1])


def test_tail_code_rejects_bad_input() -> None:
    layout = Layout(((50, 1),))  # 6 spare bits
    packed = pack(torch.zeros(3, 50, dtype=torch.int64), layout)
    for bits in (0, 7, True, 2.0):
        with pytest.raises(ValueError, match="spare bits"):
            write_tail(packed, torch.zeros(3, dtype=torch.int64), layout, bits)
        with pytest.raises(ValueError, match="spare bits"):
            read_tail(packed, layout, bits)
    with pytest.raises(ValueError, match=r"lie in \[0, 64\)"):
        write_tail(packed, torch.tensor([0, 64, 1]), layout, 6)
    with pytest.raises(ValueError, match=r"lie in \[0, 64\)"):
        write_tail(packed, torch.tensor([0, -1, 1]), layout, 6)
    with pytest.raises(ValueError, match="integers of shape"):
        write_tail(packed, torch.zeros(3), layout, 6)
    with pytest.raises(ValueError, match="integers of shape"):
        write_tail(packed, torch.zeros(2, dtype=torch.int64), layout, 6)
    with pytest.raises(ValueError, match="packed"):
        read_tail(packed[:, :-1], layout, 6)
    with pytest.raises(ValueError, match="packed"):
        read_tail(packed.to(torch.int32), layout, 6)
    assert torch.equal(packed, torch.zeros(3, 7, dtype=torch.uint8))  # nothing was written


@pytest.mark.parametrize("dim", [1, 7, 50, 64, 100])
@pytest.mark.parametrize("row_bytes", [0, 1, 5, 7, 13, 40])
@pytest.mark.parametrize("spare", [0, 1, 4, 7])
def test_layout_for_bytes_with_spare_bits(dim: int, row_bytes: int, spare: int) -> None:
    """The most code bits that fit in row_bytes with at least ``spare`` padding bits (or a clear error)."""
    def fits(total: int) -> bool:
        low, n_high = divmod(total, dim)
        layout = Layout(tuple(s for s in ((n_high, low + 1), (dim - n_high, low)) if s[0] > 0))
        return layout.row_bytes <= row_bytes and layout.spare_bits >= spare
    possible = [t for t in range(0, min(8 * row_bytes, 8 * dim) + 1) if fits(t)]
    if not possible:
        with pytest.raises(ValueError, match="spare bits"):
            layout_for_bytes(dim, row_bytes, spare_bits=spare)
        return
    layout = layout_for_bytes(dim, row_bytes, spare_bits=spare)
    assert layout.bits_per_row == max(possible) and layout.row_bytes <= row_bytes and layout.spare_bits >= spare
    if spare == 0:
        assert layout == layout_for_bytes(dim, row_bytes)
    with pytest.raises(ValueError, match="spare_bits"):
        layout_for_bytes(dim, row_bytes, spare_bits=8)


@pytest.mark.slow  # runs the Triton kernels under the interpreter: 13–23 s each on a busy 2-core machine
@pytest.mark.parametrize("bits,dim,code_bytes", [(1, 50, None), (2, 50, None), (3, 40, None), (4, 50, None),
                                                 (2.5, 40, None), (5, 24, None), (1.5, 50, None), (None, 50, 3)])
def test_readers_ignore_padding_bits(bits: float | None, dim: int, code_bytes: int | None) -> None:
    """unpack, scan.dequantize / scores / search (CPU) and the Triton kernels (CUDA, or TRITON_INTERPRET=1)
    return identical results whether the padding bits (a tail code's room) are zero or all ones."""
    from tqvec import TurboQuantizer, scan

    gen = torch.Generator().manual_seed(dim)
    tq = TurboQuantizer(dim, bits) if code_bytes is None else TurboQuantizer.for_bytes(dim, code_bytes)
    layout, table = tq.layout, tq.table("cpu")
    codes = tq.encode(torch.randn(70, dim, generator=gen))
    filled = set_padding_bits(codes.packed, layout)
    assert layout.spare_bits == 0 or not torch.equal(filled, codes.packed)
    assert torch.equal(unpack(filled, layout), unpack(codes.packed, layout))
    assert torch.equal(scan.dequantize(filled, table), scan.dequantize(codes.packed, table))
    bias = torch.randn(70, generator=gen)
    rotated, _ = tq.rotate_queries(torch.randn(5, dim, generator=gen))
    blocks = [tq.code_block(type(codes)(p, codes.scales), bias) for p in (codes.packed, filled)]
    assert torch.equal(scan.scores(rotated, blocks[0], table), scan.scores(rotated, blocks[1], table))
    for a, b in zip(scan.search(rotated, blocks[0], table, 7), scan.search(rotated, blocks[1], table, 7)):
        assert torch.equal(a, b)
    if importlib.util.find_spec("triton") is None:
        return
    from tqvec.kernels import ops  # noqa: PLC0415

    if torch.cuda.is_available():
        device = "cuda"
    elif ops.interpreting():
        device = "cpu"
    else:
        return
    dev_table = tq.table(device)
    dev_blocks = [tq.code_block(type(codes)(p.to(device), codes.scales.to(device)), bias.to(device))
                  for p in (codes.packed, filled)]
    q = rotated.to(device)
    assert torch.equal(ops.scores(q, dev_blocks[0], dev_table), ops.scores(q, dev_blocks[1], dev_table))
    for nq in (1, 5):
        for a, b in zip(ops.search(q[:nq], dev_blocks[0], dev_table, 7), ops.search(q[:nq], dev_blocks[1], dev_table, 7)):
            assert torch.equal(a, b)
