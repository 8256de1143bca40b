"""``ShardedIndex``: one tqvec index per Ray actor, scatter-gather search; ``build_shards``: bulk encoding
with Ray Data. Needs the ``ray`` extra (``pip install "tqvec[ray]"``).

Modules, one job each: :mod:`~tqvec.distributed.settings` (``IndexSettings``, the shards' ``Index``
configuration), :mod:`~tqvec.distributed.routing` (which shard holds an id),
:mod:`~tqvec.distributed.manifest` (the saved directory: manifest, checks, writer lock, stale files),
:mod:`~tqvec.distributed.actor` (one shard in a Ray actor), :mod:`~tqvec.distributed.client`
(``ShardedIndex``, failures, the top-k merge) and :mod:`~tqvec.distributed.build` (``build_shards``).

Identical scores. A sharded search returns the scores that one :class:`~tqvec.index.Index` with the same
settings returns over the same data, bit for bit, and the same ids except where scores tie exactly
(duplicate vectors: their order is unspecified in ``Index`` too). Every shard encodes with the same
``seed``, hence the same rotation and codebook, and, where the correction centers, with the same frozen
center. :class:`ShardedIndex` computes that center exactly as ``Index`` does, as the mean of its first
non-empty ``add`` call, and hands it to every shard; :func:`build_shards` takes it as ``center=`` (for
instance ``Index.center`` of an index built earlier) or computes the mean of all the data in one extra
pass. Shards made by an index factory (e.g. an IVF index) freeze whatever they freeze from their own data.

Example::

    >>> from tqvec.distributed import IndexSettings, ShardedIndex  # doctest: +SKIP
    >>> with ShardedIndex(IndexSettings(384, bits=4, metric="cosine"), n_shards=4) as index:  # doctest: +SKIP
    ...     index.add(x)
    ...     D, I = index.search(q, 10)
    ...     index.save("my-index")
"""
from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("tqvec.distributed needs Ray, which is not installed: pip install 'tqvec[ray]'") from err

from .build import ENCODER_CPUS, build_shards
from .client import ShardedIndex, ShardError, merge_topk
from .manifest import LOCK, MANIFEST, MANIFEST_KIND, MANIFEST_VERSION, read_manifest
from .routing import ROUTINGS, shard_of, splitmix64
from .settings import IndexSettings

__all__ = ["ENCODER_CPUS", "IndexSettings", "LOCK", "MANIFEST", "MANIFEST_KIND", "MANIFEST_VERSION", "ROUTINGS",
           "ShardError", "ShardedIndex", "build_shards", "merge_topk", "read_manifest", "shard_of", "splitmix64"]
