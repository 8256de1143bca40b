"""The per-vector row store that :class:`~tqvec.index.Index` and :class:`~tqvec.ivf.IVFIndex` share: published
row snapshots, side fields and their storage dtypes, ids and their lookup table, the FAISS-style ``(D, I)``
answer, and the checks of a file's row arrays."""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import _fastscan, scan
from .quantizer import Codes, TurboQuantizer
from .rotation import ROTATION_KINDS, rotated_dim
from .validation import MAX_ID, as_device, as_ids, check_array, check_bits, check_choice, check_positive_int, check_seed

METRICS = ("ip", "l2", "cosine")
CORRECTIONS = ("auto", "none", "rescale", "center")
#: a uint8 scale code c stands for 2**(c / LOG_SCALE_STEPS), covering [1, 2] (cosine "rescale": 1/⟨ŷ, Πx⟩)
LOG_SCALE_STEPS = 255


@dataclass
class RowSnapshot:
    """Named per-row tensors with spare capacity; rows ``[0, size)`` are live and never modified in place.

    ``scoring`` caches the scan's view of the live rows (side fields widened to float32 or derived from the
    codes), built by the first search of this snapshot, and ``native_search`` the native search bound to them
    with the center it was built for; a new snapshot is published on every change."""

    tensors: dict[str, torch.Tensor]
    ids: np.ndarray
    size: int
    scoring: list[scan.CodeBlock] = field(default_factory=list)
    native_search: tuple[torch.Tensor | None, _fastscan.QuerySearch] | None = None

    def view(self) -> RowSnapshot:
        n = self.size
        return RowSnapshot({k: t[:n] for k, t in self.tensors.items()}, self.ids[:n], n)


def side_fields_for(metric: str, mode: str, correction: str, unit_codes: bool | None = None,
                    log_scale: bool = True) -> dict[str, torch.dtype]:
    """Per-vector side-information fields stored for this configuration, with their storage dtypes: the scale
    (not for ``correction="none"`` on ``unit_codes``, unit-norm coded vectors: by default those of cosine), the
    bias (``"center"``, or ``"l2"``'s ``−‖x‖²/2``), the QJL residual norm (``"prod"``).

    float16 for cosine (bounded values), float32 otherwise; with ``log_scale``, for cosine with ``"rescale"``
    the scale 1/⟨ŷ, Πx⟩ ∈ [1, 2] is a uint8 log code (relative step 0.27%).
    """
    unit_codes = metric == "cosine" if unit_codes is None else unit_codes
    names = () if (unit_codes and correction == "none") else ("scale",)
    if correction == "center" or metric == "l2":
        names += ("bias",)
    if mode == "prod":
        names += ("residual",)
    fields = {name: torch.float16 if metric == "cosine" else torch.float32 for name in names}
    if log_scale and metric == "cosine" and correction == "rescale" and mode == "mse":
        fields["scale"] = torch.uint8
    return fields


#: a center frozen from fewer rows warns: centering by an n-row mean adds about 1/n of the data's variance to every
#: centered vector (E‖x − c‖² = tr Σ · (1 + 1/n)), which outweighs what centering gains when n is small
MIN_CENTER_ROWS = 100


def frozen_center(x: torch.Tensor, remedy: str, caller_depth: int = 1) -> torch.Tensor:
    """The centering vector frozen from rows ``x`` ``(n, dim)`` (n ≥ 1): their mean, with a ``UserWarning`` naming
    ``remedy`` when n < :data:`MIN_CENTER_ROWS` (every later code carries that mean's estimation error), attributed
    to the user's line ``caller_depth`` frames above the caller of this function."""
    n = x.shape[0]
    if n < MIN_CENTER_ROWS:
        warnings.warn(f"correction='center' freezes its center from {n} row(s), fewer than {MIN_CENTER_ROWS}: its "
                      f"error weighs on every code ({remedy}, or use correction='rescale')", UserWarning,
                      stacklevel=2 + caller_depth)
    return x.mean(0)


def store_side(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.uint8:
        return (torch.log2(values) * LOG_SCALE_STEPS).round().clamp(0, LOG_SCALE_STEPS).to(torch.uint8)
    return values.to(dtype)


def load_side(stored: torch.Tensor) -> torch.Tensor:
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
    # equal distances in id order (as the native search and the sharded merge): the answer does not depend on
    # the order rows were stored in
    order = np.lexsort((labels, distances if metric == "l2" else -distances), axis=1)
    distances, labels = np.take_along_axis(distances, order, 1), np.take_along_axis(labels, order, 1)
    nan = np.isnan(distances)
    if nan.any():
        order = np.argsort(nan, axis=1, kind="stable")
        distances, labels = np.take_along_axis(distances, order, 1), np.take_along_axis(labels, order, 1)
    if k is not None:
        distances, labels = _fastscan.pad_results(distances, labels, k, metric == "l2")
    return distances, labels


class CodedRows:
    """The per-vector row layout that :class:`~tqvec.index.Index` and :class:`~tqvec.ivf.IVFIndex` share: packed
    codes (and QJL bits in ``prod`` mode) from ``quantizer``, side fields ``side_fields`` (name → stored dtype), an
    optional rerank code from ``fine_quantizer``, and the steps of loading them from a file. Subclasses set those
    and ``dim``, ``bits``, ``mode``, ``correction``, ``device``, and define ``__len__`` and ``_check_loaded``."""

    dim: int
    bits: float
    metric: str
    mode: str
    row_bytes: int
    correction: str
    device: torch.device
    side_fields: dict[str, torch.dtype]
    quantizer: TurboQuantizer
    fine_quantizer: TurboQuantizer | None

    def _set_config(self, dim: int, bits: float, metric: str, mode: str, correction: str, rotation: str, seed: int,
                    device: str | torch.device) -> tuple[int, torch.device]:
        """Check the settings both index types share and set ``dim``, ``bits``, ``metric``, ``mode`` and
        ``row_bytes`` (bytes of codes per vector); returns the checked ``(seed, device)``.

        Raises
        ------
        ValueError
            A value out of its range or choices (``correction`` and ``rotation`` are only checked here).
        """
        self.dim = check_positive_int("dim", dim)
        self.bits = check_bits(bits)
        self.metric = check_choice("metric", metric, METRICS)
        self.mode = check_choice("mode", mode, ("mse", "prod"))
        check_choice("correction", correction, CORRECTIONS)
        check_choice("rotation", rotation, ROTATION_KINDS)
        self.row_bytes = math.ceil(self.dim * self.bits / 8)
        return check_seed(seed), as_device(device)

    def _coded_fields(self, codes: Codes, x: torch.Tensor, bias: torch.Tensor | None,
                      fine_input: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every stored field of encoded rows: the packed codes, the side fields as stored (``bias``, the centering
        bias of each row, minus ½‖x‖² for L2; needed when ``side_fields`` has one), the QJL bits in ``prod`` mode
        and the rerank code of ``fine_input`` (checked float32 rows) when there is a fine quantizer."""
        side = {"scale": codes.scales, "residual": codes.residual_norms}
        if "bias" in self.side_fields:
            side["bias"] = bias - 0.5 * (x * x).sum(1) if self.metric == "l2" else bias
        out = {"packed": codes.packed}
        out.update({name: store_side(side[name], dtype) for name, dtype in self.side_fields.items()})
        if self.mode == "prod":
            out["qjl"] = codes.qjl
        if self.fine_quantizer is not None:
            fine = self.fine_quantizer.encode_checked(fine_input)
            out.update(fine_packed=fine.packed, fine_scale=fine.scales)
        return out

    @staticmethod
    def _side_bytes(fields: dict[str, torch.dtype]) -> int:
        return sum(torch.empty(0, dtype=dtype).element_size() for dtype in fields.values())

    def _budget_quantizer(self, code_bytes: int, seed: int, rotation: str) -> TurboQuantizer:
        """The quantizer whose packed codes (and QJL bits) fill ``code_bytes`` bytes per vector."""
        rescale = self.mode == "mse" and self.correction != "none"
        try:
            return TurboQuantizer.for_bytes(self.dim, code_bytes, self.mode, rotation=rotation, seed=seed, rescale=rescale)
        except ValueError as err:
            side = self._side_bytes(self.side_fields)
            qjl = math.ceil(rotated_dim(rotation, self.dim) / 8) if self.mode == "prod" else 0
            fewest_bits = math.ceil(800 * (side + qjl + 1) / self.dim) / 100  # one byte of codes at least
            remedy = (f"use bits >= {fewest_bits:g}" if fewest_bits <= 8 else
                      f"even 8 bits are too few at dim={self.dim} for this metric's side information")
            taken = f"the side information {tuple(self.side_fields)} takes {side}" + (f" and the QJL bits {qjl}" if qjl else "")
            raise ValueError(f"bits={self.bits:g}: {self.row_bytes} bytes per vector at dim={self.dim}, of which {taken}, "
                             f"leaves no room for codes: {remedy}") from err

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

    def _loaded_tensors(self, arrays: dict[str, np.ndarray], ids: np.ndarray, center: np.ndarray | None,
                        device: str | torch.device) -> dict[str, torch.Tensor]:
        """The row ``arrays`` of a file, checked against this freshly built configuration (``_check_loaded``:
        ``ValueError``), as tensors on ``device`` (over read-only mapped arrays, never written)."""
        self._check_loaded(arrays, ids, center)
        with warnings.catch_warnings():  # read-only mmap arrays: tensors over them are never written
            warnings.simplefilter("ignore", UserWarning)
            return {name: torch.as_tensor(arr).to(device) for name, arr in arrays.items()}

    def _restore_header(self, meta: dict, center: np.ndarray | None, device: str | torch.device) -> None:
        """The loaded centering state and next automatic id."""
        self._center = None if center is None else torch.as_tensor(np.array(center, np.float32)).to(device)
        self._center_pending = meta["center_pending"]
        self._next_id = meta["next_id"]

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


#: per-vector side fields any configuration may store (:func:`side_fields_for`)
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


@dataclass(frozen=True)
class ListSnapshot:
    """An inverted-file index's published rows, what a search reads: rows ``[0, size)`` of the row tensors, and
    each list's rows (int32 arrays)."""

    tensors: dict[str, torch.Tensor]  # name -> (size, ...) rows, never modified in place
    ids: np.ndarray  # (size,) int64
    lists: tuple[torch.Tensor, ...]  # nlist × (n_l,) int32 row numbers
    size: int
    #: what searches derive from this snapshot, built once: "block" (the scan's view of all rows), "lists" (the
    #: native scan's lists with their reference vectors, and the centroids they came from), "search" (the native
    #: search bound to them, and the query preparation it was built with)
    cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def list_table(self) -> _fastscan.Lists:
        """The lists as ``(offsets (nlist + 1,), rows (size,))`` int64 arrays for the native scan, built once."""
        sizes = np.array([len(rows) for rows in self.lists], np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        rows = torch.cat(self.lists).long().cpu().numpy() if self.lists else np.zeros(0, np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.size):
            raise RuntimeError("inverted lists name rows outside the index")
        return _fastscan.Lists(offsets, rows)
