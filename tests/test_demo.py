"""``tqvec demo`` (``make run``) on a small GloVe subset: every method at equal bytes, a table and a plot."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tqvec.bench import demo
from tqvec.cli import main as cli_main


def test_methods_fit_the_budget() -> None:
    for bits in (1, 2, 2.5, 4):
        methods = demo.methods_for(bits)
        assert methods[0].family == "tqvec" and all(m.family == "faiss" for m in methods[1:])
        assert any(m.name.startswith("FAISS PQ") and m.name.endswith("x4fs") for m in methods)
        assert any("SQtqmse" in m.name for m in methods) == float(bits).is_integer()


def test_recall_at_10() -> None:
    truth = np.arange(20).reshape(2, 10)
    assert demo.recall_at_10(truth[:, ::-1], truth) == 1.0
    assert demo.recall_at_10(np.array([[0, 1, 2, 3, 4, 50, 51, 52, 53, 54], truth[1]]), truth) == 0.75


@pytest.mark.slow  # GloVe load, exact top-10 and four builds
def test_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["demo", "--n", "3000", "--queries", "40", "--bits", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "method" not in line]
    assert [r[0].strip() for r in rows] == ["tqvec Index 4b", "FAISS PQ50x4fs", "FAISS RR50,SQtqmse4", "FAISS SQ4"]
    budget = math.ceil(50 * 4 / 8)
    for method, _bits, nbytes, recall, qps, build in ([c.strip() for c in r] for r in rows):
        assert float(nbytes) <= budget, method
        assert 0 <= float(recall) <= 1 and float(qps.replace(",", "")) > 0 and float(build) >= 0, method
    assert float(rows[0][2]) == budget  # tqvec spends exactly its budget
    assert float(rows[0][3]) >= 0.6  # 4-bit recall@10 on GloVe (0.79 on all 390,000 vectors; easier here)
    assert (tmp_path / "demo_glove-50.md").read_text().count("\n| ") == 5
    assert (tmp_path / "demo_glove-50.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_rejects_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n must lie in"):
        demo.load_glove(0, 10)
    with pytest.raises(SystemExit):
        demo.main(["--bits", "9", "--out", str(tmp_path)])
