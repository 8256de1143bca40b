"""The torch search of :class:`~tqvec.ivf.IVFIndex`: the reference path, and the one that serves CUDA indexes, QJL
codes (``mode="prod"``) and ``rerank``. Coarse probing and per-list constants in torch, then the probed lists'
rows scanned through :mod:`tqvec.scan`: one native call on the CPU where it serves the codes, else per query
(the probed lists' rows gathered and scanned at once) or, for many queries, list by list (each probed list
scanned once for all the queries that probe it, merged into each query's running top-k)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from . import _fastscan, scan
from ._rows import search_results
from .quantizer import Codes

if TYPE_CHECKING:
    from ._rows import ListSnapshot
    from .ivf import IVFIndex

#: coarse scores (queries × lists) made and sorted at once while probing (buffers allocated once per search:
#: allocating them per block of queries fragmented the heap, +200 MiB of RSS at nq = 10k, nlist 8192)
PROBE_BLOCK_SCORES = 1 << 20
#: the one-query-at-a-time strategy is used while ``nq · GATHER_RATIO ≤`` the number of distinct probed lists
GATHER_RATIO = 4


def search_torch(index: IVFIndex, q: torch.Tensor, k: int, nprobe: int,
                 rerank: int | None) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`IVFIndex.search` of validated queries ``q`` ``(nq, dim)`` on the index's device, through :mod:`tqvec.scan`
    (Triton kernels on CUDA; on the CPU the native list scan where it serves the codes, else the torch strategies:
    per query, or list by list for many queries)."""
    if index.metric == "cosine":
        q = torch.nn.functional.normalize(q, dim=1)
    snap, centroids = index._snap, index.centroids
    nq, depth = q.shape[0], min(k * (rerank or 1), max(1, snap.size))  # never more work than ntotal
    if snap.size == 0 or centroids is None:
        values = torch.full((nq, k), float("-inf"), device=q.device)
        return search_results(index.metric, q, values, torch.full((nq, k), -1, dtype=torch.int64, device=q.device), snap.ids)
    probe, constant = probe_lists(index, q, min(nprobe, index.nlist))
    rotated, projected = index.quantizer.rotate_checked(q)
    whole = index._scan_block(snap)
    if scan.native_serves(rotated, whole, index.quantizer.table(index.device)):
        probes = _fastscan.Probes(probe.cpu().numpy(), constant.cpu().numpy())
        values, rows = scan.search_lists(rotated, whole, index.quantizer.table(index.device), depth,
                                         index._native_lists(snap), probes)
    elif nq == 1 or nq * GATHER_RATIO <= len(torch.unique(probe)):
        values, rows = search_gather(index, snap, rotated, projected, probe, constant, depth)
    else:
        values, rows = search_lists(index, snap, rotated, projected, probe, constant, depth)
    if rerank is not None:
        values, rows = rerank_rows(index, q, snap, rows, min(k, depth))
    return search_results(index.metric, q, values, rows, snap.ids, k=k)


def probe_lists(index: IVFIndex, q: torch.Tensor, nprobe: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``nprobe`` closest lists, ``(nq, nprobe)`` int64 (ties to the lower list, as in the native
    kernel), and the constant each adds to the scores of its rows, ``(nq, nprobe)`` float32 (⟨q, centroid⟩ for
    residual codes, else ⟨q, center⟩ or 0). Coarse scores are made and sorted for blocks of queries in buffers
    of :data:`PROBE_BLOCK_SCORES` entries allocated once, never ``nq × nlist`` at once."""
    centroids, center, nq = index.centroids, index._center, q.shape[0]
    half_norms = None if index.metric == "ip" else 0.5 * (centroids * centroids).sum(1)
    rows = max(1, min(nq, PROBE_BLOCK_SCORES // index.nlist))
    scores = torch.empty(rows, index.nlist, device=q.device)
    closeness = None if half_norms is None else torch.empty_like(scores)
    ordered = (torch.empty(rows, index.nlist, device=q.device),
               torch.empty(rows, index.nlist, dtype=torch.int64, device=q.device))
    probe = torch.empty(nq, nprobe, dtype=torch.int64, device=q.device)
    constant = torch.zeros(nq, nprobe, device=q.device)
    for start in range(0, nq, rows):
        m = min(rows, nq - start)
        coarse = torch.matmul(q[start:start + m], centroids.T, out=scores[:m])
        close = coarse if half_norms is None else torch.sub(coarse, half_norms, out=closeness[:m])
        torch.sort(close, dim=1, descending=True, stable=True, out=(ordered[0][:m], ordered[1][:m]))
        probe[start:start + m] = ordered[1][:m, :nprobe]
        if index.encoding == "residual":
            torch.gather(coarse, 1, probe[start:start + m], out=constant[start:start + m])
        elif center is not None:
            constant[start:start + m] = (q[start:start + m] @ center)[:, None]
    return probe, constant


def block(index: IVFIndex, t: dict[str, torch.Tensor], extra_bias: torch.Tensor) -> scan.CodeBlock:
    """The scan's view of gathered rows ``t``, with ``extra_bias`` ``(n,)`` added to the stored bias."""
    bias = extra_bias if "bias" not in t else t["bias"].float() + extra_bias
    return index.quantizer.code_block(index._codes(t), bias)


def search_gather(index: IVFIndex, snap: ListSnapshot, rotated: torch.Tensor, projected: torch.Tensor | None,
                   probe: torch.Tensor, constant: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query: gather the probed lists' rows and scan them at once (``constant``: :func:`probe_lists`'s, one per
    probe). Returns (values, rows) ``(nq, depth)``."""
    nq = rotated.shape[0]
    values = torch.full((nq, depth), float("-inf"), device=rotated.device)
    rows = torch.full((nq, depth), -1, dtype=torch.int64, device=rotated.device)
    table = index.quantizer.table(index.device)
    for i in range(nq):
        lists = probe[i].tolist()
        parts = [snap.lists[l] for l in lists]
        sizes = torch.tensor([len(p) for p in parts], device=rotated.device)
        members = torch.cat(parts)
        if not len(members):
            continue
        t = {name: tensor.index_select(0, members) for name, tensor in snap.tensors.items() if not name.startswith("fine")}
        extra = torch.repeat_interleave(constant[i], sizes)
        v, r = scan.search(rotated[i:i + 1], block(index, t, extra), table, depth,
                           None if projected is None else projected[i:i + 1])
        values[i], rows[i] = v[0], torch.where(r[0] >= 0, members[r[0].clamp_min(0)].long(), -1)
    return values, rows


def search_lists(index: IVFIndex, snap: ListSnapshot, rotated: torch.Tensor, projected: torch.Tensor | None,
                  probe: torch.Tensor, constant: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """List by list: every probed list is scanned once for all its queries, its results merged at once into
    each query's running top-``depth`` (memory ``nq × depth``, not ``nq × nprobe × depth``; ``constant``: one per
    probe, as :func:`probe_lists` gives)."""
    nq, nprobe = probe.shape
    table = index.quantizer.table(index.device)
    best_v = torch.full((nq, depth), float("-inf"), device=rotated.device)
    best_r = torch.full((nq, depth), -1, dtype=torch.int64, device=rotated.device)
    flat = probe.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=index.nlist).tolist()
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
        v, r = scan.search(rotated[qi], block(index, t, bias), table, depth, None if projected is None else projected[qi])
        merged_v = torch.cat([best_v[qi], v + constant.flatten()[pairs][:, None]], dim=1)
        merged_r = torch.cat([best_r[qi], torch.where(r >= 0, members[r.clamp_min(0)].long(), -1)], dim=1)
        top, pos = torch.topk(merged_v, depth, dim=1)
        best_v[qi], best_r[qi] = top, torch.gather(merged_r, 1, pos)
    return best_v, best_r.masked_fill(best_v == float("-inf"), -1)


def rerank_rows(index: IVFIndex, q: torch.Tensor, snap: ListSnapshot, rows: torch.Tensor,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescore candidate ``rows`` ``(nq, R·k)`` against their decoded fine vectors; keep the best ``k``."""
    flat = rows.clamp_min(0).reshape(-1)
    fine = index.fine_quantizer.decode(Codes(snap.tensors["fine_packed"][flat], snap.tensors["fine_scale"][flat]))
    base = index._bases(row_lists_of(index, snap, flat))
    x = (fine if base is None else fine + base).view(*rows.shape, index.dim)
    values = torch.einsum("qd,qcd->qc", q, x)
    if index.metric == "l2":
        values = values - 0.5 * (x * x).sum(-1)
    values = values.masked_fill(rows < 0, float("-inf"))
    top, pos = torch.topk(values, k, dim=1)
    return top, torch.gather(rows, 1, pos).masked_fill(top == float("-inf"), -1)


def row_lists_of(index: IVFIndex, snap: ListSnapshot, rows: torch.Tensor) -> torch.Tensor:
    """The list of each of ``rows`` (only needed for residual bases)."""
    if index.encoding == "direct":
        return torch.zeros_like(rows)
    return index._row_lists(snap)[rows]
