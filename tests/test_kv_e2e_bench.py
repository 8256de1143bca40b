"""``bench.kv_e2e``: a tiny CPU run writes both reports and keeps earlier parts; the budget search finds the largest size
that fits (with a stand-in for ``generate()``, since the budget needs CUDA)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from tqvec.bench import kv_e2e  # noqa: E402


@pytest.mark.slow  # 6–13 s on a busy 2-core machine: a few hundred tiny decode and generate steps
def test_tiny_cpu_run_writes_reports_and_keeps_parts(tmp_path: Path) -> None:
    common = ["--tiny", "--device", "cpu", "--out", str(tmp_path), "--contexts", "512", "--new-tokens", "22"]
    kv_e2e.main([*common, "--prefill-chunk", "128"])
    data = json.loads((tmp_path / "kv_e2e.json").read_text())
    assert {"device", "torch", "transformers", "model", "parts"} <= data.keys()
    assert data["model"]["layers"] == 2 and data["model"]["weights_bytes"] > 0
    parts = data["parts"]
    assert set(parts) == set(kv_e2e.PARTS)
    assert all(p["environment"] == kv_e2e.part_environment() for p in parts.values())  # kept with parts of later runs
    peak = parts["peak"]
    assert [r["cache"] for r in peak["rows"]] == ["DynamicCache + sdpa", "TurboQuantCache 4b + tqvec"]
    assert all(r["ok"] and r["peak_bytes"] is None and r["decode_tokens_per_s"] > 0 for r in peak["rows"])
    dyn, tq = peak["rows"]
    assert dyn["kv16_bytes"] == 2 * 2 * 2 * 64 * 2 * 512 and dyn["cache_bytes"] >= dyn["kv16_bytes"]
    assert 0 < tq["cache_bytes"] < dyn["cache_bytes"]
    (check,) = peak["checks"]
    assert check["context"] == 512 and check["pass"] is None  # no memory figures on the CPU
    (speed,) = parts["decode"]["checks"]
    assert speed["ratio"] > 0 and speed["target"] is None and speed["static_ratio"] > 0 and speed["bound_ratio"] > 0
    assert [r["cache"] for r in parts["decode"]["rows"]] == ["DynamicCache + sdpa", "TurboQuantCache 4b + tqvec",
                                                             "StaticTurboQuantCache 4b + tqvec", kv_e2e.BOUND_LABEL]
    assert all(r["timed_steps"] == kv_e2e.DECODE_ROUND_STEPS and len(r["round_ms"]) == 1  # 22 tokens: one whole round
               and r["ms_per_step"] == r["round_ms"][0] for r in parts["decode"]["rows"])
    assert "needs CUDA" in parts["budget"]["skipped"] and "needs CUDA" in parts["batch"]["skipped"]
    md = (tmp_path / "kv_e2e.md").read_text()
    for heading in ("## Peak memory", "## Eager decode", "## Longest prompt", "## Largest batch"):
        assert heading in md

    kv_e2e.main([*common, "--parts", "decode"])  # a later invocation replaces its own part and keeps the others
    again = json.loads((tmp_path / "kv_e2e.json").read_text())["parts"]
    assert again["peak"] == parts["peak"] and "--parts decode" in again["decode"]["command"]


def test_decode_ratios_pair_the_rounds() -> None:
    """A ratio compares rounds run side by side, not each variant's median: a host that slowed the reference in two
    rounds of three and the other cache in one does not make the other cache 2.5x faster."""
    rows = [{"cache": "dyn", "variant": "a", "context": 32768, "round_ms": [10.0, 30.0, 30.0], "tokens_per_s": 1000 / 30},
            {"cache": "tq", "variant": "b", "context": 32768, "round_ms": [12.0, 12.0, 33.0], "tokens_per_s": 1000 / 12}]
    (check,) = kv_e2e.decode_checks({"rows": rows}, "dyn", "tq")
    assert check["ratio"] == pytest.approx(30 / 33) and check["pass"] is False and check["static_ratio"] is None
    assert check["bound_ratio"] is None


def test_decode_variants_size_the_shared_static_cache_for_every_step() -> None:
    """On CUDA the static cache's two variants (step graphs on and off) share one cache: it must hold the prompt and
    both variants' warm-up and timed steps."""
    cfg = kv_e2e.llama_config(2, tiny=True)
    model = SimpleNamespace(device=torch.device("cuda"), config=cfg)
    kinds = kv_e2e.cache_kinds(cfg, 4)
    bench = kv_e2e.Bench(model=model, kinds=kinds, new_tokens=64, chunk=0, deadline=kv_e2e.Deadline(1e9), save=lambda: None)
    variants = kv_e2e.decode_variants(bench, 1000, 4, rounds=4, steps=16)
    assert [v.label for v in variants] == ["default SDPA backend", "cuDNN SDPA off", "tqvec attention",
                                           kv_e2e.STATIC_VARIANT, kv_e2e.STATIC_VARIANT + ", step graphs off",
                                           kv_e2e.BOUND_VARIANT]
    static = [v for v in variants if v.kind.name.startswith(kv_e2e.STATIC_LABEL)]
    assert len({v.kind for v in static}) == 1 and [v.graphs for v in static] == [True, False]
    max_len = static[0].kind.make.args[1]
    assert max_len > 1000 + 2 * (kv_e2e.E2E_WARMUP + 4 * 16)


def _bench() -> kv_e2e.Bench:
    """A bench whose model is only a device (the CPU: no warm-up runs); runs go to a ``generate_run`` stand-in."""
    model = SimpleNamespace(device=torch.device("cpu"))
    return kv_e2e.Bench(model=model, kinds=(), new_tokens=22, chunk=0, deadline=kv_e2e.Deadline(1e9), save=lambda: None)


def _fake_generate(peak: Callable[[int], float], budget: int, tokens_per_s: float = 100.0) -> Callable[..., dict]:
    """A ``generate_run`` stand-in: batch rows ``b`` peak at ``peak(b)`` bytes, fail beyond ``budget`` (when one is
    given: the warm-up runs have none), 0.01 s a row."""
    def run(model, kind, batch, length, new_tokens, chunk, budget_bytes=None):
        assert budget_bytes in (None, budget)
        used = peak(batch)
        return {"cache": kind.name, "batch": batch, "context": length, "ok": budget_bytes is None or used <= budget,
                "seconds": 0.01 * batch, "peak_bytes": used, "decode_tokens_per_s": tokens_per_s * batch}
    return run


@pytest.mark.parametrize("curve,predicted,largest", [(0.0, 50, 50), (0.1, 49, 47)])
def test_search_verifies_the_predicted_largest(monkeypatch: pytest.MonkeyPatch, curve: float, predicted: int,
                                               largest: int) -> None:
    """Peak = 1000 + 100·b (+ curve·b²): the linear fit at 1 and 2 rows predicts; the runs move to the true largest."""
    budget = 6000
    monkeypatch.setattr(kv_e2e, "generate_run", _fake_generate(lambda b: 1000 + 100 * b + curve * b * b, budget))
    result: dict = {}
    kind = kv_e2e.Kind("fake", "sdpa", lambda: None)
    kv_e2e.largest_in_budget(_bench(), kind, lambda b: (b, 64), (1, 2), 1, budget, 60.0, False, result)
    assert result["predicted"] == predicted
    assert result["largest_completed"] == largest and result["smallest_failed"] == largest + 1
    assert kv_e2e.search_value(result, 1) == (largest, "measured")
    assert [a["ok"] for a in result["attempts"]][-2:] in ([True, False], [False, True])


def test_search_skips_long_runs_and_reports_the_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = 6000
    monkeypatch.setattr(kv_e2e, "generate_run", _fake_generate(lambda b: 1000 + 100 * b, budget))
    result: dict = {}
    kind = kv_e2e.Kind("fake", "sdpa", lambda: None)
    kv_e2e.largest_in_budget(_bench(), kind, lambda b: (b, 64), (1, 2), 1, budget, 0.1, False, result)
    (skipped,) = result["attempts"]  # 50 rows would take 0.5 s > 0.1 s
    assert skipped["size"] == 50 and "max-run-s" in skipped["skipped"]
    assert kv_e2e.search_value(result, 1) == (50, "predicted")


def test_search_checks_and_markdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two searches (DynamicCache's budget fits 10 rows, TurboQuantCache's 40): size and throughput ratios, the table."""
    searches = []
    for name, rows, rate in (("DynamicCache + sdpa", 10, 100.0), ("TurboQuantCache 4b + tqvec", 40, 60.0)):
        budget = 1000 + 100 * rows
        monkeypatch.setattr(kv_e2e, "generate_run", _fake_generate(lambda b: 1000 + 100 * b, budget, rate))
        result: dict = {}
        kv_e2e.largest_in_budget(_bench(), kv_e2e.Kind(name, "sdpa", lambda: None), lambda b: (b, 64), (1, 2), 1, budget,
                                 60.0, False, result)
        searches.append(result)
    section = {"command": "cmd", "settings": {"step": 1}, "settings_text": "", "searches": searches}
    checks = kv_e2e.search_checks(section, 1, throughput=True)
    assert (checks["dynamic"], checks["turbo"], checks["ratio"], checks["pass"]) == (10, 40, 4.0, True)
    assert checks["throughput_ratio"] == pytest.approx(60 * 40 / (100 * 10)) and checks["throughput_pass"] is True
    section["checks"] = checks
    data = {"device": "cpu", "torch": "t", "transformers": "t", "parts": {"batch": section},
            "model": {"layers": 2, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "head_dim": 64,
                      "vocab": 1000, "weights_bytes": 1}}
    md = kv_e2e.markdown(data)
    assert "## Largest batch" in md and "4.00×, target ≥ 3×: pass" in md and "2.40×, target ≥ 2×: pass" in md


def test_a_lower_bound_below_the_target_decides_nothing() -> None:
    """TurboQuantCache's size known only from below (a failure far above its largest completed size) leaves the size
    and throughput checks undecided; a failure close enough above it that no size could reach the target fails."""
    def search(done: int, failed: int) -> dict:
        runs = [{"size": done, "ok": True, "decode_tokens_per_s": 10.0 * done}, {"size": failed, "ok": False}]
        return {"largest_completed": done, "smallest_failed": failed, "predicted": failed, "attempts": runs,
                "fit": []}

    dynamic = search(6, 7)
    open_ended = kv_e2e.search_checks({"searches": [dynamic, search(2, 32)]}, 1, throughput=True)
    assert open_ended["turbo_how"] == "at least" and open_ended["pass"] is None and open_ended["throughput_pass"] is None
    capped = kv_e2e.search_checks({"searches": [dynamic, search(2, 10)]}, 1, throughput=True)
    assert capped["pass"] is False
    measured = kv_e2e.search_checks({"searches": [dynamic, search(20, 21)]}, 1, throughput=True)
    assert measured["pass"] is True and measured["throughput_pass"] is True
