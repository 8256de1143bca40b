"""Input checks for the public API: one place for shape, dtype, finiteness and range errors.

Every function raises ``ValueError`` with a message that names the argument and what was expected.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: largest accepted squared L2 norm of an input row, 2**120 ≈ 1.3e36 (norm ≈ 1.2e18): float32 stops at
#: 2**128, and scoring forms ‖q‖², ‖x‖² and ±2⟨q, x⟩ (sums up to 4× the larger squared norm) plus the
#: centering terms, so 2**8 of headroom keeps every intermediate finite
MAX_SQUARED_NORM = 2.0 ** 120
#: ids lie in ``[0, MAX_ID]``: int64 without the −1 "no result" marker, and ``MAX_ID + 1`` (the next
#: automatic id) still fits int64
MAX_ID = 2**63 - 2
#: seeds lie in ``[0, MAX_SEED]`` (torch generators take 64 bits; derived seeds add small offsets)
MAX_SEED = 2**63 - 1


def as_float_matrix(x: Any, dim: int, name: str = "x", device: torch.device | str | None = None) -> torch.Tensor:
    """``x`` as a finite float32 ``(n, dim)`` torch tensor (numpy or torch in; float16/32/64/longdouble, bfloat16),
    detached from autograd, every row's squared L2 norm at most :data:`MAX_SQUARED_NORM`.

    ``n == 0`` is allowed. The tensor stays on its device unless ``device`` is given. Raises ``ValueError``
    naming ``name`` for a non-float dtype, a wrong shape, NaN/±Inf (also values beyond float32's range), or
    a row whose squared norm would overflow scoring.

    >>> as_float_matrix(np.ones((2, 3)), 3).dtype
    torch.float32
    >>> as_float_matrix(np.full((1, 3), 1e20), 3)
    Traceback (most recent call last):
    ...
    ValueError: x row 0 has squared L2 norm 3e+40, more than the 1.3e+36 that float32 scoring can hold
    """
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            raise ValueError(f"{name} must hold floats (float16/32/64), got dtype {x.dtype}")
        # converted by numpy, not torch: torch's intra-op threads spin on after a parallel op and slow the native
        # search that follows; values beyond float32's range become inf, rejected below
        with np.errstate(over="ignore"):
            array = np.asarray(x, dtype=np.float32, order="C")
        if not array.flags.writeable:  # read-only memory (a Ray object, a read-only memmap): torch wants its own copy
            array = array.copy()
        x = torch.from_numpy(array)
    elif not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must hold floats (float16/32/64 or bfloat16), got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n, {dim}), got {x.ndim}-D shape {tuple(x.shape)}")
    if x.shape[1] != dim:
        raise ValueError(f"{name} has dimension {x.shape[1]}, expected {dim}")
    x = x.detach()  # autograd stops here: stored rows must never hold a graph (numpy() would refuse them)
    if device is not None:
        x = x.to(device)
    x = x.to(torch.float32).contiguous()  # one memory layout, so results never depend on strides
    if x.numel():
        check_row_norms(x, name)
    return x


def as_float_array(x: Any, dim: int, name: str = "x", *, check_values: bool = True) -> np.ndarray:
    """:func:`as_float_matrix` of ``x`` on the CPU, as a C-contiguous float32 numpy array: the same input
    accepted, the same ``ValueError`` raised.

    A float32 ``(n, dim)`` numpy array that is C-contiguous and aligned is returned as it is (no copy, no torch
    tensor) after numpy checks its values (:func:`check_array_norms`), or unchecked with ``check_values=False``
    (for a consumer that checks them itself, as the native search does); anything else goes through
    :func:`as_float_matrix`, which checks them.

    >>> x = np.ones((2, 3), np.float32)
    >>> as_float_array(x, 3) is x
    True
    >>> as_float_array(np.full((1, 3), np.nan, np.float32), 3, "queries")
    Traceback (most recent call last):
    ...
    ValueError: queries contains NaN or Inf
    """
    if (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 2 and x.shape[1] == dim
            and x.flags.c_contiguous and x.flags.aligned):
        if check_values:
            check_array_norms(x, name)
        return x
    return as_float_matrix(x, dim, name, "cpu").numpy()


def check_row_norms(x: torch.Tensor, name: str = "x") -> None:
    """Raise ``ValueError`` naming ``name`` if the float ``(n, d)`` tensor ``x`` holds NaN/±Inf or a row whose squared
    L2 norm exceeds :data:`MAX_SQUARED_NORM`.

    One pass (the largest magnitude, NaN propagating) decides almost every input: if ``d · max|x|²`` is within
    the limit, so is every row. Only otherwise are the exact per-row squared norms computed (in float64). CPU
    tensors but bfloat16 (which numpy lacks) are read by numpy (:func:`check_array_norms`).
    """
    if x.device.type == "cpu" and x.dtype != torch.bfloat16:  # numpy: no intra-op threads left spinning
        check_array_norms(x.numpy(), name)
        return
    low, high = torch.aminmax(x)
    if _beyond_bound(max(-float(low), float(high)), x.shape[1], name):
        _check_squared_norms(x.double().square().sum(1).cpu().numpy(), name)


def check_array_norms(x: np.ndarray, name: str = "x") -> None:
    """:func:`check_row_norms` of a float ``(n, d)`` numpy array, by ufunc reductions only: no BLAS call, whose
    threads spin on after it and slow the native search that follows."""
    if x.size and _beyond_bound(float(np.maximum.reduce(np.abs(x), axis=None)), x.shape[1], name):
        with np.errstate(over="ignore"):  # float64 input may overflow: inf, rejected
            _check_squared_norms(np.add.reduce(np.square(x, dtype=np.float64), axis=1), name)


def _beyond_bound(largest: float, dim: int, name: str) -> bool:
    """True when ``d · largest²`` exceeds :data:`MAX_SQUARED_NORM` (``largest``: the largest magnitude of a
    ``(n, d)`` matrix); ``ValueError`` naming ``name`` when ``largest`` is NaN or ±Inf."""
    if not math.isfinite(largest):
        raise ValueError(f"{name} contains NaN or Inf")
    return largest * largest * dim > MAX_SQUARED_NORM


def _check_squared_norms(squared: np.ndarray, name: str) -> None:
    """``ValueError`` naming ``name`` and the first row whose exact squared norm (``squared``, ``(n,)`` float64)
    exceeds :data:`MAX_SQUARED_NORM`."""
    bad = np.flatnonzero(squared > MAX_SQUARED_NORM)
    if len(bad):
        row = int(bad[0])
        raise ValueError(f"{name} row {row} has squared L2 norm {float(squared[row]):.3g}, more than the "
                         f"{MAX_SQUARED_NORM:.2g} that float32 scoring can hold")


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
    if type(value) is int and value >= 1:  # the common case, first (bool is a subclass, not this type)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def as_ids(ids: Any, n: int | None = None, name: str = "ids") -> np.ndarray:
    """``ids`` as a 1-D int64 numpy array (of length ``n`` when given), every id in ``[0, MAX_ID]``.

    Raises ``ValueError`` naming ``name`` for non-integers, a wrong shape or length, or an id outside
    ``[0, 2**63 − 2]`` (negative ids, −1 the "no result" marker among them, and ids that int64 cannot
    hold are refused rather than wrapped).

    >>> as_ids([3, 1]).tolist()
    [3, 1]
    >>> as_ids([-1])
    Traceback (most recent call last):
    ...
    ValueError: ids must lie in [0, 9223372036854775806], got -1
    """
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    try:
        arr = np.asarray(ids)
    except (OverflowError, ValueError) as err:
        raise ValueError(f"{name} must be a 1-D sequence of integers: {err}") from err
    if arr.dtype.kind == "f" and isinstance(ids, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):  # ints past int64 beside small ones: float64
        arr = np.asarray(ids, dtype=object)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype == object and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                                for i in arr):
        bad = next(int(i) for i in arr if not 0 <= int(i) <= MAX_ID)  # python ints too big for any numpy dtype
        raise ValueError(f"{name} must lie in [0, {MAX_ID}], got {bad}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries, expected {n} (one per vector)")
    if arr.size:
        low, high = arr.min(), arr.max()  # compared in their own dtype: uint64 never wraps here
        if low < 0 or high > MAX_ID:
            raise ValueError(f"{name} must lie in [0, {MAX_ID}], got {int(low) if low < 0 else int(high)}")
    return arr.astype(np.int64, copy=False)


def check_seed(seed: Any) -> int:
    """``seed`` as an int in ``[0, MAX_SEED]`` (``ValueError`` naming ``seed`` otherwise).

    >>> check_seed(7)
    7
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    return int(seed)


def as_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` that exists here: ``ValueError`` naming ``device`` for an unknown name or
    a CUDA device this machine lacks.

    >>> as_device("cpu")
    device(type='cpu')
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from err
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index is not None and dev.index >= count):
            raise ValueError(f"device {device!r} is not available here ({count} CUDA devices)")
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


# ------------------------------------------------------------------------------------------ loaded files
# Checks that index loaders run on a file's header (``meta``) and arrays before building anything the header
# implies. They raise ``ValueError`` naming the field; the loaders turn it into ``StorageError``.


def check_meta(meta: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    """``meta[name]`` if present and of ``kind`` (bool is not an int here); ``ValueError`` otherwise.

    >>> check_meta({"dim": 8}, "dim", int)
    8
    """
    if name not in meta:
        raise ValueError(f"the header lacks {name!r}")
    value = meta[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise ValueError(f"header field {name!r} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def check_array(arrays: dict[str, np.ndarray], name: str, dtype: str | None, shape: tuple[int | None, ...],
                bound: float | None = None) -> np.ndarray:
    """``arrays[name]`` if it has ``dtype`` (a numpy dtype string; None: any float) and ``shape`` (None: any
    size on that axis), and, with ``bound``, only finite entries of magnitude at most ``bound``.

    >>> check_array({"c": np.zeros(3, np.float32)}, "c", "<f4", (3,), bound=1.0).shape
    (3,)
    """
    if name not in arrays:
        raise ValueError(f"array {name!r} is missing")
    a = arrays[name]
    if (dtype is None and a.dtype.kind != "f") or (dtype is not None and a.dtype.str != dtype):
        raise ValueError(f"array {name!r} has dtype {a.dtype}, expected {dtype or 'a float type'}")
    if len(a.shape) != len(shape) or any(w is not None and s != w for s, w in zip(a.shape, shape)):
        want = tuple("n" if w is None else w for w in shape)
        raise ValueError(f"array {name!r} has shape {a.shape}, expected {want}")
    if bound is not None and a.size:
        low, high = float(a.min()), float(a.max())  # NaN propagates through min/max
        if not (math.isfinite(low) and math.isfinite(high)) or max(-low, high) > bound:
            raise ValueError(f"array {name!r} holds NaN, Inf or values beyond ±{bound:.3g}")
    return a


def check_file_ids(ids: np.ndarray, next_id: Any) -> None:
    """A file's ``ids`` (int64 ``(n,)``): in ``[0, MAX_ID]``, distinct, each below ``next_id`` ≤ ``MAX_ID + 1``."""
    if isinstance(next_id, bool) or not isinstance(next_id, int) or not 0 <= next_id <= MAX_ID + 1:
        raise ValueError(f"next_id must be an integer in [0, {MAX_ID + 1}], got {next_id!r}")
    if len(ids):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= next_id:
            raise ValueError(f"ids must lie in [0, next_id={next_id}), got {low if low < 0 else high}")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("duplicate ids")


def check_row_budget(arrays: dict[str, np.ndarray], row_arrays: Iterable[str], dim: int, bits: float) -> None:
    """The stored bytes per vector of ``row_arrays`` (codes and side fields: ``(n, ...)`` arrays) must fill the
    budget ``ceil(dim · bits / 8)`` that every tqvec index spends, less at most 8 bytes of layout slack.

    This ties ``dim`` to the arrays' widths before anything of size ``dim²`` (the rotation) is built.
    """
    budget = math.ceil(dim * bits / 8)
    stored = sum(arrays[name].dtype.itemsize * math.prod(arrays[name].shape[1:]) for name in row_arrays
                 if name in arrays)
    if not budget - 8 <= stored <= budget:
        raise ValueError(f"rows store {stored} bytes per vector, dim={dim} at bits={bits:g} needs "
                         f"{budget} (header and arrays disagree)")
