"""A small emulator of the straight-line PTX that tqvec's inline-asm decoders emit, so their arithmetic is checked on
the CPU (on CUDA the GPU runs them; CI has none).

Covers ``mov``, ``and``, ``shl``, ``shr``, ``sub`` (``.b32`` / ``.u32``), ``lop3.b32``, ``prmt.b32`` (default mode,
sign-replicate selectors included) and ``dp4a.s32.s32``, on 32-bit registers.
"""
from __future__ import annotations


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3``: bit ``i`` of the result is bit ``(a_i << 2) | (b_i << 1) | c_i`` of ``lut``."""
    out = 0
    for k in range(8):
        if (lut >> k) & 1:
            pick = lambda x, bit: x if bit else ~x  # noqa: E731
            out |= pick(a, k & 4) & pick(b, k & 2) & pick(c, k & 1)
    return out


def prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte ``i`` of the result is byte ``s & 7`` of the pool ``b:a`` for selector
    nibble ``s`` = bits ``4i … 4i + 3``, or that byte's sign bit replicated when ``s & 8``."""
    pool = a | (b << 32)
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 15
        byte = (pool >> (8 * (s & 7))) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if s & 8 else byte) << (8 * i)
    return out


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def dp4a(a: int, b: int, c: int) -> int:
    """PTX ``dp4a.s32.s32``: ``c`` + the dot product of the four signed bytes of ``a`` and of ``b``."""
    return _signed(c, 32) + sum(_signed(a >> (8 * i), 8) * _signed(b >> (8 * i), 8) for i in range(4))


_OPS = {
    "mov.b32": lambda a: a[0], "and.b32": lambda a: a[0] & a[1], "shr.b32": lambda a: a[0] >> a[1],
    "shl.b32": lambda a: a[0] << a[1], "sub.u32": lambda a: a[0] - a[1], "lop3.b32": lambda a: lop3(*a),
    "prmt.b32": lambda a: prmt(*a), "dp4a.s32.s32": lambda a: dp4a(*a),
}


def run_ptx(asm: str, inputs: dict[str, int], outputs: list[str]) -> list[int]:
    """Execute ``asm`` (one ``{ … }`` block) with the registers ``inputs`` (e.g. ``{"$4": word}``) set; returns the
    ``outputs`` registers as unsigned 32-bit values."""
    regs = {name: value & 0xFFFFFFFF for name, value in inputs.items()}
    val = lambda tok: int(tok, 0) if tok[0].isdigit() else regs[tok]  # noqa: E731
    for stmt in asm.strip().removeprefix("{").removesuffix("}").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        regs[d] = _OPS[op]([val(t) for t in src]) & 0xFFFFFFFF
    return [regs[name] for name in outputs]
