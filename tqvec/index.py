"""``Index``: a flat TurboQuant index with FAISS conventions (``add`` / ``search`` → ``(D, I)``).

Budget. ``bits`` is the storage budget per dimension, everything a vector costs counted (codes,
QJL bits, per-vector side information; not its int64 id): each vector takes exactly
``ceil(dim · bits / 8)`` bytes, so ``Index(bits=4)`` stores what FAISS ``SQ4`` or ``PQ{d/2}x8``
stores. Side information is carved out of the budget and the codes get the rest, at fractional
bits per channel where needed (:func:`tqvec.packing.layout_for_bytes`).

Scoring (``correction``). Each vector ``x`` is encoded by
:class:`~tqvec.quantizer.TurboQuantizer`; a query ``q`` is scored, for ``correction="center"``, as

    ⟨q, x⟩ ≈ s_x · ⟨Π(q − c), ŷ_x⟩ + bias_x + (⟨q, c⟩ − ‖c‖²)

with ``c`` a centering vector (the mean of the first ``add`` call, frozen, stored in the index),
``ŷ_x`` the codebook levels of the rotated ``(x − c)/‖x − c‖``, ``s_x = ‖x − c‖ / ⟨ŷ_x, Π(x − c)/‖x − c‖⟩``
(removes each vector's own shrinkage) and ``bias_x = ⟨c, x⟩`` exact. ``"rescale"`` drops the
centering (``c = 0``, no bias); ``"none"`` stores the plain norm (plain TurboQuant; with
``metric="cosine"`` nothing at all, the norm being 1). For ``metric="l2"``, ``bias_x`` also holds
``−‖x‖²/2`` and ``D = ‖q‖² − 2·score``. The per-query constant does not change the ranking.
Side information is float16 for ``cosine`` (bounded values) and float32 otherwise, except the
cosine ``"rescale"`` scale, a uint8 log code (see :func:`_side_fields`).

Centering in the code padding (``tail_bits > 0``). For ``metric="cosine"``, ``mode="mse"`` below
``AUTO_RESCALE_MIN_BITS`` bits, when the 4 side bytes of ``"center"`` would take more than
``AUTO_SIDE_SHARE`` of the budget, ``"center"`` stores nothing beside the codes: the codes get the
whole budget, every channel at least 1 bit, laid out so that the row's last byte keeps
``tail_bits`` ≥ ``TAIL_MIN_BITS`` padding bits (:func:`tqvec.packing.layout_for_bytes`), and those bits
hold ``bias_x = ⟨c, x⟩`` as a uniform code over ``[−‖c‖, ‖c‖]`` (its exact range for unit ``x``;
:func:`tqvec.packing.write_tail`). The scale is derived, not stored: ``‖x − c‖ = √(1 − 2·bias_x + ‖c‖²)``
for unit ``x``, divided by ``‖ŷ_x‖`` (computed from the codes), so

    ⟨q, x⟩ ≈ ‖x − c‖ · ⟨Π(q − c), ŷ_x / ‖ŷ_x‖⟩ + bias_x + (⟨q, c⟩ − ‖c‖²).

No ``1/⟨ŷ, u⟩`` rescale here: at 1 bit it ranked worse on GloVe. On GloVe-50 at 1 bit (7 bytes: 50
one-bit codes and a 6-bit bias code in the 6 padding bits) this lifts recall@10 from about 0.21 to
about 0.23 (README, Index section).

``"auto"`` picks ``"center"`` when its side information takes at most ``AUTO_SIDE_SHARE`` of the
budget; else ``"rescale"``, except for cosine below ``AUTO_RESCALE_MIN_BITS`` bits, where it picks
``"center"`` in the code padding when that layout exists and ``"none"`` otherwise: rules measured on
GloVe-50 and KJV-MiniLM (README, Index section).

Concurrency. ``search`` may run from many threads at once. ``add`` and ``remove`` take a lock and
never modify rows that a running search reads (``add`` writes past the published size, growth
copies, ``remove`` builds new arrays), so every search sees the index as it was when it started.

Memory. The scan runs blockwise (see :mod:`tqvec.scan`): no ``nq × N`` score matrix is formed.
"""
from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import _fastscan, scan, storage
from .packing import Layout, layout_for_bytes, read_tail, write_tail
from .quantizer import Codes, TurboQuantizer
from .rotation import rotated_dim, rowwise_matmul
from .validation import (
    MAX_ID,
    MAX_SQUARED_NORM,
    as_device,
    as_float_matrix,
    as_ids,
    check_array,
    check_bits,
    check_choice,
    check_file_ids,
    check_meta,
    check_positive_int,
    check_row_budget,
    check_row_norms,
    check_seed,
)

METRICS = ("ip", "l2", "cosine")
CORRECTIONS = ("auto", "none", "rescale", "center")
#: "auto" centers when scale + bias take at most this share of the per-vector budget
AUTO_SIDE_SHARE = 0.10
#: below this budget (bits per dimension) "auto" stores no per-vector scale for cosine: at 1 bit a
#: constant scale ranked better than the rescaled one on both real sets (README, Index section)
AUTO_RESCALE_MIN_BITS = 2
#: a uint8 scale code c stands for 2**(c / LOG_SCALE_STEPS), covering [1, 2] (cosine "rescale": 1/⟨ŷ, Πx⟩)
LOG_SCALE_STEPS = 255
#: fewest padding bits that carry the cosine centering bias as a tail code (4, 5 and 6 bits ranked alike
#: on GloVe-50 at 1 bit)
TAIL_MIN_BITS = 4
FILE_KIND = "tqvec.Index"
#: 2: the header records ``tail_bits`` (version 1 files load unless their configuration now means a tail code)
FILE_VERSION = 2


@dataclass
class _Rows:
    """Named per-row tensors with spare capacity; rows ``[0, size)`` are live and never modified in place.

    ``scoring`` caches the scan's view of the live rows (side fields widened to float32 or derived from the
    codes), built by the first search of this snapshot; a new snapshot is published on every change."""

    tensors: dict[str, torch.Tensor]
    ids: np.ndarray
    size: int
    scoring: list[scan.CodeBlock] = field(default_factory=list)

    def view(self) -> "_Rows":
        n = self.size
        return _Rows({k: t[:n] for k, t in self.tensors.items()}, self.ids[:n], n)


def _side_fields(metric: str, mode: str, correction: str) -> dict[str, torch.dtype]:
    """Per-vector side-information fields stored for this configuration, with their storage dtypes.

    float16 for cosine (bounded values), float32 otherwise; for cosine with ``"rescale"`` the scale
    1/⟨ŷ, Πx⟩ ∈ [1, 2] is a uint8 log code (relative step 0.27%).
    """
    names = () if (metric == "cosine" and correction == "none") else ("scale",)
    if correction == "center" or metric == "l2":
        names += ("bias",)
    if mode == "prod":
        names += ("residual",)
    fields = {name: torch.float16 if metric == "cosine" else torch.float32 for name in names}
    if metric == "cosine" and correction == "rescale" and mode == "mse":
        fields["scale"] = torch.uint8
    return fields


def _store_side(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.uint8:
        return (torch.log2(values) * LOG_SCALE_STEPS).round().clamp(0, LOG_SCALE_STEPS).to(torch.uint8)
    return values.to(dtype)


def _load_side(stored: torch.Tensor) -> torch.Tensor:
    if stored.dtype == torch.uint8:
        return torch.exp2(stored.float() / LOG_SCALE_STEPS)
    return stored.float()


def sort_ids(live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sorted ids, their rows)`` of the live int64 ids, the lookup table of :func:`rows_of_ids`."""
    order = np.argsort(live, kind="stable")
    return live[order], order


def rows_of_ids(table: tuple[np.ndarray, np.ndarray], ids: np.ndarray, missing_ok: bool = False) -> np.ndarray:
    """Row of each id in ``table`` (:func:`sort_ids`): −1 if absent and ``missing_ok``, else ``KeyError``."""
    keys, order = table
    if len(keys) == 0:
        found, rows = np.zeros(len(ids), bool), np.full(len(ids), -1, np.int64)
    else:
        pos = np.searchsorted(keys, ids).clip(0, len(keys) - 1)
        found = keys[pos] == ids
        rows = np.where(found, order[pos], -1)
    if not missing_ok and not found.all():
        raise KeyError(f"unknown id {int(ids[~found][0])}")
    return rows


def new_ids(ids: Any, n: int, next_id: int, table: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Ids ``(n,)`` int64 for ``n`` added vectors: ``ids`` checked (``ValueError`` on a duplicate or an id in
    ``table``), or consecutive from ``next_id`` when None."""
    if ids is None:
        if next_id + n - 1 > MAX_ID:
            raise ValueError(f"automatic ids are used up: {n} more after {next_id - 1} would pass the largest id "
                             f"{MAX_ID}; pass ids explicitly")
        return np.arange(next_id, next_id + n, dtype=np.int64)
    new = as_ids(ids, n)
    if len(np.unique(new)) != n:
        raise ValueError("ids contain duplicates")
    present = rows_of_ids(table, new, missing_ok=True) >= 0
    if present.any():
        raise ValueError(f"id {int(new[present][0])} is already in the index")
    return new


def _numpy(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t


def search_results(
    metric: str, q: torch.Tensor | np.ndarray, scores: torch.Tensor | np.ndarray, rows: torch.Tensor | np.ndarray,
    ids: np.ndarray, k: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """FAISS-style ``(D, I)`` float32 / int64 ``(nq, k)`` from estimated inner products ``scores`` of queries ``q`` and
    their ``rows`` (−1: no result, given D ``±inf`` and I −1), ``ids[row]`` the stored id. L2 distances are the
    estimates ``‖q‖² − 2·score``, not clamped at 0: at low rates they can fall far below (−49 at 1.5 bits in
    ``tests/test_index.py``), and clamping would flatten the ranking D reports.

    A NaN estimate (which validated inputs and files cannot produce) never ranks first: such entries move,
    in order, to the end of their row (where numpy's sort puts NaN), behind every number and the padding.

    ``k`` (≥ the columns of ``scores``): pad the results to ``k`` columns with ∓inf / −1, so that a search may
    scan for at most ``ntotal`` results and still answer ``k`` (FAISS's convention)."""
    rows_np = _numpy(rows)
    labels = np.where(rows_np >= 0, ids[rows_np.clip(0)] if len(ids) else -1, -1)
    scores_np = _numpy(scores).astype(np.float32, copy=False)
    if metric == "l2":
        q_np = _numpy(q)
        squared = np.einsum("ij,ij->i", q_np, q_np).astype(np.float32)[:, None]
        distances = np.where(rows_np < 0, np.float32(np.inf), squared - 2 * scores_np)
    else:
        distances = np.where(rows_np < 0, np.float32(-np.inf), scores_np)
    nan = np.isnan(distances)
    if nan.any():
        order = np.argsort(nan, axis=1, kind="stable")
        distances, labels = np.take_along_axis(distances, order, 1), np.take_along_axis(labels, order, 1)
    if k is not None and k > distances.shape[1]:
        pad = k - distances.shape[1]
        fill = np.float32(np.inf if metric == "l2" else -np.inf)
        distances = np.concatenate([distances, np.full((len(distances), pad), fill, np.float32)], 1)
        labels = np.concatenate([labels, np.full((len(labels), pad), -1, np.int64)], 1)
    return distances, labels


class CodedRows:
    """The per-vector row layout that :class:`Index` and :class:`tqvec.ivf.IVFIndex` share: packed codes (and QJL
    bits in ``prod`` mode) from ``quantizer``, side fields ``side_fields`` (name → stored dtype), an optional
    rerank code from ``fine_quantizer``. Subclasses set those and ``dim``, ``bits``, ``mode``, ``correction``,
    ``device``, and define ``__len__``."""

    dim: int
    bits: float
    mode: str
    correction: str
    device: torch.device
    side_fields: dict[str, torch.dtype]
    quantizer: TurboQuantizer
    fine_quantizer: TurboQuantizer | None

    @staticmethod
    def _side_bytes(fields: dict[str, torch.dtype]) -> int:
        return sum(torch.empty(0, dtype=dtype).element_size() for dtype in fields.values())

    def _budget_quantizer(self, code_bytes: int, seed: int, rotation: str) -> TurboQuantizer:
        """The quantizer whose packed codes (and QJL bits) fill ``code_bytes`` bytes per vector."""
        rescale = self.mode == "mse" and self.correction != "none"
        try:
            return TurboQuantizer.for_bytes(self.dim, code_bytes, self.mode, rotation, seed, rescale)
        except ValueError as err:
            raise ValueError(f"bits={self.bits:g}: {err} (side information {tuple(self.side_fields)} needs "
                             f"{self._side_bytes(self.side_fields)} bytes)") from err

    def _empty_tensors(self) -> dict[str, torch.Tensor]:
        """Zero-row tensors of every stored field, on ``device``."""
        dev = self.device
        tensors = {"packed": torch.zeros(0, self.quantizer.layout.row_bytes, dtype=torch.uint8, device=dev)}
        tensors.update({name: torch.zeros(0, dtype=dtype, device=dev) for name, dtype in self.side_fields.items()})
        if self.mode == "prod":
            tensors["qjl"] = torch.zeros(0, math.ceil(self.quantizer.rotated_dim / 8), dtype=torch.uint8, device=dev)
        if self.fine_quantizer is not None:
            tensors["fine_packed"] = torch.zeros(0, self.fine_quantizer.layout.row_bytes, dtype=torch.uint8, device=dev)
            tensors["fine_scale"] = torch.zeros(0, dtype=torch.float32, device=dev)
        return tensors

    @property
    def ntotal(self) -> int:
        """Number of stored vectors (FAISS name)."""
        return len(self)

    @property
    def code_bytes_per_vector(self) -> int:
        """Bytes per vector that scoring reads: codes, QJL bits and side information (≤ the budget)."""
        q = self.quantizer
        qjl = math.ceil(q.rotated_dim / 8) if self.mode == "prod" else 0
        return q.layout.row_bytes + qjl + self._side_bytes(self.side_fields)

    @property
    def rerank_bytes_per_vector(self) -> int:
        """Extra bytes per vector of the rerank code (0 without ``rerank_bits``)."""
        fq = self.fine_quantizer
        return 0 if fq is None else fq.layout.row_bytes + 4


class Index(CodedRows):
    """Flat TurboQuant index (module docstring: budget, scoring, concurrency).

    ``dim``; ``bits`` per-dimension storage budget (≥ 1, fractional allowed); ``metric`` "ip" | "l2" |
    "cosine"; ``mode`` "mse" | "prod"; ``seed``; ``rotation`` "haar" | "hadamard"; ``correction``
    "auto" | "none" | "rescale" | "center"; ``rerank_bits``: also keep a finer code at that many bits
    per dimension for ``search(..., rerank=R)`` (extra bytes, reported apart); ``device`` "cpu" | "cuda".
    """

    def __init__(
        self,
        dim: int,
        bits: float = 4,
        metric: str = "ip",
        mode: str = "mse",
        seed: int = 0,
        rotation: str = "haar",
        correction: str = "auto",
        rerank_bits: float | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.dim = check_positive_int("dim", dim)
        self.bits = check_bits(bits)
        self.metric = check_choice("metric", metric, METRICS)
        self.mode = check_choice("mode", mode, ("mse", "prod"))
        check_choice("correction", correction, CORRECTIONS)
        check_choice("rotation", rotation, ("haar", "hadamard"))
        seed = check_seed(seed)
        device = as_device(device)
        self.row_bytes = math.ceil(self.dim * self.bits / 8)
        side_fits = self._side_bytes(_side_fields(metric, mode, "center")) <= AUTO_SIDE_SHARE * self.row_bytes
        low_cosine = metric == "cosine" and self.bits < AUTO_RESCALE_MIN_BITS
        tail_layout = self._tail_layout(rotation) if low_cosine and mode == "mse" and not side_fits else None
        if correction == "auto":
            if side_fits:
                correction = "center"
            elif low_cosine:
                correction = "none" if tail_layout is None else "center"
            else:
                correction = "rescale"
        self.correction = correction
        #: width of the centering bias code kept in the code padding (0: not used; module docstring)
        self.tail_bits = tail_layout.spare_bits if correction == "center" and tail_layout is not None else 0
        self.side_fields = {} if self.tail_bits else _side_fields(metric, mode, correction)
        self.device = torch.device(device)
        if self.tail_bits:
            self.quantizer = TurboQuantizer(dim, 1, mode, rotation, seed, rescale=False, layout=tail_layout)
        else:
            self.quantizer = self._budget_quantizer(self.row_bytes - self._side_bytes(self.side_fields), seed, rotation)
        self.fine_quantizer = None
        if rerank_bits is not None:
            fine_bits = check_bits(rerank_bits)
            self.fine_quantizer = TurboQuantizer(dim, fine_bits, "mse", rotation, seed + 1, rescale=True)
        self._center: torch.Tensor | None = None
        self._query_prep: tuple[torch.Tensor | None, object] | None = None  # center -> the native query preparation
        self._center_pending = correction == "center"
        self._lock = threading.Lock()
        self._next_id = 0
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None
        self._rows = _Rows(self._empty_tensors(), np.zeros(0, np.int64), 0)

    def _tail_layout(self, rotation: str) -> Layout | None:
        """The code layout of the whole budget with ≥ ``TAIL_MIN_BITS`` spare bits for the bias code and at
        least 1 bit on every channel, or None."""
        channels = rotated_dim(rotation, self.dim)
        try:
            layout = layout_for_bytes(channels, self.row_bytes, spare_bits=TAIL_MIN_BITS)
        except ValueError:
            return None
        return layout if layout.bits_per_row >= channels else None

    # ------------------------------------------------------------------ properties
    def __len__(self) -> int:
        return self._rows.size

    @property
    def center(self) -> np.ndarray | None:
        """The centering vector ``c`` (dim,) float32, or None."""
        return None if self._center is None else self._center.cpu().numpy()

    @property
    def bytes_per_vector(self) -> int:
        """Everything stored per vector: codes, side information, rerank code and the int64 id."""
        return self.code_bytes_per_vector + self.rerank_bytes_per_vector + 8

    def __repr__(self) -> str:
        tail = f", tail_bits={self.tail_bits}" if self.tail_bits else ""
        return (f"Index(dim={self.dim}, bits={self.bits:g}, metric={self.metric!r}, mode={self.mode!r}, "
                f"correction={self.correction!r}{tail}, n={len(self)}, code_bits={self.quantizer.bits:.3f})")

    def set_center(self, center: Any) -> None:
        """Freeze the centering vector ``c`` ``(dim,)`` before the first ``add`` (``correction="center"`` only),
        e.g. to share one center across shards or to take it from a sample. Cosine indexes expect a mean of
        unit vectors."""
        c = as_float_matrix(np.asarray(center, np.float32).reshape(1, -1) if not isinstance(center, torch.Tensor)
                            else center.reshape(1, -1), self.dim, "center", self.device)[0]
        with self._lock:
            if self.correction != "center":
                raise ValueError(f"set_center needs correction='center', this index uses {self.correction!r}")
            if len(self) or not self._center_pending:
                raise ValueError("the center is frozen already (set it before the first add)")
            self._center, self._center_pending = c, False

    # ------------------------------------------------------------------ add
    def add(self, x: Any, ids: Any = None) -> np.ndarray:
        """Encode and append ``x`` ``(n, dim)``; ``ids`` int64 ``(n,)`` (default: consecutive). Returns the ids."""
        x = as_float_matrix(x, self.dim, "x", self.device)  # checked once here, not again by the quantizer
        if self.metric == "cosine":
            x = torch.nn.functional.normalize(x, dim=1)
        with self._lock:
            new_ids = self._new_ids(ids, x.shape[0])
            if self._center_pending and x.shape[0]:
                self._center = x.mean(0)
                self._center_pending = False
            self._append(self._encode(x), new_ids)
        return new_ids

    def _new_ids(self, ids: Any, n: int) -> np.ndarray:
        return new_ids(ids, n, self._next_id, self._id_table())

    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row tensors for ``x`` (validated; already normalized for cosine)."""
        centered = x if self._center is None else x - self._center
        codes = self.quantizer.encode_checked(centered)
        out = {"packed": codes.packed}
        if self.tail_bits:
            write_tail(codes.packed, self._bias_code(self._center_products(x)), self.quantizer.layout, self.tail_bits)
        side = {"scale": codes.scales, "residual": codes.residual_norms}
        if "bias" in self.side_fields:
            bias = torch.zeros(x.shape[0], device=x.device) if self._center is None else self._center_products(x)
            side["bias"] = bias - 0.5 * (x * x).sum(1) if self.metric == "l2" else bias
        out.update({name: _store_side(side[name], dtype) for name, dtype in self.side_fields.items()})
        if self.mode == "prod":
            out["qjl"] = codes.qjl
        if self.fine_quantizer is not None:
            fine = self.fine_quantizer.encode_checked(centered)
            out.update(fine_packed=fine.packed, fine_scale=fine.scales)
        return out

    def _center_products(self, x: torch.Tensor) -> torch.Tensor:
        """⟨c, x⟩ ``(n,)`` of every row, each independent of the batch it came in (:func:`rowwise_matmul`)."""
        return rowwise_matmul(x, self._center[:, None])[:, 0]

    def _append(self, new: dict[str, torch.Tensor], ids: np.ndarray) -> None:
        rows, n, m = self._rows, self._rows.size, len(ids)
        if n + m > len(rows.ids):  # grow geometrically: amortized O(1) per vector
            cap = max(n + m, 2 * len(rows.ids), 1024)
            grown = {}
            for name, t in rows.tensors.items():
                grown[name] = t.new_empty((cap, *t.shape[1:]))
                grown[name][:n] = t[:n]
            grown_ids = np.empty(cap, np.int64)
            grown_ids[:n] = rows.ids[:n]
            rows = _Rows(grown, grown_ids, n)
        for name, t in new.items():
            rows.tensors[name][n:n + m] = t
        rows.ids[n:n + m] = ids
        self._rows = _Rows(rows.tensors, rows.ids, n + m)  # publish: running searches keep their snapshot
        self._next_id = max(self._next_id, int(ids.max()) + 1 if m else 0)
        self._sorted = None

    # ------------------------------------------------------------------ ids
    def _id_table(self) -> tuple[np.ndarray, np.ndarray]:
        """:func:`sort_ids` of the live ids, cached until rows change."""
        if self._sorted is None:
            self._sorted = sort_ids(self._rows.ids[: self._rows.size])
        return self._sorted

    def _rows_of(self, ids: np.ndarray, missing_ok: bool = False) -> np.ndarray:
        """Row of each id (−1 if absent and ``missing_ok``, else ``KeyError``)."""
        return rows_of_ids(self._id_table(), ids, missing_ok)

    def remove(self, ids: Any) -> int:
        """Remove the vectors with these ids (an unknown id raises ``KeyError``, nothing removed). Returns the count."""
        ids = np.unique(as_ids(ids))
        with self._lock:
            keep = np.ones(self._rows.size, bool)
            keep[self._rows_of(ids)] = False
            live = self._rows.view()
            mask = torch.from_numpy(keep).to(self.device)
            self._rows = _Rows({k: t[mask] for k, t in live.tensors.items()}, live.ids[keep], int(keep.sum()))
            self._sorted = None
        return len(ids)

    def reconstruct(self, ids: Any) -> np.ndarray:
        """Decoded vectors ``(len(ids), dim)`` float32 (from the rerank code when present)."""
        ids = as_ids(ids)
        with self._lock:
            rows = torch.from_numpy(self._rows_of(ids)).to(self.device)
            live = self._rows.view()
        t = {k: v[rows] for k, v in live.tensors.items()}
        if self.fine_quantizer is not None:
            x = self.fine_quantizer.decode(Codes(t["fine_packed"], t["fine_scale"]))
        else:
            x = self.quantizer.decode(self._codes(t))
        return (x if self._center is None else x + self._center).cpu().numpy()

    def _codes(self, t: dict[str, torch.Tensor]) -> Codes:
        """The quantizer's :class:`Codes` view of stored rows ``t`` (see :meth:`_side`)."""
        return self._side(t)[0]

    def _side(self, t: dict[str, torch.Tensor]) -> tuple[Codes, torch.Tensor | None]:
        """The quantizer's :class:`Codes` view of stored rows ``t`` (side fields widened to float32, or derived
        from the tail code) and the additive per-row bias ``(n,)`` float32 (None without one)."""
        packed = t["packed"]
        if self.tail_bits:
            return self._tail_side(packed)
        scale = _load_side(t["scale"]) if "scale" in t else torch.ones(packed.shape[0], device=packed.device)
        residual = _load_side(t["residual"]) if "residual" in t else None
        bias = t["bias"].float() if "bias" in t else None
        return Codes(packed, scale, t.get("qjl"), residual), bias

    def _bias_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(‖c‖, step)`` of the uniform bias code over ``[−‖c‖, ‖c‖]`` (float32 scalars)."""
        center = self._center if self._center is not None else torch.zeros(self.dim, device=self.device)
        radius = torch.linalg.vector_norm(center)
        return radius, radius * (2.0 / ((1 << self.tail_bits) - 1))

    def _bias_code(self, bias: torch.Tensor) -> torch.Tensor:
        """``bias = ⟨c, x⟩`` ``(n,)`` → nearest of the ``2**tail_bits`` uniform levels over ``[−‖c‖, ‖c‖]`` (int64)."""
        radius, step = self._bias_range()
        if float(step) == 0.0:  # c = 0: every bias is 0, level 0 decodes to −‖c‖ = 0
            return torch.zeros(bias.shape[0], dtype=torch.int64, device=bias.device)
        return torch.round((bias + radius) / step).clamp(0, (1 << self.tail_bits) - 1).to(torch.int64)

    def _tail_side(self, packed: torch.Tensor) -> tuple[Codes, torch.Tensor]:
        """Scale ``‖x − c‖ / ‖ŷ‖`` and bias ``⟨c, x⟩`` of rows that carry the bias as a tail code (module docstring)."""
        radius, step = self._bias_range()
        bias = read_tail(packed, self.quantizer.layout, self.tail_bits).to(torch.float32) * step - radius
        distance = torch.sqrt((1 - 2 * bias + radius * radius).clamp_min(0))  # ‖x − c‖ for unit x
        norms = self.quantizer.code_norms(packed)
        scale = torch.where(norms > 0, distance / norms.clamp_min(1e-30), torch.zeros_like(distance))
        return Codes(packed, scale), bias

    # ------------------------------------------------------------------ search
    def search(self, queries: Any, k: int, rerank: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(D, I)`` for ``queries`` ``(nq, dim)``: ``D`` float32 ``(nq, k)`` scores (ip, cosine; best = largest)
        or squared L2 distances (best = smallest); ``I`` int64 ids, −1 (and ∓inf) where fewer than k exist.

        ``rerank=R`` rescores the best ``R·k`` candidates with the finer code (needs ``rerank_bits``).
        """
        k = check_positive_int("k", k)
        q = as_float_matrix(queries, self.dim, "queries", self.device)
        if rerank is not None:
            rerank = check_positive_int("rerank", rerank)
            if self.fine_quantizer is None:
                raise ValueError("rerank needs an index built with rerank_bits")
        if rerank is None and scan.native_queries(q, self.quantizer.mode):
            return self._search_native(q.numpy(), k)
        if self.metric == "cosine":
            q = torch.nn.functional.normalize(q, dim=1)
        published = self._rows  # consistent snapshot (module docstring)
        live = published.view()
        center = self._center
        shifted = q if center is None else q - center
        constant = torch.zeros(q.shape[0], device=q.device) if center is None else q @ center - center @ center
        rotated, projected = self.quantizer.rotate_checked(shifted)
        if not published.scoring:
            published.scoring.append(self.quantizer.code_block(*self._side(live.tensors)))
        block = published.scoring[0]
        bias = block.bias
        depth = min(k * (rerank or 1), max(1, len(live.ids)))  # never more work than ntotal; the rest is padding
        values, rows = scan.search(rotated, block, self.quantizer.table(self.device), depth, projected)
        if rerank is not None:
            values, rows = self._rerank(shifted, live, bias, rows, min(k, depth))
        return search_results(self.metric, q, values + constant[:, None], rows, live.ids, k=k)

    def _search_native(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` of validated CPU queries ``x`` ``(nq, dim)`` in one native call (:func:`tqvec.scan.search_queries`)."""
        published = self._rows  # consistent snapshot (module docstring)
        n = published.size
        if not published.scoring:
            published.scoring.append(self.quantizer.code_block(*self._side(published.view().tensors)))
        center = self._center
        if self._query_prep is None or self._query_prep[0] is not center:
            prep = _fastscan.query_prep(self.quantizer.rotation, self.metric == "cosine", center)
            self._query_prep = (center, prep)
        return scan.search_queries(x, published.scoring[0], self.quantizer.table(self.device), self._query_prep[1], k,
                                   published.ids[:n], self.metric == "l2")

    def score(self, queries: Any, ids: Any) -> np.ndarray:
        """The estimates ``search`` ranks by, for given ``ids``: ``(nq, len(ids))`` float32 scores
        (ip, cosine) or squared L2 distances — FAISS's ``compute_distance_subset`` for all queries."""
        q = as_float_matrix(queries, self.dim, "queries", self.device)
        ids = as_ids(ids)
        if self.metric == "cosine":
            q = torch.nn.functional.normalize(q, dim=1)
        with self._lock:
            rows = torch.from_numpy(self._rows_of(ids)).to(self.device)
            live = self._rows.view()
        t = {k: v[rows] for k, v in live.tensors.items()}
        center = self._center
        shifted = q if center is None else q - center
        rotated, projected = self.quantizer.rotate_checked(shifted)
        codes, bias = self._side(t)
        values = scan.scores(rotated, self.quantizer.code_block(codes, bias), self.quantizer.table(self.device), projected)
        if center is not None:
            values = values + (q @ center - center @ center)[:, None]
        if self.metric == "l2":
            values = (q * q).sum(1, keepdim=True) - 2 * values
        return values.cpu().numpy().astype(np.float32)

    def _rerank(self, shifted: torch.Tensor, live: _Rows, bias: torch.Tensor | None, rows: torch.Tensor,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rescore candidate ``rows`` ``(nq, R·k)`` with the fine code; keep the best ``k`` per query."""
        fq = self.fine_quantizer
        rotated, _ = fq.rotate_checked(shifted)
        flat = rows.clamp_min(0).reshape(-1)
        levels = scan.dequantize(live.tensors["fine_packed"][flat], fq.table(self.device)).view(*rows.shape, -1)
        values = torch.einsum("qd,qcd->qc", rotated, levels) * live.tensors["fine_scale"][flat].view(rows.shape)
        if bias is not None:
            values = values + bias[flat].view(rows.shape)
        values = values.masked_fill(rows < 0, float("-inf"))
        top, pos = torch.topk(values, k, dim=1)
        return top, torch.gather(rows, 1, pos).masked_fill(top == float("-inf"), -1)

    # ------------------------------------------------------------------ persistence
    def _config(self) -> dict[str, Any]:
        return {
            "version": FILE_VERSION, "dim": self.dim, "bits": self.bits, "metric": self.metric, "mode": self.mode,
            "seed": self.quantizer.seed, "rotation": self.quantizer.rotation.kind, "correction": self.correction,
            "rerank_bits": None if self.fine_quantizer is None else self.fine_quantizer.bits,
            "center_pending": self._center_pending, "next_id": self._next_id, "tail_bits": self.tail_bits,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the index to ``path`` atomically (format: :mod:`tqvec.storage`); the old file survives a failure."""
        with self._lock:
            live = self._rows.view()
            arrays = {name: t.cpu().numpy() for name, t in live.tensors.items()}
            arrays["ids"] = live.ids
            if self._center is not None:
                arrays["center"] = self._center.cpu().numpy()
            storage.save_arrays(path, FILE_KIND, self._config(), arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, mmap: bool = False, device: str | torch.device = "cpu") -> "Index":
        """Open an index written by :meth:`save`; ``mmap=True`` maps the arrays read-only instead of reading them.

        Raises :class:`~tqvec.storage.StorageError` for any file that is not a consistent index (header and
        arrays are checked against each other before the configuration is built; docs/guarantees.md),
        ``FileNotFoundError`` if there is none. A file mapped with ``mmap=True`` must not be truncated while
        the index is in use (the OS then kills the process with SIGBUS).
        """
        meta, arrays = storage.load_arrays(path, FILE_KIND, mmap=mmap)
        version = meta.get("version")
        if version not in (1, FILE_VERSION):
            raise storage.StorageError(f"{path}: unsupported index version {version!r}")
        try:
            ids, center = _check_file(meta, arrays, version)
            index = cls(meta["dim"], meta["bits"], meta["metric"], meta["mode"], meta["seed"], meta["rotation"],
                        meta["correction"], meta["rerank_bits"], device)
            if version == 1 and index.tail_bits:
                raise storage.StorageError(
                    f"{path}: index file version 1 stores correction='center' at this budget with float16 side "
                    f"fields; this tqvec keeps its bias in the code padding instead (tail_bits={index.tail_bits}), "
                    "so the file cannot be read: rebuild the index from the vectors")
            if version == FILE_VERSION and meta["tail_bits"] != index.tail_bits:
                raise ValueError(f"tail_bits {meta['tail_bits']!r} in the header, {index.tail_bits} for this configuration")
            arrays = {name: a for name, a in arrays.items() if name not in ("ids", "center")}
            index._check_loaded(arrays, ids, center)
            with warnings.catch_warnings():  # read-only mmap arrays: tensors over them are never written
                warnings.simplefilter("ignore", UserWarning)
                tensors = {name: torch.as_tensor(arr).to(device) for name, arr in arrays.items()}
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, storage.StorageError):
                raise
            raise storage.StorageError(f"{path}: inconsistent index file ({err})") from err
        index._center = None if center is None else torch.as_tensor(np.array(center, np.float32)).to(device)
        index._center_pending = meta["center_pending"]
        index._next_id = meta["next_id"]
        index._rows = _Rows(tensors, np.asarray(ids, np.int64), len(ids))
        return index

    def _check_loaded(self, arrays: dict[str, np.ndarray], ids: np.ndarray, center: np.ndarray | None) -> None:
        """Row ``arrays`` of a file against this (freshly built) configuration; ``ValueError`` on any mismatch."""
        check_rows(arrays, self._empty_tensors(), len(ids))
        if center is not None and self.correction != "center":
            raise ValueError(f"a center is stored without correction='center' ({self.correction!r})")


def _check_file(meta: dict, arrays: dict[str, np.ndarray], version: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Header fields and arrays of an ``Index`` file, checked against each other before the index is built
    (``ValueError``). Returns ``(ids, center)``."""
    dim = check_meta(meta, "dim", int)
    check_positive_int("dim", dim)
    bits = check_bits(check_meta(meta, "bits", (int, float)))
    for name in ("metric", "mode", "rotation", "correction"):
        check_meta(meta, name, str)
    check_seed(check_meta(meta, "seed", int))
    check_meta(meta, "rerank_bits", (int, float, type(None)))
    pending = check_meta(meta, "center_pending", bool)
    if version == FILE_VERSION:
        check_meta(meta, "tail_bits", int)
    ids = check_array(arrays, "ids", "<i8", (None,))
    check_file_ids(ids, check_meta(meta, "next_id", int))
    check_row_budget(arrays, ("packed", "qjl", *SIDE_NAMES), dim, bits)
    center = None
    if "center" in arrays:
        center = check_array(arrays, "center", "<f4", (dim,), bound=math.sqrt(MAX_SQUARED_NORM))
        check_row_norms(torch.from_numpy(np.array(center, np.float32)).reshape(1, -1), "center")
        if pending:
            raise ValueError("a stored center while center_pending is set")
    elif meta["correction"] == "center" and not pending and len(ids):
        raise ValueError("rows encoded against a center that the file lacks")
    if pending and len(ids):
        raise ValueError("center_pending is set but the file holds vectors")
    return ids, center


#: per-vector side fields any configuration may store (:func:`_side_fields`)
SIDE_NAMES = ("scale", "bias", "residual")
#: magnitude limits of stored float side fields: a scale or QJL norm is at most about a vector's norm (≤ 2**60
#: after :func:`~tqvec.validation.as_float_matrix`), a bias about its squared norm
SIDE_BOUNDS = {"scale": 2.0**64, "residual": 2.0**64, "fine_scale": 2.0**64, "bias": 2.0**122}


def check_rows(arrays: dict[str, np.ndarray], expected: dict[str, torch.Tensor], n: int) -> None:
    """The row arrays of a file: exactly the names, dtypes and widths of ``expected`` (zero-row tensors of the
    configuration), ``n`` rows each, float side fields finite and within :data:`SIDE_BOUNDS`."""
    if set(arrays) != set(expected):
        raise ValueError(f"arrays {sorted(arrays)} do not match the configuration's {sorted(expected)}")
    for name in arrays:
        want = expected[name]
        dtype = np.dtype(torch.empty(0, dtype=want.dtype).numpy().dtype).newbyteorder("<").str
        check_array(arrays, name, dtype, (n, *want.shape[1:]),
                    bound=SIDE_BOUNDS.get(name, 2.0**122) if want.dtype.is_floating_point else None)
