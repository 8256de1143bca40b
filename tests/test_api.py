"""The public API: what ``import tqvec`` offers, ``tqvec.load`` by recorded kind, and Ray kept optional."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tqvec
from tqvec import storage
from tqvec.cli import benchmarks
from tqvec.cli import main as cli_main


def _data(n: int = 600, d: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def test_every_index_type_is_public() -> None:
    assert {"Index", "IVFIndex", "ShardedIndex", "TurboQuantizer", "load"} <= set(tqvec.__all__)
    for name in tqvec.__all__:
        assert getattr(tqvec, name) is not None, name
    from tqvec.distributed import ShardedIndex  # the module path keeps working

    assert tqvec.ShardedIndex is ShardedIndex
    assert "ShardedIndex" in dir(tqvec)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = tqvec.nope


def test_sharded_index_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulate a machine without Ray: importing ``ray`` fails, and ``tqvec.ShardedIndex`` says what to install."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ModuleNotFoundError(name="ray")
    for name in [m for m in sys.modules if m == "tqvec.distributed" or m.startswith("tqvec.distributed.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(tqvec, "ShardedIndex", raising=False)  # drop the cached attribute
    with pytest.raises(ImportError, match=r"pip install 'tqvec\[ray\]'"):
        _ = tqvec.ShardedIndex
    with pytest.raises(ImportError, match="ray"):
        from tqvec import ShardedIndex  # noqa: F401
    fresh = importlib.reload(tqvec)  # `import tqvec` itself never needs Ray
    assert fresh.Index is not None and fresh.IVFIndex is not None


def test_load_opens_each_kind_and_passes_keywords(tmp_path: Path) -> None:
    x = _data()
    flat = tqvec.Index(32, bits=4, metric="cosine")
    flat.add(x)
    ivf = tqvec.IVFIndex(32, 4, bits=4, metric="l2", nprobe=2)
    ivf.add(x)
    for index, cls in ((flat, tqvec.Index), (ivf, tqvec.IVFIndex)):
        path = tmp_path / f"{cls.__name__}.tqv"
        index.save(path)
        back = tqvec.load(path, mmap=True)
        assert type(back) is cls and len(back) == len(index)
        np.testing.assert_array_equal(back.search(x[:5], 3)[1], index.search(x[:5], 3)[1])
        assert tqvec.load(str(path)).search(x[:5], 3)[1].tolist() == index.search(x[:5], 3)[1].tolist()
        with pytest.raises(TypeError, match="nope"):
            tqvec.load(path, nope=1)


def test_load_opens_a_sharded_directory_by_its_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory (or its manifest.json) whose manifest records kind "tqvec.ShardedIndex" goes to
    ``ShardedIndex.load`` with the keywords (the class is stubbed: starting Ray is test_distributed's job)."""
    calls = []

    class Stub:
        @classmethod
        def load(cls, path: Path, **kwargs: object) -> str:
            calls.append((Path(path), kwargs))
            return "sharded"

    monkeypatch.setattr(tqvec, "ShardedIndex", Stub, raising=False)
    (tmp_path / "manifest.json").write_text('{"kind": "tqvec.ShardedIndex", "version": 1}')
    assert tqvec.load(tmp_path, mmap=True) == "sharded"
    assert tqvec.load(tmp_path / "manifest.json", timeout=5.0) == "sharded"
    assert calls == [(tmp_path, {"mmap": True}), (tmp_path, {"timeout": 5.0})]


def test_load_refuses_what_is_not_an_index(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        tqvec.load(tmp_path / "missing.tqv")
    (tmp_path / "text.tqv").write_text("hello, this is not a tqvec file at all")
    with pytest.raises(storage.StorageError, match="not a tqvec file"):
        tqvec.load(tmp_path / "text.tqv")
    storage.save_arrays(tmp_path / "other.tqv", "someone.Else", {}, {"a": np.zeros(3, np.float32)})
    with pytest.raises(storage.StorageError, match="'someone.Else', which is not a tqvec index kind"):
        tqvec.load(tmp_path / "other.tqv")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(storage.StorageError, match="without manifest.json"):
        tqvec.load(empty)
    (empty / "manifest.json").write_text("[1, 2")
    with pytest.raises(storage.StorageError, match="unreadable manifest"):
        tqvec.load(empty)


@pytest.mark.slow  # imports every benchmark module: transformers, Ray, FAISS
def test_cli_lists_every_benchmark_and_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = benchmarks()
    assert "tqvec demo" in out and all(name in out for name in listed) and "(not installed)" not in out
    modules = {path.stem for path in (Path(__file__).resolve().parents[1] / "bench").glob("*.py")
               if not path.stem.startswith("_")}  # private helper modules are not benchmarks
    entered = {point.value.partition(":")[0].rsplit(".", 1)[1] for point in listed.values()}
    assert modules - entered == {"demo"}  # every benchmark module is reachable from `tqvec bench`
    for point in listed.values():
        assert callable(point.load()), point.value
    assert cli_main(["bench", "no-such-benchmark"]) == 2


@pytest.mark.parametrize("module", ["tqvec.files", "tqvec.index", "tqvec.ivf", "tqvec.quantizer", "tqvec.validation",
                                    "tqvec.rotation", "tqvec.storage", "tqvec._fastscan", "tqvec.kv._requirements",
                                    "tqvec.codebook", "tqvec.kv.codec", "tqvec.kv.attention", "tqvec.bench._cli",
                                    "tqvec.bench.kernel_ab"])
def test_docstring_examples_run(module: str) -> None:
    import doctest

    result = doctest.testmod(importlib.import_module(module), raise_on_error=False)
    assert result.attempted >= 1 and result.failed == 0


@pytest.mark.parametrize("package", ["tqvec", "tqvec.kv", "tqvec.distributed"])
def test_the_api_page_names_every_export(package: str) -> None:
    """docs/api.md lists each package's ``__all__`` under the package's heading."""
    pytest.importorskip({"tqvec.kv": "transformers", "tqvec.distributed": "ray"}.get(package, "numpy"))
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split(f"## `{package}`", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in importlib.import_module(package).__all__ if f"`{name}`" not in section]
    assert not missing, missing


@pytest.mark.parametrize("argv, message", [(["bogus"], "tqvec: unknown command 'bogus'"),
                                           (["bench", "nosuch"], "tqvec: unknown benchmark 'nosuch'"),
                                           (["bench"], "tqvec: tqvec bench needs a benchmark name")])
def test_cli_names_what_it_does_not_know(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == message and "usage: tqvec" in err


def test_cli_bench_help_is_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: tqvec")


@pytest.mark.parametrize("argv", [["encode", "--n", "-5"], ["sweep", "--dataset", "glove-50-angular", "--queries", "0"],
                                  ["ann", "--queries", "0"], ["native-cpu", "--threads", "0"]])
def test_benchmark_counts_must_be_positive(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A count of 0 or less is a usage error (it ran before, and wrote tables of negative QPS or divided by zero)."""
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", *argv])
    assert done.value.code == 2 and "must be a positive integer" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("argv", [["gpu-scan"], ["index-cuda-check"], ["kv-step", "--device", "cuda"],
                                  ["kv-e2e", "--device", "cuda"]])
def test_gpu_benchmarks_say_they_need_cuda(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", *argv])
    assert done.value.code == 2 and "CUDA GPU" in capsys.readouterr().err


def test_an_unknown_data_set_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "sweep", "--dataset", "nosuch"]) == 2
    assert capsys.readouterr().err.startswith("tqvec bench sweep: error: unknown data set 'nosuch'")
