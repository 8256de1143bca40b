"""Argument checks of the KV cache: each raises ``ValueError`` (``TypeError`` for a wrong type) naming the argument.

The finite-value check :func:`check_finite` is written for ``torch.compile``: it never turns a tensor into a
Python bool while a graph is being traced (``torch.compiler.is_compiling()``), where it records an
asynchronous assertion instead (:func:`torch._assert_async`), so the traced ``update`` has no graph break.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, NoReturn

import torch

BITS_RANGE = (1.0, 8.0)


def check_bits(name: str, bits: Any) -> float:
    """``bits`` (a real number, fractional allowed) as a float in ``BITS_RANGE``.

    Raises ``TypeError`` for a non-number (a string, a bool, None) and ``ValueError`` for NaN, ±inf or a value
    outside the range: ``TurboQuantCache(cfg, key_bits=8.5)`` → ``ValueError: key_bits must lie in [1, 8], got 8.5``.
    Fractional rates split a head's channels between ``floor(bits)`` and ``floor(bits) + 1`` bits, so both must lie
    in the range too.
    """
    if isinstance(bits, bool) or not isinstance(bits, numbers.Real):
        raise TypeError(f"{name} must be a number of bits per channel in [{BITS_RANGE[0]:g}, {BITS_RANGE[1]:g}], "
                        f"got {bits!r} ({type(bits).__name__})")
    value = float(bits)
    if math.isnan(value) or not BITS_RANGE[0] <= value <= BITS_RANGE[1]:
        raise ValueError(f"{name} must lie in [{BITS_RANGE[0]:g}, {BITS_RANGE[1]:g}] bits per channel, got {bits!r}")
    return value


def check_int(name: str, value: Any, low: int) -> int:
    """``value`` as an int ``>= low`` (bools and floats rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def check_choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    """``value`` if it is one of ``options``."""
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}")
    return value


def text_config(config: Any):
    """The decoder text config of a transformers ``PretrainedConfig`` (``model.config``).

    Raises ``TypeError`` for anything else, e.g. ``None`` or the model itself (a common slip:
    ``TurboQuantCache(model)`` instead of ``TurboQuantCache(model.config)``).
    """
    from transformers import PretrainedConfig  # noqa: PLC0415

    if not isinstance(config, PretrainedConfig):
        hint = " (pass model.config, not the model)" if hasattr(config, "config") else ""
        raise TypeError(f"config must be a transformers PretrainedConfig{hint}, got {type(config).__name__}")
    text = config.get_text_config(decoder=True)
    for field in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(text, field, None), int):
            raise ValueError(f"config has no integer {field}: not the config of a transformer decoder")
    return text


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or ±inf (under ``torch.compile``: an async assertion, no graph break).

    Eager: one reduction (a sum is finite iff every entry is, barring overflow, which the exact test then settles).
    """
    if torch.compiler.is_compiling():
        torch._assert_async(torch.isfinite(x).all(), f"{name} contains NaN or Inf")
        return
    if x.numel() and not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf")


def check_states(key_states: Any, value_states: Any, head_dim: int) -> None:
    """Shapes of a cache update: ``(b, h, t, head_dim)`` float tensors, ``head_dim`` the one the cache was built for.

    Raises ``ValueError`` naming the argument (a wrong ``head_dim`` names the config: the cache was built from
    another model's).
    """
    for name, x in (("key_states", key_states), ("value_states", value_states)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or not x.is_floating_point():
            got = (f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__)
            raise ValueError(f"{name} must be a (batch, heads, tokens, head_dim) float tensor, got {got}")
        if x.shape[-1] != head_dim:
            raise ValueError(f"config: the cache was built for head_dim {head_dim}, but the model's {name} have "
                             f"head_dim {x.shape[-1]}; build the cache from the model's own config (model.config)")
    if key_states.shape[:3] != value_states.shape[:3]:
        raise ValueError(f"key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)} differ "
                         "in (batch, heads, tokens)")


def refuse_tensor_use(handle: object, name: str) -> NoReturn:
    """Raise for a tensor attribute ``name`` (``shape``, ``dtype``, ``transpose``…) asked of a cache's read handle
    ``handle`` (a ``CompressedKV`` or ``StaticKV``): another attention function got it. ``TypeError`` saying how to
    select the ``tqvec`` attention and naming the cache class in use; dunder lookups stay ``AttributeError``, so copy
    and pickle protocols behave as usual."""
    if name.startswith("__"):
        raise AttributeError(name)
    cache = getattr(vars(handle).get("layer"), "cache_name", "TurboQuantCache")
    raise TypeError(
        f"an attention function other than 'tqvec' read {cache}'s compressed keys (it asked for .{name}): a {cache} "
        "is read by the 'tqvec' attention only. Call model.set_attn_implementation('tqvec') (registered by importing "
        "tqvec.kv) before running the model with this cache.")
