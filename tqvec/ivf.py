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

Search. One query at a time (or few): the probed lists' rows are gathered and scanned in one
:func:`tqvec.scan.search` call with the per-list constants folded into the bias. Many queries: list by
list, each probed list scanned once for all the queries that probe it (a GEMM per list), then the
per-list top-k are merged. Both run on the index's device through :mod:`tqvec.scan` (Triton kernels on
CUDA) and use torch's intra-op threads on CPU (``torch.set_num_threads``).

Concurrency and files: as ``Index`` (searches see a snapshot; ``add``/``remove`` take a lock; ``save``
writes atomically through :mod:`tqvec.storage` with kind ``"tqvec.IVFIndex"``).
"""
from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import _fastscan, scan, storage
from .index import CORRECTIONS, METRICS, SIDE_NAMES, CodedRows, check_rows, new_ids, rows_of_ids, search_results, sort_ids
from .quantizer import Codes, TurboQuantizer
from .rotation import rowwise_matmul
from .validation import (
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

ENCODINGS = ("residual", "direct")
#: "auto" picks "center" when scale + bias take at most this share of the budget. IVF's own rule: on GloVe-50
#: at 4 bits (residual, 512 lists) center beat rescale at equal bytes (recall@10 0.839 vs 0.828 at nprobe 64)
#: although the flat Index now centers only up to 10%.
AUTO_SIDE_SHARE = 0.25
FILE_KIND = "tqvec.IVFIndex"
FILE_VERSION = 1
#: k-means trains on at most this many sampled rows per list (FAISS's ``max_points_per_centroid``)
MAX_POINTS_PER_LIST = 256
#: auto-training on the first ``add`` needs at least this many rows per list (FAISS warns below it)
MIN_POINTS_PER_LIST = 39
KMEANS_ITERATIONS = 20
#: most scores (rows × nlist, float32) that assigning vectors to lists holds at once: 16 MiB
ASSIGN_BLOCK_SCORES = 1 << 22
#: the one-query-at-a-time path is used while ``nq · GATHER_RATIO ≤`` the number of distinct probed lists
GATHER_RATIO = 4


@dataclass(frozen=True)
class _Snapshot:
    """What a search reads: rows ``[0, size)`` of the row tensors, and each list's rows (int32 arrays)."""

    tensors: dict[str, torch.Tensor]  # name -> (size, ...) rows, never modified in place
    ids: np.ndarray  # (size,) int64
    lists: tuple[torch.Tensor, ...]  # nlist × (n_l,) int32 row numbers
    size: int
    #: what searches derive from this snapshot, built once: "block" (the scan's view of all rows)
    cache: dict[str, scan.CodeBlock] = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def list_table(self) -> _fastscan.Lists:
        """The lists as ``(offsets (nlist + 1,), rows (size,))`` int64 arrays for the native scan, built once."""
        sizes = np.array([len(rows) for rows in self.lists], np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        rows = torch.cat(self.lists).long().cpu().numpy() if self.lists else np.zeros(0, np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.size):
            raise RuntimeError("inverted lists name rows outside the index")
        return _fastscan.Lists(offsets, rows)


def kmeans(x: torch.Tensor, k: int, iterations: int = KMEANS_ITERATIONS, seed: int = 0,
           by_ip: bool = False) -> torch.Tensor:
    """Lloyd's k-means of ``x`` ``(n, d)`` float32 into ``k`` centroids ``(k, d)`` (seeded init from rows).

    ``by_ip``: assign by largest inner product (for ``metric="ip"``) instead of L2. Empty clusters
    are re-seeded from the rows of the largest cluster.
    """
    n = x.shape[0]
    if n < k:
        raise ValueError(f"k-means needs at least nlist={k} training vectors, got {n}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:k].to(x.device)].clone()
    for _ in range(iterations):
        assign = _assign(x, centroids, by_ip)
        counts = torch.bincount(assign, minlength=k)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        empty = counts == 0
        centroids = torch.where(empty[:, None], centroids, sums / counts.clamp_min(1)[:, None])
        if bool(empty.any()):
            donors = torch.nonzero(assign == int(counts.argmax())).flatten()
            pick = donors[torch.randperm(len(donors), generator=gen)[: int(empty.sum())].to(x.device)]
            centroids[torch.nonzero(empty).flatten()[: len(pick)]] = x[pick] * (1 + 1e-4)
    return centroids


def _assign(x: torch.Tensor, centroids: torch.Tensor, by_ip: bool) -> torch.Tensor:
    """Nearest centroid of each row of ``x`` ``(n, d)`` → ``(n,)`` int64.

    Blockwise: at most :data:`ASSIGN_BLOCK_SCORES` scores (rows × nlist) exist at a time, so memory stays
    bounded whatever ``n`` and ``nlist`` (training calls this every k-means iteration).
    """
    half_sq = 0.5 * (centroids * centroids).sum(1)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    block = max(1, ASSIGN_BLOCK_SCORES // max(1, centroids.shape[0]))
    for start in range(0, x.shape[0], block):
        s = rowwise_matmul(x[start:start + block], centroids.T)
        out[start:start + block] = (s if by_ip else s - half_sq).argmax(1)
    return out


class IVFIndex(CodedRows):
    """Inverted-file TurboQuant index (module docstring: partition, encoding, budget, search).

    ``dim``; ``nlist`` lists; ``bits`` per-dimension storage budget as for ``Index``; ``metric`` "ip" | "l2"
    | "cosine"; ``mode`` "mse" | "prod" (the quantizer's); ``encoding`` "residual" | "direct"; ``seed``;
    ``rotation`` "haar" | "hadamard"; ``correction`` "auto" | "none" | "rescale" | "center"; ``rerank_bits``:
    a finer code for ``search(..., rerank=R)`` (extra bytes); ``nprobe`` the default lists probed;
    ``device`` "cpu" | "cuda".
    """

    def __init__(
        self,
        dim: int,
        nlist: int,
        bits: float = 4,
        metric: str = "ip",
        mode: str = "mse",
        encoding: str = "residual",
        seed: int = 0,
        rotation: str = "haar",
        correction: str = "auto",
        rerank_bits: float | None = None,
        nprobe: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        self.dim = check_positive_int("dim", dim)
        self.nlist = check_positive_int("nlist", nlist)
        self.bits = check_bits(bits)
        self.metric = check_choice("metric", metric, METRICS)
        self.mode = check_choice("mode", mode, ("mse", "prod"))
        self.encoding = check_choice("encoding", encoding, ENCODINGS)
        check_choice("correction", correction, CORRECTIONS)
        self.nprobe = check_positive_int("nprobe", nprobe)
        self.seed = seed = check_seed(seed)
        device = as_device(device)
        self.side_dtype = torch.float16 if metric == "cosine" else torch.float32
        self.row_bytes = math.ceil(self.dim * self.bits / 8)
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
            self.fine_quantizer = TurboQuantizer(dim, check_bits(rerank_bits), "mse", rotation, seed + 1, rescale=True)
        self.centroids: torch.Tensor | None = None  # (nlist, dim) float32
        self._query_prep: tuple[tuple, object] | None = None  # (centroids, center) -> the native query preparation
        self._center: torch.Tensor | None = None
        self._center_pending = encoding == "direct" and correction == "center"
        self._lock = threading.Lock()
        self._next_id = 0
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None
        self._capacity: dict[str, torch.Tensor] = self._empty_tensors()
        self._ids_capacity = np.zeros(0, np.int64)
        self._list_capacity: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int32, device=self.device)] * self.nlist
        self._list_sizes = [0] * self.nlist
        self._snap = _Snapshot({k: t[:0] for k, t in self._capacity.items()}, self._ids_capacity[:0],
                               tuple(t[:0] for t in self._list_capacity), 0)

    # ------------------------------------------------------------------ configuration
    def _side_fields(self, correction: str) -> dict[str, torch.dtype]:
        """Per-vector side fields (all ``side_dtype``): the scale (unless plain unit-norm direct cosine codes), bias,
        QJL norm."""
        unit = self.metric == "cosine" and self.encoding == "direct" and correction == "none"
        names = () if unit else ("scale",)
        if correction == "center" or self.metric == "l2":
            names += ("bias",)
        if self.mode == "prod":
            names += ("residual",)
        return dict.fromkeys(names, self.side_dtype)

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
        cap = MAX_POINTS_PER_LIST * self.nlist
        if x.shape[0] > cap:
            gen = torch.Generator(device="cpu").manual_seed(self.seed)
            x = x[torch.randperm(x.shape[0], generator=gen)[:cap].to(x.device)]
        self.centroids = kmeans(x, self.nlist, seed=self.seed, by_ip=self.metric == "ip")

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
            if self._center_pending:
                self._center = x.mean(0)
                self._center_pending = False
            lists = _assign(x, self.centroids, self.metric == "ip")
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
        codes = self.quantizer.encode(u)
        out = {"packed": codes.packed}
        side = {"scale": codes.scales, "residual": codes.residual_norms}
        if "bias" in self.side_fields:
            bias = torch.zeros(x.shape[0], device=x.device)
            if self.correction == "center" and base is not None:
                bias = (base * (u - self.quantizer.decode(codes))).sum(1)
            side["bias"] = bias - 0.5 * (x * x).sum(1) if self.metric == "l2" else bias
        out.update({name: side[name].to(dtype) for name, dtype in self.side_fields.items()})
        if self.mode == "prod":
            out["qjl"] = codes.qjl
        if self.fine_quantizer is not None:
            fine = self.fine_quantizer.encode(u)
            out.update(fine_packed=fine.packed, fine_scale=fine.scales)
        return out

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
        self._snap = _Snapshot({k: t[:size] for k, t in self._capacity.items()}, self._ids_capacity[:size],
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

    def _row_lists(self, snap: _Snapshot) -> torch.Tensor:
        """The list of every row ``(size,)`` int64."""
        out = torch.empty(snap.size, dtype=torch.int64, device=self.device)
        for l, rows in enumerate(snap.lists):
            out[rows] = l
        return out

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
        q = as_float_matrix(queries, self.dim, "queries", self.device)
        if rerank is not None:
            rerank = check_positive_int("rerank", rerank)
            if self.fine_quantizer is None:
                raise ValueError("rerank needs an index built with rerank_bits")
        if rerank is None and scan.native_queries(q, self.mode) and self._snap.size and self.centroids is not None:
            return self._search_native(q.numpy(), k, min(nprobe, self.nlist))
        if self.metric == "cosine":
            q = torch.nn.functional.normalize(q, dim=1)
        snap, centroids, center = self._snap, self.centroids, self._center
        nq, depth = q.shape[0], min(k * (rerank or 1), max(1, snap.size))  # never more work than ntotal
        if snap.size == 0 or centroids is None:
            values = torch.full((nq, k), float("-inf"), device=q.device)
            return search_results(self.metric, q, values, torch.full((nq, k), -1, dtype=torch.int64, device=q.device), snap.ids)
        nprobe = min(nprobe, self.nlist)
        qc = q @ centroids.T  # (nq, nlist)
        closeness = qc if self.metric == "ip" else qc - 0.5 * (centroids * centroids).sum(1)
        # ties go to the lower list number, as in the native kernel
        probe = torch.sort(closeness, dim=1, descending=True, stable=True).indices[:, :nprobe]
        if self.encoding == "residual":
            constant = qc
        else:  # one base for every list
            constant = (torch.zeros(nq, 1, device=q.device) if center is None else (q @ center)[:, None]).expand(-1, self.nlist)
        rotated, projected = self.quantizer.rotate_checked(q)
        whole = self._scan_block(snap)
        if scan.native_serves(rotated, whole, self.quantizer.table(self.device)):
            probes = _fastscan.Probes(probe.cpu().numpy(), constant.gather(1, probe).cpu().numpy())
            values, rows = scan.search_lists(rotated, whole, self.quantizer.table(self.device), depth, snap.list_table, probes)
        elif nq == 1 or nq * GATHER_RATIO <= len(torch.unique(probe)):
            values, rows = self._search_gather(snap, rotated, projected, probe, constant, depth)
        else:
            values, rows = self._search_lists(snap, rotated, projected, probe, constant, depth)
        if rerank is not None:
            values, rows = self._rerank(q, snap, rows, min(k, depth))
        return search_results(self.metric, q, values, rows, snap.ids, k=k)

    def _scan_block(self, snap: _Snapshot) -> scan.CodeBlock:
        """The scan's view of all rows of ``snap`` (side fields widened once per snapshot)."""
        if "block" not in snap.cache:
            coded = {name: t for name, t in snap.tensors.items() if not name.startswith("fine")}
            bias = coded["bias"].float() if "bias" in coded else None
            snap.cache["block"] = self.quantizer.code_block(self._codes(coded), bias)
        return snap.cache["block"]

    def _search_native(self, x: np.ndarray, k: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` of validated CPU queries ``x`` ``(nq, dim)`` on a non-empty trained index, in one native
        call (:func:`tqvec.scan.search_queries`: normalizing, probing and rotating happen in the kernel)."""
        snap, centroids, center = self._snap, self.centroids, self._center
        key = (centroids, center)
        if self._query_prep is None or any(a is not b for a, b in zip(self._query_prep[0], key)):
            base = center if self.encoding == "direct" else None
            prep = _fastscan.query_prep(self.quantizer.rotation, self.metric == "cosine", None, centroids,
                                        by_ip=self.metric == "ip", residual=self.encoding == "residual", base=base)
            self._query_prep = (key, prep)
        return scan.search_queries(x, self._scan_block(snap), self.quantizer.table(self.device), self._query_prep[1], k,
                                   snap.ids, self.metric == "l2", snap.list_table, nprobe)

    def _block(self, t: dict[str, torch.Tensor], extra_bias: torch.Tensor) -> scan.CodeBlock:
        """The scan's view of gathered rows ``t``, with ``extra_bias`` ``(n,)`` added to the stored bias."""
        bias = extra_bias if "bias" not in t else t["bias"].float() + extra_bias
        return self.quantizer.code_block(self._codes(t), bias)

    def _search_gather(self, snap: _Snapshot, rotated: torch.Tensor, projected: torch.Tensor | None,
                       probe: torch.Tensor, constant: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query: gather the probed lists' rows and scan them at once. Returns (values, rows) ``(nq, depth)``."""
        nq = rotated.shape[0]
        values = torch.full((nq, depth), float("-inf"), device=rotated.device)
        rows = torch.full((nq, depth), -1, dtype=torch.int64, device=rotated.device)
        table = self.quantizer.table(self.device)
        for i in range(nq):
            lists = probe[i].tolist()
            parts = [snap.lists[l] for l in lists]
            sizes = torch.tensor([len(p) for p in parts], device=rotated.device)
            members = torch.cat(parts)
            if not len(members):
                continue
            t = {name: tensor.index_select(0, members) for name, tensor in snap.tensors.items() if not name.startswith("fine")}
            extra = torch.repeat_interleave(constant[i, probe[i]], sizes)
            v, r = scan.search(rotated[i:i + 1], self._block(t, extra), table, depth,
                               None if projected is None else projected[i:i + 1])
            values[i], rows[i] = v[0], torch.where(r[0] >= 0, members[r[0].clamp_min(0)].long(), -1)
        return values, rows

    def _search_lists(self, snap: _Snapshot, rotated: torch.Tensor, projected: torch.Tensor | None,
                      probe: torch.Tensor, constant: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """List by list: every probed list is scanned once for all its queries, its results merged at once into
        each query's running top-``depth`` (memory ``nq × depth``, not ``nq × nprobe × depth``)."""
        nq, nprobe = probe.shape
        table = self.quantizer.table(self.device)
        best_v = torch.full((nq, depth), float("-inf"), device=rotated.device)
        best_r = torch.full((nq, depth), -1, dtype=torch.int64, device=rotated.device)
        flat = probe.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.nlist).tolist()
        start = 0
        for l, c in enumerate(counts):
            if not c:
                continue
            pairs = order[start:start + c]
            start += c
            members = snap.lists[l]
            if not len(members):
                continue
            qi = pairs // nprobe  # distinct: a query probes a list at most once
            t = {name: tensor.index_select(0, members) for name, tensor in snap.tensors.items() if not name.startswith("fine")}
            bias = torch.zeros(len(members), device=rotated.device)
            v, r = scan.search(rotated[qi], self._block(t, bias), table, depth, None if projected is None else projected[qi])
            merged_v = torch.cat([best_v[qi], v + constant[qi, l][:, None]], dim=1)
            merged_r = torch.cat([best_r[qi], torch.where(r >= 0, members[r.clamp_min(0)].long(), -1)], dim=1)
            top, pos = torch.topk(merged_v, depth, dim=1)
            best_v[qi], best_r[qi] = top, torch.gather(merged_r, 1, pos)
        return best_v, best_r.masked_fill(best_v == float("-inf"), -1)

    def _rerank(self, q: torch.Tensor, snap: _Snapshot, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rescore candidate ``rows`` ``(nq, R·k)`` against their decoded fine vectors; keep the best ``k``."""
        flat = rows.clamp_min(0).reshape(-1)
        fine = self.fine_quantizer.decode(Codes(snap.tensors["fine_packed"][flat], snap.tensors["fine_scale"][flat]))
        base = self._bases(self._row_lists_of(snap, flat))
        x = (fine if base is None else fine + base).view(*rows.shape, self.dim)
        values = torch.einsum("qd,qcd->qc", q, x)
        if self.metric == "l2":
            values = values - 0.5 * (x * x).sum(-1)
        values = values.masked_fill(rows < 0, float("-inf"))
        top, pos = torch.topk(values, k, dim=1)
        return top, torch.gather(rows, 1, pos).masked_fill(top == float("-inf"), -1)

    def _row_lists_of(self, snap: _Snapshot, rows: torch.Tensor) -> torch.Tensor:
        """The list of each of ``rows`` (only needed for residual bases)."""
        if self.encoding == "direct":
            return torch.zeros_like(rows)
        return self._row_lists(snap)[rows]

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
        ``FileNotFoundError`` if there is none. A mapped file must not be truncated while in use (SIGBUS).
        """
        meta, arrays = storage.load_arrays(path, FILE_KIND, mmap=mmap)
        if meta.get("version") != FILE_VERSION:
            raise storage.StorageError(f"{path}: unsupported index version {meta.get('version')!r}")
        try:
            ids, lists, centroids, center = _check_file(meta, arrays)
            index = cls(meta["dim"], meta["nlist"], meta["bits"], meta["metric"], meta["mode"], meta["encoding"],
                        meta["seed"], meta["rotation"], meta["correction"], meta["rerank_bits"], meta["nprobe"], device)
            arrays = {name: a for name, a in arrays.items() if name not in ("ids", "lists", "centroids", "center")}
            index._check_loaded(arrays, ids, center)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                tensors = {name: torch.as_tensor(arr).to(device) for name, arr in arrays.items()}
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, storage.StorageError):
                raise
            raise storage.StorageError(f"{path}: inconsistent index file ({err})") from err
        index.centroids = None if centroids is None else torch.as_tensor(np.array(centroids, np.float32)).to(device)
        index._center = None if center is None else torch.as_tensor(np.array(center, np.float32)).to(device)
        index._center_pending = meta["center_pending"]
        index._next_id = meta["next_id"]
        index._reset_rows(tensors, np.asarray(ids, np.int64), torch.as_tensor(np.array(lists, np.int64)).to(device))
        return index

    def _check_loaded(self, arrays: dict[str, np.ndarray], ids: np.ndarray, center: np.ndarray | None) -> None:
        """Row ``arrays`` of a file against this (freshly built) configuration; ``ValueError`` on any mismatch."""
        check_rows(arrays, self._empty_tensors(), len(ids))
        if center is not None and not (self.encoding == "direct" and self.correction == "center"):
            raise ValueError("a center is stored, but only direct encoding with correction='center' uses one")


def _check_file(meta: dict, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                    np.ndarray | None]:
    """Header fields and arrays of an ``IVFIndex`` file, checked against each other before the index is built
    (``ValueError``). Returns ``(ids, lists, centroids, center)``."""
    dim = check_positive_int("dim", check_meta(meta, "dim", int))
    nlist = check_positive_int("nlist", check_meta(meta, "nlist", int))
    check_positive_int("nprobe", check_meta(meta, "nprobe", int))
    bits = check_bits(check_meta(meta, "bits", (int, float)))
    for name in ("metric", "mode", "encoding", "rotation", "correction"):
        check_meta(meta, name, str)
    check_seed(check_meta(meta, "seed", int))
    check_meta(meta, "rerank_bits", (int, float, type(None)))
    pending = check_meta(meta, "center_pending", bool)
    ids = check_array(arrays, "ids", "<i8", (None,))
    check_file_ids(ids, check_meta(meta, "next_id", int))
    lists = check_array(arrays, "lists", "<i4", (len(ids),))
    if len(lists) and (int(lists.min()) < 0 or int(lists.max()) >= nlist):
        raise ValueError(f"list numbers must lie in [0, {nlist})")
    check_row_budget(arrays, ("packed", "qjl", *SIDE_NAMES), dim, bits)
    centroids = None
    if "centroids" in arrays:
        centroids = check_array(arrays, "centroids", "<f4", (nlist, dim), bound=math.sqrt(MAX_SQUARED_NORM))
        check_row_norms(torch.from_numpy(np.array(centroids)), "centroids")
    elif len(ids):
        raise ValueError("vectors without centroids")
    center = None
    if "center" in arrays:
        center = check_array(arrays, "center", "<f4", (dim,), bound=math.sqrt(MAX_SQUARED_NORM))
        check_row_norms(torch.from_numpy(np.array(center, np.float32)).reshape(1, -1), "center")
        if pending:
            raise ValueError("a stored center while center_pending is set")
    if pending and len(ids):
        raise ValueError("center_pending is set but the file holds vectors")
    return ids, lists, centroids, center
