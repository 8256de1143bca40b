"""Bad input raises ValueError naming the problem; zero vectors and empty batches work."""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from tqvec import TurboQuantizer, validation

pytestmark = pytest.mark.usefixtures("single_torch_thread")

DIM = 24  # not a power of two: hadamard pads to 32
MODES = [("mse", "haar"), ("mse", "hadamard"), ("prod", "haar"), ("prod", "hadamard")]


@pytest.fixture(scope="module", params=MODES, ids=["-".join(m) for m in MODES])
def quantizer(request: pytest.FixtureRequest) -> TurboQuantizer:
    mode, rotation = request.param
    return TurboQuantizer(DIM, 3, mode, rotation=rotation, seed=1)


def good(n: int = 4, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)


# ---------------------------------------------------------------- constructor
@pytest.mark.parametrize("kwargs, message", [
    ({"bits": 0}, "bits"), ({"bits": 0.5}, "bits"), ({"bits": 8.5}, "bits"), ({"bits": 9}, "bits"),
    ({"bits": -1}, "bits"), ({"bits": float("nan")}, "bits"), ({"bits": "4"}, "bits"), ({"bits": True}, "bits"),
    ({"mode": "fast"}, "mode"), ({"mode": "MSE"}, "mode"), ({"rotation": "dct"}, "rotation"),
    ({"dim": 0}, "dim"), ({"dim": 1}, "dim"), ({"dim": 2.0}, "dim"), ({"dim": -5}, "dim"),
    ({"mode": "prod", "rescale": True}, "rescale"), ({"seed": 1.5}, "seed"), ({"seed": -1}, "seed"),
    ({"seed": True}, "seed"), ({"seed": None}, "seed"),
])
def test_constructor_rejects(kwargs: dict, message: str) -> None:
    args = {"dim": DIM, **kwargs}
    with pytest.raises(ValueError, match=message):
        TurboQuantizer(**args)


@pytest.mark.parametrize("bits", [1, 1.5, 2.5, 3.5, 8, np.float32(2.5), np.int64(4)])
def test_constructor_accepts_bit_range(bits: float) -> None:
    assert TurboQuantizer(DIM, bits).bits == float(bits)


# ---------------------------------------------------------------- encode / inner_product input
BAD_INPUTS = [
    (good(dim=DIM + 1), "has dimension 25, expected 24"),
    (good()[0], "2-D"),
    (good()[None], "2-D"),
    (np.array(1.0, dtype=np.float32), "2-D"),
    (np.float32(1.0), "numpy array or torch tensor"),
    (np.where(np.eye(4, DIM) > 0, np.nan, good()).astype(np.float32), "NaN or Inf"),
    (np.where(np.eye(4, DIM) > 0, np.inf, good()).astype(np.float32), "NaN or Inf"),
    (np.where(np.eye(4, DIM) > 0, -np.inf, good()).astype(np.float64), "NaN or Inf"),
    (np.ones((4, DIM), dtype=np.int64), "floats"),
    (np.ones((4, DIM), dtype=bool), "floats"),
    (np.ones((4, DIM), dtype=np.complex64), "floats"),
    (torch.ones(4, DIM, dtype=torch.int32), "floats"),
    (torch.full((4, DIM), float("nan")), "NaN or Inf"),
    (good().tolist(), "numpy array or torch tensor"),
]


@pytest.mark.parametrize("bad, message", BAD_INPUTS)
def test_encode_rejects(quantizer: TurboQuantizer, bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantizer.encode(bad)


@pytest.mark.parametrize("bad, message", BAD_INPUTS)
def test_inner_product_rejects_bad_queries(quantizer: TurboQuantizer, bad: object, message: str) -> None:
    codes = quantizer.encode(good())
    with pytest.raises(ValueError, match=f"^queries .*{re.escape(message)}"):
        quantizer.inner_product(bad, codes)


def test_error_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^x has dimension 5, expected 24$"):
        TurboQuantizer(DIM).encode(np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError, match=r"^queries contains NaN or Inf$"):
        q = TurboQuantizer(DIM)
        q.inner_product(np.full((1, DIM), np.nan, np.float32), q.encode(good()))


# ---------------------------------------------------------------- zero vectors and empty batches
def test_zero_vectors(quantizer: TurboQuantizer) -> None:
    """Zero rows encode without NaN, decode to exactly 0 and score exactly 0; other rows are unaffected."""
    x = good(6)
    x[[1, 4]] = 0.0
    codes = quantizer.encode(x)
    for t in codes._tensors():
        if t.is_floating_point():
            assert torch.isfinite(t).all()
    decoded = quantizer.decode(codes)
    assert torch.equal(decoded[[1, 4]], torch.zeros(2, DIM))
    scores = quantizer.inner_product(good(3), codes)
    assert torch.equal(scores[:, [1, 4]], torch.zeros(3, 2))
    alone = quantizer.encode(x[[0, 2, 3, 5]])
    torch.testing.assert_close(quantizer.decode(alone), decoded[[0, 2, 3, 5]])
    assert torch.equal(quantizer.inner_product(np.zeros((2, DIM), np.float32), codes), torch.zeros(2, 6))


def test_zero_vector_with_rescale() -> None:
    q = TurboQuantizer(DIM, 2, rescale=True)
    assert torch.equal(q.decode(q.encode(np.zeros((2, DIM), np.float32))), torch.zeros(2, DIM))


def test_empty_batches(quantizer: TurboQuantizer) -> None:
    empty = quantizer.encode(np.zeros((0, DIM), np.float32))
    assert len(empty) == 0 and empty.nbytes == 0
    assert empty.packed.shape == (0, quantizer.layout.row_bytes)
    assert tuple(quantizer.decode(empty).shape) == (0, DIM)
    assert tuple(quantizer.inner_product(good(3), empty).shape) == (3, 0)
    codes = quantizer.encode(good(5))
    scores = quantizer.inner_product(torch.zeros(0, DIM), codes)
    assert tuple(scores.shape) == (0, 5) and scores.dtype == torch.float32
    assert len(quantizer.encode(torch.zeros(0, DIM, dtype=torch.float64))) == 0


# ---------------------------------------------------------------- helpers directly
def test_as_float_matrix() -> None:
    out = validation.as_float_matrix(np.ones((2, 3), np.float16), 3)
    assert out.dtype == torch.float32 and tuple(out.shape) == (2, 3)
    assert validation.as_float_matrix(torch.ones(2, 3, dtype=torch.bfloat16), 3).dtype == torch.float32
    with pytest.raises(ValueError, match="vecs has dimension 4, expected 3"):
        validation.as_float_matrix(np.ones((2, 4)), 3, "vecs")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_read_only_arrays_are_copied_without_a_warning(dtype: type) -> None:
    """A read-only array (a Ray object, a memmap opened "r") is copied: torch warns on, and must not alias, memory it
    cannot write."""
    x = good().astype(dtype)
    x.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = validation.as_float_matrix(x, DIM)
    assert out.numpy().flags.writeable and np.array_equal(out.numpy(), x.astype(np.float32))


def test_finiteness_check_fast_path_is_exact() -> None:
    """A single NaN, +inf or −inf anywhere is rejected, also where +inf and −inf would cancel to NaN; a row whose
    squared norm overflows float32 scoring is rejected with its number (issue 20, item 1), while rows that only
    the cheap bound (d · max|x|²) flags, but whose exact norms fit, are accepted."""
    big = np.full((4, 3), 3e38, np.float32)
    for x in (big, -big):
        with pytest.raises(ValueError, match="x row 0 has squared L2 norm"):
            validation.as_float_matrix(x, 3)
    for bad in ([np.nan], [np.inf], [-np.inf], [np.inf, -np.inf]):
        x = np.ones((5, 3), np.float32)
        x.flat[[4, 11][: len(bad)]] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            validation.as_float_matrix(x, 3)
        with pytest.raises(ValueError, match="NaN or Inf"):
            validation.as_float_matrix(torch.from_numpy(x).double(), 3)
    with pytest.raises(ValueError, match="NaN or Inf"):  # beyond float32's range
        validation.as_float_matrix(np.full((1, 3), 1e39), 3)
    edge = np.zeros((3, 3), np.float32)
    edge[0, 0] = edge[1, 1] = -8e17  # 6.4e35 per row, but 3 · (8e17)² = 1.9e36 > MAX_SQUARED_NORM
    assert torch.equal(validation.as_float_matrix(edge, 3), torch.from_numpy(edge))
    edge[2] = 8e17  # 3 · 6.4e35 in one row
    with pytest.raises(ValueError, match="x row 2 has squared L2 norm 1.92e\\+36"):
        validation.as_float_matrix(edge, 3)
    assert 3 * 8e17**2 > validation.MAX_SQUARED_NORM > 8e17**2


def _error(call, *args) -> str | None:
    try:
        call(*args)
    except ValueError as err:
        return str(err)
    return None


HUGE = np.zeros((3, DIM), np.float32)
HUGE[2] = 1e18  # finite, but its squared norm overflows float32 scoring


@pytest.mark.parametrize("bad, message", [*BAD_INPUTS, (HUGE, "row 2 has squared L2 norm")])
def test_as_float_array_raises_as_float_matrix_does(bad: object, message: str) -> None:
    """The numpy fast path of the native search (float32 C-contiguous input) and its fallback raise exactly the
    errors of as_float_matrix, also through Index.search and IVFIndex.search."""
    from tqvec import Index, IVFIndex

    expected = _error(validation.as_float_matrix, bad, DIM, "queries")
    assert expected is not None and message in expected
    assert _error(validation.as_float_array, bad, DIM, "queries") == expected
    flat, ivf = Index(DIM, 4, "l2"), IVFIndex(DIM, 2, 4, "l2")
    flat.add(good(100))
    ivf.add(good(100))
    assert _error(flat.search, bad, 3) == expected
    assert _error(ivf.search, bad, 3) == expected


@pytest.mark.parametrize("x", [
    good(), good(0), good().astype(np.float64), good().astype(np.float16), np.asfortranarray(good()),
    good(8)[::2], np.full((2, DIM), 1e17, np.float32), torch.from_numpy(good()), torch.from_numpy(good()).bfloat16(),
], ids=["float32", "empty", "float64", "float16", "fortran", "strided", "large", "torch", "bfloat16"])
def test_as_float_array_equals_as_float_matrix(x: object) -> None:
    out = validation.as_float_array(x, DIM)
    assert out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, validation.as_float_matrix(x, DIM).numpy())
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous:
        assert out is x  # checked in place, no copy


def test_requires_grad_is_detached() -> None:
    x = torch.ones(2, 3, requires_grad=True)
    out = validation.as_float_matrix(x, 3)
    assert not out.requires_grad and out.grad_fn is None


def test_longdouble_becomes_float32() -> None:
    assert validation.as_float_matrix(np.ones((2, 3), np.longdouble), 3).dtype == torch.float32


def test_check_helpers() -> None:
    assert validation.check_bits(8) == 8.0 and validation.check_bits(2.5) == 2.5
    with pytest.raises(ValueError, match="bits"):
        validation.check_bits(None)
    assert validation.check_choice("mode", "a", ["a", "b"]) == "a"
    with pytest.raises(ValueError, match="unknown mode 'c'"):
        validation.check_choice("mode", "c", ["a", "b"])
    assert validation.check_positive_int("k", np.int32(3)) == 3
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="k must be a positive integer"):
            validation.check_positive_int("k", bad)


def test_as_ids() -> None:
    np.testing.assert_array_equal(validation.as_ids(torch.tensor([3, 1])), [3, 1])
    assert validation.as_ids(7).tolist() == [7] and validation.as_ids([]).shape == (0,)
    with pytest.raises(ValueError, match="1-D"):
        validation.as_ids(np.zeros((2, 2), np.int64))
    for floats in ([1.5], [1.0, 2**63]):
        with pytest.raises(ValueError, match="ids must be integers, got dtype float64"):
            validation.as_ids(floats)
    with pytest.raises(ValueError, match="expected 3"):
        validation.as_ids([1, 2], n=3)
    for bad in ([-1], [2**63 - 1], [2**63], np.array([2**64 - 1], np.uint64), [2**80], np.array([-3], np.int16),
                [2**63, 5], (5, 2**64)):  # mixed with small ints, numpy would make these float64
        with pytest.raises(ValueError, match=r"ids must lie in \[0, 9223372036854775806\]"):
            validation.as_ids(bad)
    assert validation.as_ids(np.array([validation.MAX_ID], np.uint64)).tolist() == [validation.MAX_ID]


def test_check_seed_and_device() -> None:
    assert validation.check_seed(0) == 0 and validation.check_seed(np.int64(validation.MAX_SEED)) == validation.MAX_SEED
    for bad in (-1, validation.MAX_SEED + 1, 2**64, 1.0, True, "1"):
        with pytest.raises(ValueError, match="seed must be an integer"):
            validation.check_seed(bad)
    assert validation.as_device("cpu") == torch.device("cpu")
    for bad in ("cuda:99", "nonsense", "meta"):
        with pytest.raises(ValueError, match="device"):
            validation.as_device(bad)
