"""A checkout's root on sys.path does not hide installed packages named like tqvec's top-level folders."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_in_checkout(code: str, site: Path) -> subprocess.CompletedProcess:
    """``python -c code`` with the checkout's root first on sys.path (as ``python -c`` run there puts it) and
    ``site`` after it."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["kernels", "datasets", "bench"])
def test_installed_package_takes_the_folders_place(tmp_path: Path, name: str) -> None:
    """``import kernels`` (which transformers does when Hugging Face's package is installed), ``import datasets`` and
    ``import bench`` run from a checkout's root give the installed packages, and tqvec's own still import."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("MARK = 'installed'\n")
    done = _run_in_checkout(f"import {name}, tqvec.{name}; print({name}.MARK, tqvec.{name}.__name__)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["installed", f"tqvec.{name}"]


def test_folder_alone_names_tqvec(tmp_path: Path) -> None:
    """Without an installed package of that name, the import fails and says where the folder belongs."""
    done = _run_in_checkout("import datasets", tmp_path)
    assert done.returncode != 0
    assert "importable as 'tqvec.datasets'" in done.stderr
