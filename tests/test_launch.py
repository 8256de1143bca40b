"""Host-side launch helpers: grid arithmetic equal to Triton's own (which is slow to call from Python)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from kernel_env import KERNEL_DEVICE

from tqvec.kernels.launch import Launcher, cdiv, pow2, resident_blocks


def test_cdiv_and_pow2_equal_tritons() -> None:
    assert all(cdiv(x, y) == triton.cdiv(x, y) for x in range(301) for y in range(1, 41))
    assert all(pow2(x) == triton.next_power_of_2(x) for x in range(1, 5001))


@pytest.mark.parametrize("registers,warps,shared,blocks", [
    (168, 4, 48 << 10, 3),  # registers bound: 65536 // (168 · 128)
    (170, 4, 0, 2),  # rounded up to 176 per thread: 65536 // (176 · 128), not // (170 · 128) = 3
    (64, 4, 100 << 10, 2),  # shared memory bound: 233472 // (102400 + 1024)
    (32, 4, 0, 16),  # threads bound: 2048 // 128
])
def test_resident_blocks_take_the_tightest_limit(monkeypatch: pytest.MonkeyPatch, registers: int, warps: int,
                                                 shared: int, blocks: int) -> None:
    """Blocks per multiprocessor of a compiled kernel on an H100-like device (64K registers, 228 KiB of shared memory,
    2,048 threads): the least of what its registers (8 per thread at a time), its shared memory (1 KiB reserved per
    block) and its threads allow."""
    props = SimpleNamespace(warp_size=32, regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                            max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    kernel = SimpleNamespace(_init_handles=lambda: None, n_regs=registers,
                             metadata=SimpleNamespace(num_warps=warps, shared=shared))
    assert resident_blocks(kernel, torch.device("cuda", 0)) == blocks


def test_bound_launch_fills_in_the_moving_arguments() -> None:
    """A kernel bound with one tensor fixed runs with the moving ones each call gives (on CUDA through the direct
    launch after the first call, else Triton's own launch or its interpreter); a call with too few arguments fails."""
    @triton.jit
    def add_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(y_ptr + i, mask=i < n) + tl.load(x_ptr + i, mask=i < n), mask=i < n)

    x = torch.arange(8, dtype=torch.float32, device=KERNEL_DEVICE)
    interpret = KERNEL_DEVICE == "cpu"
    bound = Launcher(add_kernel).bind({"x_ptr": x}, ("y_ptr", "n"), {"BLOCK": 8}, interpret)
    for n in (8, 5, 5):
        y = torch.ones(8, device=KERNEL_DEVICE)
        bound((1,), (y, n))
        assert y.tolist() == [1.0 + v if v < n else 1.0 for v in range(8)]
    with pytest.raises(TypeError, match="moving arguments"):
        bound((1,), (y,))
