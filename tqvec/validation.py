"""Input checks for the public API: one place for shape, dtype, finiteness and range errors.

Every function raises ``ValueError`` with a message that names the argument and what was expected.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def as_float_matrix(x: Any, dim: int, name: str = "x", device: torch.device | str | None = None) -> torch.Tensor:
    """``x`` as a finite float32 ``(n, dim)`` torch tensor (numpy or torch in; float16/32/64, bfloat16).

    ``n == 0`` is allowed. The tensor stays on its device unless ``device`` is given.
    """
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            raise ValueError(f"{name} must hold floats (float16/32/64), got dtype {x.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(x))
    elif not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must hold floats (float16/32/64 or bfloat16), got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n, {dim}), got {x.ndim}-D shape {tuple(x.shape)}")
    if x.shape[1] != dim:
        raise ValueError(f"{name} has dimension {x.shape[1]}, expected {dim}")
    if device is not None:
        x = x.to(device)
    x = x.to(torch.float32).contiguous()  # one memory layout, so results never depend on strides
    # a sum is finite whenever every entry is (IEEE: NaN and ±inf propagate), and one reduction is ~3x
    # cheaper than an elementwise check; only a non-finite sum (a bad entry, or overflow) needs the exact test
    if x.numel() and not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    return x


def check_choice(name: str, value: str, options: Iterable[str]) -> str:
    """``value`` if it is one of ``options``."""
    options = tuple(options)
    if value not in options:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, options))}")
    return value


def check_bits(bits: Any, low: float = 1, high: float = 8) -> float:
    """``bits`` as a float in ``[low, high]``; fractional rates allowed."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float, np.integer, np.floating)):
        raise ValueError(f"bits must be a number in [{low}, {high}], got {bits!r}")
    if not low <= float(bits) <= high:
        raise ValueError(f"bits must lie in [{low}, {high}], got {bits}")
    return float(bits)


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an int ≥ 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def as_ids(ids: Any, n: int | None = None, name: str = "ids") -> np.ndarray:
    """``ids`` as a 1-D int64 numpy array (of length ``n`` when given)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries, expected {n} (one per vector)")
    return arr.astype(np.int64, copy=False)
