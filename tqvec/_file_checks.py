"""Header and array checks of :class:`~tqvec.index.Index` and :class:`~tqvec.ivf.IVFIndex` files, run before an
index is built from them: every inconsistency raises ``ValueError`` (the loaders report it as a
:class:`~tqvec.storage.StorageError` naming the file)."""
from __future__ import annotations

import math

import numpy as np

from ._rows import SIDE_NAMES
from .validation import (
    MAX_SQUARED_NORM,
    check_array,
    check_array_norms,
    check_bits,
    check_file_ids,
    check_meta,
    check_positive_int,
    check_row_budget,
    check_seed,
)


def _common(meta: dict, arrays: dict[str, np.ndarray], strings: tuple[str, ...]) -> tuple[int, float, bool, np.ndarray]:
    """The fields both kinds share: ``(dim, bits, center_pending, ids)``."""
    dim = check_positive_int("dim", check_meta(meta, "dim", int))
    bits = check_bits(check_meta(meta, "bits", (int, float)))
    for name in strings:
        check_meta(meta, name, str)
    check_seed(check_meta(meta, "seed", int))
    check_meta(meta, "rerank_bits", (int, float, type(None)))
    pending = check_meta(meta, "center_pending", bool)
    ids = check_array(arrays, "ids", "<i8", (None,))
    check_file_ids(ids, check_meta(meta, "next_id", int))
    return dim, bits, pending, ids


def _float_rows(arrays: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A stored float32 vector or matrix whose rows must be valid inputs (finite, norms within range)."""
    values = check_array(arrays, name, "<f4", shape, bound=math.sqrt(MAX_SQUARED_NORM))
    check_array_norms(values.reshape(-1, shape[-1]), name)
    return values


def _center(arrays: dict[str, np.ndarray], dim: int, pending: bool, n: int) -> np.ndarray | None:
    """The stored centering vector, if any, consistent with ``center_pending`` and the ``n`` stored vectors."""
    center = None
    if "center" in arrays:
        center = _float_rows(arrays, "center", (dim,))
        if pending:
            raise ValueError("a stored center while center_pending is set")
    if pending and n:
        raise ValueError("center_pending is set but the file holds vectors")
    return center


def check_index_file(meta: dict, arrays: dict[str, np.ndarray], has_tail_bits: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """An ``Index`` file (``has_tail_bits``: its version records ``tail_bits``). Returns ``(ids, center)``."""
    dim, bits, pending, ids = _common(meta, arrays, ("metric", "mode", "rotation", "correction"))
    if has_tail_bits:
        check_meta(meta, "tail_bits", int)
    check_row_budget(arrays, ("packed", "qjl", *SIDE_NAMES), dim, bits)
    center = _center(arrays, dim, pending, len(ids))
    if center is None and meta["correction"] == "center" and not pending and len(ids):
        raise ValueError("rows encoded against a center that the file lacks")
    return ids, center


def check_ivf_file(meta: dict, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                      np.ndarray | None]:
    """An ``IVFIndex`` file. Returns ``(ids, lists, centroids, center)``."""
    dim, bits, pending, ids = _common(meta, arrays, ("metric", "mode", "encoding", "rotation", "correction"))
    nlist = check_positive_int("nlist", check_meta(meta, "nlist", int))
    check_positive_int("nprobe", check_meta(meta, "nprobe", int))
    lists = check_array(arrays, "lists", "<i4", (len(ids),))
    if len(lists) and (int(lists.min()) < 0 or int(lists.max()) >= nlist):
        raise ValueError(f"list numbers must lie in [0, {nlist})")
    check_row_budget(arrays, ("packed", "qjl", *SIDE_NAMES), dim, bits)
    centroids = None
    if "centroids" in arrays:
        centroids = _float_rows(arrays, "centroids", (nlist, dim))
    elif len(ids):
        raise ValueError("vectors without centroids")
    return ids, lists, centroids, _center(arrays, dim, pending, len(ids))
