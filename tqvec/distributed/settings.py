"""``IndexSettings``: the configuration of the plain :class:`~tqvec.index.Index` that every shard holds.

One object carries the ``Index`` arguments through :class:`~tqvec.distributed.ShardedIndex`,
:func:`~tqvec.distributed.build_shards`, the shard actors and the manifest, so none of them repeats
``Index``'s signature.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import storage
from ..index import Index


@dataclass(frozen=True)
class IndexSettings:
    """The arguments of :class:`~tqvec.index.Index` (same meaning, same defaults), checked and resolved.

    Construction builds one empty ``Index`` to check the arguments (``ValueError`` naming the bad one) and
    stores the resolved values: ``bits`` as a float and ``correction="auto"`` as the correction it picks,
    so equal settings give byte-identical shards (same seed, rotation and codebook).

    Example::

        >>> IndexSettings(384, bits=4, metric="cosine").correction  # "auto", resolved as Index resolves it
        'center'
    """

    dim: int
    bits: float = 4
    metric: str = "ip"
    mode: str = "mse"
    seed: int = 0
    rotation: str = "haar"
    correction: str = "auto"
    rerank_bits: float | None = None

    def __post_init__(self) -> None:
        template = Index(**self.as_dict())
        object.__setattr__(self, "bits", template.bits)
        object.__setattr__(self, "correction", template.correction)

    def as_dict(self) -> dict[str, Any]:
        """The settings as ``Index`` keyword arguments (JSON-serializable: the manifest stores them)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any, where: str) -> IndexSettings:
        """Settings read from a manifest; raises ``StorageError`` naming ``where`` if they are not valid."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, dict) or set(values) != names:
            raise storage.StorageError(f"{where}: index settings must have exactly the keys {sorted(names)}, "
                                       f"got {values!r}")
        try:
            return cls(**values)
        except (TypeError, ValueError) as err:
            raise storage.StorageError(f"{where}: invalid index settings ({err})") from err

    def new_index(self, center: np.ndarray | None = None) -> Index:
        """An empty ``Index`` with these settings; ``center`` ``(dim,)``: its centering vector, frozen now."""
        index = Index(**self.as_dict())
        if center is not None:
            index.set_center(center)
        return index
