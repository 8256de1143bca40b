"""The ``tqvec`` command: ``tqvec demo``, ``tqvec datasets …`` and ``tqvec bench …``.

Each subcommand lives beside its code (``tqvec.datasets.cli``, ``tqvec.bench.*``) and is imported only
when run, so optional dependencies (faiss, h5py, transformers, ray, triton) load only where needed.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

#: ``tqvec demo``: the quick comparison that ``make run`` prints
DEMO = ("tqvec.bench.demo", "main")
#: entry-point group of the benchmarks (pyproject.toml lists them)
BENCH_GROUP = "tqvec.bench"


def benchmarks() -> dict[str, EntryPoint]:
    """The benchmarks ``tqvec bench NAME`` runs: name → entry point (``module:function`` taking argv)."""
    return {point.name: point for point in entry_points(group=BENCH_GROUP)}


def summary(point: EntryPoint) -> str:
    """First docstring line of a benchmark's function (its module's for ``main``), read without importing it."""
    module, _, function = point.value.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "(not installed)"
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    node = tree if function == "main" else next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function), tree)
    text = (ast.get_docstring(node) or "").strip().splitlines()
    line = text[0] if text else ""
    return line.split("``: ", 1)[1] if line.startswith("``") and "``: " in line else line


def usage() -> str:
    """The ``tqvec --help`` text: commands, then every benchmark with its summary."""
    lines = ["usage: tqvec {demo,datasets,bench} ...", "",
             "  tqvec demo [options]            tqvec beside FAISS at equal bytes on GloVe-50, in minutes",
             "  tqvec datasets {list,build NAME}", "  tqvec bench NAME [options]", "", "benchmarks:"]
    lines += [f"  {name:<17} {summary(point)}" for name, point in sorted(benchmarks().items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tqvec`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return int(getattr(importlib.import_module(DEMO[0]), DEMO[1])(rest) or 0)
    if command == "datasets":
        from tqvec.datasets.cli import main as datasets_main  # noqa: PLC0415

        return int(datasets_main(rest) or 0)
    if command != "bench":
        return _refuse(f"unknown command {command!r}")
    if not rest:
        return _refuse("tqvec bench needs a benchmark name")
    if rest[0] in ("-h", "--help"):
        print(usage())
        return 0
    known = benchmarks()
    if rest[0] not in known:
        return _refuse(f"unknown benchmark {rest[0]!r}")
    from tqvec.datasets import DatasetError  # noqa: PLC0415 - the data sets load with the benchmark

    try:
        result = known[rest[0]].load()(rest[1:])
    except DatasetError as err:  # an unknown or unreadable data set: a usage error, not a traceback
        print(f"tqvec bench {rest[0]}: error: {err}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def _refuse(what: str) -> int:
    """Say ``what`` the command line asked that ``tqvec`` does not know, then the usage, on stderr; exit status 2."""
    print(f"tqvec: {what}\n\n{usage()}", file=sys.stderr)
    return 2

if __name__ == "__main__":
    sys.exit(main())
