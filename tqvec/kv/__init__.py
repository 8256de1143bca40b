"""KV-cache compression for Hugging Face transformers with TurboQuant codes.

Three lines turn it on::

    cache = TurboQuantCache(model.config, key_bits=3.5, value_bits=3.5)
    model.set_attn_implementation("tqvec")
    model.generate(**inputs, past_key_values=cache)   # or cache=cache in newer transformers

:class:`StaticTurboQuantCache` (``tqvec.kv.static``) preallocates its buffers for ``max_cache_len`` tokens so that a
decode step can be captured in a CUDA graph and replayed (docs/kv.md).

Importing this package registers the ``"tqvec"`` attention and mask functions.
"""
from .attention import NAME, register
from .cache import CompressedKV, TurboQuantCache, TurboQuantLayer
from .codec import HeadCodec
from .static import StaticKV, StaticTurboQuantCache, StaticTurboQuantLayer

register()

__all__ = ["NAME", "CompressedKV", "HeadCodec", "StaticKV", "StaticTurboQuantCache", "StaticTurboQuantLayer",
           "TurboQuantCache", "TurboQuantLayer", "register"]
