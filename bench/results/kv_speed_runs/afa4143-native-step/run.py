"""Run a module of a copied package tree past the editable install: ``python run.py TREE MODULE ARGS...``.

TREE holds a ``tqvec`` package (with ``kernels``, ``datasets`` and ``bench`` copied inside it, as the wheel installs
them, and the tree's own build of ``_native``). The editable install's finder is removed from ``sys.meta_path`` so
that ``import tqvec`` finds TREE's copy."""
import runpy
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "skbc" not in repr(f).lower()]
sys.path.insert(0, sys.argv[1])
module = sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
import tqvec  # noqa: E402

assert tqvec.__file__.startswith(sys.path[0]), tqvec.__file__
runpy.run_module(module, run_name="__main__")
