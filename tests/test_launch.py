"""Host-side launch helpers: grid arithmetic equal to Triton's own (which is slow to call from Python)."""
from __future__ import annotations

import triton

from tqvec.kernels.launch import cdiv, pow2


def test_cdiv_and_pow2_equal_tritons() -> None:
    assert all(cdiv(x, y) == triton.cdiv(x, y) for x in range(301) for y in range(1, 41))
    assert all(pow2(x) == triton.next_power_of_2(x) for x in range(1, 5001))
