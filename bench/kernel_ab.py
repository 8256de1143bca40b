"""A/B of the GPU search's tuning constants: whole searches per variant, side by side, on one card.

A variant names module constants of ``tqvec.kernels`` and their values for its runs (``NAME=VALUE``, a Python
literal; ``NAME`` alone means ``kernels.ops.NAME``, ``topk.BLOCK`` means ``kernels.topk.BLOCK``), or fields of
:class:`~tqvec.kernels.ops.SearchSettings` (``settings.int8_hopper=False``). For each shape
``DxNQ`` the run builds ``gpu_scan``'s database (``--rows`` Gaussian rows of ``D`` channels at ``--bits``, queries
from seed 7) and times, per variant, the whole ``ops.search`` (k = 10, graph-replayed, L2 flushed, median) and stage
1 alone (:func:`gpu_scan.stage1_ms`), in ``--rounds`` rounds, every other round in reverse order, beside the bf16
matmul alone. One JSON line per (shape, variant, round) goes to ``--out``; a line per shape says which variants
returned the first variant's ids for the first 200 queries; the last line lists the compiled Triton kernels'
registers, spills and shared memory. A variant that fails (a tiling that does not compile, say) is a line with its
error, not the end of the run.

``tqvec bench kernel-ab --out ab.jsonl --shapes 384x100 768x100 --variant base --variant s3 ROW_LOOP_STAGES=3``
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO

import torch
import triton

from tqvec.kernels import ops

from . import gpu_scan

#: queries whose ids every variant must match (the first variant's)
SAME_IDS_QUERIES = 200
#: ``tqvec.kernels`` modules whose compiled kernels the last line lists (``hopper_stage`` where Gluon imports)
KERNEL_MODULES = ("int8_stage", "scan_kernel", "dp4a_stage", "topk", "hopper_stage")
#: the pseudo-module of :class:`~tqvec.kernels.ops.SearchSettings` fields in a variant (``settings.FIELD=VALUE``)
SETTINGS = "settings"


@dataclass(frozen=True)
class Variant:
    """A name and the constants it sets: ``{(module, attribute): value}``."""

    name: str
    settings: dict[tuple[str, str], object] = field(default_factory=dict)


def parse_shape(text: str) -> tuple[int, int]:
    """``"DxNQ"`` → ``(d, nq)``, both positive.

    Raises
    ------
    ValueError
        ``text`` is not two positive integers joined by ``x``.

    Examples
    --------
    >>> parse_shape("384x100")
    (384, 100)
    """
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a shape is DxNQ with positive integers, e.g. 384x100; got {text!r}")
    return int(parts[0]), int(parts[1])


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"tqvec.kernels.{name}")


def parse_variant(tokens: list[str]) -> Variant:
    """``[NAME, "CONSTANT=VALUE", …]`` → a :class:`Variant`; ``CONSTANT`` is ``ops.CONSTANT`` unless it names its
    module (``topk.BLOCK``) or is a search setting (``settings.int8_hopper``), ``VALUE`` a Python literal.

    Raises
    ------
    ValueError
        No name, a setting without ``=``, a value that is not a literal, a constant the module does not have or a
        field :class:`~tqvec.kernels.ops.SearchSettings` does not have.

    Examples
    --------
    >>> parse_variant(["s3", "ROW_LOOP_STAGES=3", "topk.BLOCK=256"]).settings
    {('ops', 'ROW_LOOP_STAGES'): 3, ('topk', 'BLOCK'): 256}
    >>> parse_variant(["triton", "settings.int8_hopper=False"]).settings
    {('settings', 'int8_hopper'): False}
    """
    if not tokens or "=" in tokens[0]:
        raise ValueError(f"a variant starts with its name, then CONSTANT=VALUE settings; got {tokens}")
    settings: dict[tuple[str, str], object] = {}
    for token in tokens[1:]:
        key, sep, literal = token.partition("=")
        if not sep:
            raise ValueError(f"variant {tokens[0]!r}: a setting is CONSTANT=VALUE, got {token!r}")
        module, _, attribute = key.rpartition(".")
        module = module or "ops"
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"variant {tokens[0]!r}: {literal!r} is not a Python literal") from exc
        if module == SETTINGS:
            if attribute not in {f.name for f in dataclasses.fields(ops.SearchSettings)}:
                raise ValueError(f"variant {tokens[0]!r}: SearchSettings has no field {attribute!r}")
        else:
            try:
                found = hasattr(_module(module), attribute)
            except ModuleNotFoundError:
                found = False
            if not found:
                raise ValueError(f"variant {tokens[0]!r}: tqvec.kernels.{module} has no constant {attribute!r}")
        settings[(module, attribute)] = value
    return Variant(tokens[0], settings)


@contextlib.contextmanager
def constants_set(settings: dict[tuple[str, str], object]) -> Iterator[None]:
    """Set the constants and search settings for the block, then restore them; captured search graphs are dropped on
    both sides."""
    fields = {attribute: value for (module, attribute), value in settings.items() if module == SETTINGS}
    constants = {key: value for key, value in settings.items() if key[0] != SETTINGS}
    saved = {key: getattr(_module(key[0]), key[1]) for key in constants}
    for (module, attribute), value in constants.items():
        setattr(_module(module), attribute, value)
    ops.clear_graphs()
    try:
        with ops.configured(**fields):
            yield
    finally:
        for (module, attribute), value in saved.items():
            setattr(_module(module), attribute, value)
        ops.clear_graphs()


def compiled_kernels() -> list[dict]:
    """Warps, stages, registers, spills and shared bytes of every Triton kernel of :data:`KERNEL_MODULES` compiled
    so far, with its specialization key (argument types and constexpr values, cut at 300 characters)."""
    found = []
    for module_name in KERNEL_MODULES:
        try:
            module = _module(module_name)
        except (ImportError, AttributeError):  # hopper_stage without Gluon
            continue
        for name, fn in vars(module).items():
            if not isinstance(fn, triton.runtime.JITFunction):
                continue
            for caches in fn.device_caches.values():
                for key, kernel in caches[0].items():
                    kernel._init_handles()
                    found.append({"kernel": name, "warps": kernel.metadata.num_warps,
                                  "stages": kernel.metadata.num_stages, "registers": kernel.n_regs,
                                  "spills": kernel.n_spills, "shared": kernel.metadata.shared, "key": str(key)[:300]})
    return found


def _log(out: IO[str], **row: object) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(json.dumps(row), flush=True)


def run_shape(db: gpu_scan.Database, queries: torch.Tensor, nq: int, variants: list[Variant], rounds: int,
              out: IO[str]) -> None:
    """Time every variant on ``nq`` of ``queries`` over ``db`` and log the rows (:func:`_log`)."""
    bits = next(iter(db.blocks))
    tq, block = db.quantizers[bits], db.blocks[bits]
    table = tq.table("cuda")
    matmul = gpu_scan.time_ms(lambda: gpu_scan.bf16_matmul(queries[:nq].to(torch.bfloat16), db.x_bf16))
    rotated = tq.rotate_queries(queries[:nq])[0]
    ids: dict[str, torch.Tensor] = {}
    for rnd in range(rounds):
        for variant in variants if rnd % 2 == 0 else variants[::-1]:
            try:
                with constants_set(variant.settings):
                    ms = gpu_scan.time_ms(lambda: ops.search(rotated, block, table, gpu_scan.K))
                    stage1 = gpu_scan.stage1_ms(rotated, block, table)
                    ids.setdefault(variant.name, ops.search(rotated[:SAME_IDS_QUERIES], block, table, gpu_scan.K)[1].cpu())
                _log(out, d=db.d, nq=nq, variant=variant.name, round=rnd, search_ms=ms, stage1_ms=stage1,
                     matmul_ms=matmul, vs_matmul=matmul / ms)
            except Exception as exc:  # noqa: BLE001 - a variant that fails is a result of the run
                _log(out, d=db.d, nq=nq, variant=variant.name, round=rnd, error=f"{type(exc).__name__}: {exc}"[:400])
    first = ids.get(variants[0].name)
    _log(out, d=db.d, nq=nq, same_ids={name: first is not None and bool(torch.equal(got, first))
                                       for name, got in ids.items()})


def main(argv: list[str] | None = None) -> None:
    """Run the A/B and write its JSON lines to ``--out``."""
    p = argparse.ArgumentParser(prog="tqvec bench kernel-ab", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON-lines file to write")
    p.add_argument("--shapes", nargs="+", required=True, help="DxNQ, e.g. 384x100")
    p.add_argument("--variant", nargs="+", action="append", required=True, metavar="NAME [CONSTANT=VALUE ...]",
                   help="a variant; the first is the one the others' ids are compared with")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--bits", type=float, default=4)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes]
        variants = [parse_variant(tokens) for tokens in args.variant]
    except ValueError as exc:
        p.error(str(exc))
    if len({v.name for v in variants}) != len(variants):
        p.error("variant names must differ")
    if not torch.cuda.is_available():
        raise SystemExit("tqvec bench kernel-ab needs a CUDA device")
    bits = int(args.bits) if float(args.bits).is_integer() else args.bits
    started = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        _log(out, device=torch.cuda.get_device_name(), rows=args.rows, bits=bits,
             variants={v.name: {f"{m}.{a}": val for (m, a), val in v.settings.items()} for v in variants})
        for d in sorted({d for d, _ in shapes}):
            queries = torch.randn(max(nq for dd, nq in shapes if dd == d), d, device="cuda",
                                  generator=torch.Generator(device="cuda").manual_seed(7))
            db = gpu_scan.Database(args.rows, d, (bits,), queries)
            for nq in (nq for dd, nq in shapes if dd == d):
                run_shape(db, queries, nq, variants, args.rounds, out)
            del db, queries
            ops.clear_graphs()
            torch.cuda.empty_cache()
        _log(out, kernels=compiled_kernels(), seconds=time.time() - started)


if __name__ == "__main__":
    main()
