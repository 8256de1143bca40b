"""``TurboQuantLayer.update`` under ``torch.compile``: the compress path (finite check, centering, encode) traces as one
graph, and non-finite states are still refused there."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tqvec.kv import TurboQuantLayer  # noqa: E402
from tqvec.kv.codec import HeadCodec  # noqa: E402


def _filled_layer() -> tuple[TurboQuantLayer, torch.Generator]:
    layer = TurboQuantLayer(HeadCodec(64, 4, rescale=True), HeadCodec(64, 4, seed=7), window=8, sinks=2)
    g = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, 2, 40, 64, generator=g), torch.randn(1, 2, 40, 64, generator=g))
    return layer, g


def test_compressing_update_has_no_graph_break() -> None:
    layer, g = _filled_layer()

    def step(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        handle, _ = layer.update(k, v)
        return handle.keys

    k, v = torch.randn(1, 2, 16, 64, generator=g), torch.randn(1, 2, 16, 64, generator=g)
    explained = torch._dynamo.explain(step)(k, v)
    assert layer.key_store.length == 30 + 16  # the traced call compressed 16 tokens (window 8 + 16 new > chunk)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]


def test_one_token_update_has_no_graph_break() -> None:
    layer, g = _filled_layer()

    def step(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        handle, _ = layer.update(k, v)
        return handle.keys

    explained = torch._dynamo.explain(step)(torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g))
    assert explained.graph_break_count == 0 and not explained.break_reasons, [r.reason for r in explained.break_reasons]


def test_compiled_update_refuses_non_finite_states() -> None:
    layer, g = _filled_layer()
    step = torch.compile(lambda k, v: layer.update(k, v)[0].keys, backend="eager", fullgraph=True)
    k, v = torch.randn(1, 2, 16, 64, generator=g), torch.randn(1, 2, 16, 64, generator=g)
    k[0, 1, 3, 5] = float("nan")
    with pytest.raises(RuntimeError, match="key_states contains NaN or Inf"):
        step(k, v)
