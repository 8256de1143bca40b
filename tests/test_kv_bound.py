"""``bench._kv_bound``: the decode bound's cache stores nothing but keeps the positions right, and its attention mixes
no tokens, so a step's logits are those of the same position in one forward over the whole sequence."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tqvec.bench import _kv_bound as kv_bound  # noqa: E402
from tqvec.bench import kv_e2e  # noqa: E402
from tqvec.bench.kv_cpu import cache_nbytes  # noqa: E402


def test_steps_count_tokens_store_nothing_and_match_a_whole_forward() -> None:
    model = kv_e2e.build_model(kv_e2e.llama_config(2, tiny=True), torch.device("cpu"))
    kv_bound.register()
    model.set_attn_implementation(kv_bound.NO_ATTENTION)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    cache = kv_bound.bound_cache(model.config.num_hidden_layers)
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
        steps = [model(input_ids=ids[:, :7], cache=cache).logits]
        steps += [model(input_ids=ids[:, t:t + 1], cache=cache).logits for t in range(7, 12)]
    assert cache.get_seq_length() == 12 and cache_nbytes(cache) == 0
    assert all(layer.keys is None and layer.values is None for layer in cache.layers)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole)


def test_the_attention_is_a_view_of_the_queries() -> None:
    query = torch.randn(2, 4, 3, 8)
    out, weights = kv_bound.no_attention(torch.nn.Identity(), query, query, query, None)
    assert weights is None and out.shape == (2, 3, 4, 8) and out.data_ptr() == query.data_ptr()
    torch.testing.assert_close(out, query.transpose(1, 2))
