"""The repository's top-level ``kernels/``, ``datasets/`` and ``bench/`` folders install as ``tqvec.kernels``,
``tqvec.datasets`` and ``tqvec.bench``. With a checkout's root on ``sys.path`` (``python -m …`` or ``python -c …`` run
there), ``import kernels`` or ``import datasets`` would find those folders instead of the PyPI packages of the same
names (Hugging Face's ``kernels``, which transformers imports when it is installed, and ``datasets``). Each folder's
``__init__`` calls :func:`defer_to_installed` when it is imported under its top-level name.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def defer_to_installed(name: str, init_file: str) -> None:
    """Put the installed package ``name`` in ``sys.modules`` in place of the checkout folder being imported as ``name``
    (``init_file``: that folder's ``__init__.py``); the import statement then returns the installed package.

    Raises
    ------
    ImportError
        When no package ``name`` is installed outside the checkout (the folder is only ``tqvec.<name>``).

    Examples
    --------
    In ``kernels/__init__.py``: ``if __name__ == "kernels": defer_to_installed(__name__, __file__)``.
    """
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        raise ImportError(f"{name!r} from {checkout} is tqvec's folder, importable as 'tqvec.{name}'; "
                          f"no other package {name!r} is installed", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
