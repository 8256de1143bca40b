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

Everything that reads or writes codes goes through :class:`Layout`, :func:`pack` and
:func:`unpack`; kernels take ``Layout.segment_table()``.
"""
from __future__ import annotations

import math
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

    def segment_table(self) -> list[tuple[int, int, int, int]]:
        """Rows ``(first_channel, dim, bits, first_byte)`` per non-empty segment, for kernels."""
        table, channel, byte = [], 0, 0
        for (dim, bits), nbytes in zip(self.segments, self.segment_bytes):
            if dim and bits:
                table.append((channel, dim, bits, byte))
            channel += dim
            byte += nbytes
        return table


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


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(bits, device=device, dtype=torch.uint8)


def pack(indices: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Pack ``(n, layout.dim)`` integer indices (each < 2**bits of its segment) into ``(n, row_bytes)`` uint8."""
    if indices.ndim != 2 or indices.shape[1] != layout.dim:
        raise ValueError(f"indices must be (n, {layout.dim}), got {tuple(indices.shape)}")
    n, device = indices.shape[0], indices.device
    parts, channel = [], 0
    for (dim, bits), nbytes in zip(layout.segments, layout.segment_bytes):
        if nbytes == 0:
            channel += dim
            continue
        seg = indices[:, channel:channel + dim].to(torch.uint8)
        channel += dim
        if 8 % bits == 0:  # whole codes per byte: shift and add, no bit stream
            per_byte = 8 // bits
            seg = torch.nn.functional.pad(seg, (0, nbytes * per_byte - dim)).view(n, nbytes, per_byte)
            shifts = bits * torch.arange(per_byte, device=device, dtype=torch.int32)
            parts.append((seg.to(torch.int32) << shifts).sum(-1, dtype=torch.int32).to(torch.uint8))
            continue
        stream = ((seg.unsqueeze(-1) >> _shifts(bits, device)) & 1).reshape(n, dim * bits)
        stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - dim * bits))
        weights = (1 << _shifts(8, device).to(torch.int32)).to(torch.uint8)
        parts.append((stream.view(n, nbytes, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8))
    if not parts:
        return torch.zeros(n, 0, dtype=torch.uint8, device=device)
    return torch.cat(parts, dim=1)


def unpack(packed: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Unpack ``(n, row_bytes)`` uint8 into ``(n, layout.dim)`` int64 indices (0 for 0-bit segments)."""
    if packed.ndim != 2 or packed.shape[1] != layout.row_bytes or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 (n, {layout.row_bytes}), got {packed.dtype} {tuple(packed.shape)}")
    n, device = packed.shape[0], packed.device
    parts, byte = [], 0
    for (dim, bits), nbytes in zip(layout.segments, layout.segment_bytes):
        if nbytes == 0:
            parts.append(torch.zeros(n, dim, dtype=torch.int64, device=device))
            continue
        seg = packed[:, byte:byte + nbytes]
        byte += nbytes
        stream = ((seg.unsqueeze(-1) >> _shifts(8, device)) & 1).reshape(n, nbytes * 8)[:, : dim * bits]
        weights = (1 << torch.arange(bits, device=device, dtype=torch.int64))
        parts.append((stream.view(n, dim, bits).to(torch.int64) * weights).sum(-1))
    return torch.cat(parts, dim=1)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Pack the signs of ``(n, m)`` floats as 1-bit codes (1 = non-negative) into ``(n, ceil(m/8))`` uint8."""
    return pack((values >= 0).to(torch.uint8), Layout(((values.shape[1], 1),)))


def unpack_signs(packed: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: ``(n, m)`` float32 of ±1."""
    return unpack(packed, Layout(((m, 1),))).to(torch.float32) * 2 - 1


def layout_for_bytes(dim: int, row_bytes: int, max_bits: int = MAX_BITS) -> Layout:
    """The layout of ``dim`` channels with the most code bits that packs into at most ``row_bytes`` bytes.

    Bits are spread as evenly as possible (two segments: ``b + 1`` and ``b`` bits per channel).
    """
    if row_bytes < 0:
        raise ValueError(f"row_bytes must be >= 0, got {row_bytes}")
    for total in range(min(8 * row_bytes, dim * max_bits), -1, -1):
        low, n_high = divmod(total, dim)
        segments = tuple(s for s in ((n_high, low + 1), (dim - n_high, low)) if s[0] > 0)
        layout = Layout(segments)
        if layout.row_bytes <= row_bytes:
            return layout
    raise AssertionError("unreachable: total = 0 always fits")
