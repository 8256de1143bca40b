"""``ShardActor``: one shard's index inside a Ray actor (the client wraps it with ``ray.remote``).

Every method returns ``(value, epoch)``. ``epoch`` is ``(token, file)``: a token drawn anew at each
(re)start and the name of the shard file the actor started from (None: it started empty). The client
compares epochs to notice restarts that lost unsaved changes.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..index import Index
from .manifest import MANIFEST, check_shard_file, file_entry, read_manifest
from .settings import IndexSettings

Epoch = tuple[str, "str | None"]  # (token of one actor start, the shard file it loaded)


class ShardActor:
    """Shard number ``shard``: a plain ``Index`` with ``settings``, or whatever ``make()`` returns.

    At every (re)start it loads the file that ``directory``'s manifest names for it (``mmap``: mapped
    read-only), or starts from ``make()`` when ``directory`` is None or holds no manifest yet.
    """

    def __init__(self, shard: int, make: Callable[[], Any], settings: IndexSettings | None, directory: str | None,
                 mmap: bool) -> None:
        self.shard, self.settings = shard, settings
        self.index, source = self._restore(make, directory, mmap)
        self.epoch: Epoch = (secrets.token_hex(8), source)

    def _restore(self, make: Callable[[], Any], directory: str | None, mmap: bool) -> tuple[Any, str | None]:
        """The shard and its file name, as its directory's manifest names it; a fresh index if none."""
        if directory is None or not (Path(directory) / MANIFEST).exists():
            return make(), None
        cls = Index if self.settings is not None else type(make())
        for _ in range(3):  # a concurrent save may delete the file between reading the manifest and opening
            entry = read_manifest(directory)["shards"][self.shard]
            try:
                path = check_shard_file(Path(directory), self.shard, entry)
                return (cls.load(path, mmap=True) if mmap else cls.load(path)), entry["file"]
            except FileNotFoundError:
                time.sleep(0.1)
        raise FileNotFoundError(f"shard {self.shard}: the file named by {directory}/{MANIFEST} is missing")

    def info(self) -> tuple[dict[str, Any], Epoch]:
        """Class, dim, metric, vector count and center (a list, or None) of the shard's index."""
        center = getattr(self.index, "center", None)
        return {"class": f"{type(self.index).__module__}.{type(self.index).__qualname__}", "dim": self.index.dim,
                "metric": self.index.metric, "count": len(self.index),
                "center": None if center is None else center.tolist()}, self.epoch

    def add(self, x: np.ndarray, ids: np.ndarray, center: np.ndarray | None) -> tuple[None, Epoch]:
        """Add ``x`` ``(n, dim)`` under ``ids`` ``(n,)``; ``center`` ``(dim,)``: the shared center to freeze
        first (plain ``Index`` shards). Raises ``ValueError`` if the shard froze another center."""
        if center is not None:
            have = self.index.center
            if have is None and len(self.index) == 0:
                self.index = self.settings.new_index(center)
            elif have is None or not np.array_equal(have, center):
                raise ValueError(f"shard {self.shard}: its center differs from the index's shared center")
        self.index.add(x, ids)
        return None, self.epoch

    def remove(self, ids: np.ndarray) -> tuple[int, Epoch]:
        """Remove ``ids``; returns how many (``KeyError`` for an unknown id)."""
        return self.index.remove(ids), self.epoch

    def search(self, q: np.ndarray, k: int, options: dict[str, Any]) -> tuple[tuple[np.ndarray, np.ndarray], Epoch]:
        """The shard's ``(D, I)`` for queries ``q`` ``(nq, dim)``; ``options`` go to its ``search``."""
        return self.index.search(q, k, **options), self.epoch

    def reconstruct(self, ids: np.ndarray) -> tuple[np.ndarray, Epoch]:
        """Decoded vectors ``(len(ids), dim)``."""
        return self.index.reconstruct(ids), self.epoch

    def count(self) -> tuple[int, Epoch]:
        """Vectors held."""
        return len(self.index), self.epoch

    def save(self, path: str) -> tuple[dict[str, Any], Epoch]:
        """Save the shard to ``path`` (atomically); returns its manifest entry."""
        self.index.save(path)
        return file_entry(Path(path), len(self.index)), self.epoch
