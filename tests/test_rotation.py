"""The seeded rotations (tqvec.rotation): orthogonal, invertible, deterministic in the seed, batch-invariant."""
from __future__ import annotations

import pytest
import torch

from tqvec.rotation import ROTATION_KINDS, make_rotation

pytestmark = pytest.mark.usefixtures("single_torch_thread")

DIMS = [1, 50, 93, 128, 384, 784]


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("kind", ROTATION_KINDS)
def test_rotation_is_orthogonal_and_inverse_undoes_it(kind: str, dim: int) -> None:
    """The matrix of ``forward`` (its rows on the basis) has orthonormal columns (float32 products: 1e-5), so norms
    and inner products are kept, and ``inverse`` maps the rotated vectors back."""
    rotation = make_rotation(kind, dim, seed=5)
    matrix = rotation.forward(torch.eye(dim)).double()  # (dim, out_dim): row i = forward(e_i)
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(dim, dtype=torch.float64), atol=1e-5, rtol=0)
    x = torch.randn(7, dim, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(rotation.inverse(rotation.forward(x)), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ROTATION_KINDS)
def test_rotation_depends_on_seed_alone(kind: str) -> None:
    """The same seed gives bit-identical outputs; another seed another rotation."""
    x = torch.randn(4, 93, generator=torch.Generator().manual_seed(7))
    a, b, c = (make_rotation(kind, 93, seed).forward(x) for seed in (1, 1, 2))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c, atol=1e-3)


@pytest.mark.parametrize("kind", ROTATION_KINDS)
def test_rotation_is_batch_invariant(kind: str) -> None:
    """Row i of a batch is rotated to the same bits as row i alone (stored codes must not depend on the batch), on one
    thread as the module runs."""
    rotation = make_rotation(kind, 384, seed=8)
    x = torch.randn(45, 384, generator=torch.Generator().manual_seed(9))
    batch = rotation.forward(x)
    for i in (0, 17, 44):
        assert torch.equal(batch[i:i + 1], rotation.forward(x[i:i + 1]))


def test_unknown_rotation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown rotation 'kac'"):
        make_rotation("kac", 16, seed=0)
