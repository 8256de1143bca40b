"""The README's quick-start snippets run as written, its links resolve, and it stays short."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def _index(ns: dict[str, Any]) -> None:
    assert ns["I"].shape == (5, 10) and (ns["I"][:, 0] == np.arange(5)).all()  # each vector finds itself
    assert type(ns["index"]).__name__ == "Index" and len(ns["index"]) == 10_000 - 3


def _ivf(ns: dict[str, Any]) -> None:
    assert ns["I"].shape == (5, 10) and (ns["I"][:, 0] == np.arange(5)).all()
    assert (np.diff(ns["D"], axis=1) >= 0).all()  # l2: smallest first


def _quantizer(ns: dict[str, Any]) -> None:
    assert tuple(ns["x_hat"].shape) == (1000, 128) and tuple(ns["ip"].shape) == (5, 1000)
    exact = ns["x"][:5] @ ns["x"].T
    assert np.corrcoef(np.asarray(ns["ip"]).ravel(), exact.ravel())[0, 1] > 0.9


def _kv(ns: dict[str, Any]) -> None:
    assert ns["out"].shape[0] == 1 and 300 < ns["out"].shape[1] <= 308  # random weights may emit EOS early
    assert ns["cache"].get_seq_length() >= 300 and ns["cache"].nbytes() > 0


def _sharded(ns: dict[str, Any]) -> None:
    assert ns["I"].shape == (5, 10) and (ns["I"][:, 0] == ns["ids"][:5]).all()
    assert (Path("shards") / "manifest.json").is_file()


#: (id, marks, check of the namespace the block leaves), in README order
CASES = [("Index", [], _index), ("IVFIndex", [], _ivf), ("TurboQuantizer", [], _quantizer),
         ("kv-cache", [], _kv), ("ShardedIndex", [pytest.mark.slow], _sharded)]


def test_readme_has_one_snippet_per_case_and_stays_short() -> None:
    assert len(BLOCKS) == len(CASES)
    for (name, _, _), block in zip(CASES, BLOCKS):
        assert name.split("-")[0].lower() in block.lower(), name
        assert 5 <= len([line for line in block.splitlines() if line.strip()]) <= 12, name
    assert README.stat().st_size <= 12_000


def test_readme_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", README.read_text(encoding="utf-8")):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


@pytest.mark.parametrize("block, check", [pytest.param(b, c, id=n, marks=m) for (n, m, c), b in zip(CASES, BLOCKS)])
def test_readme_snippet_runs(block: str, check: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the snippets write files into the working directory
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    check(namespace)
