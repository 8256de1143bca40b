"""``bench.kv_graph``: the report's ratios against each StaticCache row, and the CPU refusal (graphs need CUDA)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tqvec.bench import kv_graph  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _row(context: int, cache: str, mode: str, ms: float) -> dict:
    return {"context": context, "cache": cache, "mode": mode, "ms_per_step": ms, "tokens_per_s": 1000 / ms,
            "cached_tokens": context + 69}


def test_markdown_ratios_and_targets() -> None:
    data = {"device": "GPU", "command": "tqvec bench kv-graph", "layers": 32, "batch": 1, "steps": 64,
            "transformers": "5", "torch": "2", "rows": [
                _row(32768, "StaticCache", "graph", 20.0), _row(32768, "StaticCache", "compile", 10.0),
                _row(32768, "StaticTurboQuantCache", "graph", 8.0), _row(32768, "StaticTurboQuantCache", "compile", 5.0),
                _row(4096, "StaticCache", "graph", 5.0)]}
    md = kv_graph.markdown(data)
    assert "| 32768 | 2.50× | 1.25× | 2.00× | ≥ 1.0× |" in md  # tqvec's tokens/s over each baseline's
    assert "| 4096 | — | — | — | — |" in md  # no tqvec row, no target at this context


def test_committed_report_matches_its_json() -> None:
    """bench/results/kv_graph.md is what markdown() writes from the committed kv_graph.json."""
    data = json.loads((ROOT / "bench/results/kv_graph.json").read_text())
    assert (ROOT / "bench/results/kv_graph.md").read_text() == kv_graph.markdown(data)
    steps = {(r["context"], r["cache"], r["mode"]): r for r in data["rows"]}
    for context in (32768, 131072):  # every run advanced the cache by the warm-up and the timed steps
        assert all(r["cached_tokens"] == context + kv_graph.WARMUP + data["steps"] for (c, *_), r in steps.items()
                   if c == context)


def test_refuses_to_run_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_graph.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        kv_graph.main(["--tiny", "--out", str(tmp_path)])
