"""The native CPU scan: the C++ fast-scan kernel of ``tqvec._native`` behind :func:`tqvec.scan.search`.

A packed row is read as a sequence of *steps* (:func:`plan`), each a code with its own table: a 4-bit
channel, two 2-bit or four 1-bit channels per nibble, one 3- to 8-bit channel per step (read across a byte
boundary where it straddles one). With AVX2 + FMA the kernel scans a layout built once per index snapshot
(:func:`layout`, ``docs/native.md``): for codes of at least :data:`TWO_STAGE_MIN_BITS` bits over at least
:data:`TWO_STAGE_MIN_CHANNELS` channels, a coarse code of each row in blocks of 32 (one byte shuffle looks up 32
rows, 64 with AVX-512 BW) — the high 2 bits of each channel's code for 3- and 4-bit codes (:data:`HIGH_PAIRS`),
else its sign bits — then exact scores for the rows whose estimate plus :data:`CONFIDENCE` standard errors can
reach the k-th best; for wider codes (5 to 8 bits, one channel per step) the same two stages with each
channel's high nibble first (:data:`HIGH_NIBBLES`); for other codes of at most 4 bits per step, the codes
themselves in such blocks with 8-bit tables, the best ``rescore`` rows by that estimate re-scored exactly
(:func:`rescore_count`), so the top-k equals the exact one unless the table rounding moved a row across the
``rescore``-th place. Other codes, or a CPU without AVX2, take the exact kernel: float tables for every row (an
inverted file's rows copied in list order). A flat batch of two-stage codes (at least 32 queries) on a CPU with
AVX-512 VNNI takes the int8 kernel instead (``csrc/int8_scan.h``): each row decoded once to byte levels for all the
batch's queries, 8-bit products of 16 queries at a time (on AMX tiles where the CPU has AMX-INT8), the best
``rescore`` rows re-scored exactly.
QJL signs (``mode="prod"``) are not served: the torch path runs.

:func:`decode_step` runs one decode step of attention over a compressed KV cache (coded tokens and the tokens kept
exactly, ``csrc/attention.cpp``) for :func:`tqvec.scan.attend` on the CPU; :class:`BoundDecodeStep` is the same step
with a cache layer's buffers converted once, for the cache's one-token steps.

Which kernel runs: :func:`set_cpu_kernel` (``"auto"``, ``"native"``, ``"torch"``; default from the environment
variable ``TQVEC_CPU_KERNEL``, else ``"auto"``). Threads: ``torch.get_num_threads()`` at call time, from a pool
started once per process; after a search its threads poll for the next one for up to 2 ms before they sleep, as
OpenMP's threads do, unless the pool's threads and its callers outnumber the CPUs or ``OMP_WAIT_POLICY=passive``.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .packing import Layout
from .rotation import KacRotation, Rotation
from .validation import MAX_SQUARED_NORM

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
#: the native kernel's instruction-set cap: 0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI, 4 AMX (the best this CPU
#: has is used)
MAX_ISA = 4
#: codes of at least this many bits per channel (on average) ...: an index's 3- and 2.5-bit budgets leave 2.9 and
#: 2.4 code bits per channel once the per-row scale (and bias) are paid for; 2-bit codes (1.9) scan faster in one
#: stage at 384 channels (docs/native.md)
TWO_STAGE_MIN_BITS = 2.25
#: ... and at least this many channels are scanned in two stages, signs first (the sign estimate's error
#: shrinks as 1/sqrt(channels): at 50 channels too many rows need their exact score, at 384 few do)
TWO_STAGE_MIN_CHANNELS = 128
#: the two-stage scan's bound, in standard deviations of its first-stage estimate
CONFIDENCE = 3.0
#: codes with a step wider than 4 bits, one channel per step, are scanned in two stages, their high nibbles
#: first (the estimate of a 4-bit code, whose error bound is far tighter than the signs')
HIGH_NIBBLES = True
#: 3- and 4-bit codes, one channel per step, scanned in two stages start from the high 2 bits of each code (two
#: channels per nibble) instead of its sign: twice the first stage's bytes, a bound about half as wide
HIGH_PAIRS = False


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
    """True when the extension runs its fast scan (AVX2, or AVX-512 where present) on this CPU."""
    return _native is not None and bool(_native.has_avx2())


def kernels() -> tuple[str, ...]:
    """The kernels this CPU runs, fastest last: ``"scalar"`` (exact float tables, any CPU), ``"avx2"`` and
    ``"avx512"`` (the fast scan with 256- or 512-bit shuffles), ``"avx512-vnni"`` and ``"amx"`` (also the int8
    kernel for flat batches, its products by VPDPBUSD or on AMX tiles). :func:`search` runs the fastest; a kernel's
    position is its ``max_isa``."""
    if _native is None:
        return ()
    found = (True, _native.has_avx2(), _native.has_avx512(), _native.has_avx512_vnni(), _native.has_amx())
    return ("scalar", "avx2", "avx512", "avx512-vnni", "amx")[: found.index(False) if False in found else len(found)]


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

    @functools.cached_property
    def handle(self) -> _native.Plan:
        """The extension's checked copy of this plan, built once."""
        return _native.Plan(self.byte, self.shift, self.width, self.channel, self.offset, self.level)

    @functools.cached_property
    def narrow(self) -> bool:
        """True when every step has at most 4 bits (what the fast scan reads)."""
        return bool(np.all(self.width <= 4))

    @functools.cached_property
    def single_channel(self) -> bool:
        """True when each channel is read by one step of its own, of 3 to 8 bits (what the high-bit layouts read)."""
        first, rest = self.channel[:, 0], self.channel[:, 1:]
        return bool(len(first) and np.all(first >= 0) and np.all(rest == -1) and np.all(self.width >= 3)
                    and np.array_equal(np.sort(first), np.arange(len(first))))

    @functools.cached_property
    def channels(self) -> int:
        """Query channels the steps read."""
        return int(np.count_nonzero(self.channel >= 0))

    @functools.cached_property
    def bits_per_channel(self) -> float:
        """Code bits per channel read, on average (0 for a plan without channels)."""
        return float(self.width.sum()) / self.channels if self.channels else 0.0


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
class Lists:
    """Inverted lists over the rows of one code block: list ``l`` holds rows ``rows[offsets[l]:offsets[l + 1]]``;
    ``reference`` ``(nlist, D)`` float32 (optional): a rotated vector per list near which its queries fall (its
    centroid), around which the two-stage layouts bound their first-stage estimates (``docs/native.md``)."""

    offsets: np.ndarray  # (nlist + 1,) int64
    rows: np.ndarray  # (total,) int64, each in [0, n)
    reference: np.ndarray | None = None


@dataclass(frozen=True)
class Probes:
    """The lists each query scans: query ``i`` scans lists ``lists[i]`` (−1: none), adding ``constant[i, j]`` to
    the scores from list ``lists[i, j]``."""

    lists: np.ndarray  # (nq, nprobe) int64
    constant: np.ndarray  # (nq, nprobe) float32


_NONE = {np.dtype(t): np.zeros(0, t) for t in (np.float32, np.int64, np.uint8)}
_NO_PROBE = np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32)


def _array(t: torch.Tensor | None, dtype: type) -> np.ndarray:
    """A C-contiguous numpy view (a copy only where needed) of ``t`` as ``dtype``; an empty array stands for None."""
    if t is None:
        return _NONE[np.dtype(dtype)]
    if t.device.type != "cpu" or t.requires_grad:
        t = t.detach().cpu()
    array = t.numpy()
    return array if array.dtype == dtype and array.flags.c_contiguous else np.ascontiguousarray(array, dtype=dtype)


def layout(steps: Plan, lists: Lists | None = None) -> str:
    """The layout :func:`rows` builds for codes read by ``steps`` on this CPU: ``"high-nibbles"`` (the two-stage
    scan of wide codes, :data:`HIGH_NIBBLES`: some step wider than 4 bits, one channel per step), for codes of at
    least :data:`TWO_STAGE_MIN_BITS` bits per channel and :data:`TWO_STAGE_MIN_CHANNELS` channels the two-stage scan
    from ``"high-pairs"`` (:data:`HIGH_PAIRS`: 3- or 4-bit codes, one channel per step) or else ``"signs"``,
    ``"nibbles"`` (the one-stage fast scan, every step of at most 4 bits); else, for the exact kernel, ``"lists"``
    (the rows copied in list order, when there are ``lists``) or ``""`` (none)."""
    if simd() and HIGH_NIBBLES and not steps.narrow and steps.single_channel:
        return "high-nibbles"
    if simd() and steps.bits_per_channel >= TWO_STAGE_MIN_BITS and steps.channels >= TWO_STAGE_MIN_CHANNELS:
        return "high-pairs" if HIGH_PAIRS and steps.single_channel else "signs"
    if simd() and steps.narrow:
        return "nibbles"
    return "lists" if lists is not None else ""


def rows(packed: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, steps: Plan,
         lists: Lists | None = None) -> _native.Rows:
    """What :func:`search` reads, checked and held once per index snapshot: ``packed`` ``(n, row_bytes)`` codes with
    their ``scale`` / ``bias`` ``(n,)`` (None: 1 / 0), grouped by ``lists`` (None: one group of all rows), and the
    layout the kernel scans (:func:`layout`): each list's rows in blocks of 32, byte-major within a block, of
    the codes (one stage) or of their sign bits with each row's estimate gain and error scale (two stages), or
    the rows copied in list order (the exact kernel). The arrays must not change while the result lives (index
    snapshots never change).

    Raises
    ------
    RuntimeError
        When the extension is not built.
    """
    if _native is None:
        raise RuntimeError("the native CPU kernel is not built: reinstall tqvec with a C++17 compiler present")
    chosen = layout(steps, lists)
    lists = lists or Lists(np.array([0, packed.shape[0]], np.int64), _NONE[np.dtype(np.int64)])
    reference = (_NONE[np.dtype(np.float32)] if lists.reference is None
                 else np.ascontiguousarray(lists.reference[:, :steps.channels], np.float32))
    return _native.Rows(_array(packed, np.uint8), _array(scale, np.float32), _array(bias, np.float32), lists.offsets,
                        lists.rows, steps.handle, chosen, reference)


def search(queries: np.ndarray, source: _native.Rows, steps: Plan, k: int,
           probes: Probes | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` of ``scale · ⟨query, ŷ_row⟩ + bias (+ list constant)`` per query, as :func:`tqvec.scan.search`.

    ``queries`` ``(nq, D)`` float32 rotated queries; ``source`` the rows (:func:`rows`) read by ``steps``; ``probes``
    restrict and offset the rows per query when ``source`` has lists (None: all rows). Returns
    ``(values (nq, k) float32, rows (nq, k) int64)`` numpy arrays, best first, ``-inf`` / −1 padding.
    """
    probe, constant = (probes.lists, probes.constant) if probes is not None else _NO_PROBE
    values, found, _, _ = _native.search(steps.handle, source, np.ascontiguousarray(queries, np.float32), probe, constant,
                                      int(k), rescore_count(k), CONFIDENCE, max(1, torch.get_num_threads()), MAX_ISA)
    return values, found


def query_prep(rotation: Rotation, normalize: bool, center: torch.Tensor | None = None,
               centroids: torch.Tensor | None = None, by_ip: bool = True, residual: bool = False,
               base: torch.Tensor | None = None) -> _native.Queries:
    """What an index does to a query before the scan, for :class:`QuerySearch`: ``normalize`` it (cosine),
    rotate it with ``rotation``; a flat index subtracts its ``center`` first (adding ``⟨q, c⟩ − ‖c‖²`` to the
    scores); an inverted-file index probes the lists of ``centroids`` ``(nlist, dim)`` (largest ``⟨q, c_l⟩`` when
    ``by_ip``, else nearest in L2) with constant ``⟨q, c_l⟩`` (``residual``) or ``⟨q, base⟩`` (0 without ``base``).
    Hold the result while these tensors stay the same."""
    matrix = rotation.matrix("cpu") if rotation.kind == "haar" else None
    signs = rotation.signs("cpu").reshape(-1) if rotation.kind != "haar" else None
    rounds = rotation.ROUNDS if isinstance(rotation, KacRotation) else 0
    half = None if centroids is None or by_ip else 0.5 * (centroids * centroids).sum(1)
    return _native.Queries(rotation.dim, _array(matrix, np.float32), _array(signs, np.float32), rounds, normalize,
                           _array(center, np.float32), _array(centroids, np.float32), _array(half, np.float32), residual,
                           _array(base, np.float32), MAX_SQUARED_NORM)


@dataclass(frozen=True, slots=True)
class QuerySearch:
    """An index's native search of raw queries, bound once per index snapshot: the rows ``source`` (:func:`rows`) read
    by ``steps``, the query preparation ``prep`` (:func:`query_prep`), the ``ids`` of the rows (one per row) and
    whether scores are reported as ``l2`` distances. Calling it searches in one native call on the search's threads;
    the arrays must not change while it lives (index snapshots never change).
    """

    source: object  # _native.Rows
    steps: Plan
    prep: object  # _native.Queries
    ids: np.ndarray
    l2: bool

    def __call__(self, queries: np.ndarray, k: int, nprobe: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` of raw ``queries`` ``(nq, dim)`` C-contiguous float32 (shape and dtype validated by the caller),
        prepared as ``prep`` says, probing ``nprobe`` lists when it has centroids. The kernel checks the queries'
        values as :func:`tqvec.validation.check_array_norms` does (the same ``ValueError``: NaN or Inf, or a row's
        squared norm beyond ``MAX_SQUARED_NORM``) and returns nothing for a batch that holds such a row (an
        inverted-file batch on several threads is checked chunk by chunk, each chunk before its scan; other searches
        before any scan).

        Returns FAISS-style ``(D, I)`` ``(nq, k)``: ``I`` the ids of the best rows, ``D`` their scores, or with
        ``l2`` the distances ``‖q‖² − 2·score``; −1 and −inf (+inf for ``l2``) where fewer than ``k`` rows exist.
        """
        depth = min(k, max(1, len(self.ids)))  # never more work than ntotal; the rest is padding
        distances, labels, _ = _native.search_queries(self.steps.handle, self.source, self.prep, queries, self.ids,
                                                      self.l2, nprobe, depth, rescore_count(depth), CONFIDENCE,
                                                      max(1, torch.get_num_threads()), MAX_ISA)
        return pad_results(distances, labels, k, self.l2)


def pad_results(distances: np.ndarray, labels: np.ndarray, k: int, l2: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(D, I)`` ``(nq, m)`` padded to ``k ≥ m`` columns with −inf (+inf with ``l2``) and −1 (FAISS's convention for
    fewer than ``k`` results); unchanged when ``m == k``. Raises numpy's ``MemoryError`` / ``ValueError`` when
    ``(nq, k)`` outputs cannot be allocated."""
    pad = k - distances.shape[1]
    if pad <= 0:
        return distances, labels
    fill = np.float32(np.inf if l2 else -np.inf)
    return (np.concatenate([distances, np.full((len(distances), pad), fill, np.float32)], 1),
            np.concatenate([labels, np.full((len(labels), pad), -1, np.int64)], 1))


#: one channel segment of coded tokens for :func:`decode_step`: (codes, scale, plan, rotated channels)
CodedSegment = tuple[torch.Tensor, torch.Tensor, Plan, int]
#: tokens kept exactly for :func:`decode_step`: (keys, values), each ``(b, h, count, head_dim)``
ExactTokens = tuple[torch.Tensor, torch.Tensor]


def decode_step(queries: torch.Tensor, key_rotation: torch.Tensor, value_back: torch.Tensor, keys: Sequence[CodedSegment],
                values: Sequence[CodedSegment], n: int, key_mean: torch.Tensor, value_mean: torch.Tensor,
                sinks: ExactTokens, window: ExactTokens, valid: torch.Tensor | None) -> torch.Tensor:
    """One decode step of attention over a compressed KV cache, natively: ``n`` coded tokens between the sinks and
    the window, which are kept exactly.

    The queries are rotated like the keys; a coded token's logit is the sum over its key segments of scale · ⟨query
    channels of the segment, levels⟩ (exact float tables), an exact token's ⟨query, key − key_mean⟩. One softmax
    over all of them weights the values: the coded tokens' scale · levels rotated back by ``value_back`` plus
    ``value_mean``, the exact tokens' values as they are.

    Parameters
    ----------
    queries : (b, h, G, head_dim) float32
        The G query heads of each KV head, scaled by the softmax scaling, not rotated.
    key_rotation : (head_dim, key_dim) or (h, head_dim, key_dim) float32
        Into the keys' rotated channels (one per KV head where they differ).
    value_back : (value_dim, head_dim) or (h, value_dim, head_dim) float32
        Out of the values' rotated channels.
    keys, values : sequences of (codes, scale, plan, dim)
        Channel segments side by side from rotated channel 0 (a quantizer's codes are one segment; channel groups
        coded apart one each; ``key_dim`` / ``value_dim`` are the sums of their ``dim``): ``codes`` ``(b, h,
        capacity, row_bytes)`` uint8 read by ``plan``, of which tokens ``[0, n)`` are read, ``scale`` ``(b, h, ≥ n)``.
    key_mean, value_mean : (b, h, head_dim) float32
        Subtracted from the keys before coding (the exact tokens' logits subtract it too), added back to the values.
    sinks, window : (keys, values), each (b, h, count, head_dim)
        Tokens kept exactly before and after the coded ones (converted to float32).
    valid : (b, sinks + n + window) bool, optional
        False masks a token out.

    Returns
    -------
    (b, h, G, head_dim) float32
        The attention output; 0 for a query with no valid token.

    Raises
    ------
    ValueError
        When the shapes do not fit (codes or scales shorter than ``n``, segments wider than the rotations, a
        rotation, mean, exact part or mask of the wrong shape).

    Examples
    --------
    Two heads of ten 4-bit tokens, three queries each, no rotation and no exact tokens:

    >>> import torch
    >>> from tqvec import TurboQuantizer
    >>> tq = TurboQuantizer(64, 4, seed=0)
    >>> codes = tq.encode(torch.randn(20, 64))
    >>> coded = [(codes.packed.view(1, 2, 10, -1), codes.scales.view(1, 2, 10), tq.table("cpu").native_plan(), 64)]
    >>> eye, mean, none = torch.eye(64), torch.zeros(1, 2, 64), torch.zeros(1, 2, 0, 64)
    >>> out = decode_step(torch.randn(1, 2, 3, 64), eye, eye, coded, coded, 10, mean, mean, (none, none),
    ...                   (none, none), None)
    >>> out.shape
    torch.Size([1, 2, 3, 64])
    """
    return BoundDecodeStep(key_rotation, value_back, keys, values, key_mean, value_mean, sinks)(queries, n, window, valid)


class BoundDecodeStep:
    """:func:`decode_step` bound to the inputs that stay from one step to the next (a cache layer's): the codes,
    rotations, means and sinks are made ready for the native kernel once, here; a call converts only its queries,
    window, mask and the scales of its ``n`` tokens.

    The codes are read in place: tokens written into the same buffers after binding are seen by later calls. Means
    and sinks are read as they were at binding (in place where already float32). Bind again when any buffer is
    replaced.

    Parameters
    ----------
    key_rotation, value_back, keys, values, key_mean, value_mean, sinks
        As :func:`decode_step` takes them; the ``(b, h)`` of ``key_mean`` is every call's.

    Examples
    --------
    One head of 32 one-bit tokens (a buffer), read over its first 16 tokens, then all of them:

    >>> import torch
    >>> from tqvec import TurboQuantizer
    >>> quantizer = TurboQuantizer(32, 1, seed=0)
    >>> buffer = quantizer.encode(torch.randn(32, 32))
    >>> side = [(buffer.packed[None, None], buffer.scales[None, None], quantizer.table("cpu").native_plan(), 32)]
    >>> exact = torch.zeros(1, 1, 0, 32), torch.zeros(1, 1, 0, 32)
    >>> step = BoundDecodeStep(torch.eye(32), torch.eye(32), side, side, torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), exact)
    >>> [tuple(step(torch.randn(1, 1, 2, 32), n, exact, None).shape) for n in (16, 32)]
    [(1, 1, 2, 32), (1, 1, 2, 32)]
    """

    def __init__(self, key_rotation: torch.Tensor, value_back: torch.Tensor, keys: Sequence[CodedSegment],
                 values: Sequence[CodedSegment], key_mean: torch.Tensor, value_mean: torch.Tensor,
                 sinks: ExactTokens) -> None:
        self._batch_heads = tuple(key_mean.shape[:2])
        self._rotations = (_array(key_rotation, np.float32), _array(value_back, np.float32), key_rotation.shape[-1],
                           value_back.shape[-2])
        coded = lambda parts: [(plan.handle, self._heads(codes), scale, int(dim)) for codes, scale, plan, dim in parts]  # noqa: E731
        self._keys, self._values = coded(keys), coded(values)
        self._means = self._heads(key_mean.float()), self._heads(value_mean.float())
        self._sinks = self._heads(sinks[0].float()), self._heads(sinks[1].float())

    def _heads(self, t: torch.Tensor) -> np.ndarray:
        """``t`` ``(b, h, ...)`` as an array over ``b · h`` heads (uint8 codes, else float32)."""
        b, h = self._batch_heads
        return _array(t.reshape(b * h, *t.shape[2:]), np.uint8 if t.dtype == torch.uint8 else np.float32)

    def __call__(self, queries: torch.Tensor, n: int, window: ExactTokens, valid: torch.Tensor | None) -> torch.Tensor:
        """:func:`decode_step`'s output for ``queries`` ``(b, h, G, head_dim)`` over ``n`` coded tokens of the bound
        buffers, the sinks and ``window``, masked by ``valid``; raises ``ValueError`` as it does, and for queries of
        another ``(b, h)`` than the binding's."""
        b, h, group, dim = queries.shape
        if (b, h) != self._batch_heads:
            raise ValueError(f"queries have (batch, heads) {(b, h)}, the step was bound to {self._batch_heads}")
        scaled = lambda parts: [(plan, codes, self._heads(scale[:, :, :n].float()), dim)  # noqa: E731
                                for plan, codes, scale, dim in parts]
        out = _native.decode_step(
            scaled(self._keys), scaled(self._values), _array(queries.reshape(b * h, group, dim), np.float32),
            *self._rotations, n, *self._means, *self._sinks, self._heads(window[0].float()), self._heads(window[1].float()),
            _array(None if valid is None else valid.to(torch.uint8), np.uint8), h, torch.get_num_threads())
        return torch.from_numpy(out).view(b, h, group, dim)
