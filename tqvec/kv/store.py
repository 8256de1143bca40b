"""Growable storage of TurboQuant codes for one layer's keys or values: ``(batch, kv_heads, tokens)``.

Per channel group ``g`` of the :class:`~tqvec.kv.codec.HeadCodec` the store holds

* ``packed[g]``: ``(b, h, capacity, row_bytes)`` uint8 codebook indices (layout: :mod:`tqvec.packing`),
* ``scales[g]``: ``(b, h, capacity)`` float16 multipliers (‖x‖, or the rescaled norm),
* ``qjl[g]`` / ``rnorms[g]`` (``prod`` mode): ``(b, h, capacity, ceil(D/8))`` uint8 QJL signs and
  ``(b, h, capacity)`` float16 residual norms.

Tokens ``[0, length)`` are valid. Capacity grows geometrically (×1.5, in steps of at least
``MIN_GROWTH`` tokens) so appending one token per decode step costs amortized O(1) copies.
:meth:`nbytes` counts the allocated capacity: it is exactly what the store holds in memory.
"""
from __future__ import annotations

import torch

from ..quantizer import Codes
from .codec import HeadCodec

MIN_GROWTH = 256


class CodeStore:
    """Codes of ``(b, h, length)`` head vectors under ``codec`` (all tensors on one device)."""

    def __init__(self, codec: HeadCodec) -> None:
        self.codec = codec
        self.length = 0
        self.fields: list[dict[str, torch.Tensor]] = []

    # ------------------------------------------------------------------ writing
    def append(self, x: torch.Tensor) -> None:
        """Encode and append ``x`` ``(b, h, t, head_dim)`` (already centered and channel-permuted)."""
        b, h, t, _ = x.shape
        if t == 0:
            return
        parts = []
        for g in self.codec.groups:
            codes = g.quantizer.encode(x[..., g.start:g.stop].reshape(b * h * t, g.stop - g.start).float())
            part = {"packed": codes.packed, "scales": codes.scales.half()}
            if codes.qjl is not None:
                part.update(qjl=codes.qjl, rnorms=codes.residual_norms.half())
            parts.append({k: v.reshape(b, h, t, *v.shape[1:]) for k, v in part.items()})
        self._reserve(self.length + t, parts)
        for dst, src in zip(self.fields, parts):
            for k, v in src.items():
                dst[k][:, :, self.length:self.length + t] = v
        self.length += t

    def _reserve(self, needed: int, like: list[dict[str, torch.Tensor]]) -> None:
        capacity = self.fields[0]["packed"].shape[2] if self.fields else 0
        if needed <= capacity:
            return
        new_cap = max(needed, int(capacity * 1.5), capacity + MIN_GROWTH) if capacity else needed
        grown = []
        for i, part in enumerate(like):
            fresh = {}
            for k, v in part.items():
                buf = v.new_zeros((v.shape[0], v.shape[1], new_cap, *v.shape[3:]))
                if self.fields:
                    buf[:, :, :self.length] = self.fields[i][k][:, :, :self.length]
                fresh[k] = buf
            grown.append(fresh)
        self.fields = grown

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (capacity is kept)."""
        self.length = min(self.length, max(0, length))

    def index_batch(self, index: torch.Tensor) -> None:
        """Reorder / select / repeat batch rows by ``index`` (int64, any length)."""
        self.fields = [{k: v.index_select(0, index.to(v.device)) for k, v in part.items()} for part in self.fields]

    # ------------------------------------------------------------------ reading
    def codes(self, group: int, batch: int, head: int, start: int, stop: int) -> Codes:
        """:class:`Codes` (float32 scales, views of the packed rows) of tokens ``[start, stop)`` of one head."""
        f = self.fields[group]
        rnorms = f.get("rnorms")
        return Codes(
            packed=f["packed"][batch, head, start:stop],
            scales=f["scales"][batch, head, start:stop].float(),
            qjl=None if "qjl" not in f else f["qjl"][batch, head, start:stop],
            residual_norms=None if rnorms is None else rnorms[batch, head, start:stop].float(),
        )

    def rows(self, group: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[start, stop)`` of all heads: packed ``(b·h·L, row_bytes)`` uint8, scales ``(b, h, L)`` float32."""
        f = self.fields[group]
        packed = f["packed"][:, :, start:stop]
        return packed.reshape(-1, packed.shape[-1]), f["scales"][:, :, start:stop].float()

    def nbytes(self) -> int:
        """Bytes allocated by the store (capacity included)."""
        return sum(v.numel() * v.element_size() for part in self.fields for v in part.values())

    def used_nbytes(self) -> int:
        """Bytes of the ``length`` valid tokens: ``b · h · length · codec.bytes_per_vector``."""
        if not self.fields:
            return 0
        b, h = self.fields[0]["packed"].shape[:2]
        return b * h * self.length * self.codec.bytes_per_vector
