"""The native CPU scan: the C++ fast-scan kernel of ``tqvec._native`` behind :func:`tqvec.scan.search`.

A packed row is read as a sequence of *steps* (:func:`plan`), each a code with its own table: a 4-bit
channel, two 2-bit or four 1-bit channels per nibble, one 3- to 8-bit channel per step (read across a byte
boundary where it straddles one). Where every step has at most 4 bits and the CPU has AVX2 + FMA, the kernel
transposes 32 rows at a time, scans them with 8-bit tables (one byte shuffle looks up 32 rows), keeps the best
``rescore`` rows by that estimate and re-scores those exactly with float tables, so its top-k equals the exact
one unless the table rounding moved a row across the ``rescore``-th place (:func:`rescore_count`; 3-bit codes
cost a shuffle each, 4-bit codes half of one). Wider codes, or a CPU without AVX2, take the exact kernel:
float tables for every row. QJL signs (``mode="prod"``) are not served: the torch path runs.

Which kernel runs: :func:`set_cpu_kernel` (``"auto"``, ``"native"``, ``"torch"``; default from the environment
variable ``TQVEC_CPU_KERNEL``, else ``"auto"``). Threads: ``torch.get_num_threads()`` at call time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .packing import Layout

try:
    from . import _native
except ImportError:  # the extension was not built (no compiler at install time): torch serves every search
    _native = None

CPU_KERNELS = ("auto", "native", "torch")
#: candidates re-scored exactly: at least this many ...
RESCORE_MIN = 32
#: ... and this many per result
RESCORE_PER_RESULT = 2
_setting = {"kernel": os.environ.get("TQVEC_CPU_KERNEL", "auto")}


def set_cpu_kernel(kernel: str) -> None:
    """Choose the CPU search kernel: ``"auto"`` (native where it serves the codes, else torch), ``"native"``
    (raise where it cannot serve them) or ``"torch"`` (the reference path).

    Raises
    ------
    ValueError
        For another name.
    """
    if kernel not in CPU_KERNELS:
        raise ValueError(f"cpu kernel must be one of {CPU_KERNELS}, got {kernel!r}")
    _setting["kernel"] = kernel


def cpu_kernel() -> str:
    """The configured CPU kernel (see :func:`set_cpu_kernel`)."""
    return _setting["kernel"]


def available() -> bool:
    """True when the compiled extension is importable."""
    return _native is not None


def simd() -> bool:
    """True when the extension runs its AVX2 kernel on this CPU."""
    return _native is not None and bool(_native.has_avx2())


def rescore_count(k: int) -> int:
    """Rows kept by the 8-bit estimate and re-scored exactly for a top-``k`` search."""
    return max(RESCORE_MIN, RESCORE_PER_RESULT * k)


@dataclass(frozen=True)
class Plan:
    """The kernel's reading of one layout. Step ``t`` reads a ``width[t]``-bit code at bit ``shift[t]`` of byte
    ``byte[t]`` (continuing into the next byte where it straddles) and covers query channels ``channel[t]`` (−1
    unused, at most 4); its table has ``offset[t + 1] − offset[t] = 2^width[t]`` entries, and
    ``level[4·offset[t] : 4·offset[t + 1]]`` holds, as a ``(4, 2^width)`` block, the level of each covered channel
    for every code value (zeros for unused slots)."""

    byte: np.ndarray
    shift: np.ndarray
    width: np.ndarray
    channel: np.ndarray
    offset: np.ndarray
    level: np.ndarray


def plan(layout: Layout, levels: torch.Tensor) -> Plan:
    """The steps that read ``layout`` (codebook ``levels`` ``(segments, 256)``): two 2-bit or four 1-bit channels
    share a 4-bit step, 3- to 8-bit channels take one step each. Bits past a segment's ``dim · bits`` (padding,
    tail codes) are never read.

    >>> p = plan(Layout(((3, 4), (2, 3))), torch.arange(512.0).view(2, 256))
    >>> p.byte.tolist(), p.shift.tolist(), p.width.tolist(), p.offset.tolist()
    ([0, 0, 1, 2, 2], [0, 4, 0, 0, 3], [4, 4, 4, 3, 3], [0, 16, 32, 48, 56, 64])
    """
    table = levels.detach().cpu().numpy().astype(np.float32)
    steps: list[tuple[int, int, int, list[int], np.ndarray]] = []  # byte, shift, width, channels, (2^width, 4)
    first_byte = first_channel = 0
    for segment, ((dim, bits), nbytes) in enumerate(zip(layout.segments, layout.segment_bytes)):
        level, mask = table[segment], (1 << bits) - 1
        per_step = 4 // bits if bits in (1, 2) else 1
        for t in range(-(-dim // per_step) if bits else 0):
            covered = range(t * per_step, min(dim, (t + 1) * per_step))
            bit, width = bits * t * per_step, bits * len(covered)
            codes = np.arange(1 << width)
            entries = np.zeros((1 << width, 4), np.float32)
            for j in range(len(covered)):
                entries[:, j] = level[(codes >> (j * bits)) & mask]
            steps.append((first_byte + bit // 8, bit % 8, width, [first_channel + c for c in covered], entries))
        first_byte += nbytes
        first_channel += dim
    channel = np.full((len(steps), 4), -1, np.int32)
    for t, step in enumerate(steps):
        channel[t, : len(step[3])] = step[3]
    sizes = [len(step[4]) for step in steps]
    column = lambda i: np.array([step[i] for step in steps], dtype=np.int32)  # noqa: E731
    blocks = [np.ascontiguousarray(step[4].T).ravel() for step in steps]  # (4, 2^width) per step
    return Plan(column(0), column(1), column(2), channel, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32),
                np.concatenate(blocks) if blocks else np.zeros(0, np.float32))


@dataclass(frozen=True)
class Groups:
    """Rows scanned per query, for inverted lists: list ``l`` holds rows ``rows[offsets[l]:offsets[l + 1]]``;
    query ``i`` scans lists ``probe[i]`` (−1: none) adding ``constant[i, j]`` to the scores from ``probe[i, j]``."""

    offsets: np.ndarray  # (nlist + 1,) int64
    rows: np.ndarray  # (total,) int64, each in [0, n)
    probe: np.ndarray  # (nq, nprobe) int64
    constant: np.ndarray  # (nq, nprobe) float32


_NONE = {np.dtype(np.float32): np.zeros(0, np.float32), np.dtype(np.int64): np.zeros(0, np.int64)}
_NO_PROBE = np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32)


def _array(t: torch.Tensor | None, dtype: type) -> np.ndarray:
    """A C-contiguous numpy view (a copy only where needed) of ``t`` as ``dtype``; an empty array stands for None."""
    if t is None:
        return _NONE[np.dtype(dtype)]
    if t.device.type != "cpu" or t.requires_grad:
        t = t.detach().cpu()
    array = t.numpy()
    return array if array.dtype == dtype and array.flags.c_contiguous else np.ascontiguousarray(array, dtype=dtype)


def search(queries: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
           steps: Plan, k: int, groups: Groups | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of ``scale · ⟨query, ŷ_row⟩ + bias (+ group constant)`` per query, as :func:`tqvec.scan.search`.

    ``queries`` ``(nq, D)`` float32 rotated queries; ``packed`` ``(n, row_bytes)`` uint8 codes read by ``steps``;
    ``scale``/``bias`` ``(n,)`` or None; ``groups`` restricts and offsets the rows per query (None: all rows).
    Returns ``(values (nq, k) float32, rows (nq, k) int64)``, best first, ``-inf`` / −1 padding.

    Raises
    ------
    RuntimeError
        When the extension is not built.
    """
    if _native is None:
        raise RuntimeError("the native CPU kernel is not built: reinstall tqvec with a C++17 compiler present")
    n, nq = packed.shape[0], queries.shape[0]
    if n == 0:
        return torch.full((nq, k), float("-inf")), torch.full((nq, k), -1, dtype=torch.int64)
    if groups is None:
        groups = Groups(np.array([0, n], np.int64), _NONE[np.dtype(np.int64)], *_NO_PROBE)
    values, rows, _ = _native.search(
        _array(packed, np.uint8), steps.byte, steps.shift, steps.width, steps.channel, steps.offset,
        steps.level,
        _array(queries, np.float32), _array(scale, np.float32), _array(bias, np.float32), groups.offsets,
        groups.rows, groups.probe, groups.constant, int(k), rescore_count(k), max(1, torch.get_num_threads()), True)
    return torch.from_numpy(values), torch.from_numpy(rows)
