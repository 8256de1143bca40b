"""TurboQuant: online, data-oblivious vector quantization (arXiv 2504.19874) with QJL (arXiv 2406.03482).

``encode`` stores ‖x‖, rotates x/‖x‖ with a seeded random rotation Π and quantizes every rotated
coordinate with the Lloyd–Max codebook of the exact coordinate density (no training data).

* ``mode="mse"``: ``bits`` bits per coordinate. ⟨q, x⟩ ≈ ‖x‖·⟨Πq, ŷ⟩ (biased low: ×2/π at 1 bit).
* ``mode="prod"``: ``bits − 1`` bits of ``mse`` plus 1-bit QJL of the rotated residual r = Πu − ŷ:
  ``sign(S·r)`` with S a seeded D×D Gaussian, and ‖r‖. ⟨q, x⟩ ≈ ‖x‖·(⟨Πq, ŷ⟩ + ‖r‖·√(π/2)/D·⟨SΠq, sign(S·r)⟩),
  an unbiased estimate.
* ``rescale=True`` (``mse`` only): store ``‖x‖ / ⟨ŷ, Πu⟩`` in place of ‖x‖. This removes each vector's
  own shrinkage of ŷ toward 0, so scores are nearly unbiased per vector (same 32 bits per vector).

Fractional ``bits`` (e.g. 2.5) split the D rotated channels into two groups: the first
``round(frac·D)`` channels at ``ceil(bits)`` bits, the rest at ``floor(bits)`` bits, each group with the
Lloyd–Max codebook of its own bit width (rotated channels are exchangeable, so which channels get the
extra bit does not matter). The packed layout is documented in :mod:`tqvec.packing`.

Seeds: Π comes from ``seed``; S from ``seed + QJL_SEED_OFFSET``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

import torch

from . import scan
from .codebook import lloyd_max_codebook
from .packing import Layout, layout_for_bytes, pack, pack_signs, split_channels, unpack, unpack_signs
from .rotation import ROTATION_KINDS, gaussian_matrix, make_rotation, rotated_dim, rowwise_matmul
from .validation import as_float_matrix, check_bits, check_choice, check_positive_int

MODES = ("mse", "prod")
QJL_SEED_OFFSET = 0x9E3779B1
ENCODE_BLOCK_ROWS = 1 << 20  # rows per encode step: bounds temporaries (~0.5 GB at d = 128)
#: CPU: at most this many rotated values per encode step, so that each step's temporaries stay in cache
#: (2 MB of float32; docs/method.md, encode speed)
ENCODE_BLOCK_VALUES = 1 << 19


@dataclass
class Codes:
    """``n`` vectors encoded by one :class:`TurboQuantizer`; all tensors share one device.

    ``len(codes)`` is ``n``; ``codes[rows]`` selects rows (a slice, index tensor or boolean mask).

    Attributes
    ----------
    packed : torch.Tensor of shape (n, layout.row_bytes), dtype uint8
        Packed codebook indices of the rotated unit vector (layout: :mod:`tqvec.packing`).
    scales : torch.Tensor of shape (n,), dtype float32
        The multiplier of ⟨Πq, ŷ⟩: ‖x‖, or with ``rescale`` ‖x‖/⟨ŷ, Πu⟩ (‖x‖ where that alignment is ≤ 0).
    qjl : torch.Tensor of shape (n, ceil(D / 8)), dtype uint8, or None
        QJL sign bits of the residual, ``D`` the rotated dimension (``prod`` mode only).
    residual_norms : torch.Tensor of shape (n,), dtype float32, or None
        ‖Πu − ŷ‖ of the unit vector u = x/‖x‖ (``prod`` mode only).
    nbytes : int
        Bytes held by all stored fields (read-only property).
    device : torch.device
        The device of the tensors (read-only property).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    qjl: torch.Tensor | None = None
    residual_norms: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by all stored fields."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def device(self) -> torch.device:
        """The device of the tensors."""
        return self.packed.device

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]

    def __getitem__(self, rows: Any) -> "Codes":
        """Codes of the selected rows (a slice, index tensor or boolean mask)."""
        return Codes(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows] for f in fields(self)})

    def to(self, device: torch.device | str) -> "Codes":
        """The same codes on ``device`` (tensors already there are not copied)."""
        return Codes(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device) for f in fields(self)})

    @staticmethod
    def cat(parts: list["Codes"]) -> "Codes":
        """Concatenate codes of one quantizer along rows."""
        return Codes(**{
            f.name: None if getattr(parts[0], f.name) is None else torch.cat([getattr(p, f.name) for p in parts])
            for f in fields(Codes)
        })


@dataclass
class _GridTables:
    """:class:`_GridBucketizer`'s lookup tables on one device (flattened over segments, offsets per channel)."""

    counts: torch.Tensor  # (S·cells,) int32: boundaries below the start of the 3-cell window of each cell
    boundaries: torch.Tensor  # (S·(B + 1),) float32: each segment's boundaries, then +inf padding
    cell_offset: torch.Tensor  # (D,) int32: segment s · cells
    boundary_offset: torch.Tensor  # (D,) int32: segment s · (B + 1)
    level_offset: torch.Tensor  # (D,) int32: segment s · 256 (rows of CodeTable.levels)


class _GridBucketizer:
    """Exact ``bucketize`` of all channels of a layout at once, without a binary search per value.

    Values are mapped to cells of a uniform grid of width ``h`` < (smallest gap between two boundaries of a
    segment) / 3. With float32 rounding a value lands in its true cell or a neighbour, so it lies in the
    3-cell window starting one cell below the cell it landed in; that window holds at most one boundary.
    The table gives the number of boundaries below the window, and one comparison with the next boundary
    (strict, as ``bucketize``) completes the count. Values beyond the grid are clamped to its end cells,
    whose counts are 0 and all boundaries. Tests compare it with ``torch.bucketize`` on boundaries ± 1 ulp.
    """

    MAX_CELLS = 1 << 20

    def __init__(self, layout: Layout, boundaries: list[torch.Tensor | None], levels: torch.Tensor) -> None:
        present = [b.double() for b in boundaries if b is not None and len(b)]
        gaps = [float((b[1:] - b[:-1]).min()) for b in present if len(b) > 1]
        reach = max((float(b.abs().max()) for b in present), default=0.0)
        width = (min(gaps) if gaps else max(reach, 1.0)) / 3.01
        reach += 3 * width
        cells = math.ceil(2 * reach / width) + 1
        if cells > self.MAX_CELLS:
            raise ValueError(f"decision boundaries too close for a grid of at most {self.MAX_CELLS} cells")
        most = max((len(b) for b in present), default=0)
        counts = torch.zeros(len(layout.segments), cells, dtype=torch.int32)
        padded = torch.full((len(layout.segments), most + 1), float("inf"), dtype=torch.float32)
        window_start = -reach + (torch.arange(cells, dtype=torch.float64) - 1) * width
        for s, b in enumerate(boundaries):
            if b is not None and len(b):
                counts[s] = torch.searchsorted(b.double(), window_start).to(torch.int32)  # #{b < start}
                padded[s, : len(b)] = b
        segment = torch.cat([torch.full((dim,), s, dtype=torch.int32) for s, (dim, _) in enumerate(layout.segments)])
        self.scale, self.shift, self.last_cell = 1.0 / width, reach / width, cells - 1
        self.single = len(layout.segments) == 1
        self._tables = {torch.device("cpu"): _GridTables(counts.reshape(-1), padded.reshape(-1), segment * cells,
                                                         segment * (most + 1), segment * levels.shape[1])}

    def on(self, device: torch.device) -> _GridTables:
        if device not in self._tables:
            cpu = self._tables[torch.device("cpu")]
            self._tables[device] = _GridTables(*(getattr(cpu, f.name).to(device) for f in fields(_GridTables)))
        return self._tables[device]

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, D)`` float32 → ``(n, D)`` int32 counts of boundaries strictly below each value."""
        t = self.on(x.device)
        cell = torch.add(torch.full((), self.shift, dtype=torch.float32, device=x.device), x, alpha=self.scale)
        cell = cell.clamp_(0, self.last_cell).to(torch.int32)  # truncation = floor on [0, cells)
        if not self.single:
            cell += t.cell_offset
        count = t.counts.index_select(0, cell.view(-1)).view(x.shape)
        position = count if self.single else count + t.boundary_offset
        count += x > t.boundaries.index_select(0, position.view(-1)).view(x.shape)
        return count


class TurboQuantizer:
    """TurboQuant for ``dim``-dimensional vectors at ``bits`` bits per coordinate: online, no training.

    Parameters
    ----------
    dim : int
        Vector dimension (≥ 2).
    bits : float
        Bits per coordinate, 1–8, fractional allowed (channels split between two widths).
    mode : {"mse", "prod"}
        ``"prod"`` spends one bit per channel on a QJL sign code of the residual (unbiased inner products).
    rotation : {"haar", "hadamard", "fht-kac"}, keyword-only
        Dense Haar (O(d²)), randomized Hadamard (fast; pads to a power of two D ≥ dim), or FHT-Kac (Hadamard
        rounds without padding; the native CPU search rotates each query in O(d log d)).
    seed : int, keyword-only
    rescale : bool, keyword-only
        Store ``‖x‖ / ⟨ŷ, Πx/‖x‖⟩`` instead of ``‖x‖`` (removes each vector's shrinkage).
    layout : Layout, keyword-only
        Overrides the channel split of the ``mse`` part derived from ``bits``; it may give channels 0 bits
        (they decode to 0), which lets budget-driven callers such as :class:`~tqvec.index.Index` spend an
        exact number of bytes; ``bits`` then reports the realised rate.

    Raises
    ------
    ValueError
        An argument of the wrong type, out of its range or choices, named in the message.

    Examples
    --------
    >>> import torch
    >>> tq = TurboQuantizer(64, bits=4)
    >>> x = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    >>> codes = tq.encode(x)
    >>> tuple(codes.packed.shape), codes.packed.dtype
    ((10, 32), torch.uint8)
    >>> bool(((tq.decode(codes) - x).norm(dim=1) < 0.2 * x.norm(dim=1)).all())
    True
    """

    def __init__(self, dim: int, bits: float = 4, mode: str = "mse", *, rotation: str = "haar", seed: int = 0,
                 rescale: bool = False, layout: Layout | None = None) -> None:
        self.dim = check_positive_int("dim", dim)
        if self.dim < 2:
            raise ValueError(f"dim must be at least 2, got {dim}")
        self.bits = check_bits(bits)
        self.mode = check_choice("mode", mode, MODES)
        check_choice("rotation", rotation, ROTATION_KINDS)
        if rescale and mode != "mse":
            raise ValueError("rescale applies to mode='mse' only (prod scores are already unbiased)")
        # not validation.check_seed: the seeds callers derive (seed + 1, + 1000, ...) may pass its MAX_SEED
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed, self.rescale = int(seed), bool(rescale)
        self.rotation = make_rotation(rotation, self.dim, self.seed)
        self.rotated_dim = self.rotation.out_dim
        codebook_dim = max(self.rotated_dim, 3)
        if layout is None:
            layout = split_channels(self.rotated_dim, self.bits - (mode == "prod"))
        elif layout.dim != self.rotated_dim:
            raise ValueError(f"layout covers {layout.dim} channels, the rotation produces {self.rotated_dim}")
        else:
            self.bits = layout.bits_per_row / self.rotated_dim + (mode == "prod")
        self.layout: Layout = layout
        self.codebooks = [lloyd_max_codebook(codebook_dim, b) if b else None for _, b in self.layout.segments]
        levels = torch.zeros(len(self.layout.segments), 256, dtype=torch.float32)
        for s, cb in enumerate(self.codebooks):
            if cb is not None:
                levels[s, : len(cb.levels)] = torch.as_tensor(cb.levels, dtype=torch.float32)
        self._tables = {torch.device("cpu"): scan.CodeTable(self.layout, levels)}
        self._boundaries = [None if cb is None else torch.as_tensor(cb.boundaries, dtype=torch.float32) for cb in self.codebooks]
        self._boundary_tables: dict[torch.device, torch.Tensor] = {}
        self._grid: _GridBucketizer | None = None
        self._qjl_cpu = gaussian_matrix(self.rotated_dim, self.rotated_dim, self.seed + QJL_SEED_OFFSET) if mode == "prod" else None
        self._qjl: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def for_bytes(cls, dim: int, code_bytes: int, mode: str = "mse", *, rotation: str = "haar", seed: int = 0,
                  rescale: bool = False) -> "TurboQuantizer":
        """The quantizer whose codes fill at most ``code_bytes`` bytes per vector.

        ``code_bytes`` counts the packed codes and, in ``prod`` mode, the QJL sign bits, not the float32 scale and
        residual norm (:attr:`bits_per_vector` counts everything). Bits are spread as evenly as possible over the
        rotated channels (``b + 1`` and ``b`` bits per channel).

        Parameters
        ----------
        dim : int
            Vector dimension (≥ 2).
        code_bytes : int
            Bytes of codes per vector.
        mode, rotation, seed, rescale
            As in :class:`TurboQuantizer`.

        Returns
        -------
        TurboQuantizer
            Its ``bits`` reports the realised rate.

        Raises
        ------
        ValueError
            ``code_bytes`` leaves no room for codes (0 in ``mse`` mode, fewer than the ``ceil(D / 8)`` bytes of QJL
            bits in ``prod`` mode, ``D`` the rotated dimension), or an argument the constructor refuses.

        Examples
        --------
        >>> tq = TurboQuantizer.for_bytes(64, 20)
        >>> tq.layout.row_bytes, tq.bits
        (20, 2.5)
        """
        channels = rotated_dim(check_choice("rotation", rotation, ROTATION_KINDS), dim)
        mse_bytes = code_bytes - (math.ceil(channels / 8) if mode == "prod" else 0)
        if mse_bytes < 0 or (mode == "mse" and mse_bytes == 0):
            raise ValueError(f"{code_bytes} bytes per vector leaves no room for codes at dim={dim} in {mode!r} mode")
        return cls(dim, 1, mode, rotation=rotation, seed=seed, rescale=rescale, layout=layout_for_bytes(channels, mse_bytes))

    def __repr__(self) -> str:
        return (f"TurboQuantizer(dim={self.dim}, bits={self.bits:.4g}, mode={self.mode!r}, "
                f"rotation={self.rotation.kind!r}, seed={self.seed}, rescale={self.rescale})")

    # ------------------------------------------------------------------ sizes
    @property
    def bits_per_vector(self) -> int:
        """Exact stored bits per vector: packed codes (byte-padded) + float32 scale (+ QJL bits and ‖r‖)."""
        bits = 8 * self.layout.row_bytes + 32
        if self.mode == "prod":
            bits += 8 * math.ceil(self.rotated_dim / 8) + 32
        return bits

    @property
    def expected_unit_mse(self) -> float:
        """Theoretical E‖Πu − ŷ‖² of the ``mse`` part for a unit vector u (sum of per-channel codebook MSE).

        This is E‖u − û‖² for ``haar``; for ``hadamard`` with dim < D the decoded error drops the padding
        directions and comes out near ``dim / D`` of it."""
        return sum(d * (cb.mse if cb else 1.0 / self.rotated_dim) for (d, _), cb in zip(self.layout.segments, self.codebooks))

    # ------------------------------------------------------------------ device caches
    def table(self, device: torch.device | str) -> scan.CodeTable:
        """The layout and codebook levels on ``device``, copied there once.

        Parameters
        ----------
        device : torch.device or str

        Returns
        -------
        tqvec.scan.CodeTable
            Its ``levels`` are ``(n_segments, 256)`` float32: row ``s`` holds segment ``s``'s levels, zero-padded.
        """
        device = torch.device(device)
        if device not in self._tables:
            self._tables[device] = self._tables[torch.device("cpu")].to(device)
        return self._tables[device]

    def qjl_matrix(self, device: torch.device | str) -> torch.Tensor:
        """The QJL projection ``S`` on ``device``, copied there once (``prod`` mode only).

        Parameters
        ----------
        device : torch.device or str

        Returns
        -------
        torch.Tensor of shape (D, D), dtype float32
            ``D`` the rotated dimension.

        Raises
        ------
        ValueError
            In ``mse`` mode.
        """
        if self._qjl_cpu is None:
            raise ValueError("QJL matrix exists in mode='prod' only")
        device = torch.device(device)
        if device not in self._qjl:
            self._qjl[device] = self._qjl_cpu.to(device)
        return self._qjl[device]

    # ------------------------------------------------------------------ encode / decode
    def encode(self, x: Any) -> Codes:
        """Encode vectors into :class:`Codes` on ``x``'s device.

        Parameters
        ----------
        x : numpy.ndarray or torch.Tensor of shape (n, dim)
            Finite floats (float16/32/64, or bfloat16 for torch), converted to float32; ``n`` may be 0.

        Returns
        -------
        Codes
            torch tensors, also for numpy input (then on the CPU): ``packed`` ``(n, layout.row_bytes)`` uint8,
            ``scales`` ``(n,)`` float32 and, in ``prod`` mode, ``qjl`` ``(n, ceil(D / 8))`` uint8 and
            ``residual_norms`` ``(n,)`` float32.

        Raises
        ------
        ValueError
            ``x`` is not a float numpy array or torch tensor of shape ``(n, dim)``, holds NaN or ±Inf, or has a row
            whose squared norm exceeds :data:`tqvec.validation.MAX_SQUARED_NORM`.

        Examples
        --------
        >>> import numpy as np
        >>> tq = TurboQuantizer(64, bits=3, mode="prod")
        >>> codes = tq.encode(np.random.default_rng(0).standard_normal((5, 64)))
        >>> type(codes.packed).__name__, tuple(codes.packed.shape), tuple(codes.qjl.shape)
        ('Tensor', (5, 16), (5, 8))
        """
        return self.encode_checked(as_float_matrix(x, self.dim, "x"))

    def encode_checked(self, x: torch.Tensor) -> Codes:
        """:meth:`encode` without its input checks, for callers that validated once.

        Parameters
        ----------
        x : torch.Tensor of shape (n, dim), dtype float32
            Already checked by :func:`~tqvec.validation.as_float_matrix`: finite, contiguous.

        Returns
        -------
        Codes
            As :meth:`encode`, on ``x``'s device.
        """
        n = x.shape[0]
        rows = ENCODE_BLOCK_ROWS if x.is_cuda else min(ENCODE_BLOCK_ROWS, max(1, ENCODE_BLOCK_VALUES // self.rotated_dim))
        if n <= rows:
            return self._encode_block(x)
        first = self._encode_block(x[:rows])
        out = Codes(**{f.name: None if getattr(first, f.name) is None else  # preallocated: no concatenation
                       getattr(first, f.name).new_empty((n, *getattr(first, f.name).shape[1:])) for f in fields(Codes)})
        for start in range(0, n, rows):
            block = first if start == 0 else self._encode_block(x[start:start + rows])
            for f in fields(Codes):
                if getattr(block, f.name) is not None:
                    getattr(out, f.name)[start:start + len(block)] = getattr(block, f.name)
        return out

    def _quantize(self, rotated: torch.Tensor) -> torch.Tensor:
        """``(n, D)`` rotated unit vectors → ``(n, D)`` int32 codebook indices: the number of the channel's
        decision boundaries strictly below each value (``torch.bucketize``: a value on a boundary takes the
        lower cell). One 1-bit segment: a comparison; else :class:`_GridBucketizer`, exact and faster."""
        segments = self.layout.segments
        if len(segments) == 1 and segments[0][1] <= 1:
            boundaries = self._boundaries[0]
            if boundaries is None:
                return torch.zeros(rotated.shape, dtype=torch.int32, device=rotated.device)
            return torch.gt(rotated, float(boundaries[0])).to(torch.int32)
        if self._grid is None:
            self._grid = _GridBucketizer(self.layout, self._boundaries, self._tables[torch.device("cpu")].levels)
        return self._grid.quantize(rotated)

    def _levels_of(self, indices: torch.Tensor) -> torch.Tensor:
        """``(n, D)`` codebook levels ``ŷ`` of ``indices`` (equal, bit for bit, to dequantizing their packed codes)."""
        levels = self.table(indices.device).levels
        if len(self.layout.segments) == 1:
            return levels[0].index_select(0, indices.reshape(-1)).view(indices.shape)
        if self._grid is None:
            self._grid = _GridBucketizer(self.layout, self._boundaries, self._tables[torch.device("cpu")].levels)
        offsets = self._grid.on(indices.device).level_offset
        return levels.reshape(-1).index_select(0, (indices + offsets).reshape(-1)).view(indices.shape)

    def _encode_block(self, x: torch.Tensor) -> Codes:
        if x.is_cuda:
            return self._encode_block_cuda(x)
        norms = torch.linalg.vector_norm(x, dim=1)
        unit = x / torch.where(norms > 0, norms, torch.ones_like(norms))[:, None]
        rotated = self.rotation.forward(unit)
        indices = self._quantize(rotated)
        packed = pack(indices, self.layout)
        scales = norms
        if self.rescale:
            alignment = (self._levels_of(indices) * rotated).sum(1)
            scales = torch.where(alignment > 0, norms / alignment.clamp_min(1e-30), norms)
        if self.mode == "mse":
            return Codes(packed, scales)
        residual = rotated - self._levels_of(indices)
        signs = pack_signs(rowwise_matmul(residual, self.qjl_matrix(x.device).T))
        return Codes(packed, scales, signs, torch.linalg.vector_norm(residual, dim=1))

    def boundary_table(self, device: torch.device) -> torch.Tensor:
        """The Triton kernels' table of decision boundaries on ``device``, made once per device.

        Parameters
        ----------
        device : torch.device

        Returns
        -------
        torch.Tensor of shape (n_segments, 256), dtype float32
            Row ``s``: segment ``s``'s ascending boundaries, zero-padded (:func:`tqvec.kernels.ops.boundary_table`).

        Raises
        ------
        ImportError
            Triton is not installed (:mod:`tqvec.kernels` needs it).
        """
        from .kernels import ops  # noqa: PLC0415 - Triton is optional

        if device not in self._boundary_tables:
            self._boundary_tables[device] = ops.boundary_table(self._boundaries, device)
        return self._boundary_tables[device]

    def _encode_block_cuda(self, x: torch.Tensor) -> Codes:
        """CUDA: rotate (GEMM), then one Triton kernel normalizes, quantizes and packs (‖Πx‖ = ‖x‖)."""
        from .kernels import ops  # noqa: PLC0415 - Triton is optional and CUDA-only

        rotated = self.rotation.forward(x)
        packed, norms, alignment = ops.encode(rotated, self.table(x.device), self.boundary_table(x.device))
        scales = torch.where(alignment > 0, norms / alignment.clamp_min(1e-30), norms) if self.rescale else norms
        if self.mode == "mse":
            return Codes(packed, scales)
        unit = rotated / torch.where(norms > 0, norms, torch.ones_like(norms))[:, None]
        residual = unit - scan.dequantize(packed, self.table(x.device))
        signs = pack_signs(rowwise_matmul(residual, self.qjl_matrix(x.device).T))
        return Codes(packed, scales, signs, torch.linalg.vector_norm(residual, dim=1))

    def decode(self, codes: Codes) -> torch.Tensor:
        """Reconstruct vectors from ``codes``, in ``prod`` mode including the QJL term.

        Parameters
        ----------
        codes : Codes
            ``n`` rows made by this quantizer's :meth:`encode`.

        Returns
        -------
        torch.Tensor of shape (n, dim), dtype float32
            On ``codes.device``.

        Examples
        --------
        >>> import torch
        >>> tq = TurboQuantizer(50, bits=2, rotation="hadamard")  # D = 64 rotated channels
        >>> y = tq.decode(tq.encode(torch.randn(3, 50)))
        >>> tuple(y.shape), y.dtype
        ((3, 50), torch.float32)
        """
        rotated = scan.dequantize(codes.packed, self.table(codes.device))
        if self.mode == "prod":
            signs = unpack_signs(codes.qjl, self.rotated_dim)
            gain = math.sqrt(math.pi / 2) / self.rotated_dim
            rotated = rotated + gain * codes.residual_norms[:, None] * rowwise_matmul(signs, self.qjl_matrix(codes.device))
        return self.rotation.inverse(rotated) * codes.scales[:, None]

    def code_norms(self, packed: torch.Tensor) -> torch.Tensor:
        """‖ŷ‖ of each packed row's ``mse`` codes, from the codes alone (padding bits ignored).

        1-bit segments add a constant, 2/4/8-bit ones a per-byte table of summed squared levels, other widths
        their unpacked levels.

        Parameters
        ----------
        packed : torch.Tensor of shape (n, layout.row_bytes), dtype uint8
            ``Codes.packed`` of this quantizer.

        Returns
        -------
        torch.Tensor of shape (n,), dtype float32
            On ``packed``'s device.

        Raises
        ------
        ValueError
            ``packed`` is not uint8 of shape ``(n, layout.row_bytes)``.

        Examples
        --------
        >>> import torch
        >>> tq = TurboQuantizer(64, bits=4)  # haar: decode keeps the norm, ‖x̂‖ = scale · ‖ŷ‖
        >>> codes = tq.encode(torch.randn(3, 64))
        >>> bool(torch.allclose(tq.code_norms(codes.packed) * codes.scales, tq.decode(codes).norm(dim=1), rtol=1e-4))
        True
        """
        layout, n = self.layout, packed.shape[0]
        if packed.ndim != 2 or packed.shape[1] != layout.row_bytes or packed.dtype != torch.uint8:
            raise ValueError(f"packed must be uint8 (n, {layout.row_bytes}), got {packed.dtype} {tuple(packed.shape)}")
        squares = self.table(packed.device).levels.square()
        total = torch.zeros(n, dtype=torch.float32, device=packed.device)
        byte = 0
        for s, ((dim, bits), nbytes) in enumerate(zip(layout.segments, layout.segment_bytes)):
            seg = packed[:, byte:byte + nbytes]
            byte += nbytes
            if not bits:
                continue
            if bits == 1:  # symmetric levels ±a: every row holds dim · a²
                total += dim * squares[s, 0]
            elif 8 % bits == 0:
                per_byte, mask = 8 // bits, (1 << bits) - 1
                values = torch.arange(256, device=packed.device)
                codes = (values[:, None] >> (bits * torch.arange(per_byte, device=packed.device))) & mask
                full, rest = divmod(dim, per_byte)
                if full:
                    lut = squares[s][codes].sum(1)
                    total += lut.index_select(0, seg[:, :full].reshape(-1).long()).view(n, full).sum(1)
                if rest:  # the segment's last byte: its valid codes only
                    total += squares[s][codes[:, :rest]].sum(1).index_select(0, seg[:, full].long())
            else:
                idx = unpack(seg, Layout(((dim, bits),)))
                total += squares[s].index_select(0, idx.reshape(-1)).view(n, dim).sum(1)
        return total.sqrt()

    # ------------------------------------------------------------------ scoring
    def rotate_queries(self, queries: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate queries for scoring: ``Πq`` and, in ``prod`` mode, the QJL projections ``SΠq``.

        Parameters
        ----------
        queries : numpy.ndarray or torch.Tensor of shape (nq, dim)
            Checked and converted as in :meth:`encode`.

        Returns
        -------
        rotated : torch.Tensor of shape (nq, D), dtype float32
            ``D`` the rotated dimension (> ``dim`` where ``"hadamard"`` pads); on the queries' device (the CPU for
            numpy input).
        projected : torch.Tensor of shape (nq, D), dtype float32, or None
            None in ``mse`` mode.

        Raises
        ------
        ValueError
            ``queries`` fails the checks of :meth:`encode`.
        """
        return self.rotate_checked(as_float_matrix(queries, self.dim, "queries"))

    def rotate_checked(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`rotate_queries` without its input checks.

        Parameters
        ----------
        q : torch.Tensor of shape (nq, dim), dtype float32
            Already checked by :func:`~tqvec.validation.as_float_matrix`.

        Returns
        -------
        rotated, projected : torch.Tensor of shape (nq, D) float32, and the same or None
            As :meth:`rotate_queries`.
        """
        rotated = self.rotation.forward(q, rowwise=False)  # queries are never stored: the faster product
        projected = rotated @ self.qjl_matrix(q.device).T if self.mode == "prod" else None
        return rotated, projected

    def code_block(self, codes: Codes, bias: torch.Tensor | None = None) -> scan.CodeBlock:
        """The scan's view of ``codes``: per-vector scale, optional additive bias, QJL terms.

        Parameters
        ----------
        codes : Codes
            ``n`` rows of this quantizer.
        bias : torch.Tensor of shape (n,), dtype float32, optional
            Added to every score of its row.

        Returns
        -------
        tqvec.scan.CodeBlock
            Holds ``codes``'s tensors (not copied); in ``prod`` mode also ``sign_scale`` ``(n,)`` float32.
        """
        if self.mode == "mse":
            return scan.CodeBlock(codes.packed, codes.scales, bias)
        gain = math.sqrt(math.pi / 2) / self.rotated_dim
        return scan.CodeBlock(codes.packed, codes.scales, bias, codes.qjl, codes.scales * codes.residual_norms * gain)

    def inner_product(self, queries: Any, codes: Codes) -> torch.Tensor:
        """Estimated inner products ⟨q, x⟩ of every query with every encoded vector, on the codes' device.

        The estimate of each mode is in the module docstring (unbiased in ``prod`` mode).

        Parameters
        ----------
        queries : numpy.ndarray or torch.Tensor of shape (nq, dim)
            Checked and converted as in :meth:`encode`, then moved to ``codes.device``.
        codes : Codes
            ``n`` vectors encoded by this quantizer.

        Returns
        -------
        torch.Tensor of shape (nq, n), dtype float32
            On ``codes.device``; a torch tensor also for numpy queries.

        Raises
        ------
        ValueError
            ``queries`` fails the checks of :meth:`encode`.

        Examples
        --------
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> tq = TurboQuantizer(64, bits=4)
        >>> scores = tq.inner_product(rng.standard_normal((2, 64)), tq.encode(rng.standard_normal((100, 64))))
        >>> type(scores).__name__, tuple(scores.shape), scores.dtype
        ('Tensor', (2, 100), torch.float32)
        """
        rotated, projected = self.rotate_queries(queries)
        rotated = rotated.to(codes.device)
        projected = None if projected is None else projected.to(codes.device)
        return scan.scores(rotated, self.code_block(codes), self.table(codes.device), projected)
