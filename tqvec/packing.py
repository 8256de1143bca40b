"""The packed code layout: the one contract between quantizer, index files, Triton kernels and KV cache.

Layout, version 1
-----------------
* A vector's quantization indices are one row of ``row_bytes`` bytes; ``n`` vectors are an
  ``(n, row_bytes)`` uint8 array, row-major (C order).
* A row is the concatenation of *segments*. Segment ``s`` covers ``dims[s]`` consecutive rotated
  channels, each stored with ``bits[s]`` bits (1..8), and is padded with zero bits to whole bytes.
  Fractional rates (2.5, 3.5 bits) use two segments: the first ``n_hi`` channels at ``ceil(bits)``
  bits, the rest at ``floor(bits)`` bits (see :func:`split_channels`).
* Inside a segment, channel ``j``'s index occupies stream bits ``[j*b, (j+1)*b)``, least
  significant bit first; stream bit ``i`` is bit ``i % 8`` of byte ``i // 8`` (little-endian bit
  order). For b in {1, 2, 4, 8} this is plain nibble/crumb packing: channel ``j`` sits in byte
  ``j*b // 8`` at shift ``(j*b) % 8``. For b in {3, 5, 6, 7} a code may straddle two bytes.
* QJL sign bits (``prod`` mode) use the same rules with one segment of 1-bit codes: bit = 1 means
  a non-negative projection.
* Tail code (an addition to version 1 that changes no code bit): the last byte-holding segment ends in
  ``Layout.spare_bits`` padding bits (0..7), the top bits of the row's last byte. A writer may store
  one small unsigned integer of ``w <= spare_bits`` bits there, in the top ``w`` bits of the last
  byte (value ``v`` is the byte's bits ``[8 - w, 8)``, least significant first: ``byte |= v << (8 - w)``;
  :func:`write_tail` / :func:`read_tail`). Its width is not recorded in the row: whoever writes a tail
  code records ``w`` beside the codes (``tqvec.Index`` does, in its file header). Readers of channel
  codes (:func:`unpack`, ``tqvec.scan``, the Triton kernels) read stream bits ``[0, dim*bits)`` of
  each segment only, so they give the same result whatever the padding bits hold; every other
  padding bit stays zero.

Everything that reads or writes codes goes through :class:`Layout`, :func:`pack` and
:func:`unpack` (tail codes: :func:`write_tail`, :func:`read_tail`); kernels take ``Layout.segment_table()``.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

LAYOUT_VERSION = 1
MAX_BITS = 8


@dataclass(frozen=True)
class Layout:
    """Segments ``((dim, bits), ...)`` of one packed row; segments with ``bits == 0`` hold nothing."""

    segments: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        for dim, bits in self.segments:
            if dim < 0 or not 0 <= bits <= MAX_BITS:
                raise ValueError(f"invalid segment (dim={dim}, bits={bits})")

    @property
    def dim(self) -> int:
        """Total channels covered by the row."""
        return sum(d for d, _ in self.segments)

    @property
    def bits_per_row(self) -> int:
        """Code bits actually used per row, before byte padding."""
        return sum(d * b for d, b in self.segments)

    @property
    def segment_bytes(self) -> tuple[int, ...]:
        return tuple(math.ceil(d * b / 8) for d, b in self.segments)

    @property
    def row_bytes(self) -> int:
        """Bytes per packed row, padding included."""
        return sum(self.segment_bytes)

    @property
    def spare_bits(self) -> int:
        """Padding bits (0..7) at the end of the last segment that holds bytes: the room for a tail code."""
        for (dim, bits), nbytes in zip(reversed(self.segments), reversed(self.segment_bytes)):
            if nbytes:
                return 8 * nbytes - dim * bits
        return 0

    def segment_table(self) -> list[tuple[int, int, int, int]]:
        """Rows ``(first_channel, dim, bits, first_byte)`` per non-empty segment, for kernels."""
        return [(channels.start, dim, bits, row_bytes.start) for channels, row_bytes, dim, bits, _ in _walk(self)]


def _walk(layout: Layout) -> Iterator[tuple[slice, slice, int, int, int]]:
    """``(channels, row_bytes, dim, bits, nbytes)`` of each segment of ``layout`` that holds bytes, in row order:
    ``channels`` and ``row_bytes`` are the slices of the row's channels and of its packed bytes it covers."""
    channel, byte = 0, 0
    for (dim, bits), nbytes in zip(layout.segments, layout.segment_bytes):
        if nbytes:
            yield slice(channel, channel + dim), slice(byte, byte + nbytes), dim, bits, nbytes
        channel += dim
        byte += nbytes


def split_channels(dim: int, bits: float) -> Layout:
    """Layout for ``dim`` channels at an average of ``bits`` bits (0..8, fractional allowed).

    The first ``round((bits - floor(bits)) * dim)`` channels get ``floor(bits) + 1`` bits, the rest
    ``floor(bits)``; the realised rate is exact in :attr:`Layout.bits_per_row`.
    """
    if not 0 <= bits <= MAX_BITS:
        raise ValueError(f"bits must lie in [0, {MAX_BITS}], got {bits}")
    low = math.floor(bits)
    n_high = round((bits - low) * dim) if low < MAX_BITS else 0
    segments = ((n_high, low + 1), (dim - n_high, low)) if n_high else ((dim, low),)
    return Layout(tuple(s for s in segments if s[0] > 0) or ((dim, 0),))


def _pack_segment(seg: torch.Tensor, bits: int, nbytes: int, out: torch.Tensor) -> None:
    """Write ``(n, dim)`` codes of ``bits`` bits as one segment's ``nbytes`` bytes into ``out`` ``(n, nbytes)``."""
    n, dim = seg.shape
    if 8 % bits == 0:  # whole codes per byte: OR the shifted codes of each byte position in uint8
        per_byte = 8 // bits
        if dim == nbytes * per_byte:
            codes = seg.to(torch.uint8).reshape(n, nbytes, per_byte)
        else:
            codes = seg.new_zeros((n, nbytes * per_byte), dtype=torch.uint8)
            codes[:, :dim] = seg
            codes = codes.view(n, nbytes, per_byte)
        acc = codes[:, :, 0].clone()
        for k in range(1, per_byte):
            acc |= codes[:, :, k] << (k * bits)
        out.copy_(acc)
        return
    # 3, 5, 6, 7 bits: every 8 codes fill exactly `bits` bytes; assemble them as one int64 word
    groups = math.ceil(dim / 8)
    codes = seg.new_zeros((n, groups * 8), dtype=torch.int64)
    codes[:, :dim] = seg
    codes = codes.view(n, groups, 8)
    word = codes[:, :, 0].clone()
    for k in range(1, 8):
        word |= codes[:, :, k] << (k * bits)
    for j in range(bits):  # byte j of each group; bytes past nbytes are all padding and dropped
        byte = (word >> (8 * j)) & 0xFF
        cols = range(j, min(groups * bits, nbytes), bits)
        if len(cols):
            out[:, j::bits] = byte[:, : len(cols)]


def _unpack_segment(seg: torch.Tensor, dim: int, bits: int, out: torch.Tensor) -> None:
    """Read ``dim`` codes of ``bits`` bits from one segment's bytes ``seg`` ``(n, nbytes)`` into ``out`` ``(n, dim)``."""
    n, nbytes = seg.shape
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per_byte = 8 // bits
        codes = out.new_empty((n, nbytes, per_byte))
        for k in range(per_byte):
            codes[:, :, k] = (seg >> (k * bits)) & mask
        out.copy_(codes.view(n, nbytes * per_byte)[:, :dim])
        return
    groups = math.ceil(dim / 8)
    raw = seg.new_zeros((n, groups * bits), dtype=torch.int64)
    raw[:, :nbytes] = seg
    raw = raw.view(n, groups, bits)
    word = raw[:, :, 0].clone()
    for j in range(1, bits):
        word |= raw[:, :, j] << (8 * j)
    codes = out.new_empty((n, groups, 8))
    for k in range(8):
        codes[:, :, k] = (word >> (k * bits)) & mask
    out.copy_(codes.view(n, groups * 8)[:, :dim])


def pack(indices: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Pack ``(n, layout.dim)`` integer indices (each < 2**bits of its segment) into ``(n, row_bytes)`` uint8."""
    if indices.ndim != 2 or indices.shape[1] != layout.dim:
        raise ValueError(f"indices must be (n, {layout.dim}), got {tuple(indices.shape)}")
    n = indices.shape[0]
    out = torch.empty(n, layout.row_bytes, dtype=torch.uint8, device=indices.device)
    for channels, row_bytes, _, bits, nbytes in _walk(layout):
        _pack_segment(indices[:, channels], bits, nbytes, out[:, row_bytes])
    return out


def unpack(packed: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Unpack ``(n, row_bytes)`` uint8 into ``(n, layout.dim)`` int64 indices (0 for 0-bit segments)."""
    if packed.ndim != 2 or packed.shape[1] != layout.row_bytes or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 (n, {layout.row_bytes}), got {packed.dtype} {tuple(packed.shape)}")
    n = packed.shape[0]
    out = torch.zeros(n, layout.dim, dtype=torch.int64, device=packed.device)
    for channels, row_bytes, dim, bits, _ in _walk(layout):
        _unpack_segment(packed[:, row_bytes].to(torch.int64), dim, bits, out[:, channels])
    return out


def _check_tail(packed: torch.Tensor, layout: Layout, bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= layout.spare_bits:
        raise ValueError(f"a tail code needs 1..spare_bits bits; this layout {layout.segments} has "
                         f"{layout.spare_bits} spare bits, got bits={bits!r}")
    if packed.ndim != 2 or packed.shape[1] != layout.row_bytes or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 (n, {layout.row_bytes}), got {packed.dtype} {tuple(packed.shape)}")


def write_tail(packed: torch.Tensor, values: torch.Tensor, layout: Layout, bits: int) -> torch.Tensor:
    """Store ``values`` ``(n,)`` (integers in ``[0, 2**bits)``) as the tail code of the rows of ``packed``
    ``(n, row_bytes)`` uint8, in place: the top ``bits`` bits of each row's last byte (module docstring).
    Returns ``packed``."""
    _check_tail(packed, layout, bits)
    values = torch.as_tensor(values, device=packed.device)
    if values.shape != (packed.shape[0],) or values.dtype.is_floating_point or values.dtype == torch.bool:
        raise ValueError(f"values must be integers of shape ({packed.shape[0]},), got {values.dtype} {tuple(values.shape)}")
    if values.numel() and not (bool((values >= 0).all()) and bool((values < 1 << bits).all())):
        raise ValueError(f"tail code values must lie in [0, {1 << bits}) for bits={bits}")
    shift = 8 - bits
    last = packed[:, -1]
    packed[:, -1] = (last & ((1 << shift) - 1)) | (values.to(torch.uint8) << shift)
    return packed


def read_tail(packed: torch.Tensor, layout: Layout, bits: int) -> torch.Tensor:
    """The ``bits``-bit tail code of each row of ``packed`` ``(n, row_bytes)``: ``(n,)`` int64 (see :func:`write_tail`)."""
    _check_tail(packed, layout, bits)
    return (packed[:, -1] >> (8 - bits)).to(torch.int64)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Pack the signs of ``(n, m)`` floats as 1-bit codes (1 = non-negative) into ``(n, ceil(m/8))`` uint8."""
    return pack((values >= 0).to(torch.uint8), Layout(((values.shape[1], 1),)))


def unpack_signs(packed: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: ``(n, m)`` float32 of ±1."""
    return unpack(packed, Layout(((m, 1),))).to(torch.float32) * 2 - 1


def layout_for_bytes(dim: int, row_bytes: int, max_bits: int = MAX_BITS, spare_bits: int = 0) -> Layout:
    """The layout of ``dim`` channels with the most code bits that packs into at most ``row_bytes`` bytes
    and, with ``spare_bits`` > 0, leaves at least that many padding bits for a tail code.

    Bits are spread as evenly as possible (two segments: ``b + 1`` and ``b`` bits per channel).
    """
    if row_bytes < 0:
        raise ValueError(f"row_bytes must be >= 0, got {row_bytes}")
    if not 0 <= spare_bits <= 7:
        raise ValueError(f"spare_bits must lie in [0, 7], got {spare_bits}")
    for total in range(min(8 * row_bytes, dim * max_bits), -1, -1):
        low, n_high = divmod(total, dim)
        segments = tuple(s for s in ((n_high, low + 1), (dim - n_high, low)) if s[0] > 0)
        layout = Layout(segments)
        if layout.row_bytes <= row_bytes and layout.spare_bits >= spare_bits:
            return layout
    if spare_bits:
        raise ValueError(f"{row_bytes} bytes cannot hold codes of {dim} channels with {spare_bits} spare bits")
    raise AssertionError("unreachable: total = 0 always fits")
