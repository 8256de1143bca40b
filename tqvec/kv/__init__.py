"""KV-cache compression for Hugging Face transformers with TurboQuant codes.

Three lines turn it on::

    cache = TurboQuantCache(model.config, key_bits=3.5, value_bits=3.5)
    model.set_attn_implementation("tqvec")
    model.generate(**inputs, cache=cache)

:class:`StaticTurboQuantCache` (``tqvec.kv.static``) preallocates its buffers for ``max_cache_len`` tokens so that a
decode step can be captured in a CUDA graph and replayed (docs/kv.md).

Importing this package registers the ``"tqvec"`` attention and mask functions; it needs transformers ≥ 5.24
(:mod:`tqvec.kv._requirements`) and says so with an ``ImportError`` otherwise.
"""
from . import _requirements  # noqa: F401 - first: names the transformers release needed before an import fails
from .attention import NAME, register
from .cache import CompressedKV, TurboQuantCache, TurboQuantLayer
from .codec import HeadCodec
from .static import StaticKV, StaticTurboQuantCache, StaticTurboQuantLayer

register()

__all__ = ["NAME", "CompressedKV", "HeadCodec", "StaticKV", "StaticTurboQuantCache", "StaticTurboQuantLayer",
           "TurboQuantCache", "TurboQuantLayer", "register"]
