"""rows_as_m.patch applied: the rows-as-M fused int8 stage 1 gives the same floats as group_max_kernel (bias or none,
groups of 16 and 32, 24 / 40 / 64 channels, products by subtraction or converted) and the reference's search answer.
Run with tests/ and tests/support on the path (call.sh)."""
import pytest
import torch
from test_kernels import KERNEL_DEVICE, assert_topk_equal, dev, make_case, stage1_config

from tqvec import scan
from tqvec.kernels import ops


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("dim", [24, 40, 64])
@pytest.mark.parametrize("limit", [None, -1])
def test_rows_as_m_equals(monkeypatch, bias, group, dim, limit):
    if limit is not None:
        monkeypatch.setattr(ops, "FAST_CONVERSION_MAX_ABS_SUM", limit)
    tq, cpu_block, dev_block, rotated, _ = make_case(4, "mse", dim, n=300, nq=20, bias=bias)
    changes, config = stage1_config("fused", group)
    maxima = {}
    for rows in (True, False):
        monkeypatch.setattr(ops, "INT8_ROWS_AS_M", rows)
        with ops.configured(**changes):
            maxima[rows] = ops.group_maxima(dev(rotated), None, dev_block, tq.table(KERNEL_DEVICE), config).cpu()
            got = ops.search(dev(rotated), dev_block, tq.table(KERNEL_DEVICE), 7, config=config)
        assert_topk_equal(got, scan.search(rotated, cpu_block, tq.table("cpu"), 7),
                          scan.scores(rotated, cpu_block, tq.table("cpu")))
    assert torch.isfinite(maxima[True]).all() and torch.equal(maxima[True], maxima[False])
