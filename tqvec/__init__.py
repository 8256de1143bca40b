"""tqvec: TurboQuant vector quantization for ANN indexes and LLM KV caches.

Index types: :class:`Index` (flat), :class:`IVFIndex` (inverted lists) and :class:`ShardedIndex` (one index
per Ray actor; imported on first use, so Ray stays optional: without it, ``tqvec.ShardedIndex`` raises an
``ImportError`` that names the ``ray`` extra). :func:`load` opens any saved tqvec index by the kind its file
records.
"""
from __future__ import annotations

from typing import Any

from .codebook import Codebook, lloyd_max_codebook
from .files import load
from .index import Index
from .ivf import IVFIndex
from .quantizer import Codes, TurboQuantizer

__all__ = ["Codebook", "Codes", "IVFIndex", "Index", "ShardedIndex", "TurboQuantizer", "load", "lloyd_max_codebook"]
__version__ = "0.1.0"

#: names served by :func:`__getattr__` from the module that needs an optional extra: name -> (module, extra)
_LAZY = {"ShardedIndex": ("tqvec.distributed", "ray")}


def __getattr__(name: str) -> Any:
    """``tqvec.ShardedIndex``, imported on first use; raises ``ImportError`` naming the extra it needs."""
    if name not in _LAZY:
        raise AttributeError(f"module 'tqvec' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    module, extra = _LAZY[name]
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != extra:
            raise
        raise ImportError(f"tqvec.{name} needs Ray, which is not installed: pip install 'tqvec[{extra}]'",
                          name=err.name) from err
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
