"""``ShardedIndex``: one index per Ray actor, scatter-gather search, merged top-k (package docstring).

Failures. Each shard actor runs with Ray's ``max_restarts``; a restarted actor reloads its shard from the
file that its directory's manifest names (or starts empty if it was never saved; the first ``save`` to a
directory re-creates the actors from there). Every call waits at most ``timeout`` seconds: starting the
actors (an actor that cannot be scheduled raises :class:`ShardError` naming it), a read retrying a shard
that is restarting, a write, the directory lock of a save. A shard whose actor is dead for good (its
``max_restarts`` used up, or killed without restart) fails a call at once, retried or not: Ray will not bring
it back, only :meth:`ShardedIndex.load` does. A restart that lost changes made since the last save
(every reply carries an epoch: a token drawn at actor start and the file it loaded) makes the shard
*lost*: searches, ``add``, ``remove`` and ``save`` raise ``ShardError`` until the index is reloaded with
:meth:`ShardedIndex.load`. ``search(..., allow_partial=True)`` returns the merged answer of the shards
that answered, plus the missing ones. ``add``, ``remove`` and ``save`` are not retried (a retry could
apply twice); a failing shard raises ``ShardError``, and ``add``/``remove`` are not atomic across shards.
"""
from __future__ import annotations

import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from .. import storage
from .._rows import frozen_center
from ..validation import as_float_array, as_float_matrix, as_ids, check_choice, check_positive_int
from .actor import Epoch, ShardActor
from .manifest import (
    MANIFEST,
    commit,
    read_manifest,
    remove_stale,
    shard_file_name,
    try_remove_stale,
    verify_shard_files,
    writer_lock,
)
from .routing import ROUTINGS, route
from .settings import IndexSettings


class ShardError(RuntimeError):
    """One or more shards could not answer, could not start, or lost data; ``shards`` holds their numbers."""

    def __init__(self, message: str, shards: Sequence[int]) -> None:
        super().__init__(message)
        self.shards = tuple(sorted(shards))


def _last_line(err: BaseException) -> str:
    """The last non-empty line of an error's message (Ray puts the cause there, after a traceback)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(err).__name__


def _first_center(x: torch.Tensor, metric: str) -> np.ndarray:
    """The center ``Index.add`` freezes for first batch ``x`` ``(n, dim)`` float32: same ops, same bits, and the same
    warning when the batch is small (:func:`~tqvec._rows.frozen_center`, attributed to the caller of ``add``)."""
    if metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
    return frozen_center(x, "pass a larger first batch to add, or use correction='rescale'", caller_depth=2).numpy()


def _check_timeout(timeout: Any) -> float:
    """``timeout`` as a positive finite float (seconds)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def merge_topk(parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int, metric: str,
               nq: int) -> tuple[np.ndarray, np.ndarray]:
    """K-way merge of per-shard results.

    Parameters
    ----------
    parts : sequence of (D, I)
        Per shard, ``(nq, k_s)`` float32 scores and int64 ids with ``k_s ≤ k``, best first.
    k : int
        Results per query.
    metric : str
        ``"l2"`` (smallest first) or a similarity metric (largest first).
    nq : int
        Number of queries.

    Returns
    -------
    D : numpy.ndarray of shape (nq, k), float32
    I : numpy.ndarray of shape (nq, k), int64
        Equal scores come in id order (as one index answers); with fewer than ``k`` results the tail is −1 with
        ∓inf.

    Examples
    --------
    >>> D, I = merge_topk([(np.array([[3.0]], np.float32), np.array([[7]]))], 2, "ip", nq=1)
    >>> I.tolist()
    [[7, -1]]
    """
    pad = np.inf if metric == "l2" else -np.inf
    D = np.concatenate([*(d for d, _ in parts), np.full((nq, k), pad, np.float32)], axis=1)
    I = np.concatenate([*(i for _, i in parts), np.full((nq, k), -1, np.int64)], axis=1)
    order = np.lexsort((I, D if metric == "l2" else -D), axis=1)[:, :k]
    return np.take_along_axis(D, order, 1), np.take_along_axis(I, order, 1)


class ShardedIndex:
    """An index split over ``n_shards`` Ray actors, searched by scatter-gather.

    Routing, scores and files: the package docstring; failures and timeouts: the module docstring. Ray is
    initialized on first use unless the caller did it. Shards run on CPU. Methods may be called from several
    threads. Used as a context manager, the actors are killed on exit (:meth:`close`).

    Parameters
    ----------
    index : IndexSettings or callable
        The shards' configuration: :class:`IndexSettings` (a plain ``Index`` per shard), or a picklable
        zero-argument callable returning an index with the ``Index`` contract (e.g.
        ``functools.partial(IVFIndex, 384, 64)``).
    n_shards : int
        Number of shard actors, ≥ 1.
    routing : {"hash", "round_robin"}, keyword-only
        Which shard holds an id (:mod:`tqvec.distributed.routing`).
    max_restarts : int, keyword-only
        Ray restarts per actor.
    actor_options : dict, optional, keyword-only
        Passed to Ray's ``.options`` (e.g. ``{"num_cpus": 1}``).
    timeout : float, keyword-only
        Seconds any one call may wait (module docstring), > 0; 120 leaves room for cold actor starts.

    Attributes
    ----------
    dim : int
        Vector dimension, as the shards report it.
    metric : str
        The shards' metric.
    n_shards, routing, timeout
        The arguments, checked.

    Raises
    ------
    ValueError
        A bad ``index``, ``n_shards``, ``routing`` or ``timeout``, named in the message; or shards that disagree
        on class, ``dim`` or metric (an ``index`` callable whose indexes differ).
    ShardError
        Actors that did not start (or answer) within ``timeout``; the ones started are killed.

    Examples
    --------
    >>> import numpy as np
    >>> from tqvec.distributed import IndexSettings, ShardedIndex
    >>> x = np.random.default_rng(0).standard_normal((1000, 384)).astype(np.float32)
    >>> with ShardedIndex(IndexSettings(384, bits=4, metric="cosine"), 2) as index:  # doctest: +SKIP
    ...     ids = index.add(x)
    ...     D, I = index.search(x[:5], 10)
    """

    def __init__(self, index: IndexSettings | Callable[[], Any], n_shards: int, *, routing: str = "hash",
                 max_restarts: int = 3, actor_options: dict[str, Any] | None = None, timeout: float = 120.0) -> None:
        settings, factory = (index, None) if isinstance(index, IndexSettings) else (None, index)
        if factory is not None and not callable(factory):
            raise ValueError(f"index must be IndexSettings or a callable returning an index, got {type(index).__name__}")
        config = {"dim": None if settings is None else settings.dim,
                  "n_shards": check_positive_int("n_shards", n_shards),
                  "routing": check_choice("routing", routing, ROUTINGS), "next_id": 0}
        self._start(config, settings, factory, None, False, max_restarts, actor_options, timeout)

    # ------------------------------------------------------------------ setup
    def _start(self, config: dict[str, Any], settings: IndexSettings | None, factory: Callable[[], Any] | None,
               directory: Path | None, mmap: bool, max_restarts: int, actor_options: dict[str, Any] | None,
               timeout: float) -> None:
        self.dim: int | None = config["dim"]
        self.n_shards: int = config["n_shards"]
        self.routing: str = config["routing"]
        self.timeout = _check_timeout(timeout)
        self._settings = settings
        self._factory = factory if factory is not None else settings.new_index
        self._next_id: int = config["next_id"]
        self._mmap, self._max_restarts, self._actor_options = mmap, max_restarts, dict(actor_options or {})
        self._lock = threading.RLock()
        self._unsaved = np.zeros(self.n_shards, bool)
        self._lost: set[int] = set()
        self._actors: list[Any] = []
        self._spawn(directory)

    def _spawn(self, directory: Path | None) -> None:
        """(Re)create the shard actors; they load from ``directory`` when it holds a saved index. Raises
        ``ShardError`` (actors killed) if any does not answer within ``timeout``."""
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        remote = ray.remote(ShardActor).options(max_restarts=self._max_restarts, **self._actor_options)
        path = None if directory is None else str(directory)
        self._actors = [remote.remote(s, self._factory, self._settings, path, self._mmap) for s in range(self.n_shards)]
        self._directory = directory
        self._epochs: list[Epoch | None] = [None] * self.n_shards
        self._files: list[str | None] = [None] * self.n_shards
        try:
            if directory is not None:
                self._files = [entry["file"] for entry in read_manifest(directory)["shards"]]
            infos = self._call("info", {s: () for s in range(self.n_shards)})
            self._check_shards(infos)
        except ShardError as err:
            self.close()
            raise ShardError(f"starting the shard actors failed: {err} (an actor that never answers may not be "
                             f"schedulable: actor_options {self._actor_options} against ray.available_resources())",
                             err.shards) from err
        except BaseException:
            self.close()
            raise

    def _check_shards(self, infos: list[dict[str, Any]]) -> None:
        """Check that the shards agree (class, dim, metric, center) and adopt their dim, metric and center."""
        classes = {info["class"] for info in infos}
        dims = {(i["dim"], i["metric"]) for i in infos}
        if len(classes) != 1 or len(dims) != 1 or self.dim not in (None, infos[0]["dim"]):
            raise ValueError(f"shards disagree or do not match dim={self.dim}: "
                             f"{sorted({(i['class'], i['dim'], i['metric']) for i in infos})}")
        self.index_class: str = classes.pop()
        self.dim, self.metric = infos[0]["dim"], infos[0]["metric"]
        held = [i for i in infos if i["center"] is not None]  # shards emptied by remove keep theirs
        centers = {tuple(i["center"]) for i in held if i["count"]} or {tuple(i["center"]) for i in held}
        if self._settings is not None and len(centers) > 1:
            raise storage.StorageError("shards hold different centers: their scores are not comparable")
        self._center = np.array(centers.pop(), np.float32) if centers else None

    def close(self) -> None:
        """Kill the shard actors (the saved files stay)."""
        with self._lock:
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
            self._actors = []

    def __enter__(self) -> ShardedIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ShardedIndex(dim={self.dim}, n_shards={self.n_shards}, metric={self.metric!r}, "
                f"routing={self.routing!r}, index_class={self.index_class!r}{'' if self._actors else ', closed'})")

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, args: dict[int, tuple], *, retry: bool = False, mutates: bool = False,
              allow_missing: bool = False) -> list[Any]:
        """Call ``method`` on each shard in ``args``; values in shard order (``None`` where missing).

        Every reply's epoch is noted as it arrives (``mutates``: the shard now has unsaved changes), so a
        failure elsewhere loses no bookkeeping. With ``retry`` a shard that is restarting is called again until
        ``self.timeout``; a shard that has not answered by then (or, without ``retry``, one that is down, or
        one whose actor is dead for good, at once) raises :class:`ShardError`, unless ``allow_missing``. An
        error raised inside a shard (e.g. ``KeyError``) is re-raised once every shard has replied.
        """
        if not self._actors:
            raise RuntimeError("this ShardedIndex is closed")
        deadline = time.monotonic() + self.timeout
        pending = {getattr(self._actors[s], method).remote(*a): s for s, a in args.items()}
        results: list[Any] = [None] * self.n_shards
        failed: dict[int, str] = {}
        errors: list[Exception] = []
        delay = 0.05
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                failed.update({s: f"no answer within {self.timeout:g} s" for s in pending.values()})
                break
            s = pending.pop(ready[0])
            try:
                results[s], epoch = ray.get(ready[0])
            except RayTaskError as err:  # raised by the index inside the shard: typed as its cause
                errors.append(err)
                continue
            except ActorDiedError as err:  # no restart left (Ray raises ActorUnavailableError while restarting)
                failed[s] = f"actor dead for good ({_last_line(err)}); reload the index with ShardedIndex.load"
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

    def _raise_if_lost(self, shards: set[int] | None = None) -> None:
        """Raise ``ShardError`` if any of ``shards`` (default: any shard) is lost."""
        lost = self._lost if shards is None else self._lost & shards
        if lost:
            where = f"its file in {self._directory}" if self._directory else "an empty index (never saved)"
            raise ShardError(f"shard(s) {sorted(lost)} restarted from {where} and lost the changes made after the "
                             "last save; reload with ShardedIndex.load and add them again", lost)

    # ------------------------------------------------------------------ mutations
    def add(self, x: Any, ids: Any = None) -> np.ndarray:
        """Add vectors, each to the shard its id routes to; not atomic across shards (module docstring).

        An error raised inside a shard's index (e.g. ``ValueError`` for an id it already holds) is re-raised, as
        its own type, once every shard has replied; the other shards keep their part.

        Parameters
        ----------
        x : numpy.ndarray or torch.Tensor of shape (n, dim)
            Finite floats, checked as :meth:`Index.add <tqvec.index.Index.add>` checks them.
        ids : array-like of shape (n,), optional
            Distinct integer ids in ``[0, 2**63 − 2]``; default: consecutive, after the largest id so far. Must be
            None with ``routing="round_robin"``.

        Returns
        -------
        numpy.ndarray of shape (n,), dtype int64
            The ids.

        Raises
        ------
        ValueError
            Bad ``x`` or ``ids`` (also duplicates, or ``ids`` given with ``round_robin``); nothing is sent.
        ShardError
            A shard is lost (nothing is sent), or a shard failed or turned out lost during this call (the other
            shards keep their part).
        RuntimeError
            The index is closed.
        """
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
            self._raise_if_lost()  # changes to a lost index could never be saved
            if self._settings is not None and self._settings.correction == "center" and self._center is None:
                self._center = _first_center(x_t, self.metric)
            x_np = x_t.numpy()
            parts = route(ids, self.n_shards, self.routing)
            self._next_id = max(self._next_id, int(ids.max()) + 1)
            self._call("add", {s: (x_np[p], ids[p], self._center) for s, p in parts.items()}, mutates=True)
            self._raise_if_lost()
        return ids

    def remove(self, ids: Any) -> int:
        """Remove the vectors with these ids; not atomic across shards (module docstring).

        Parameters
        ----------
        ids : array-like of shape (n,)
            Integer ids; repeated ids count once.

        Returns
        -------
        int
            The number of distinct ids removed.

        Raises
        ------
        ValueError
            Bad ``ids``; nothing is sent.
        KeyError
            An unknown id: its shard removes nothing, the other shards keep their removals.
        ShardError
            As :meth:`add`.
        RuntimeError
            The index is closed.
        """
        ids = np.unique(as_ids(ids))
        with self._lock:
            self._raise_if_lost()
            parts = route(ids, self.n_shards, self.routing)
            counts = self._call("remove", {s: (ids[p],) for s, p in parts.items()}, mutates=True)
            self._raise_if_lost()
        return sum(counts[s] for s in parts)

    # ------------------------------------------------------------------ reads
    def search(self, queries: Any, k: int, rerank: int | None = None, *, allow_partial: bool = False,
               **options: Any) -> tuple[np.ndarray, ...]:
        """Top-``k`` over all shards, as :meth:`Index.search <tqvec.index.Index.search>`.

        An error raised by a shard's ``search`` (e.g. for an option it does not take) is re-raised as its own type.

        Parameters
        ----------
        queries : numpy.ndarray or torch.Tensor of shape (nq, dim)
            Finite floats.
        k : int
            Results per query, ≥ 1.
        rerank : int, optional
            Passed to every shard's ``search``, when given.
        allow_partial : bool, keyword-only
            Return what the answering shards found instead of raising :class:`ShardError`.
        **options
            Passed to every shard's ``search`` (e.g. ``nprobe=`` of an IVF index).

        Returns
        -------
        D : numpy.ndarray of shape (nq, k), dtype float32
            Scores (best = largest) or, for ``"l2"``, squared distances (best = smallest); ∓inf padding.
        I : numpy.ndarray of shape (nq, k), dtype int64
            Ids, best first; −1 where fewer than ``k`` results exist.
        missing : tuple of int
            Only with ``allow_partial``: the sorted shards that did not answer or are lost.

        Raises
        ------
        ValueError
            Bad ``queries`` or ``k``.
        ShardError
            Without ``allow_partial``: a shard still down after ``timeout`` (retried meanwhile), dead for good
            (at once), or lost.
        RuntimeError
            The index is closed.
        """
        k = check_positive_int("k", k)
        q = as_float_array(queries, self.dim, "queries")
        q_ref = ray.put(q)  # one copy in the object store, read by every shard
        options = options if rerank is None else dict(options, rerank=rerank)
        replies = self._call("search", {s: (q_ref, k, options) for s in range(self.n_shards)}, retry=True,
                             allow_missing=allow_partial)
        missing = {s for s, r in enumerate(replies) if r is None} | self._lost
        if not allow_partial:
            self._raise_if_lost()
        D, I = merge_topk([r for s, r in enumerate(replies) if s not in missing], k, self.metric, nq=len(q))
        return (D, I, tuple(sorted(missing))) if allow_partial else (D, I)

    def reconstruct(self, ids: Any) -> np.ndarray:
        """Decoded vectors of ``ids``, in their order.

        Parameters
        ----------
        ids : array-like of shape (n,)
            Integer ids.

        Returns
        -------
        numpy.ndarray of shape (n, dim), dtype float32

        Raises
        ------
        ValueError
            Bad ``ids``.
        KeyError
            An unknown id.
        ShardError
            A shard holding one of ``ids`` is still down after ``timeout`` (retried meanwhile), dead for good (at
            once), or lost.
        RuntimeError
            The index is closed.
        """
        ids = as_ids(ids)
        parts = route(ids, self.n_shards, self.routing)
        replies = self._call("reconstruct", {s: (ids[p],) for s, p in parts.items()}, retry=True)
        out = np.empty((len(ids), self.dim), np.float32)
        for s, p in parts.items():
            out[p] = replies[s]
        self._raise_if_lost(set(parts))
        return out

    def shard_sizes(self) -> list[int]:
        """Vectors held by each shard.

        Returns
        -------
        list of int
            One count per shard, in shard order.

        Raises
        ------
        ShardError
            A shard still down after ``timeout`` (retried meanwhile), dead for good (at once), or lost.
        RuntimeError
            The index is closed.
        """
        counts = self._call("count", {s: () for s in range(self.n_shards)}, retry=True)
        self._raise_if_lost()
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
        """Save every shard and then the manifest into directory ``path`` (:mod:`tqvec.distributed.manifest`).

        Holds the directory's writer lock and first deletes what crashed writers left there. Saving to a directory
        other than the current one re-creates the actors from the files just written, so that a restarted shard
        reloads from there.

        Parameters
        ----------
        path : str or os.PathLike
            The directory; created if missing.

        Raises
        ------
        TimeoutError
            Another writer held the directory's lock for ``timeout`` seconds.
        ShardError
            A shard is lost, or down; the directory then keeps its previous save. Also when, after a save to a new
            directory, the re-created actors do not start within ``timeout``: the save is complete, the index closed.
        OSError
            The directory or its lock file cannot be created; an error a shard's own save raises is re-raised as
            its type (the directory keeps its previous save).
        RuntimeError
            The index is closed.
        """
        if not self._actors:  # before touching the disk: a closed index leaves no directory or lock behind
            raise RuntimeError("this ShardedIndex is closed")
        directory = Path(path).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock, writer_lock(directory, self.timeout):
            self._raise_if_lost()
            remove_stale(directory)
            token = secrets.token_hex(4)
            files = [directory / shard_file_name(s, token) for s in range(self.n_shards)]
            try:
                entries = self._call("save", {s: (str(f),) for s, f in enumerate(files)})
                self._raise_if_lost()
                config = {"dim": self.dim, "n_shards": self.n_shards, "routing": self.routing,
                          "index": None if self._settings is None else self._settings.as_dict(),
                          "next_id": self._next_id, "index_class": self.index_class}
                commit(directory, config, entries)
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
             timeout: float = 120.0) -> ShardedIndex:
        """Open a directory written by :meth:`save` or :func:`build_shards`: one actor per shard file.

        Every shard file's SHA-256 is recomputed first (one read of each, several at a time), so a corrupt or
        swapped file is refused before any actor starts. Leftovers of crashed writers are deleted when no writer
        holds the directory (skipped if read-only).

        Parameters
        ----------
        path : str or os.PathLike
            The directory.
        index_factory : callable, optional, keyword-only
            The factory that made the shards, if one did (its class's ``load`` reads them); None for plain
            ``Index`` shards.
        mmap : bool, keyword-only
            Map the shard files read-only instead of reading them.
        max_restarts, actor_options, timeout : keyword-only
            As in the constructor.

        Returns
        -------
        ShardedIndex

        Raises
        ------
        FileNotFoundError
            ``path`` holds no ``manifest.json``.
        tqvec.storage.StorageError
            An unreadable, corrupt or foreign manifest or index settings; a shard file missing, corrupt or from
            another save (named); shards that hold different centers.
        ValueError
            ``index_factory`` given for plain ``Index`` shards or missing for factory-made ones; shards of another
            class than the manifest records, or that disagree; a bad ``timeout``.
        ShardError
            Actors that did not start within ``timeout``.

        Examples
        --------
        >>> index = ShardedIndex.load("my-index", mmap=True)  # doctest: +SKIP
        """
        directory = Path(path).resolve()
        manifest = read_manifest(directory)
        try_remove_stale(directory)
        verify_shard_files(directory, manifest)
        config = manifest["config"]
        settings = None if config["index"] is None else IndexSettings.from_dict(config["index"], str(directory / MANIFEST))
        if (index_factory is None) == (settings is None):
            raise ValueError(f"{directory}: shards are {config.get('index_class')}; "
                             + ("pass the index_factory that made them" if index_factory is None
                                else "they are plain Index shards, load them without index_factory"))
        self = cls.__new__(cls)
        self._start(config, settings, index_factory, directory, mmap, max_restarts, actor_options, timeout)
        if self.index_class != config.get("index_class"):
            self.close()
            raise ValueError(f"{directory}: shards were {config.get('index_class')}, loaded as {self.index_class}")
        return self
