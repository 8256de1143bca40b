"""The streaming-floor kernels of ``bench.kv_gpu_floor`` touch every byte they claim to (else the floor would be a
fake): their partial xors combine to the xor of all words, or of all decoded levels, for any program count."""
from __future__ import annotations

import functools

import pytest
import torch
from kernel_env import KERNEL_DEVICE, needs_kernels

from tqvec.bench.kv_gpu_floor import fold
from tqvec.kernels.unpack import nibble_pair_asm
from tqvec.kv.codec import HeadCodec


def _xor(values: torch.Tensor) -> int:
    return functools.reduce(lambda a, b: a ^ b, values.tolist(), 0)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("decode", [False, True])
def test_fold_covers_every_byte(programs: int, decode: bool) -> None:
    gen = torch.Generator().manual_seed(programs)
    codes = torch.randint(0, 256, (1_000,), dtype=torch.uint8, generator=gen)  # not a multiple of the block
    levels = HeadCodec(128, 4).groups[0].quantizer.table("cpu").levels
    asm = "" if KERNEL_DEVICE == "cpu" else nibble_pair_asm(levels[0])
    got = _xor(fold(codes.to(KERNEL_DEVICE), levels.to(KERNEL_DEVICE), asm, 64, programs, decode).cpu())
    if decode:
        half = levels[0, :16].half().view(torch.int16).to(torch.int32)
        want = _xor(half[codes.long() & 15]) ^ _xor(half[codes.long() >> 4])
    else:
        want = _xor(codes.view(torch.int32))
    assert got == want
    codes[-1] ^= 1  # the last byte counts
    assert _xor(fold(codes.to(KERNEL_DEVICE), levels.to(KERNEL_DEVICE), asm, 64, programs, decode).cpu()) != want
