"""``tqvec datasets list`` and ``tqvec datasets build NAME``."""
from __future__ import annotations

import argparse
import sys

from .hdf5 import DatasetError
from .registry import build, list_datasets


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tqvec datasets", description="ANN benchmark data sets")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="show the registered data sets and whether each is ready")
    build_cmd = commands.add_parser("build", help="build and cache a data set; prints its HDF5 path")
    build_cmd.add_argument("name", help="a registered name, e.g. glove-50-angular or synthetic-10000-32")
    build_cmd.add_argument("--force", action="store_true", help="rebuild even if cached")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 data set error)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            for info in list_datasets():
                print(f"{info.name:<26} {'ready' if info.cached else '-':<6} {info.description}")
            print("also: synthetic-<n>-<d>[-angular|-euclidean|-ip], or the path of an ann-benchmarks .hdf5 file")
        else:
            print(build(args.name, force=args.force))
    except DatasetError as e:
        print(f"tqvec datasets: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
