"""Growable storage of TurboQuant codes for one layer's keys or values: ``(batch, kv_heads, tokens)``.

Per channel group ``g`` of the :class:`~tqvec.kv.codec.HeadCodec` the store holds

* ``packed[g]``: ``(b, h, capacity, row_bytes)`` uint8 codebook indices (layout: :mod:`tqvec.packing`),
* ``scales[g]``: ``(b, h, capacity)`` float16 multipliers (‖x‖, or the rescaled norm),
* ``qjl[g]`` / ``rnorms[g]`` (``prod`` mode): ``(b, h, capacity, ceil(D/8))`` uint8 QJL signs and
  ``(b, h, capacity)`` float16 residual norms.

Tokens ``[0, length)`` are valid. The first allocation is exact (a prefill); later growth reserves
``max(MIN_GROWTH, needed // GROWTH_DIVISOR)`` tokens beyond what is needed, so the capacity stays within
``MIN_GROWTH`` tokens or ``1 / GROWTH_DIVISOR`` of the contents (whichever is larger) and a growth, which copies the
store, happens once per ``MIN_GROWTH`` appended tokens at most (a decode step compresses ``compress_chunk`` tokens at
a time). :meth:`nbytes` counts the allocated capacity: it is exactly what the store holds in memory.

:meth:`append` centers, permutes and encodes ``ENCODE_ROWS``-row slices (over all batch rows and heads) straight
into the reserved capacity, so its transient float32 buffers are bounded by one slice, not by the prefill's length;
on CUDA, one ``mse`` quantizer that :func:`tqvec.kernels.append.encode_chunk` serves is encoded by that one launch per
slice (centering, rotation, quantization, packing and the scale), the torch operations otherwise.
:meth:`decode` inverts it, slice by slice, into a caller's buffer of any float dtype (the ``tqvec`` attention's dense
path for several query tokens).
"""
from __future__ import annotations

from types import ModuleType

import torch

from ..quantizer import Codes
from .checks import check_finite
from .codec import HeadCodec

#: growth beyond the tokens needed: at least this many tokens ...
MIN_GROWTH = 64
#: ... or this fraction (1 / GROWTH_DIVISOR) of them
GROWTH_DIVISOR = 128
#: rows (batch × heads × tokens) encoded per slice by :meth:`CodeStore.append`
ENCODE_ROWS = 8192
#: on CUDA, :meth:`CodeStore.append` encodes a slice in one Triton launch where the kernel serves the codec
FUSED_ENCODE = True


def permute_channels(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x`` ``(b, h, t, d)`` with each head's channels in the order ``perm`` ``(h, d)``: ``out[..., i] = x[..., perm[i]]``."""
    b, h, t, d = x.shape
    return torch.gather(x, 3, perm[None, :, None, :].expand(b, h, t, d))


def restore_channels(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`permute_channels`: ``out[..., perm[i]] = x[..., i]``."""
    b, h, t, d = x.shape
    return torch.empty_like(x).scatter_(3, perm[None, :, None, :].expand(b, h, t, d), x)


class CodeStore:
    """Codes of ``(b, h, length)`` head vectors under ``codec`` (all tensors on one device)."""

    def __init__(self, codec: HeadCodec) -> None:
        self.codec = codec
        self.length = 0
        self.fields: list[dict[str, torch.Tensor]] = []

    # ------------------------------------------------------------------ writing
    def append(self, x: torch.Tensor, mean: torch.Tensor | None = None, perm: torch.Tensor | None = None,
               name: str = "x") -> None:
        """Encode and append ``x`` ``(b, h, t, head_dim)`` (any float dtype) as ``permute(x − mean, perm)``.

        ``mean``: ``(b, h, head_dim)`` float32 subtracted first (None: no centering); ``perm``: ``(h, head_dim)``
        int64 channel order (None: identity). Raises ``ValueError`` naming ``name`` if ``x`` holds NaN or ±inf
        (nothing is appended then).
        """
        b, h, t, d = x.shape
        if t == 0:
            return
        check_finite(name, x)
        self._reserve(self.length + t, b, h, x.device)
        step = max(1, ENCODE_ROWS // (b * h))
        kernel = self._fused_kernel(x) if mean is not None and perm is None else None
        if kernel is not None:
            from .attention import _rotation_matrices  # noqa: PLC0415 - attention imports this module

            quantizer, dst = self.codec.groups[0].quantizer, self.fields[0]
            rotation = _rotation_matrices(quantizer, x.device)[0]
            mean = mean.float().contiguous()  # as the kernel reads it (the layers' means already are)
            for start in range(0, t, step):
                kernel.encode_chunk(x[:, :, start:start + step], mean, rotation, quantizer, dst["packed"], dst["scales"],
                                    self.length + start)
            self.length += t
            return
        for start in range(0, t, step):
            stop = min(start + step, t)
            block = x[:, :, start:stop].float()
            if mean is not None:
                block = block - mean[:, :, None]
            if perm is not None:
                block = permute_channels(block, perm)
            at = slice(self.length + start, self.length + stop)
            for g, dst in zip(self.codec.groups, self.fields):
                rows = block[..., g.start:g.stop].reshape(-1, g.stop - g.start).contiguous()
                codes = g.quantizer.encode_checked(rows)
                dst["packed"][:, :, at] = codes.packed.view(b, h, stop - start, -1)
                dst["scales"][:, :, at] = codes.scales.view(b, h, stop - start).half()
                if codes.qjl is not None:
                    dst["qjl"][:, :, at] = codes.qjl.view(b, h, stop - start, -1)
                    dst["rnorms"][:, :, at] = codes.residual_norms.view(b, h, stop - start).half()
        self.length += t

    def _fused_kernel(self, x: torch.Tensor) -> ModuleType | None:
        """:mod:`tqvec.kernels.append` where :meth:`append` encodes ``x`` with its
        :func:`~tqvec.kernels.append.encode_chunk` (one launch per slice): on CUDA where ``FUSED_ENCODE`` is on and the
        codec is one ``mse`` quantizer that the kernel serves; else None."""
        if not (FUSED_ENCODE and x.is_cuda and len(self.codec.groups) == 1 and self.codec.mode == "mse"):
            return None
        try:
            from ..kernels import append as kernel  # noqa: PLC0415 - Triton is optional
        except ImportError:
            return None
        return kernel if kernel.serves(self.codec.groups[0].quantizer) else None

    def allocate(self, capacity: int, b: int, h: int, device: torch.device) -> None:
        """Allocate zeroed buffers of exactly ``capacity`` tokens for an empty store (a static cache's, which never
        grows). Raises ``ValueError`` if the store already holds buffers."""
        if self.fields:
            raise ValueError("allocate: the store already holds buffers")
        self.fields = self._empty_fields(b, h, capacity, device)

    def write_one(self, x: torch.Tensor, mean: torch.Tensor, index: torch.Tensor, write: torch.Tensor) -> None:
        """Encode ``x`` ``(b, h, 1, head_dim)`` as ``x − mean`` and store it at token ``index`` (a 0-d int64 tensor)
        of every (batch row, head) where ``write`` (a 0-d bool tensor) is True; else leave the store as it is.

        Fixed shapes and no host synchronization (so a CUDA graph can capture it): the token is always encoded,
        then written back over itself when ``write`` is False. One channel group (an integer rate), no channel
        order; ``x`` is not checked for NaN or ±inf (that check would synchronize). ``length`` is not changed.
        """
        b, h, _, d = x.shape
        rows = (x.float() - mean[:, :, None]).reshape(b * h, d).contiguous()
        codes = self.codec.groups[0].quantizer.encode_checked(rows)
        at = index.view(1)
        fields = self.fields[0]
        for name, new in (("packed", codes.packed.view(b, h, 1, -1)), ("scales", codes.scales.view(b, h, 1).half())):
            buffer = fields[name]
            buffer.index_copy_(2, at, torch.where(write, new, buffer.index_select(2, at)))

    def _empty_fields(self, b: int, h: int, capacity: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
        """Zeroed buffers of ``capacity`` tokens for every group and field."""
        out = []
        for g in self.codec.groups:
            q = g.quantizer
            part = {"packed": torch.zeros((b, h, capacity, q.layout.row_bytes), dtype=torch.uint8, device=device),
                    "scales": torch.zeros((b, h, capacity), dtype=torch.float16, device=device)}
            if q.mode == "prod":
                part["qjl"] = torch.zeros((b, h, capacity, -(-q.rotated_dim // 8)), dtype=torch.uint8, device=device)
                part["rnorms"] = torch.zeros((b, h, capacity), dtype=torch.float16, device=device)
            out.append(part)
        return out

    @property
    def capacity(self) -> int:
        """Tokens the buffers can hold without growing."""
        return self.fields[0]["packed"].shape[2] if self.fields else 0

    def _reserve(self, needed: int, b: int, h: int, device: torch.device) -> None:
        """Capacity for ``needed`` tokens: exact when empty, else ``needed + max(MIN_GROWTH, needed // GROWTH_DIVISOR)``."""
        if self.fields and self.fields[0]["packed"].shape[:2] != (b, h):
            raise ValueError(f"x has (batch, heads) {(b, h)}, the store holds {tuple(self.fields[0]['packed'].shape[:2])}")
        capacity = self.capacity
        if needed <= capacity:
            return
        new_cap = needed if self.length == 0 else needed + max(MIN_GROWTH, needed // GROWTH_DIVISOR)
        grown = self._empty_fields(b, h, new_cap, device)
        for old, fresh in zip(self.fields, grown):
            for k, v in old.items():
                fresh[k][:, :, :self.length] = v[:, :, :self.length]
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
        return self._codes(group, (batch, head, slice(start, stop)))

    def rows(self, group: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[start, stop)`` of all heads: packed ``(b·h·L, row_bytes)`` uint8, scales ``(b, h, L)`` float32."""
        f = self.fields[group]
        packed = f["packed"][:, :, start:stop]
        return packed.reshape(-1, packed.shape[-1]), f["scales"][:, :, start:stop].float()

    def decode(self, out: torch.Tensor, mean: torch.Tensor | None = None, perm: torch.Tensor | None = None,
               start: int = 0, rows: int = ENCODE_ROWS) -> None:
        """Write tokens ``[start, start + t)`` into ``out`` ``(b, h, t, head_dim)`` (any float dtype, may be a view):
        the inverse of :meth:`append`, ``decode(codes)`` with its channels put back through ``perm``, plus ``mean``.

        ``mean`` ``(b, h, head_dim)`` float32 and ``perm`` ``(h, head_dim)`` int64 are the ones given to :meth:`append`
        (None: none). Each group decodes with :meth:`TurboQuantizer.decode <tqvec.quantizer.TurboQuantizer.decode>`
        (``prod`` codes with their QJL term), so ``⟨q, out[..., i, :]⟩ = ⟨q, mean⟩ +`` the score the scan computes
        for token ``i`` from the codes. Slices of ``rows`` rows (over all batch rows and heads) are decoded in float32
        and written into ``out`` at once, so the float32 transients are bounded by one slice.

        Raises ``ValueError`` if ``out``'s batch rows, heads or ``head_dim`` differ from the store's, or if the tokens
        run past ``length``.
        """
        b, h, t, d = out.shape
        if not self.fields or self.fields[0]["packed"].shape[:2] != (b, h) or d != self.codec.head_dim:
            held = tuple(self.fields[0]["packed"].shape[:2]) if self.fields else "no codes"
            raise ValueError(f"out {tuple(out.shape)} does not match the store: (batch, heads) {held}, "
                             f"head_dim {self.codec.head_dim}")
        if not 0 <= start <= start + t <= self.length:
            raise ValueError(f"tokens [{start}, {start + t}) run past the {self.length} stored")
        step = max(1, rows // (b * h))
        for lo in range(0, t, step):
            hi = min(lo + step, t)
            at = slice(start + lo, start + hi)
            block = out.new_empty((b, h, hi - lo, d), dtype=torch.float32)
            for gi, g in enumerate(self.codec.groups):
                block[..., g.start:g.stop] = g.quantizer.decode(self._all_heads(gi, at)).view(b, h, hi - lo, -1)
            if perm is not None:
                block = restore_channels(block, perm)
            if mean is not None:
                block += mean[:, :, None]
            out[:, :, lo:hi] = block

    def _all_heads(self, group: int, tokens: slice) -> Codes:
        """:class:`Codes` (float32 scales) of ``tokens`` of every batch row and head, rows in (batch, head, token)
        order."""
        return self._codes(group, (slice(None), slice(None), tokens))

    def _codes(self, group: int, index: tuple) -> Codes:
        """:class:`Codes` (float32 scales) of the fields of ``group`` indexed by ``index`` over (batch, head, token),
        flattened to rows."""
        f = {k: v[index] for k, v in self.fields[group].items()}
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        rnorms = f.get("rnorms")
        return Codes(
            packed=rows(f["packed"]),
            scales=f["scales"].reshape(-1).float(),
            qjl=None if "qjl" not in f else rows(f["qjl"]),
            residual_norms=None if rnorms is None else rnorms.reshape(-1).float(),
        )

    def nbytes(self) -> int:
        """Bytes allocated by the store (capacity included)."""
        return sum(v.numel() * v.element_size() for part in self.fields for v in part.values())

    def used_nbytes(self) -> int:
        """Bytes of the ``length`` valid tokens: ``b · h · length · codec.bytes_per_vector``."""
        if not self.fields:
            return 0
        b, h = self.fields[0]["packed"].shape[:2]
        return b * h * self.length * self.codec.bytes_per_vector
