"""``IVFIndex``: an inverted-file TurboQuant index — coarse k-means lists, TurboQuant codes inside them.

Partition. ``nlist`` centroids from k-means (torch, seeded; trained on at most
``MAX_POINTS_PER_LIST · nlist`` sampled rows, FAISS's cap). ``train(x)`` trains explicitly; otherwise the
first ``add`` trains on its own vectors when it brings at least ``MIN_POINTS_PER_LIST · nlist`` of them
(FAISS's warning threshold), and raises ``ValueError`` when it brings fewer. Each vector joins the list
of its nearest centroid (L2 for ``"l2"``/``"cosine"``, largest inner product for ``"ip"``); a query
probes the ``nprobe`` nearest lists by the same rule. The TurboQuant codes themselves need no training.

Encoding (``encoding``). ``"residual"``: a vector ``x`` in list ``l`` is stored as the TurboQuant code of
``u = x − c_l`` (its centroid's residual); ``"direct"``: ``u = x − g`` with ``g`` the global centering
vector of :class:`~tqvec.index.Index` (``correction="center"``) or 0 — exactly ``Index``'s codes.
With ``b`` the base (``c_l`` or ``g``), ``ŷ`` the codebook levels of ``Π u/‖u‖`` and ``s`` the stored
scale, a query ``q`` scores

    ⟨q, x⟩ ≈ ⟨q, b⟩ + s · ⟨Πq, ŷ⟩ + bias_x,

``⟨q, b⟩`` coming from the coarse search for free. ``correction="center"`` stores
``bias_x = ⟨b, u − û⟩`` (û the decoded ``u``), which makes the estimate exact along ``b``; this equals
``Index``'s centered scoring with ``(q − b)``, folded so that one rotated query serves every list.
``"rescale"`` / ``"none"`` as in ``Index``; ``"auto"`` picks ``"center"`` when scale and bias take at most
:data:`AUTO_SIDE_SHARE` of the budget (else "rescale"; "none" for unit-norm direct cosine codes).
Side information is float16 for ``cosine``, float32 otherwise. For ``metric="l2"``, ``bias_x`` also holds
``−‖x‖²/2`` (exact) and ``D = ‖q‖² − 2·score``.

Budget. ``bits`` means what it means for ``Index``: ``ceil(dim · bits / 8)`` bytes per vector for codes
and side information together. On top of that each vector costs its int64 id and a 4-byte row number in
its list (:attr:`IVFIndex.bytes_per_vector`); the index adds ``nlist · dim`` float32 centroids
(:attr:`IVFIndex.nbytes`).

Search. On the CPU one native call prepares the queries (probes, constants, rotation) and scans the probed
lists (``docs/native.md``); the torch path (:mod:`tqvec._ivf_search`) serves CUDA, QJL codes and rerank.
Threads: ``torch.set_num_threads``.

Concurrency and files: as ``Index`` (searches see a snapshot; ``add``/``remove`` take a lock; ``save``
writes atomically through :mod:`tqvec.storage` with kind ``"tqvec.IVFIndex"``).
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import numpy as np
import torch

from . import _fastscan, scan, storage
from ._file_checks import check_ivf_file
from ._ivf_search import search_torch
from ._rows import (
    MIN_CENTER_ROWS,
    CodedRows,
    ListSnapshot,
    check_rows,
    frozen_center,
    new_ids,
    rows_of_ids,
    side_fields_for,
    sort_ids,
)
from .kmeans import assign_nearest, kmeans
from .quantizer import Codes, TurboQuantizer
from .validation import (
    as_device,
    as_float_array,
    as_float_matrix,
    as_ids,
    check_bits,
    check_choice,
    check_positive_int,
)

ENCODINGS = ("residual", "direct")
#: "auto" picks "center" when scale + bias take at most this share of the budget (IVF's own rule, measured:
#: docs/design.md)
AUTO_SIDE_SHARE = 0.25
FILE_KIND = "tqvec.IVFIndex"
FILE_VERSION = 1
#: k-means trains on at most this many sampled rows per list (FAISS's ``max_points_per_centroid``)
MAX_POINTS_PER_LIST = 256
#: auto-training on the first ``add`` needs at least this many rows per list (FAISS warns below it)
MIN_POINTS_PER_LIST = 39
#: what to do about a direct-coded center frozen from few rows (:func:`~tqvec._rows.frozen_center`)
CENTER_REMEDY = f"train on at least {MIN_CENTER_ROWS} rows"


class IVFIndex(CodedRows):
    """Inverted-file TurboQuant index (module docstring: partition, encoding, budget, search).

    Parameters
    ----------
    dim : int
        Vector dimension.
    nlist : int
        Number of k-means lists.
    bits : float
        Storage budget per dimension, as for :class:`~tqvec.index.Index`.
    metric : {"ip", "l2", "cosine"}
    mode, encoding, seed, rotation, correction : keyword-only
        ``"mse"`` | ``"prod"``; ``"residual"`` (codes of ``x − centroid``) | ``"direct"``; rotation seed;
        ``"haar"`` | ``"hadamard"`` | ``"fht-kac"``; ``"auto"`` | ``"none"`` | ``"rescale"`` | ``"center"``.
    rerank_bits : float, optional
        A finer code for ``search(..., rerank=R)`` (extra bytes).
    nprobe : int
        Lists probed by default (``search(..., nprobe=)`` overrides).
    device : {"cpu", "cuda"}

    Raises
    ------
    ValueError, TypeError
        An argument out of its range or choices, named in the message.

    Examples
    --------
    >>> import numpy as np, tqvec
    >>> x = np.random.default_rng(0).standard_normal((2000, 32)).astype(np.float32)
    >>> index = tqvec.IVFIndex(32, nlist=16, bits=4, metric="l2", nprobe=4)
    >>> index.train(x)
    >>> ids = index.add(x)
    >>> D, I = index.search(x[:2], k=3)
    >>> I[:, 0].tolist(), D.shape
    ([0, 1], (2, 3))
    """

    def __init__(self, dim: int, nlist: int, bits: float = 4, metric: str = "ip", *, mode: str = "mse",
                 encoding: str = "residual", seed: int = 0, rotation: str = "haar", correction: str = "auto",
                 rerank_bits: float | None = None, nprobe: int = 1, device: str | torch.device = "cpu") -> None:
        seed, device = self._set_config(dim, bits, metric, mode, correction, rotation, seed, device)
        self.seed = seed
        self.nlist = check_positive_int("nlist", nlist)
        self.encoding = check_choice("encoding", encoding, ENCODINGS)
        self.nprobe = nprobe
        if correction == "auto":
            side = self._side_bytes(self._side_fields("center"))
            if side <= AUTO_SIDE_SHARE * self.row_bytes:
                correction = "center"
            else:
                correction = "none" if (metric == "cosine" and encoding == "direct") else "rescale"
        self.correction = correction
        self.side_fields = self._side_fields(correction)
        self.device = torch.device(device)
        code_bytes = self.row_bytes - self._side_bytes(self.side_fields)
        self.quantizer = self._budget_quantizer(code_bytes, self.seed, rotation)
        self.fine_quantizer = None
        if rerank_bits is not None:
            self.fine_quantizer = TurboQuantizer(dim, check_bits(rerank_bits), "mse", rotation=rotation, seed=seed + 1,
                                                 rescale=True)
        self.centroids: torch.Tensor | None = None  # (nlist, dim) float32
        # (centroids, center, the native query preparation made from them)
        self._query_prep: tuple[torch.Tensor, torch.Tensor | None, object] | None = None
        self._center: torch.Tensor | None = None
        self._center_pending = encoding == "direct" and correction == "center"
        self._lock = threading.Lock()
        self._next_id = 0
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None
        self._capacity: dict[str, torch.Tensor] = self._empty_tensors()
        self._ids_capacity = np.zeros(0, np.int64)
        self._list_capacity: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int32, device=self.device)] * self.nlist
        self._list_sizes = [0] * self.nlist
        self._snap = ListSnapshot({k: t[:0] for k, t in self._capacity.items()}, self._ids_capacity[:0],
                               tuple(t[:0] for t in self._list_capacity), 0)

    # ------------------------------------------------------------------ configuration
    def _side_fields(self, correction: str) -> dict[str, torch.dtype]:
        """Per-vector side fields: the scale (unless plain unit-norm direct cosine codes), bias, QJL norm."""
        unit = self.metric == "cosine" and self.encoding == "direct"
        return side_fields_for(self.metric, self.mode, correction, unit_codes=unit, log_scale=False)

    # ------------------------------------------------------------------ properties
    def __len__(self) -> int:
        return self._snap.size

    @property
    def is_trained(self) -> bool:
        return self.centroids is not None

    @property
    def list_sizes(self) -> np.ndarray:
        """Vectors per list ``(nlist,)`` int64."""
        return np.array([len(t) for t in self._snap.lists], dtype=np.int64)

    @property
    def bytes_per_vector(self) -> int:
        """Everything stored per vector: codes, side information, rerank code, int64 id, int32 list entry."""
        return self.code_bytes_per_vector + self.rerank_bytes_per_vector + 8 + 4

    @property
    def nbytes(self) -> int:
        """Bytes of the whole index: every vector's :attr:`bytes_per_vector` plus the float32 centroids and center."""
        fixed = 4 * self.dim * (self.nlist if self.is_trained else 0) + (4 * self.dim if self._center is not None else 0)
        return len(self) * self.bytes_per_vector + fixed

    def __repr__(self) -> str:
        return (f"IVFIndex(dim={self.dim}, nlist={self.nlist}, bits={self.bits:g}, metric={self.metric!r}, "
                f"mode={self.mode!r}, encoding={self.encoding!r}, correction={self.correction!r}, n={len(self)})")

    # ------------------------------------------------------------------ training
    def _prepare(self, x: Any, name: str) -> torch.Tensor:
        x = as_float_matrix(x, self.dim, name, self.device)
        return torch.nn.functional.normalize(x, dim=1) if self.metric == "cosine" else x

    def train(self, x: Any) -> None:
        """Train the coarse centroids on ``x`` ``(n, dim)``, n ≥ nlist (a seeded sample of at most
        ``MAX_POINTS_PER_LIST · nlist`` rows is used). Only an empty index can be (re)trained."""
        x = self._prepare(x, "x")
        with self._lock:
            self._train(x)

    def _train(self, x: torch.Tensor) -> None:
        if len(self):
            raise ValueError("train: the index already holds vectors (train before the first add)")
        self.centroids = kmeans(x, self.nlist, seed=self.seed, by_ip=self.metric == "ip",
                                max_points=MAX_POINTS_PER_LIST * self.nlist)
        if self._center_pending:  # direct codes centered by the training rows' mean
            self._center = frozen_center(x, CENTER_REMEDY, caller_depth=2)  # user → train / add → _train
            self._center_pending = False

    # ------------------------------------------------------------------ add
    def add(self, x: Any, ids: Any = None) -> np.ndarray:
        """Assign, encode and append ``x`` ``(n, dim)``; ``ids`` int64 ``(n,)`` (default: consecutive).

        Trains first if untrained and ``n ≥ MIN_POINTS_PER_LIST · nlist`` (else ``ValueError``). Returns the ids.
        """
        x = self._prepare(x, "x")
        with self._lock:
            new_ids = self._new_ids(ids, x.shape[0])
            if not x.shape[0]:
                return new_ids
            if not self.is_trained:
                need = MIN_POINTS_PER_LIST * self.nlist
                if x.shape[0] < need:
                    raise ValueError(f"the index is not trained: call train(x) first, or add at least "
                                     f"{need} vectors at once ({MIN_POINTS_PER_LIST} per list)")
                self._train(x)
            if self._center_pending:  # a trained index saved before train() froze the center
                self._center = frozen_center(x, CENTER_REMEDY)
                self._center_pending = False
            lists = assign_nearest(x, self.centroids, self.metric == "ip")
            self._append(self._encode(x, lists), new_ids, lists)
        return new_ids

    def _new_ids(self, ids: Any, n: int) -> np.ndarray:
        return new_ids(ids, n, self._next_id, self._id_table())

    def _bases(self, lists: torch.Tensor) -> torch.Tensor | None:
        """The base ``b`` of each row ``(n, dim)`` (its centroid, or the global center), or None for 0."""
        if self.encoding == "residual":
            return self.centroids[lists]
        return None if self._center is None else self._center.expand(len(lists), -1)

    def _encode(self, x: torch.Tensor, lists: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row tensors for ``x`` (already normalized for cosine) assigned to ``lists``."""
        base = self._bases(lists)
        u = x if base is None else x - base
        codes = self.quantizer.encode_checked(u)
        bias = None
        if "bias" in self.side_fields:
            bias = torch.zeros(x.shape[0], device=x.device)
            if self.correction == "center" and base is not None:
                bias = (base * (u - self.quantizer.decode(codes))).sum(1)
        return self._coded_fields(codes, x, bias, u)

    def _append(self, new: dict[str, torch.Tensor], ids: np.ndarray, lists: torch.Tensor) -> None:
        n, m = self._snap.size, len(ids)
        if n + m > len(self._ids_capacity):  # grow geometrically; running searches keep the old tensors
            cap = max(n + m, 2 * len(self._ids_capacity), 1024)
            for name, t in self._capacity.items():
                grown = t.new_empty((cap, *t.shape[1:]))
                grown[:n] = t[:n]
                self._capacity[name] = grown
            grown_ids = np.empty(cap, np.int64)
            grown_ids[:n] = self._ids_capacity[:n]
            self._ids_capacity = grown_ids
        for name, t in new.items():
            self._capacity[name][n:n + m] = t
        self._ids_capacity[n:n + m] = ids
        rows = torch.arange(n, n + m, dtype=torch.int32, device=self.device)
        order = torch.argsort(lists, stable=True)
        counts = torch.bincount(lists, minlength=self.nlist).tolist()
        start = 0
        for l, c in enumerate(counts):
            if c:
                self._list_append(l, rows[order[start:start + c]])
                start += c
        self._publish(n + m)
        self._next_id = max(self._next_id, int(ids.max()) + 1)

    def _list_append(self, l: int, rows: torch.Tensor) -> None:
        size, cap = self._list_sizes[l], self._list_capacity[l]
        if size + len(rows) > len(cap):
            grown = cap.new_empty(max(size + len(rows), 2 * len(cap), 16))
            grown[:size] = cap[:size]
            self._list_capacity[l] = cap = grown
        cap[size:size + len(rows)] = rows
        self._list_sizes[l] = size + len(rows)

    def _publish(self, size: int) -> None:
        self._snap = ListSnapshot({k: t[:size] for k, t in self._capacity.items()}, self._ids_capacity[:size],
                               tuple(t[:s] for t, s in zip(self._list_capacity, self._list_sizes)), size)
        self._sorted = None

    # ------------------------------------------------------------------ ids
    def _id_table(self) -> tuple[np.ndarray, np.ndarray]:
        """:func:`~tqvec.index.sort_ids` of the live ids, cached until rows change."""
        if self._sorted is None:
            self._sorted = sort_ids(self._snap.ids)
        return self._sorted

    def _rows_of(self, ids: np.ndarray, missing_ok: bool = False) -> np.ndarray:
        """Row of each id (−1 if absent and ``missing_ok``, else ``KeyError``)."""
        return rows_of_ids(self._id_table(), ids, missing_ok)

    def _row_lists(self, snap: ListSnapshot) -> torch.Tensor:
        """The list of every row ``(size,)`` int64, made once per snapshot (a rerank search reads it per query)."""
        if "row_lists" not in snap.cache:
            out = torch.empty(snap.size, dtype=torch.int64, device=self.device)
            for l, rows in enumerate(snap.lists):
                out[rows] = l
            snap.cache["row_lists"] = out
        return snap.cache["row_lists"]

    def remove(self, ids: Any) -> int:
        """Remove the vectors with these ids (an unknown id raises ``KeyError``, nothing removed). Returns the count."""
        ids = np.unique(as_ids(ids))
        with self._lock:
            keep = np.ones(self._snap.size, bool)
            keep[self._rows_of(ids)] = False
            snap = self._snap
            mask = torch.from_numpy(keep).to(self.device)
            lists = self._row_lists(snap)[mask]
            tensors = {k: t[mask] for k, t in snap.tensors.items()}
            self._reset_rows(tensors, snap.ids[keep], lists)
        return len(ids)

    def _reset_rows(self, tensors: dict[str, torch.Tensor], ids: np.ndarray, lists: torch.Tensor) -> None:
        """Replace all rows (new tensors, so running searches keep their snapshot) and rebuild the lists."""
        self._capacity = tensors
        self._ids_capacity = ids
        self._list_capacity = [torch.zeros(0, dtype=torch.int32, device=self.device)] * self.nlist
        self._list_sizes = [0] * self.nlist
        order = torch.argsort(lists, stable=True)
        counts = torch.bincount(lists, minlength=self.nlist).tolist()
        start = 0
        for l, c in enumerate(counts):
            self._list_capacity[l] = order[start:start + c].to(torch.int32)
            self._list_sizes[l] = c
            start += c
        self._publish(len(ids))

    def reconstruct(self, ids: Any) -> np.ndarray:
        """Decoded vectors ``(len(ids), dim)`` float32 (from the rerank code when present)."""
        ids = as_ids(ids)
        with self._lock:
            snap = self._snap
            rows = torch.from_numpy(self._rows_of(ids)).to(self.device)
        t = {k: v[rows] for k, v in snap.tensors.items()}
        if self.fine_quantizer is not None:
            u = self.fine_quantizer.decode(Codes(t["fine_packed"], t["fine_scale"]))
        else:
            u = self.quantizer.decode(self._codes(t))
        base = self._bases(self._row_lists(snap)[rows]) if len(rows) else None
        return (u if base is None else u + base).cpu().numpy()

    def _codes(self, t: dict[str, torch.Tensor]) -> Codes:
        n = t["packed"].shape[0]
        scale = t["scale"].float() if "scale" in t else torch.ones(n, device=t["packed"].device)
        residual = t["residual"].float() if "residual" in t else None
        return Codes(t["packed"], scale, t.get("qjl"), residual)

    @property
    def nprobe(self) -> int:
        """Lists probed by default: a positive int, settable as FAISS's ``index.nprobe`` (checked when set: a
        ``ValueError`` naming ``nprobe``, the old value kept)."""
        return self._nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        self._nprobe = check_positive_int("nprobe", value)

    # ------------------------------------------------------------------ search
    def search(self, queries: Any, k: int, nprobe: int | None = None,
               rerank: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(D, I)`` for ``queries`` ``(nq, dim)``, probing ``nprobe`` lists (default ``self.nprobe``).

        ``D`` float32 ``(nq, k)``: scores (ip, cosine; best = largest) or squared L2 distances (best =
        smallest); ``I`` int64 ids, −1 (and ∓inf) where fewer than k were found. ``rerank=R`` rescores the
        best ``R·k`` candidates with the rerank code (needs ``rerank_bits``).
        """
        k = check_positive_int("k", k)
        nprobe = self.nprobe if nprobe is None else check_positive_int("nprobe", nprobe)
        snap = self._snap  # consistent snapshot (module docstring)
        if rerank is None and snap.size and self.centroids is not None and scan.native_queries(self.device, self.mode):
            x = as_float_array(queries, self.dim, "queries", check_values=False)  # values: checked by the kernel
            return self._native_search(snap)(x, k, min(nprobe, self.nlist))
        q = as_float_matrix(queries, self.dim, "queries", self.device)
        if rerank is not None:
            rerank = check_positive_int("rerank", rerank)
            if self.fine_quantizer is None:
                raise ValueError("rerank needs an index built with rerank_bits")
        return search_torch(self, q, k, nprobe, rerank)

    def _scan_block(self, snap: ListSnapshot) -> scan.CodeBlock:
        """The scan's view of all rows of ``snap`` (side fields widened once per snapshot)."""
        if "block" not in snap.cache:
            coded = {name: t for name, t in snap.tensors.items() if not name.startswith("fine")}
            bias = coded["bias"].float() if "bias" in coded else None
            snap.cache["block"] = self.quantizer.code_block(self._codes(coded), bias)
        return snap.cache["block"]

    def _native_lists(self, snap: ListSnapshot) -> _fastscan.Lists:
        """``snap``'s lists for the native scan, with the rotated centroids as the lists' reference vectors (their
        two-stage estimates are bounded around them), built once per snapshot and centroids."""
        cached = snap.cache.get("lists")
        if cached is None or cached[0] is not self.centroids:
            rotated, _ = self.quantizer.rotate_checked(self.centroids.float())
            lists = dataclasses.replace(snap.list_table, reference=rotated.cpu().numpy())
            cached = snap.cache["lists"] = (self.centroids, lists)
        return cached[1]

    def _native_search(self, snap: ListSnapshot) -> _fastscan.QuerySearch:
        """The native search of raw CPU queries over the rows of ``snap`` (non-empty, of a trained index), in one call
        (:func:`tqvec.scan.query_search`: checking the values, normalizing, probing and rotating happen in the
        kernel); the query preparation is kept while the centroids and center stay, the bound search per snapshot."""
        centroids, center, prep = self._query_prep or (None, None, None)
        if prep is None or centroids is not self.centroids or center is not self._center:
            base = self._center if self.encoding == "direct" else None
            prep = _fastscan.query_prep(self.quantizer.rotation, self.metric == "cosine", None, self.centroids,
                                        by_ip=self.metric == "ip", residual=self.encoding == "residual", base=base)
            self._query_prep = (self.centroids, self._center, prep)
        cached = snap.cache.get("search")
        if cached is None or cached[0] is not prep:
            search = scan.query_search(self._scan_block(snap), self.quantizer.table("cpu"), prep, snap.ids,
                                       self.metric == "l2", self._native_lists(snap))
            cached = snap.cache["search"] = (prep, search)
        return cached[1]

    # ------------------------------------------------------------------ persistence
    def _config(self) -> dict[str, Any]:
        return {
            "version": FILE_VERSION, "dim": self.dim, "nlist": self.nlist, "bits": self.bits, "metric": self.metric,
            "mode": self.mode, "encoding": self.encoding, "seed": self.seed, "rotation": self.quantizer.rotation.kind,
            "correction": self.correction, "nprobe": self.nprobe,
            "rerank_bits": None if self.fine_quantizer is None else self.fine_quantizer.bits,
            "center_pending": self._center_pending, "next_id": self._next_id,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the index to ``path`` atomically (format: :mod:`tqvec.storage`); the old file survives a failure."""
        with self._lock:
            snap = self._snap
            arrays = {name: t.cpu().numpy() for name, t in snap.tensors.items()}
            arrays["ids"] = snap.ids
            arrays["lists"] = self._row_lists(snap).cpu().numpy().astype(np.int32)
            if self.centroids is not None:
                arrays["centroids"] = self.centroids.cpu().numpy()
            if self._center is not None:
                arrays["center"] = self._center.cpu().numpy()
            storage.save_arrays(path, FILE_KIND, self._config(), arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, mmap: bool = False, device: str | torch.device = "cpu") -> "IVFIndex":
        """Open an index written by :meth:`save`; ``mmap=True`` maps the row arrays read-only instead of reading
        them (later adds copy them first, removes build new ones).

        Raises :class:`~tqvec.storage.StorageError` for any file that is not a consistent index (header and arrays
        are checked against each other before the configuration is built; docs/guarantees.md),
        ``FileNotFoundError`` if there is none, ``ValueError`` for a ``device`` this machine lacks. A mapped file
        must not be truncated while in use (SIGBUS).
        """
        device = as_device(device)  # before the file: a device this machine lacks is no fault of the file
        meta, arrays = storage.load_arrays(path, FILE_KIND, mmap=mmap)
        if meta.get("version") != FILE_VERSION:
            raise storage.StorageError(f"{path}: unsupported index version {meta.get('version')!r}")
        try:
            ids, lists, centroids, center = check_ivf_file(meta, arrays)
            index = cls(meta["dim"], meta["nlist"], meta["bits"], meta["metric"], device=device,
                        **{name: meta[name] for name in ("mode", "encoding", "seed", "rotation", "correction", "rerank_bits",
                                                         "nprobe")})
            arrays = {name: a for name, a in arrays.items() if name not in ("ids", "lists", "centroids", "center")}
            tensors = index._loaded_tensors(arrays, ids, center, device)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, storage.StorageError):
                raise
            raise storage.StorageError(f"{path}: inconsistent index file ({err})") from err
        index.centroids = None if centroids is None else torch.as_tensor(np.array(centroids, np.float32)).to(device)
        index._restore_header(meta, center, device)
        index._reset_rows(tensors, np.asarray(ids, np.int64), torch.as_tensor(np.array(lists, np.int64)).to(device))
        return index

    def _check_loaded(self, arrays: dict[str, np.ndarray], ids: np.ndarray, center: np.ndarray | None) -> None:
        """Row ``arrays`` of a file against this (freshly built) configuration; ``ValueError`` on any mismatch."""
        check_rows(arrays, self._empty_tensors(), len(ids))
        if center is not None and not (self.encoding == "direct" and self.correction == "center"):
            raise ValueError("a center is stored, but only direct encoding with correction='center' uses one")
