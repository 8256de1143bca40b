"""Which shard holds an id: computed from the id alone, so ``remove`` and ``reconstruct`` go straight to it.

``routing="hash"`` puts id ``i`` on shard ``splitmix64(i) mod n`` (stable across processes and versions,
unlike Python's ``hash``); ``routing="round_robin"`` is for indexes that number their vectors themselves
(consecutive ids) and puts id ``i`` on shard ``i mod n``, round-robin in insertion order.
"""
from __future__ import annotations

import numpy as np

ROUTINGS = ("hash", "round_robin")


def splitmix64(ids: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer of each id.

    Parameters
    ----------
    ids : array-like of shape (n,)
        Integers, read as int64 and then as uint64 (two's complement).

    Returns
    -------
    numpy.ndarray of shape (n,), uint64

    Examples
    --------
    >>> hex(int(splitmix64(np.array([0]))[0]))
    '0xe220a8397b1dcdaf'
    """
    z = np.asarray(ids, np.int64).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def shard_of(ids: np.ndarray, n_shards: int, routing: str = "hash") -> np.ndarray:
    """Shard number of each id.

    Parameters
    ----------
    ids : array-like of shape (n,)
        Integer ids.
    n_shards : int
        Number of shards, ≥ 1.
    routing : {"hash", "round_robin"}
        The rule (module docstring).

    Returns
    -------
    numpy.ndarray of shape (n,), int64
        Shard numbers in ``[0, n_shards)``.

    Examples
    --------
    >>> shard_of(np.arange(5), 2, "round_robin").tolist()
    [0, 1, 0, 1, 0]
    """
    ids = np.asarray(ids, np.int64)
    if routing == "round_robin":
        return ids % n_shards
    return (splitmix64(ids) % np.uint64(n_shards)).astype(np.int64)


def route(ids: np.ndarray, n_shards: int, routing: str) -> dict[int, np.ndarray]:
    """Positions into ``ids`` ``(n,)`` of each shard's ids, by shard number (shards with none left out)."""
    shards = shard_of(ids, n_shards, routing)
    return {int(s): np.flatnonzero(shards == s) for s in np.unique(shards)}
