"""``ShardedIndex``: one tqvec index per Ray actor, scatter-gather search; ``build_shards``: bulk encoding
with Ray Data. Needs the ``ray`` extra (``pip install "tqvec[ray]"``).

Routing. Every id lives on exactly one shard, computed from the id alone, so ``remove`` and
``reconstruct`` go straight to it: ``routing="hash"`` puts id ``i`` on shard ``splitmix64(i) mod n``
(stable across processes and versions, unlike Python's ``hash``); ``routing="round_robin"`` assigns
consecutive ids itself and puts id ``i`` on shard ``i mod n`` (round-robin in insertion order).

Identical scores. A sharded search returns the scores that one :class:`~tqvec.index.Index` with the same
settings returns over the same data, bit for bit, and the same ids except where scores tie exactly
(duplicate vectors: their order is unspecified in ``Index`` too; KJV, 260 duplicate rows: 98.9 % of ids
in the same place, every score equal). Every shard encodes with the same ``seed``, hence the same
rotation and codebook, and, where the correction centers, with the same frozen center.
:class:`ShardedIndex` computes that center exactly as ``Index`` does, as the mean of its first non-empty
``add`` call, and hands it to every shard; :func:`build_shards` takes it as ``center=`` (for instance
``Index.center`` of an index built earlier) or computes the mean of all the data in one extra pass.
Shards made by an ``index_factory`` (e.g. an IVF index) freeze whatever they freeze from their own data.

Files. A saved index is a directory: ``manifest.json`` (written atomically: config, and per shard its
file, size, vector count and the SHA-256 that ends the file) and one :meth:`Index.save` file per shard,
``shard-<shard>-<save token>.tqv``. A save writes new files, then switches the manifest, then deletes the
files of the previous save: a crash at any point leaves a loadable directory.

Failures. Each shard actor runs with Ray's ``max_restarts``; a restarted actor reloads its shard from
the file that its directory's manifest names (or starts empty if it was never saved; the first ``save``
to a directory re-creates the actors from there). ``search``, ``len`` and ``reconstruct`` retry a shard
that is down until ``timeout`` seconds have passed, then raise :class:`ShardError` naming it. A restart
that lost changes made since the last save (every reply carries a token drawn at actor start and the name
of the file loaded) makes the shard *lost*: searches raise ``ShardError``, and ``save`` refuses, until
the index is reloaded with :meth:`ShardedIndex.load`. ``search(...,
allow_partial=True)`` returns the merged answer of the shards that answered, plus the missing ones.
``add``, ``remove`` and ``save`` are not retried (a retry could apply twice); a failing shard raises
``ShardError``, and ``add``/``remove`` are not atomic across shards (other shards keep their part).
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from . import storage
from .index import FILE_KIND, Index
from .validation import as_float_matrix, as_ids, check_choice, check_positive_int

MANIFEST = "manifest.json"
MANIFEST_KIND = "tqvec.ShardedIndex"
MANIFEST_VERSION = 1
ROUTINGS = ("hash", "round_robin")
_SHARD_FILE = re.compile(r"shard-\d{5}-[0-9a-f]{8}\.tqv")
#: CPUs reserved per encoder actor of :func:`build_shards` (each runs one torch thread). Below 1 so that
#: ``workers`` = the cluster's CPUs leaves room for Ray Data's file listing and read tasks (else: deadlock)
ENCODER_CPUS = 0.5
Epoch = tuple[str, "str | None"]  # (token of one actor start, the shard file it loaded)
_DIGEST_SIZE = 32  # the SHA-256 that ends every tqvec.storage file


class ShardError(RuntimeError):
    """One or more shards could not answer or lost data; ``shards`` holds their numbers."""

    def __init__(self, message: str, shards: Sequence[int]) -> None:
        super().__init__(message)
        self.shards = tuple(sorted(shards))


# ---------------------------------------------------------------------------------------- routing


def splitmix64(ids: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer of each int64 id (as uint64, two's complement): ``(n,)`` uint64."""
    z = np.asarray(ids, np.int64).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def shard_of(ids: np.ndarray, n_shards: int, routing: str = "hash") -> np.ndarray:
    """Shard number ``(n,)`` int64 of each id (module docstring: routing)."""
    ids = np.asarray(ids, np.int64)
    if routing == "round_robin":
        return ids % n_shards
    return (splitmix64(ids) % np.uint64(n_shards)).astype(np.int64)


# ---------------------------------------------------------------------------------------- files


def _write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`tqvec.storage.write_atomic`)."""
    text = json.dumps(obj, indent=1, allow_nan=False).encode("utf-8")
    storage.write_atomic(path, lambda f: f.write(text))


def _file_entry(path: Path, count: int) -> dict[str, Any]:
    """Manifest entry of a shard file: name, size, vector count and its trailing SHA-256."""
    with open(path, "rb") as f:
        f.seek(-_DIGEST_SIZE, os.SEEK_END)
        digest = f.read(_DIGEST_SIZE).hex()
    return {"file": path.name, "bytes": path.stat().st_size, "count": int(count), "sha256": digest}


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The checked manifest of a saved :class:`ShardedIndex` directory (raises ``StorageError``)."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as err:
        raise storage.StorageError(f"{path}: unreadable manifest ({err})") from err
    ok = (isinstance(manifest, dict) and manifest.get("kind") == MANIFEST_KIND
          and isinstance(manifest.get("config"), dict) and isinstance(manifest.get("shards"), list))
    if not ok:
        raise storage.StorageError(f"{path}: not a {MANIFEST_KIND} manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise storage.StorageError(f"{path}: unsupported manifest version {manifest.get('version')!r}")
    config = manifest["config"]
    if len(manifest["shards"]) != config.get("n_shards"):
        raise storage.StorageError(f"{path}: {len(manifest['shards'])} shard entries for n_shards="
                                   f"{config.get('n_shards')!r}")
    for s, entry in enumerate(manifest["shards"]):
        if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and _SHARD_FILE.fullmatch(entry["file"])):
            raise storage.StorageError(f"{path}: corrupt entry for shard {s}: {entry!r}")
    return manifest


def _commit(directory: Path, config: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Switch ``directory`` to the shard files of ``entries`` (manifest written atomically), then delete the
    shard files of earlier saves. Returns the manifest."""
    manifest = {"kind": MANIFEST_KIND, "version": MANIFEST_VERSION, "config": config, "shards": entries}
    _write_json_atomic(directory / MANIFEST, manifest)
    keep = {entry["file"] for entry in entries}
    for old in directory.iterdir():
        if _SHARD_FILE.fullmatch(old.name) and old.name not in keep:
            old.unlink()
    return manifest


def _last_line(err: BaseException) -> str:
    """The last non-empty line of an error's message (Ray puts the cause there, after a traceback)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(err).__name__


def _check_shard_file(directory: Path, shard: int, entry: dict[str, Any]) -> Path:
    """The path of ``shard``'s file after checking its size and trailing SHA-256 against the manifest."""
    path = directory / entry["file"]
    found = _file_entry(path, entry["count"])  # FileNotFoundError if missing
    if (found["bytes"], found["sha256"]) != (entry.get("bytes"), entry.get("sha256")):
        raise storage.StorageError(f"shard {shard}: {path} does not match the manifest (size {found['bytes']} vs "
                                   f"{entry.get('bytes')}, or checksum): a file from another save?")
    return path


def _empty_index_file(path: Path, settings: dict[str, Any], center: np.ndarray | None) -> None:
    """Write an empty :class:`Index` with ``settings`` whose centering vector is frozen at ``center``."""
    index = Index(**settings)
    if center is not None:
        index.set_center(center)
    index.save(path)


def _centered_index(settings: dict[str, Any], center: np.ndarray) -> Index:
    """An empty :class:`Index` with ``settings`` and its center frozen at ``center`` ``(dim,)``."""
    index = Index(**settings)
    index.set_center(center)
    return index


def _first_center(x: torch.Tensor, metric: str) -> np.ndarray:
    """The center ``Index.add`` freezes for first batch ``x`` ``(n, dim)`` float32: same ops, same bits."""
    if metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
    return x.mean(0).numpy()


# ---------------------------------------------------------------------------------------- actor


class _Shard:
    """One shard in a Ray actor. Every method returns ``(value, epoch)``; ``epoch`` is ``(token, file)``: a
    token drawn anew at each (re)start and the name of the shard file it started from (None: empty)."""

    def __init__(self, shard: int, make: Callable[[], Any], settings: dict[str, Any] | None, directory: str | None,
                 mmap: bool) -> None:
        self.shard, self.settings = shard, settings
        self.index, source = self._restore(make, directory, mmap)
        self.epoch = (secrets.token_hex(8), source)

    def _restore(self, make: Callable[[], Any], directory: str | None, mmap: bool) -> tuple[Any, str | None]:
        """The shard and its file name, as its directory's manifest names it; a fresh index if none."""
        if directory is None or not (Path(directory) / MANIFEST).exists():
            return make(), None
        cls = Index if self.settings is not None else type(make())
        for _ in range(3):  # a concurrent save may delete the file between reading the manifest and opening
            entry = read_manifest(directory)["shards"][self.shard]
            try:
                path = _check_shard_file(Path(directory), self.shard, entry)
                return (cls.load(path, mmap=True) if mmap else cls.load(path)), entry["file"]
            except FileNotFoundError:
                time.sleep(0.1)
        raise FileNotFoundError(f"shard {self.shard}: the file named by {directory}/{MANIFEST} is missing")

    def info(self) -> tuple[dict[str, Any], Epoch]:
        center = getattr(self.index, "center", None)
        return {"class": f"{type(self.index).__module__}.{type(self.index).__qualname__}", "dim": self.index.dim,
                "metric": self.index.metric, "count": len(self.index),
                "center": None if center is None else center.tolist()}, self.epoch

    def add(self, x: np.ndarray, ids: np.ndarray, center: np.ndarray | None) -> tuple[None, Epoch]:
        """Add ``x`` ``(n, dim)`` under ``ids``; ``center``: the shared center to freeze first (plain Index)."""
        if center is not None:
            have = self.index.center
            if have is None and len(self.index) == 0:
                self.index = _centered_index(self.settings, center)
            elif have is None or not np.array_equal(have, center):
                raise ValueError(f"shard {self.shard}: its center differs from the index's shared center")
        self.index.add(x, ids)
        return None, self.epoch

    def remove(self, ids: np.ndarray) -> tuple[int, Epoch]:
        return self.index.remove(ids), self.epoch

    def search(self, q: np.ndarray, k: int, options: dict[str, Any]) -> tuple[tuple[np.ndarray, np.ndarray], Epoch]:
        return self.index.search(q, k, **options), self.epoch

    def reconstruct(self, ids: np.ndarray) -> tuple[np.ndarray, Epoch]:
        return self.index.reconstruct(ids), self.epoch

    def count(self) -> tuple[int, Epoch]:
        return len(self.index), self.epoch

    def save(self, path: str) -> tuple[dict[str, Any], Epoch]:
        self.index.save(path)
        return _file_entry(Path(path), len(self.index)), self.epoch


# ---------------------------------------------------------------------------------------- ShardedIndex


class ShardedIndex:
    """An index split over ``n_shards`` Ray actors (module docstring: routing, scores, files, failures).

    The ``Index`` arguments (``bits`` … ``rerank_bits``) configure every shard, unless ``index_factory``
    (a picklable zero-argument callable returning an index with the ``Index`` contract, e.g. an
    ``IVFIndex``) makes them. ``routing`` "hash" | "round_robin"; ``max_restarts`` per actor (Ray);
    ``actor_options`` passed to Ray's ``.options`` (e.g. ``{"num_cpus": 1}``); ``timeout`` seconds that a
    read waits for a shard that is down. Ray is initialized on first use unless the caller did it.
    Shards run on CPU. Methods may be called from several threads.
    """

    def __init__(
        self,
        dim: int,
        n_shards: int,
        bits: float = 4,
        metric: str = "ip",
        mode: str = "mse",
        seed: int = 0,
        rotation: str = "haar",
        correction: str = "auto",
        rerank_bits: float | None = None,
        *,
        index_factory: Callable[[], Any] | None = None,
        routing: str = "hash",
        max_restarts: int = 3,
        actor_options: dict[str, Any] | None = None,
        timeout: float = 30.0,
    ) -> None:
        settings = None
        if index_factory is None:
            template = Index(dim, bits, metric, mode, seed, rotation, correction, rerank_bits)  # checks arguments
            settings = {"dim": dim, "bits": template.bits, "metric": metric, "mode": mode, "seed": seed,
                        "rotation": rotation, "correction": template.correction, "rerank_bits": rerank_bits}
        config = {"dim": check_positive_int("dim", dim), "n_shards": check_positive_int("n_shards", n_shards),
                  "routing": check_choice("routing", routing, ROUTINGS), "index": settings, "next_id": 0}
        self._start(config, index_factory, None, False, max_restarts, actor_options, timeout)

    # ------------------------------------------------------------------ setup
    def _start(self, config: dict[str, Any], factory: Callable[[], Any] | None, directory: Path | None, mmap: bool,
               max_restarts: int, actor_options: dict[str, Any] | None, timeout: float) -> None:
        self.dim: int = config["dim"]
        self.n_shards: int = config["n_shards"]
        self.routing: str = config["routing"]
        self.timeout = float(timeout)
        self._settings: dict[str, Any] | None = config["index"]
        self._factory = factory if factory is not None else functools.partial(Index, **self._settings)
        self._next_id: int = config["next_id"]
        self._mmap, self._max_restarts, self._actor_options = mmap, max_restarts, dict(actor_options or {})
        self._lock = threading.RLock()
        self._unsaved = np.zeros(self.n_shards, bool)
        self._lost: set[int] = set()
        self._actors: list[Any] = []
        self._spawn(directory)

    def _spawn(self, directory: Path | None) -> None:
        """(Re)create the shard actors; they load from ``directory`` when it holds a saved index."""
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        remote = ray.remote(_Shard).options(max_restarts=self._max_restarts, **self._actor_options)
        path = None if directory is None else str(directory)
        self._actors = [remote.remote(s, self._factory, self._settings, path, self._mmap) for s in range(self.n_shards)]
        self._directory = directory
        self._epochs: list[Epoch | None] = [None] * self.n_shards
        self._files: list[str | None] = [None] * self.n_shards
        if directory is not None:
            self._files = [entry["file"] for entry in read_manifest(directory)["shards"]]
        try:
            self._check_shards(self._call("info", {s: () for s in range(self.n_shards)}, timeout=None))
        except BaseException:
            self.close()
            raise

    def _check_shards(self, infos: list[dict[str, Any]]) -> None:
        """Check that the shards agree (class, dim, metric, center) and adopt their metric and center."""
        classes = {info["class"] for info in infos}
        if len(classes) != 1 or {(i["dim"], i["metric"]) for i in infos} != {(self.dim, infos[0]["metric"])}:
            raise ValueError(f"shards disagree or do not match dim={self.dim}: "
                             f"{sorted({(i['class'], i['dim'], i['metric']) for i in infos})}")
        self.index_class: str = classes.pop()
        self.metric: str = infos[0]["metric"]
        centers = {tuple(i["center"]) for i in infos if i["center"] is not None and i["count"]}
        if self._settings is not None and len(centers) > 1:
            raise storage.StorageError("shards hold different centers: their scores are not comparable")
        self._center = np.array(centers.pop(), np.float32) if centers else None

    def close(self) -> None:
        """Kill the shard actors (the saved files stay)."""
        with self._lock:
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
            self._actors = []

    def __enter__(self) -> "ShardedIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ShardedIndex(dim={self.dim}, n_shards={self.n_shards}, metric={self.metric!r}, "
                f"routing={self.routing!r}, index_class={self.index_class!r})")

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, args: dict[int, tuple], *, retry: bool = False, mutates: bool = False,
              allow_missing: bool = False, timeout: float | None = -1.0) -> list[Any]:
        """Call ``method`` on each shard in ``args``; values in shard order (``None`` where missing).

        Every reply's epoch is noted as it arrives (``mutates``: the shard now has unsaved changes), so a
        failure elsewhere loses no bookkeeping. With ``retry`` a shard that is down is called again until
        ``timeout`` (default ``self.timeout``; None: no limit); then (or at once without ``retry``) it raises
        :class:`ShardError`, unless ``allow_missing``. An error raised inside a shard (e.g. ``KeyError``)
        is re-raised once every shard has replied.
        """
        if not self._actors:
            raise RuntimeError("this ShardedIndex is closed")
        timeout = self.timeout if timeout == -1.0 else timeout
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        pending = {getattr(self._actors[s], method).remote(*a): s for s, a in args.items()}
        results: list[Any] = [None] * self.n_shards
        failed: dict[int, str] = {}
        errors: list[Exception] = []
        delay = 0.05
        while pending:
            wait = None if timeout is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if not ready:
                failed.update({s: f"no answer within {timeout:g} s" for s in pending.values()})
                break
            s = pending.pop(ready[0])
            try:
                results[s], epoch = ray.get(ready[0])
            except RayTaskError as err:  # raised by the index inside the shard: typed as its cause
                errors.append(err)
                continue
            except RayActorError as err:
                if not retry or time.monotonic() + delay > deadline:
                    failed[s] = f"actor down ({type(err).__name__}: {_last_line(err)})"
                    continue
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
                pending[getattr(self._actors[s], method).remote(*args[s])] = s
                continue
            self._observe(s, epoch)
            if mutates:
                self._unsaved[s] = True
        if errors:
            raise errors[0]
        if failed and not allow_missing:
            raise ShardError(f"{method}: " + "; ".join(f"shard {s}: {why}" for s, why in sorted(failed.items())), failed)
        return results

    def _observe(self, shard: int, epoch: Epoch) -> None:
        """Note the epoch of a reply. A new one means a restart: it lost data if the shard had unsaved changes
        or started from another file than the last save's (a restart racing a save)."""
        with self._lock:
            if epoch != self._epochs[shard]:
                if self._epochs[shard] is not None and (self._unsaved[shard] or epoch[1] != self._files[shard]):
                    self._lost.add(shard)
                self._epochs[shard], self._unsaved[shard] = epoch, False

    def _lost_error(self, shards: Sequence[int]) -> ShardError:
        where = f"its file in {self._directory}" if self._directory else "an empty index (never saved)"
        return ShardError(f"shard(s) {sorted(shards)} restarted from {where} and lost the changes made after the "
                          "last save; reload with ShardedIndex.load and add them again", shards)

    def _route(self, ids: np.ndarray) -> dict[int, np.ndarray]:
        """Positions into ``ids`` of each shard's ids (shards with none left out)."""
        shards = shard_of(ids, self.n_shards, self.routing)
        return {int(s): np.flatnonzero(shards == s) for s in np.unique(shards)}

    # ------------------------------------------------------------------ mutations
    def add(self, x: Any, ids: Any = None) -> np.ndarray:
        """Add ``x`` ``(n, dim)`` with ``ids`` ``(n,)`` int64 (default: consecutive; required None with
        ``round_robin``). Returns the ids. Not atomic across shards (module docstring)."""
        x_t = as_float_matrix(x, self.dim, "x", "cpu")
        n = x_t.shape[0]
        with self._lock:
            if ids is None:
                ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
            elif self.routing == "round_robin":
                raise ValueError("routing='round_robin' assigns the ids itself; use routing='hash' to choose ids")
            else:
                ids = as_ids(ids, n)
                if len(np.unique(ids)) != n:
                    raise ValueError("ids contain duplicates")
            if n == 0:
                return ids
            if self._settings is not None and self._settings["correction"] == "center" and self._center is None:
                self._center = _first_center(x_t, self.metric)
            x_np = x_t.numpy()
            parts = self._route(ids)
            self._next_id = max(self._next_id, int(ids.max()) + 1)
            self._call("add", {s: (x_np[p], ids[p], self._center) for s, p in parts.items()}, mutates=True)
        return ids

    def remove(self, ids: Any) -> int:
        """Remove these ids (an unknown id raises ``KeyError``; other shards keep their removals). Returns the count."""
        ids = np.unique(as_ids(ids))
        with self._lock:
            parts = self._route(ids)
            counts = self._call("remove", {s: (ids[p],) for s, p in parts.items()}, mutates=True)
        return sum(counts[s] for s in parts)

    # ------------------------------------------------------------------ reads
    def search(self, queries: Any, k: int, rerank: int | None = None, *, allow_partial: bool = False,
               **options: Any) -> tuple[np.ndarray, ...]:
        """``(D, I)`` as :meth:`Index.search` (``(nq, k)``; best first; −1 and ∓inf padding), merged over shards.
        ``rerank`` and ``options`` (e.g. ``nprobe=`` of an IVF index) go to every shard's ``search``.

        A shard that is down is retried until ``timeout``, then :class:`ShardError` names it. With
        ``allow_partial=True`` returns ``(D, I, missing)``: the merge over the shards that answered and the
        tuple of shards that did not (or lost data).
        """
        k = check_positive_int("k", k)
        q = as_float_matrix(queries, self.dim, "queries", "cpu").numpy()
        q_ref = ray.put(q)  # one copy in the object store, read by every shard
        options = options if rerank is None else dict(options, rerank=rerank)
        replies = self._call("search", {s: (q_ref, k, options) for s in range(self.n_shards)}, retry=True,
                             allow_missing=allow_partial)
        missing = {s for s, r in enumerate(replies) if r is None} | self._lost
        if self._lost and not allow_partial:
            raise self._lost_error(self._lost)
        D, I = merge_topk([r for s, r in enumerate(replies) if s not in missing], k, self.metric, nq=len(q))
        return (D, I, tuple(sorted(missing))) if allow_partial else (D, I)

    def reconstruct(self, ids: Any) -> np.ndarray:
        """Decoded vectors ``(len(ids), dim)`` float32 (unknown id: ``KeyError``)."""
        ids = as_ids(ids)
        parts = self._route(ids)
        replies = self._call("reconstruct", {s: (ids[p],) for s, p in parts.items()}, retry=True)
        out = np.empty((len(ids), self.dim), np.float32)
        for s, p in parts.items():
            out[p] = replies[s]
        if self._lost & parts.keys():
            raise self._lost_error(self._lost & parts.keys())
        return out

    def shard_sizes(self) -> list[int]:
        """Vectors held by each shard."""
        counts = self._call("count", {s: () for s in range(self.n_shards)}, retry=True)
        if self._lost:
            raise self._lost_error(self._lost)
        return counts

    def __len__(self) -> int:
        return sum(self.shard_sizes())

    @property
    def ntotal(self) -> int:
        """Number of stored vectors (FAISS name)."""
        return len(self)

    @property
    def center(self) -> np.ndarray | None:
        """The centering vector shared by all shards ``(dim,)`` float32, or None."""
        return None if self._center is None else self._center.copy()

    def shard_actor(self, shard: int) -> Any:
        """The Ray actor handle of ``shard`` (for operations and tests, e.g. ``ray.kill``)."""
        return self._actors[shard]

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> None:
        """Save every shard and then the manifest into directory ``path`` (module docstring: files).

        Saving to a directory other than the current one re-creates the actors from the files just
        written, so that a restarted shard reloads from there.
        """
        directory = Path(path).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._lost:
                raise self._lost_error(self._lost)
            token = secrets.token_hex(4)
            files = [directory / f"shard-{s:05d}-{token}.tqv" for s in range(self.n_shards)]
            try:
                entries = self._call("save", {s: (str(f),) for s, f in enumerate(files)})
                if self._lost:
                    raise self._lost_error(self._lost)
                config = {"dim": self.dim, "n_shards": self.n_shards, "routing": self.routing,
                          "index": self._settings, "next_id": self._next_id, "index_class": self.index_class}
                _commit(directory, config, entries)
            except BaseException:
                for f in files:
                    f.unlink(missing_ok=True)
                raise
            self._unsaved[:] = False
            if directory != self._directory:
                self._spawn(directory)
            else:
                self._files = [f.name for f in files]

    @classmethod
    def load(cls, path: str | os.PathLike, *, index_factory: Callable[[], Any] | None = None, mmap: bool = False,
             max_restarts: int = 3, actor_options: dict[str, Any] | None = None,
             timeout: float = 30.0) -> "ShardedIndex":
        """Open a directory written by :meth:`save` or :func:`build_shards`: one actor per shard file.

        Shards made by an ``index_factory`` need the same factory here (its class's ``load`` reads them).
        ``mmap``: map the shard files read-only instead of reading them (``Index.load``).
        """
        directory = Path(path).resolve()
        manifest = read_manifest(directory)
        for s, entry in enumerate(manifest["shards"]):  # fail here, before starting any actor
            try:
                _check_shard_file(directory, s, entry)
            except FileNotFoundError as err:
                raise storage.StorageError(f"shard {s}: {err}") from err
        config = manifest["config"]
        if (index_factory is None) == (config.get("index") is None):
            raise ValueError(f"{directory}: shards are {config.get('index_class')}; "
                             + ("pass the index_factory that made them" if index_factory is None
                                else "they are plain Index shards, load them without index_factory"))
        self = cls.__new__(cls)
        self._start(config, index_factory, directory, mmap, max_restarts, actor_options, timeout)
        if self.index_class != config.get("index_class"):
            self.close()
            raise ValueError(f"{directory}: shards were {config.get('index_class')}, loaded as {self.index_class}")
        return self


def merge_topk(parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int, metric: str,
               nq: int) -> tuple[np.ndarray, np.ndarray]:
    """K-way merge of per-shard ``(D, I)`` ``(nq, k)``: the best ``k`` per query (l2: smallest first).

    Equal scores keep shard order; with fewer than ``k`` results the tail is −1 with ∓inf.
    """
    pad = np.inf if metric == "l2" else -np.inf
    D = np.concatenate([*(d for d, _ in parts), np.full((nq, k), pad, np.float32)], axis=1)
    I = np.concatenate([*(i for _, i in parts), np.full((nq, k), -1, np.int64)], axis=1)
    order = np.argsort(D if metric == "l2" else -D, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(D, order, 1), np.take_along_axis(I, order, 1)


# ---------------------------------------------------------------------------------------- bulk build


def build_shards(
    source_files: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    n_shards: int,
    dim: int,
    bits: float = 4,
    metric: str = "ip",
    mode: str = "mse",
    seed: int = 0,
    rotation: str = "haar",
    correction: str = "auto",
    rerank_bits: float | None = None,
    *,
    routing: str = "hash",
    center: Any = None,
    id_column: str = "id",
    vector_column: str = "vector",
    rows_per_task: int = 65536,
    workers: int | None = None,
) -> dict[str, Any]:
    """Encode a collection into a :class:`ShardedIndex` directory with Ray Data; returns the manifest.

    ``source_files``: Parquet files with an int64 ``id_column`` and a ``vector_column`` of ``dim`` floats
    per row, or ``.npy`` files of ``(n, dim)`` floats whose ids are the global row numbers (files in the
    given order). ``map_batches`` runs ``workers`` encoders (default: the cluster's CPUs), each writing, per
    batch of ``rows_per_task`` rows, one part file per shard; one Ray task per shard then concatenates its
    parts into the shard file. Encodings equal those of one ``Index`` with the same settings; for a
    centering correction pass that index's ``center=`` (``(dim,)``), else the mean of all vectors is
    computed in an extra pass (module docstring: identical scores). Only plain ``Index`` shards.
    """
    files = [Path(f).resolve() for f in source_files]
    kinds = {f.suffix for f in files}
    if not files or kinds not in ({".parquet"}, {".npy"}):
        raise ValueError(f"source_files must be all .parquet or all .npy files, got suffixes {sorted(kinds)}")
    n_shards = check_positive_int("n_shards", n_shards)
    rows_per_task = check_positive_int("rows_per_task", rows_per_task)
    check_choice("routing", routing, ROUTINGS)
    template = Index(dim, bits, metric, mode, seed, rotation, correction, rerank_bits)
    settings = {"dim": dim, "bits": template.bits, "metric": metric, "mode": mode, "seed": seed,
                "rotation": rotation, "correction": template.correction, "rerank_bits": rerank_bits}
    if center is not None:
        if template.correction != "center":
            raise ValueError(f"center= needs a centering correction; correction={correction!r} resolves to "
                             f"{template.correction!r}")
        center = as_float_matrix(np.asarray(center).reshape(1, -1), dim, "center").numpy()[0]
    if not ray.is_initialized():
        ray.init()
    workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    ds = _read_parquet(files, id_column, vector_column, routing) if kinds == {".parquet"} \
        else _read_npy(files, dim, rows_per_task)
    if template.correction == "center" and center is None:
        center = _mean(ds, metric)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=out))
    try:
        empty = work / "empty.tqv"
        _empty_index_file(empty, settings, center)
        parts: list[list[str]] = [[] for _ in range(n_shards)]
        encoded = ds.map_batches(_EncodeParts, batch_size=rows_per_task, batch_format="numpy", concurrency=workers,
                                 num_cpus=ENCODER_CPUS, fn_constructor_kwargs={"empty": str(empty), "parts_dir": str(work),
                                                        "n_shards": n_shards, "routing": routing})
        for row in encoded.iter_rows():
            parts[int(row["shard"])].append(str(row["path"]))
        token = secrets.token_hex(4)
        merge = ray.remote(_merge_parts)
        entries = ray.get([merge.remote(str(empty), parts[s], str(out / f"shard-{s:05d}-{token}.tqv"))
                           for s in range(n_shards)])
        next_id = max((e.pop("next_id") for e in entries), default=0)
        config = {"dim": dim, "n_shards": n_shards, "routing": routing, "index": settings, "next_id": next_id,
                  "index_class": f"{Index.__module__}.{Index.__qualname__}"}
        return _commit(out, config, entries)
    finally:
        for f in work.iterdir():
            f.unlink()
        work.rmdir()


def _read_parquet(files: list[Path], id_column: str, vector_column: str, routing: str) -> "ray.data.Dataset":
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


def _read_npy(files: list[Path], dim: int, rows_per_task: int) -> "ray.data.Dataset":
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


def _mean(ds: "ray.data.Dataset", metric: str) -> np.ndarray:
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
        routed = shard_of(ids, self.n_shards, self.routing)
        for s in np.unique(routed):
            rows = np.flatnonzero(routed == s)
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
    return dict(_file_entry(Path(out), len(ids)), next_id=next_id)
