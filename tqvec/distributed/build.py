"""``build_shards``: bulk-encode a collection into a :class:`~tqvec.distributed.ShardedIndex` directory
with Ray Data (package docstring: identical scores; :mod:`~tqvec.distributed.manifest`: files).
"""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from .. import storage
from ..index import FILE_KIND, Index
from ..validation import as_float_matrix, as_ids, check_choice, check_positive_int
from .manifest import BUILD_PREFIX, commit, file_entry, remove_stale, shard_file_name, writer_lock
from .routing import ROUTINGS, route
from .settings import IndexSettings

#: CPUs reserved per encoder actor of :func:`build_shards` (each runs one torch thread). Below 1 so that
#: ``workers`` = the cluster's CPUs leaves room for Ray Data's file listing and read tasks (else: deadlock)
ENCODER_CPUS = 0.5


def build_shards(
    source_files: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    settings: IndexSettings,
    n_shards: int,
    *,
    routing: str = "hash",
    center: Any = None,
    id_column: str = "id",
    vector_column: str = "vector",
    rows_per_task: int = 65536,
    workers: int | None = None,
) -> dict[str, Any]:
    """Encode a collection into a :class:`ShardedIndex` directory with Ray Data; returns the manifest.

    ``map_batches`` runs the encoders, each writing, per batch, one part file per shard into a work folder
    inside ``out_dir``; one Ray task per shard then concatenates its parts into the shard file. Encodings
    equal those of one ``Index`` with the same settings (and center). Only plain ``Index`` shards.

    Parameters
    ----------
    source_files : sequence of path-like
        Parquet files with an int64 ``id_column`` and a ``vector_column`` of ``dim`` floats per row, or ``.npy``
        files of ``(n, dim)`` floats whose ids are the global row numbers (files in the given order).
    out_dir : path-like
        The directory to write (created if missing); held under its writer lock throughout.
    settings : IndexSettings
        The configuration of every shard's ``Index``.
    n_shards : int
        Number of shards, ≥ 1.
    routing : {"hash", "round_robin"}
        ``"round_robin"`` for ``.npy`` sources only.
    center : array-like of shape (dim,), optional
        The centering vector to freeze (e.g. ``Index.center`` of a reference index) when
        ``settings.correction == "center"``; None: the mean of all vectors, in one extra pass.
    id_column, vector_column : str
        The Parquet columns of the ids and the vectors.
    rows_per_task : int
        Rows per encoder batch, ≥ 1.
    workers : int, optional
        Encoder actors (default: the cluster's CPUs).

    Returns
    -------
    dict
        The manifest written (:func:`read_manifest` reads it back).

    Raises
    ------
    ValueError
        Bad arguments, bad source shapes, an id that occurs twice, or more ``workers`` than the cluster's CPUs can run
        beside a read task (Ray Data would wait forever).
    TimeoutError
        Another writer holds ``out_dir``.

    Examples
    --------
    >>> build_shards(["a.npy", "b.npy"], "out", IndexSettings(384), 4)  # doctest: +SKIP
    """
    files = [Path(f).resolve() for f in source_files]
    kinds = {f.suffix for f in files}
    if not files or kinds not in ({".parquet"}, {".npy"}):
        raise ValueError(f"source_files must be all .parquet or all .npy files, got suffixes {sorted(kinds)}")
    if not isinstance(settings, IndexSettings):
        raise ValueError(f"settings must be IndexSettings, got {type(settings).__name__}")
    n_shards = check_positive_int("n_shards", n_shards)
    rows_per_task = check_positive_int("rows_per_task", rows_per_task)
    check_choice("routing", routing, ROUTINGS)
    if center is not None:
        if settings.correction != "center":
            raise ValueError(f"center= needs a centering correction; the settings have {settings.correction!r}")
        center = as_float_matrix(np.asarray(center).reshape(1, -1), settings.dim, "center").numpy()[0]
    if not ray.is_initialized():
        ray.init()
    cpus = float(ray.cluster_resources().get("CPU", 1))
    workers = workers or max(1, int(cpus))
    if workers * ENCODER_CPUS + 1 > cpus:  # Ray Data would wait for CPUs forever
        raise ValueError(f"workers={workers}: {workers} encoders ({ENCODER_CPUS:g} CPU each) and Ray Data's read task "
                         f"(1 CPU) need {workers * ENCODER_CPUS + 1:g} CPUs, the Ray cluster has {cpus:g}: pass fewer "
                         "workers, or give Ray at least 2 CPUs")
    ds = _read_parquet(files, id_column, vector_column, routing) if kinds == {".parquet"} \
        else _read_npy(files, settings.dim, rows_per_task)
    if settings.correction == "center" and center is None:
        center = _mean(ds, settings.metric)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with writer_lock(out, timeout=0):
        remove_stale(out)
        work = Path(tempfile.mkdtemp(prefix=BUILD_PREFIX, dir=out))
        token = secrets.token_hex(4)
        files = [out / shard_file_name(s, token) for s in range(n_shards)]
        try:
            return _encode_and_commit(ds, settings, center, routing, rows_per_task, workers, work, files)
        except BaseException:
            for f in files:
                f.unlink(missing_ok=True)
            raise
        finally:
            shutil.rmtree(work)


def _encode_and_commit(ds: ray.data.Dataset, settings: IndexSettings, center: np.ndarray | None, routing: str,
                       rows_per_task: int, workers: int, work: Path, files: list[Path]) -> dict[str, Any]:
    """Encode ``ds`` into part files in ``work``, merge them into the shard ``files`` (one per shard) and
    commit them to their directory."""
    n_shards = len(files)
    empty = work / "empty.tqv"
    settings.new_index(center).save(empty)
    parts: list[list[str]] = [[] for _ in range(n_shards)]
    encoded = ds.map_batches(_EncodeParts, batch_size=rows_per_task, batch_format="numpy", concurrency=workers,
                             num_cpus=ENCODER_CPUS, fn_constructor_kwargs={"empty": str(empty), "parts_dir": str(work),
                                                                           "n_shards": n_shards, "routing": routing})
    for row in encoded.iter_rows():
        parts[int(row["shard"])].append(str(row["path"]))
    merge = ray.remote(_merge_parts)
    entries = ray.get([merge.remote(str(empty), parts[s], str(f)) for s, f in enumerate(files)])
    next_id = max((e.pop("next_id") for e in entries), default=0)
    config = {"dim": settings.dim, "n_shards": n_shards, "routing": routing, "index": settings.as_dict(),
              "next_id": next_id, "index_class": f"{Index.__module__}.{Index.__qualname__}"}
    return commit(files[0].parent, config, entries)


def _read_parquet(files: list[Path], id_column: str, vector_column: str, routing: str) -> ray.data.Dataset:
    """Rows ``{"id": int64, "vector": (dim,) float}`` of Parquet files."""
    if routing == "round_robin":
        raise ValueError("Parquet sources carry their own ids: use routing='hash' (round_robin numbers rows itself)")
    ds = ray.data.read_parquet([str(f) for f in files]).select_columns([id_column, vector_column])
    return ds.map_batches(_columns, batch_format="numpy", fn_kwargs={"id_column": id_column, "vector_column": vector_column})


def _columns(batch: dict[str, np.ndarray], id_column: str, vector_column: str) -> dict[str, np.ndarray]:
    """Rename to ``id`` / ``vector`` and stack list-of-float cells into ``(n, dim)``."""
    vectors = batch[vector_column]
    if vectors.dtype == object:
        vectors = np.stack(vectors) if len(vectors) else np.zeros((0, 0), np.float32)
    return {"id": as_ids(batch[id_column], name=id_column), "vector": vectors}


def _read_npy(files: list[Path], dim: int, rows_per_task: int) -> ray.data.Dataset:
    """Rows ``{"id", "vector"}`` of ``.npy`` files, read by row range (ids = global row numbers)."""
    items, first = [], 0
    for f in files:
        x = np.load(f, mmap_mode="r")
        if x.ndim != 2 or x.shape[1] != dim or x.dtype.kind != "f":
            raise ValueError(f"{f}: expected (n, {dim}) floats, got {x.dtype} {x.shape}")
        items += [{"path": str(f), "start": a, "stop": min(a + rows_per_task, len(x)), "first_id": first + a}
                  for a in range(0, len(x), rows_per_task)]
        first += len(x)
    return ray.data.from_items(items).map_batches(_npy_rows, batch_size=1, batch_format="numpy")


def _npy_rows(item: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rows ``[start, stop)`` of one ``.npy`` file (memory-mapped: only they are read)."""
    start, stop, first = int(item["start"][0]), int(item["stop"][0]), int(item["first_id"][0])
    x = np.array(np.load(item["path"][0], mmap_mode="r")[start:stop])
    return {"id": np.arange(first, first + len(x), dtype=np.int64), "vector": x}


def _mean(ds: ray.data.Dataset, metric: str) -> np.ndarray:
    """Mean ``(dim,)`` float32 of all vectors, as ``Index`` sees them (normalized for cosine), in float64."""
    def partial_sum(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = torch.from_numpy(np.ascontiguousarray(batch["vector"], np.float32))
        if metric == "cosine":
            x = torch.nn.functional.normalize(x, dim=1)
        return {"sum": x.double().sum(0).numpy()[None], "n": np.array([len(x)])}

    sums = ds.map_batches(partial_sum, batch_format="numpy").take_all()
    n = sum(int(r["n"]) for r in sums)
    if n == 0:
        raise ValueError("the source files hold no vectors")
    return (sum(np.asarray(r["sum"]) for r in sums) / n).astype(np.float32)


class _EncodeParts:
    """Ray Data encoder: per batch, one part file (an ``Index`` file) per shard that the batch touches."""

    def __init__(self, empty: str, parts_dir: str, n_shards: int, routing: str) -> None:
        self.index = Index.load(empty)  # reused: emptied after each part, center stays frozen
        self.parts_dir, self.n_shards, self.routing = Path(parts_dir), n_shards, routing

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids, x = as_ids(batch["id"]), batch["vector"]
        shards, paths, counts = [], [], []
        for s, rows in route(ids, self.n_shards, self.routing).items():
            path = self.parts_dir / f"part-{s:05d}-{secrets.token_hex(8)}.tqv"
            self.index.add(x[rows], ids[rows])
            self.index.save(path)
            self.index.remove(ids[rows])
            shards.append(s), paths.append(str(path)), counts.append(len(rows))
        return {"shard": np.array(shards, np.int64), "path": np.array(paths), "count": np.array(counts, np.int64)}


def _merge_parts(empty: str, parts: list[str], out: str) -> dict[str, Any]:
    """Concatenate part files (``Index`` files of one configuration) into shard file ``out``.

    Arrays with zero rows in the empty index ``empty`` are per-vector; the others (the center) must be
    equal everywhere. Returns the manifest entry plus ``next_id``.
    """
    meta, base = storage.load_arrays(empty, FILE_KIND)
    per_row = [name for name, a in base.items() if a.ndim and a.shape[0] == 0]
    arrays = {name: [a] for name, a in base.items() if name in per_row}
    for part in parts:
        part_meta, part_arrays = storage.load_arrays(part, FILE_KIND, mmap=True)
        same = (set(part_arrays) == set(base)
                and {k: v for k, v in part_meta.items() if k != "next_id"} == {k: v for k, v in meta.items() if k != "next_id"}
                and all(np.array_equal(part_arrays[n], a) for n, a in base.items() if n not in per_row))
        if not same:
            raise storage.StorageError(f"{part}: part file of another configuration")
        for name in per_row:
            arrays[name].append(part_arrays[name])
    merged = {name: np.concatenate(chunks) for name, chunks in arrays.items()}
    merged.update({name: a for name, a in base.items() if name not in per_row})
    ids = merged["ids"]
    if len(np.unique(ids)) != len(ids):
        values, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"{out}: id {int(values[counts > 1][0])} occurs more than once in the source files")
    next_id = max(0, int(ids.max()) + 1) if len(ids) else 0
    storage.save_arrays(out, FILE_KIND, dict(meta, next_id=next_id), merged)
    return dict(file_entry(Path(out), len(ids)), next_id=next_id)
