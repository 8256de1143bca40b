"""``tqvec bench kv --render``: a saved run's Markdown is rewritten beside its JSON, under the JSON's own name."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tqvec.bench import kv as kv_bench  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_render_writes_beside_the_json_under_its_name(tmp_path: Path) -> None:
    saved = tmp_path / "kv_gemma3.json"
    shutil.copy(RESULTS / "kv_gemma3.json", saved)
    (tmp_path / "kv.md").write_text("another run's report\n")
    kv_bench.main(["--render", str(saved)])
    assert (tmp_path / "kv.md").read_text() == "another run's report\n"
    rendered = (tmp_path / "kv_gemma3.md").read_text()
    assert "rendered from kv_gemma3.json" in rendered
    assert _table_lines(rendered) == _table_lines((RESULTS / "kv_gemma3.md").read_text())
