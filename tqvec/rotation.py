"""Seeded random rotations applied to batches of row vectors, as torch ops on any device.

* :class:`HaarRotation` — a Haar-random orthogonal matrix (QR of a Gaussian with the signs of R's
  diagonal folded into Q), generated in float64 on the CPU from the seed so that every device and
  platform gets the same matrix. ``O(d²)`` per vector.
* :class:`HadamardRotation` — a randomized Hadamard transform ``H·D/√P`` (random ±1 signs D, fast
  Walsh–Hadamard H) on vectors zero-padded to the next power of two P ≥ d. ``O(P log P)`` per vector;
  the rotated vectors have P coordinates, so codes cost P, not d, channels when d is not a power of two.
* :class:`KacRotation` — the FHT-Kac rotation (as in RaBitQ's library): rounds of random signs, an orthonormal
  Walsh–Hadamard transform on a power-of-two block of the coordinates and a butterfly between their two halves.
  ``O(d log d)`` per vector and no padding: d coordinates out, so codes cost d channels at any d.

All three map ``(n, dim)`` → ``(n, out_dim)`` with :meth:`forward` and back with :meth:`inverse`, and on the
CPU row ``i`` of the result depends on row ``i`` of the input alone (:func:`rowwise_matmul`).
"""
from __future__ import annotations

import math

import torch


#: rows per product in :func:`rowwise_matmul`: every CPU product of a batch has exactly this shape
ROW_BLOCK = 32


def rowwise_matmul(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ matrix`` ``(n, k) @ (k, m) → (n, m)`` whose row ``i`` depends on ``x[i]`` alone, not on ``n`` or the
    other rows (batch-invariant).

    BLAS libraries pick different kernels, with different summation orders, for different row counts, so a
    plain ``x @ matrix`` can give a vector other bits in a batch of 7 than alone. On the CPU the rows are
    zero-padded to a multiple of :data:`ROW_BLOCK` and multiplied as a batch of equal ``(ROW_BLOCK, k)``
    blocks, so every row goes through the same product whatever the batch. Other devices: plain ``@``.

    >>> x, m = torch.randn(40, 8), torch.randn(8, 3)
    >>> torch.equal(rowwise_matmul(x, m)[5:6], rowwise_matmul(x[5:6], m))
    True
    """
    if x.device.type != "cpu" or x.ndim != 2 or x.shape[0] == 0:
        return x @ matrix
    n, k = x.shape
    blocks = -(-n // ROW_BLOCK)
    if blocks * ROW_BLOCK != n:
        x = torch.cat([x, x.new_zeros(blocks * ROW_BLOCK - n, k)])
    out = torch.bmm(x.view(blocks, ROW_BLOCK, k), matrix.expand(blocks, *matrix.shape))
    return out.reshape(blocks * ROW_BLOCK, matrix.shape[1])[:n]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(int(seed))


def haar_matrix(dim: int, seed: int) -> torch.Tensor:
    """A ``(dim, dim)`` float64 Haar-random orthogonal matrix, deterministic in ``seed``."""
    gaussian = torch.randn(dim, dim, generator=_generator(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))


def gaussian_matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A ``(rows, cols)`` float32 matrix of i.i.d. N(0, 1) entries (the QJL projection S)."""
    return torch.randn(rows, cols, generator=_generator(seed), dtype=torch.float64).to(torch.float32)


class _PerDevice:
    """A float64 CPU tensor served as float32 on any device, converted once per device and cached."""

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source
        self._copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The source as float32 on ``device``."""
        device = torch.device(device)
        if device not in self._copies:
            self._copies[device] = self.source.to(device=device, dtype=torch.float32)
        return self._copies[device]


def fast_walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh–Hadamard transform along the last axis (length a power of two)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"length must be a power of two, got {n}")
    lead = x.shape[:-1]
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        x = torch.stack((pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]), dim=-2)
        h *= 2
    return x.reshape(*lead, n)


class HaarRotation:
    """``y = x @ Πᵀ`` with a seeded Haar-random orthogonal Π (``dim × dim``)."""

    kind = "haar"

    def __init__(self, dim: int, seed: int) -> None:
        self.dim = self.out_dim = dim
        self._matrix = _PerDevice(haar_matrix(dim, seed))

    def matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Π as float32 on ``device`` (cached per device)."""
        return self._matrix.get(device)

    def forward(self, x: torch.Tensor, rowwise: bool = True) -> torch.Tensor:
        """``(n, dim)`` float32 → rotated ``(n, dim)``; ``rowwise=False`` allows a faster, batch-dependent product
        (queries: their codes are never stored)."""
        return rowwise_matmul(x, self.matrix(x.device).T) if rowwise else x @ self.matrix(x.device).T

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``(n, dim)`` rotated → ``(n, dim)`` original coordinates."""
        return rowwise_matmul(y, self.matrix(y.device))


class HadamardRotation:
    """``y = H·D·pad(x)/√P``: random signs then a fast Walsh–Hadamard transform on P = 2^⌈log₂ dim⌉."""

    kind = "hadamard"

    def __init__(self, dim: int, seed: int) -> None:
        self.dim = dim
        self.out_dim = rotated_dim("hadamard", dim)
        signs = torch.randint(0, 2, (self.out_dim,), generator=_generator(seed), dtype=torch.float64) * 2 - 1
        self._signs = _PerDevice(signs)

    def signs(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The random ±1 signs D ``(out_dim,)`` as float32 on ``device`` (cached per device)."""
        return self._signs.get(device)

    def forward(self, x: torch.Tensor, rowwise: bool = True) -> torch.Tensor:
        """``(n, dim)`` float32 → rotated ``(n, out_dim)`` (elementwise: batch-invariant whatever ``rowwise``)."""
        padded = torch.nn.functional.pad(x, (0, self.out_dim - self.dim))
        return fast_walsh_hadamard(padded * self.signs(x.device)) / math.sqrt(self.out_dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``(n, out_dim)`` rotated → ``(n, dim)`` (the transform is symmetric up to the signs)."""
        x = fast_walsh_hadamard(y) / math.sqrt(self.out_dim) * self.signs(y.device)
        return x[..., : self.dim]


_SQRT_HALF = math.sqrt(0.5)


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    """``(a, b) → ((a + b)/√2, (a − b)/√2)`` between the first and second ``⌊d/2⌋`` coordinates of the last axis (an odd
    d keeps its last coordinate): orthogonal and its own inverse."""
    half = x.shape[-1] // 2
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat(((a + b) * _SQRT_HALF, (a - b) * _SQRT_HALF, rest), dim=-1)


class KacRotation(HaarRotation):
    """The FHT-Kac rotation: ``Π = K_R ⋯ K_1`` with R = :attr:`ROUNDS` rounds ``K_r = B·H_r·D_r``: random ±1 signs
    ``D_r`` on all d coordinates, an orthonormal Walsh–Hadamard transform ``H_r`` on P = 2^⌊log₂ d⌋ of them (the
    first P in even rounds, the last P in odd rounds), and the butterfly B between the first and second halves
    (``_butterfly``).

    Every factor is orthogonal, so Π is; nothing is padded (d channels out, unlike :class:`HadamardRotation`).
    One round maps a one-hot vector to ±1/√P on P coordinates; eight rounds spread every input over all d
    coordinates with the density the codebooks assume. The native CPU search applies the rounds to each query in
    ``O(R·d log d)``; torch (encoding, the reference path) multiplies by Π, built once in float64 like
    :class:`HaarRotation`'s matrix, so both share its batch-invariant product.

    >>> rotation = KacRotation(784, seed=0)
    >>> x = torch.randn(3, 784)
    >>> torch.allclose(rotation.inverse(rotation.forward(x)), x, atol=1e-5)
    True
    """

    kind = "fht-kac"
    ROUNDS = 8

    def __init__(self, dim: int, seed: int) -> None:
        self.dim = self.out_dim = dim
        self.block = 1 << max(0, math.floor(math.log2(dim)))
        signs = torch.randint(0, 2, (self.ROUNDS, dim), generator=_generator(seed), dtype=torch.float64) * 2 - 1
        self._signs = _PerDevice(signs)
        self._matrix = _PerDevice(self.apply_rounds(torch.eye(dim, dtype=torch.float64), signs).T.contiguous())

    def signs(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The random ±1 signs ``(ROUNDS, dim)`` as float32 on ``device`` (cached per device)."""
        return self._signs.get(device)

    def apply_rounds(self, x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        """``x @ Πᵀ`` ``(n, dim)`` → ``(n, dim)`` computed round by round with the ``(ROUNDS, dim)`` ``signs``, in
        ``x``'s dtype (the definition of Π, and the native search's order of operations)."""
        for r in range(self.ROUNDS):
            start = 0 if r % 2 == 0 else self.dim - self.block
            x = x * signs[r]
            block = fast_walsh_hadamard(x[..., start:start + self.block]) / math.sqrt(self.block)
            x = _butterfly(torch.cat((x[..., :start], block, x[..., start + self.block:]), dim=-1))
        return x


Rotation = HaarRotation | HadamardRotation | KacRotation
ROTATIONS = {"haar": HaarRotation, "hadamard": HadamardRotation, "fht-kac": KacRotation}
#: the rotation kinds, for argument checks
ROTATION_KINDS = tuple(ROTATIONS)


def rotated_dim(kind: str, dim: int) -> int:
    """Coordinates the rotation ``kind`` maps ``dim``-vectors to (Hadamard pads to a power of two)."""
    return 1 << max(0, math.ceil(math.log2(dim))) if kind == "hadamard" else dim


def make_rotation(kind: str, dim: int, seed: int) -> Rotation:
    """Build the rotation named ``kind`` (one of :data:`ROTATION_KINDS`)."""
    if kind not in ROTATIONS:
        raise ValueError(f"unknown rotation {kind!r}; expected one of {sorted(ROTATIONS)}")
    return ROTATIONS[kind](dim, seed)
