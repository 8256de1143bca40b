"""Streaming floors of decode attention on the GPU: how fast 4-bit K/V codes can be read, and read and decoded.

For each context (batch 1, 8 KV heads, head_dim 128, 4-bit keys and values: 64 bytes per token and side), two
minimal Triton kernels stream code bytes of the same size as the decode step's, spread over every SM:

* *read*: load the bytes (16-byte loads) and xor-fold them (nothing else);
* *read + decode*: load them and turn every nibble into its float16 codebook level with the decode-attention
  kernel's decoder (:func:`tqvec.kernels.unpack.nibble_pairs`), then xor-fold the levels.

Each floor is the fastest over a few program shapes (:data:`SHAPES`: bytes per loop step × programs per SM).

Beside them, in the same run: the empty floor (a graph replaying one trivial kernel), the tqvec decode step and fp16
SDPA (both graph-replayed, L2 flushed, as in ``bench.kv_gpu``). Attention built on this decoder has at least the
*read + decode* work to do; the floors (the best of a few shapes of a simple kernel, not proven bounds) show roughly
how far below them it can get.

``python -m tqvec.bench.kv_gpu_floor --out DIR`` writes ``kv_gpu_floor.json`` / ``kv_gpu_floor.md``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tqvec import scan
from tqvec.kernels.launch import cdiv
from tqvec.kernels.unpack import nibble_pair_asm, nibble_pairs
from tqvec.kv.codec import HeadCodec

from .kv_gpu import HKV, HQ, RESULTS, D, _time_ms, random_step

#: (bytes per program per loop step, programs per SM) tried for both floors; each floor is the fastest of them
SHAPES = ((4096, 4), (4096, 8), (4096, 16), (16384, 4), (16384, 8), (16384, 16))


@triton.jit
def _read_fold(ptr, out_ptr, n_words, words_per_program, BLOCK: tl.constexpr):
    """Program ``p``: xor of int32 words ``[p·words_per_program, …)`` of ``ptr`` (``n_words`` in all) → ``out[p]``."""
    pid = tl.program_id(0)
    start = pid * words_per_program
    stop = tl.minimum(start + words_per_program, n_words)
    acc = tl.zeros((BLOCK,), tl.int32)
    for w0 in range(start, stop, BLOCK):
        offs = w0 + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < stop, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


@triton.jit
def _decode_fold(ptr, levels_ptr, out_ptr, n_bytes, bytes_per_program, ASM: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``p``: xor of the float16 levels (as int16) of the nibbles of bytes ``[p·bytes_per_program, …)``."""
    pid = tl.program_id(0)
    start = pid * bytes_per_program
    stop = tl.minimum(start + bytes_per_program, n_bytes)
    acc = tl.zeros((BLOCK,), tl.int16)
    for b0 in range(start, stop, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        low, high = nibble_pairs(tl.load(ptr + offs, mask=offs < stop, other=0), levels_ptr, ASM)
        acc ^= low.to(tl.int16, bitcast=True) ^ high.to(tl.int16, bitcast=True)
    tl.store(out_ptr + pid, tl.xor_sum(acc.to(tl.int32), axis=0))


def fold(codes: torch.Tensor, levels: torch.Tensor, asm: str, block: int, programs: int, decode: bool) -> torch.Tensor:
    """Launch one floor kernel over ``codes`` (uint8, a multiple of 4 bytes) with ``programs`` programs of ``block``
    bytes per loop step: ``(programs,)`` int32 partial xors of the words (``decode`` False) or of the float16 levels
    (as int16, sign-extended) of every nibble (``levels``: the codebook table, levels first; ``asm``: the decoder or
    "")."""
    out = torch.empty(programs, dtype=torch.int32, device=codes.device)
    words = codes.view(torch.int32)
    per_words = cdiv(cdiv(words.numel(), programs), block // 4) * (block // 4)
    if decode:
        _decode_fold[(programs,)](codes, levels, out, codes.numel(), 4 * per_words, ASM=asm, BLOCK=block)
    else:
        _read_fold[(programs,)](words, out, words.numel(), per_words, BLOCK=block // 4)
    return out


def _stream_us(context: int, iters: int) -> tuple[list[float], list[float]]:
    """Graph-replayed µs of the read floor and of the read + decode floor over one context's code bytes, per shape of
    :data:`SHAPES`."""
    codes = torch.randint(0, 256, (_code_bytes(context),), dtype=torch.uint8, device="cuda")
    levels = HeadCodec(D, 4).groups[0].quantizer.table("cuda").levels
    asm = nibble_pair_asm(levels[0])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    read_us, decode_us = [], []
    for block, per_sm in SHAPES:
        for decode, times in ((False, read_us), (True, decode_us)):
            times.append(1000 * _time_ms(lambda: fold(codes, levels, asm, block, per_sm * sms, decode),  # noqa: B023
                                         iters, graph=True))
    return read_us, decode_us


def _code_bytes(context: int) -> int:
    """Key and value code bytes of one decode step: 8 KV heads, head_dim 128, 4 bits per channel."""
    return 2 * HKV * context * D // 2


def _step_us(context: int, iters: int) -> float:
    """Graph-replayed µs of the tqvec decode step (as ``bench.kv_gpu``)."""
    step = random_step(1, context, 4, 128)
    return 1000 * _time_ms(lambda: scan.attend(step), iters, graph=True)


def _sdpa_us(context: int, iters: int) -> float:
    """Graph-replayed µs of fp16 SDPA (as ``bench.kv_gpu``)."""
    g = torch.Generator(device="cuda").manual_seed(context)
    q = torch.randn(1, HQ, 1, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(1, HKV, context, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(1, HKV, context, D, device="cuda", dtype=torch.float16, generator=g)
    return 1000 * _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), iters, graph=True)


def floor_row(context: int, iters: int) -> dict[str, float]:
    """Graph-replayed µs at one context: read floor, read + decode floor, tqvec step, fp16 SDPA."""
    read_us, decode_us = _stream_us(context, iters)
    row = {"context": context, "code_bytes": _code_bytes(context), "read_us": min(read_us), "decode_us": min(decode_us),
           "read_us_by_shape": read_us, "decode_us_by_shape": decode_us,
           "tqvec_us": _step_us(context, iters), "sdpa_us": _sdpa_us(context, iters)}
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def empty_us(iters: int) -> float:
    """Graph-replayed µs of one trivial kernel (the timing floor every row carries)."""
    x = torch.zeros(1, device="cuda")
    return 1000 * _time_ms(lambda: x.add_(1), iters, graph=True)


def _markdown(empty: float, rows: list[dict], command: str, device: str) -> str:
    out = [f"# Streaming floors of decode attention on {device} (batch 1, 4-bit K/V, 8 KV heads, d 128)", "",
           f"Command: `{command}`. Graph-replayed medians, L2 flushed before each call. Code MB: key and value codes "
           "(the step also reads 4 bytes of scales per token and head). Read, read + decode: the fastest of "
           f"{len(SHAPES)} program shapes (bytes per loop step × programs per SM: {SHAPES}). GB/s: code bytes per "
           "second. Targets: the issue's 2× (32k) and 3× (128k) of fp16 SDPA in this run.", "",
           f"Empty floor (one trivial kernel replayed from a graph): {empty:.1f} µs.", "",
           "| context | code MB | read µs | read GB/s | read + decode µs | decode GB/s | tqvec step µs | fp16 SDPA µs "
           "| SDPA / 2 µs | SDPA / 3 µs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mb = r["code_bytes"] / 1e6
        out.append(f"| {r['context']} | {mb:.1f} | {r['read_us']:.1f} | {r['code_bytes'] / r['read_us'] / 1e3:.0f} | "
                   f"{r['decode_us']:.1f} | {r['code_bytes'] / r['decode_us'] / 1e3:.0f} | {r['tqvec_us']:.1f} | "
                   f"{r['sdpa_us']:.1f} | {r['sdpa_us'] / 2:.1f} | {r['sdpa_us'] / 3:.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Measure the floors and write ``kv_gpu_floor.json`` / ``kv_gpu_floor.md`` under ``--out``."""
    p = argparse.ArgumentParser(prog="tqvec bench kv-gpu-floor", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.kv_gpu_floor needs a CUDA device")
    command = "python -m tqvec.bench.kv_gpu_floor " + shlex.join(argv if argv is not None else sys.argv[1:])
    empty = empty_us(args.iters)
    rows = [floor_row(context, args.iters) for context in args.contexts]
    device = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_gpu_floor.json").write_text(json.dumps(
        {"command": command, "device": device, "shapes": SHAPES, "empty_us": empty, "rows": rows}, indent=2))
    (args.out / "kv_gpu_floor.md").write_text(_markdown(empty, rows, command, device))


if __name__ == "__main__":
    main()
