"""``tqvec bench kernel-ab``'s command line: shapes and variants are read strictly (a typo in a constant's or a
setting's name would otherwise time the base twice under two names), and a variant's constants and search settings
are restored after its runs."""
from __future__ import annotations

import dataclasses

import pytest

from tqvec.bench.kernel_ab import Variant, constants_set, main, parse_shape, parse_variant
from tqvec.kernels import ops, topk


def test_shapes_are_d_by_queries() -> None:
    assert parse_shape("1536X10000") == (1536, 10000)
    for bad in ("384", "384x", "x100", "384x0", "384x-1", "384x100x2", "384.5x100"):
        with pytest.raises(ValueError, match="DxNQ"):
            parse_shape(bad)


def test_variants_name_existing_constants_with_literal_values() -> None:
    variant = parse_variant(["fit", "ROW_LOOP_STAGES=3", "topk.BLOCK=256", "INT8_FUSED_MAX_QUERIES=None"])
    assert variant == Variant("fit", {("ops", "ROW_LOOP_STAGES"): 3, ("topk", "BLOCK"): 256,
                                      ("ops", "INT8_FUSED_MAX_QUERIES"): None})
    assert parse_variant(["base"]) == Variant("base", {})
    with pytest.raises(ValueError, match="has no constant 'ROW_LOOP_STAGE'"):
        parse_variant(["typo", "ROW_LOOP_STAGE=3"])
    with pytest.raises(ValueError, match="tqvec.kernels.nowhere has no constant"):
        parse_variant(["typo", "nowhere.BLOCK=3"])
    with pytest.raises(ValueError, match="not a Python literal"):
        parse_variant(["bad", "ROW_LOOP_STAGES=three"])
    with pytest.raises(ValueError, match="CONSTANT=VALUE"):
        parse_variant(["bad", "ROW_LOOP_STAGES"])
    with pytest.raises(ValueError, match="starts with its name"):
        parse_variant(["ROW_LOOP_STAGES=3"])


def test_variants_name_search_settings() -> None:
    assert parse_variant(["triton", "settings.int8_hopper=False", "ROW_LOOP_STAGES=1"]) == Variant(
        "triton", {("settings", "int8_hopper"): False, ("ops", "ROW_LOOP_STAGES"): 1})
    with pytest.raises(ValueError, match="SearchSettings has no field 'int8_hoper'"):
        parse_variant(["typo", "settings.int8_hoper=False"])


def test_constants_are_restored_even_when_a_run_fails() -> None:
    stages, block = ops.ROW_LOOP_STAGES, topk.BLOCK
    with pytest.raises(RuntimeError), constants_set({("ops", "ROW_LOOP_STAGES"): stages + 1, ("topk", "BLOCK"): 64}):
        assert (ops.ROW_LOOP_STAGES, topk.BLOCK) == (stages + 1, 64)
        raise RuntimeError("a variant that does not compile")
    assert (ops.ROW_LOOP_STAGES, topk.BLOCK) == (stages, block)


def test_settings_apply_inside_the_block_only() -> None:
    before = ops.settings()
    with pytest.raises(RuntimeError), constants_set({("settings", "int8_hopper"): not before.int8_hopper,
                                                     ("settings", "cuda_graphs"): False}):
        assert ops.settings() == dataclasses.replace(before, int8_hopper=not before.int8_hopper, cuda_graphs=False)
        raise RuntimeError("a variant that does not compile")
    assert ops.settings() == before


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "384"], "DxNQ"),
    (["--shapes", "384x100", "--variant", "a", "--variant", "a", "ROW_LOOP_STAGES=1"], "names must differ"),
    (["--shapes", "384x100", "--variant", "a", "NO_SUCH=1"], "has no constant"),
])
def test_bad_command_lines_stop_before_any_work(tmp_path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                                message: str) -> None:
    if "--variant" not in argv:
        argv = [*argv, "--variant", "base"]
    with pytest.raises(SystemExit) as stop:
        main(["--out", str(tmp_path / "ab.jsonl"), *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "ab.jsonl").exists()
