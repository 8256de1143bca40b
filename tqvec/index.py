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
cosine ``"rescale"`` scale, a uint8 log code (see :func:`side_fields_for`).

Centering in the code padding (``tail_bits > 0``): for cosine below ``AUTO_RESCALE_MIN_BITS`` bits, where the
side bytes of ``"center"`` would take more than ``AUTO_SIDE_SHARE`` of the budget, the codes take the whole
budget and ``bias_x`` becomes a uniform code over ``[−‖c‖, ‖c‖]`` in the last byte's ``tail_bits`` ≥
``tqvec._tail.TAIL_MIN_BITS`` padding bits; the scale is derived from it (``‖x − c‖ = √(1 − 2·bias_x + ‖c‖²)`` for unit
``x``, over ``‖ŷ_x‖``). ``"auto"`` picks ``"center"`` when its side information fits ``AUTO_SIDE_SHARE``, else
``"rescale"``, and below ``AUTO_RESCALE_MIN_BITS`` cosine bits the padding code where the layout has one,
``"none"`` otherwise. Rules, layouts and their measurements: ``docs/design.md``.

Concurrency. ``search`` may run from many threads at once. ``add`` and ``remove`` take a lock and
never modify rows that a running search reads (``add`` writes past the published size, growth
copies, ``remove`` builds new arrays), so every search sees the index as it was when it started.

Memory. The scan runs blockwise (:mod:`tqvec.scan`; natively on the CPU, ``docs/native.md``): no ``nq × N``
score matrix is formed.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch

from . import _fastscan, scan, storage
from ._file_checks import check_index_file
from ._rows import (
    MIN_CENTER_ROWS,
    CodedRows,
    RowSnapshot,
    check_rows,
    frozen_center,
    load_side,
    new_ids,
    rows_of_ids,
    search_results,
    side_fields_for,
    sort_ids,
)
from ._tail import bias_code, tail_layout, tail_side
from .packing import write_tail
from .quantizer import Codes, TurboQuantizer
from .rotation import rotated_dim, rowwise_matmul
from .validation import (
    as_device,
    as_float_array,
    as_float_matrix,
    as_ids,
    check_bits,
    check_positive_int,
)

#: "auto" centers when scale + bias take at most this share of the per-vector budget
AUTO_SIDE_SHARE = 0.10
#: below this budget (bits per dimension) "auto" stores no per-vector scale for cosine: at 1 bit a
#: constant scale ranked better than the rescaled one on both real sets (README, Index section)
AUTO_RESCALE_MIN_BITS = 2
FILE_KIND = "tqvec.Index"
#: 2: the header records ``tail_bits`` (version 1 files load unless their configuration now means a tail code)
FILE_VERSION = 2


class Index(CodedRows):
    """Flat TurboQuant index with FAISS conventions (module docstring: budget, scoring, concurrency).

    Parameters
    ----------
    dim : int
        Vector dimension.
    bits : float
        Storage budget per dimension, everything counted but the id (≥ 1, fractional allowed).
    metric : {"ip", "l2", "cosine"}
    mode, seed, rotation, correction : keyword-only
        ``"mse"`` | ``"prod"``; rotation seed; ``"haar"`` | ``"hadamard"`` | ``"fht-kac"``; ``"auto"`` | ``"none"`` |
        ``"rescale"`` | ``"center"`` (module docstring).
    rerank_bits : float, optional
        Also keep a finer code at that many bits per dimension for ``search(..., rerank=R)`` (extra bytes).
    device : {"cpu", "cuda"}

    Raises
    ------
    ValueError, TypeError
        An argument out of its range or choices, named in the message.

    Examples
    --------
    >>> import numpy as np, tqvec
    >>> x = np.random.default_rng(0).standard_normal((1000, 32)).astype(np.float32)
    >>> index = tqvec.Index(32, bits=4, metric="l2")
    >>> ids = index.add(x)
    >>> D, I = index.search(x[:2], k=3)
    >>> I[:, 0].tolist(), D.shape, index.code_bytes_per_vector  # 32 dims × 4 bits
    ([0, 1], (2, 3), 16)
    """

    def __init__(self, dim: int, bits: float = 4, metric: str = "ip", *, mode: str = "mse", seed: int = 0,
                 rotation: str = "haar", correction: str = "auto", rerank_bits: float | None = None,
                 device: str | torch.device = "cpu") -> None:
        seed, device = self._set_config(dim, bits, metric, mode, correction, rotation, seed, device)
        side_fits = self._side_bytes(side_fields_for(metric, mode, "center")) <= AUTO_SIDE_SHARE * self.row_bytes
        low_cosine = metric == "cosine" and self.bits < AUTO_RESCALE_MIN_BITS
        padded = low_cosine and mode == "mse" and not side_fits
        layout = tail_layout(rotated_dim(rotation, self.dim), self.row_bytes) if padded else None
        if correction == "auto":
            if side_fits:
                correction = "center"
            elif low_cosine:
                correction = "none" if layout is None else "center"
            else:
                correction = "rescale"
        self.correction = correction
        #: width of the centering bias code kept in the code padding (0: not used; module docstring)
        self.tail_bits = layout.spare_bits if correction == "center" and layout is not None else 0
        self.side_fields = {} if self.tail_bits else side_fields_for(metric, mode, correction)
        self.device = torch.device(device)
        if self.tail_bits:
            self.quantizer = TurboQuantizer(dim, 1, mode, rotation=rotation, seed=seed, layout=layout)
        else:
            self.quantizer = self._budget_quantizer(self.row_bytes - self._side_bytes(self.side_fields), seed, rotation)
        self.fine_quantizer = None
        if rerank_bits is not None:
            fine_bits = check_bits(rerank_bits)
            self.fine_quantizer = TurboQuantizer(dim, fine_bits, "mse", rotation=rotation, seed=seed + 1, rescale=True)
        self._center: torch.Tensor | None = None
        self._center_pending = correction == "center"
        self._lock = threading.Lock()
        self._next_id = 0
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None
        self._rows = RowSnapshot(self._empty_tensors(), np.zeros(0, np.int64), 0)

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
                self._center = frozen_center(x, f"call set_center(a sample's mean) before the first add, or add at "
                                                f"least {MIN_CENTER_ROWS} rows first")
                self._center_pending = False
            self._append(self._encode(x), new_ids)
        return new_ids

    def _new_ids(self, ids: Any, n: int) -> np.ndarray:
        return new_ids(ids, n, self._next_id, self._id_table())

    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row tensors for ``x`` (validated; already normalized for cosine)."""
        centered = x if self._center is None else x - self._center
        codes = self.quantizer.encode_checked(centered)
        if self.tail_bits:
            write_tail(codes.packed, bias_code(self._center_products(x), self._center_or_zero(), self.tail_bits),
                       self.quantizer.layout, self.tail_bits)
        bias = None
        if "bias" in self.side_fields:
            bias = torch.zeros(x.shape[0], device=x.device) if self._center is None else self._center_products(x)
        return self._coded_fields(codes, x, bias, centered)

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
            rows = RowSnapshot(grown, grown_ids, n)
        for name, t in new.items():
            rows.tensors[name][n:n + m] = t
        rows.ids[n:n + m] = ids
        self._rows = RowSnapshot(rows.tensors, rows.ids, n + m)  # publish: running searches keep their snapshot
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
            self._rows = RowSnapshot({k: t[mask] for k, t in live.tensors.items()}, live.ids[keep], int(keep.sum()))
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
            return tail_side(packed, self._center_or_zero(), self.tail_bits, self.quantizer)
        scale = load_side(t["scale"]) if "scale" in t else torch.ones(packed.shape[0], device=packed.device)
        residual = load_side(t["residual"]) if "residual" in t else None
        bias = t["bias"].float() if "bias" in t else None
        return Codes(packed, scale, t.get("qjl"), residual), bias

    def _center_or_zero(self) -> torch.Tensor:
        return self._center if self._center is not None else torch.zeros(self.dim, device=self.device)

    # ------------------------------------------------------------------ search
    def search(self, queries: Any, k: int, rerank: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(D, I)`` for ``queries`` ``(nq, dim)``: ``D`` float32 ``(nq, k)`` scores (ip, cosine; best = largest)
        or squared L2 distances (best = smallest); ``I`` int64 ids, −1 (and ∓inf) where fewer than k exist.

        ``rerank=R`` rescores the best ``R·k`` candidates with the finer code (needs ``rerank_bits``).
        """
        k = check_positive_int("k", k)
        if rerank is None and scan.native_queries(self.device, self.quantizer.mode):
            return self._search_native(as_float_array(queries, self.dim, "queries", check_values=False), k)
        q = as_float_matrix(queries, self.dim, "queries", self.device)
        if rerank is not None:
            rerank = check_positive_int("rerank", rerank)
            if self.fine_quantizer is None:
                raise ValueError("rerank needs an index built with rerank_bits")
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
        """:meth:`search` of CPU queries ``x`` ``(nq, dim)`` (shape and dtype validated; values checked by the kernel) in
        one native call (:func:`tqvec.scan.query_search`, bound once per published rows and center)."""
        published = self._rows  # consistent snapshot (module docstring)
        center = self._center
        cached = published.native_search
        if cached is None or cached[0] is not center:
            if not published.scoring:
                published.scoring.append(self.quantizer.code_block(*self._side(published.view().tensors)))
            prep = _fastscan.query_prep(self.quantizer.rotation, self.metric == "cosine", center)
            search = scan.query_search(published.scoring[0], self.quantizer.table("cpu"), prep,
                                       published.ids[:published.size], self.metric == "l2")
            cached = published.native_search = (center, search)
        return cached[1](x, k)

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

    def _rerank(self, shifted: torch.Tensor, live: RowSnapshot, bias: torch.Tensor | None, rows: torch.Tensor,
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
        ``FileNotFoundError`` if there is none, ``ValueError`` for a ``device`` this machine lacks. A file mapped
        with ``mmap=True`` must not be truncated while the index is in use (the OS then kills the process with
        SIGBUS).
        """
        device = as_device(device)  # before the file: a device this machine lacks is no fault of the file
        meta, arrays = storage.load_arrays(path, FILE_KIND, mmap=mmap)
        version = meta.get("version")
        if version not in (1, FILE_VERSION):
            raise storage.StorageError(f"{path}: unsupported index version {version!r}")
        try:
            ids, center = check_index_file(meta, arrays, version == FILE_VERSION)
            index = cls(meta["dim"], meta["bits"], meta["metric"], device=device,
                        **{name: meta[name] for name in ("mode", "seed", "rotation", "correction", "rerank_bits")})
            if version == 1 and index.tail_bits:
                raise storage.StorageError(
                    f"{path}: index file version 1 stores correction='center' at this budget with float16 side "
                    f"fields; this tqvec keeps its bias in the code padding instead (tail_bits={index.tail_bits}), "
                    "so the file cannot be read: rebuild the index from the vectors")
            if version == FILE_VERSION and meta["tail_bits"] != index.tail_bits:
                raise ValueError(f"tail_bits {meta['tail_bits']!r} in the header, {index.tail_bits} for this configuration")
            arrays = {name: a for name, a in arrays.items() if name not in ("ids", "center")}
            tensors = index._loaded_tensors(arrays, ids, center, device)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, storage.StorageError):
                raise
            raise storage.StorageError(f"{path}: inconsistent index file ({err})") from err
        index._restore_header(meta, center, device)
        index._rows = RowSnapshot(tensors, np.asarray(ids, np.int64), len(ids))
        return index

    def _check_loaded(self, arrays: dict[str, np.ndarray], ids: np.ndarray, center: np.ndarray | None) -> None:
        """Row ``arrays`` of a file against this (freshly built) configuration; ``ValueError`` on any mismatch."""
        check_rows(arrays, self._empty_tensors(), len(ids))
        if center is not None and self.correction != "center":
            raise ValueError(f"a center is stored without correction='center' ({self.correction!r})")
