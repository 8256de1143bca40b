"""TurboQuantCache in the hands of a new user: the default attention and bad arguments fail at once, clearly.

A tiny randomly initialized Llama (2 layers, head_dim 16) stands in for a real model: what is tested is where and how
the cache fails, not what the model says.
"""
from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tqvec.kv import StaticTurboQuantCache, TurboQuantCache  # noqa: E402
from tqvec.kv._requirements import require_transformers  # noqa: E402


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def _model(attn: str | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).eval()
    if attn is not None:
        model.set_attn_implementation(attn)
    return model


IDS = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("attn", [None, "sdpa", "eager"])
@pytest.mark.parametrize("tokens", [1, 4, 40])
@pytest.mark.parametrize("cache_class", [TurboQuantCache, StaticTurboQuantCache])
def test_other_attention_fails_at_first_call_saying_what_to_do(attn: str | None, tokens: int, cache_class: type) -> None:
    """One token, a few, or more than sinks + window: the error names the cache class in use and the fix."""
    model = _model(attn)
    cache = (TurboQuantCache(model.config, window=8, sinks=2) if cache_class is TurboQuantCache
             else StaticTurboQuantCache(model.config, 64, window=8, sinks=2))
    with pytest.raises(TypeError, match=rf"read {cache_class.__name__}'s compressed keys .*"
                                        r"set_attn_implementation\('tqvec'\)"):
        model(input_ids=IDS[:, :tokens], cache=cache)


def test_tqvec_attention_runs_and_matches_dynamic_cache_at_8_bits() -> None:
    """The control for the test above: the same call works once the tqvec attention is selected."""
    model = _model("tqvec")
    with torch.no_grad():
        ref = model.generate(IDS, max_new_tokens=8, do_sample=False, cache=DynamicCache(config=model.config))
        out = model.generate(IDS, max_new_tokens=8, do_sample=False,
                             cache=TurboQuantCache(model.config, key_bits=8, value_bits=8, window=8, sinks=2))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bits,error,message", [
    (8.5, ValueError, r"key_bits must lie in \[1, 8\].*8\.5"),
    (0.5, ValueError, r"key_bits must lie in \[1, 8\].*0\.5"),
    (math.nan, ValueError, r"key_bits must lie in \[1, 8\].*nan"),
    (math.inf, ValueError, r"key_bits must lie in \[1, 8\]"),
    ("4", TypeError, r"key_bits must be a number.*'4'"),
    (True, TypeError, r"key_bits must be a number"),
    (None, TypeError, r"key_bits must be a number"),
])
def test_bad_bits_name_the_argument(bits, error, message) -> None:
    cfg = _config()
    with pytest.raises(error, match=message):
        TurboQuantCache(cfg, key_bits=bits)
    with pytest.raises(error, match=message.replace("key_bits", "value_bits")):
        TurboQuantCache(cfg, value_bits=bits)


def test_edge_bits_are_accepted() -> None:
    cfg = _config()
    for bits in (1, 1.5, 8, 8.0):
        assert TurboQuantCache(cfg, key_bits=bits, value_bits=bits).key_codec.bits == float(bits)


@pytest.mark.parametrize("name,value,error", [
    ("window", -1, ValueError), ("window", 2.0, TypeError), ("sinks", -1, ValueError),
    ("compress_chunk", 0, ValueError), ("key_mode", "qjl", ValueError), ("split", "random", ValueError),
])
def test_bad_options_name_the_argument(name: str, value, error) -> None:
    with pytest.raises(error, match=name):
        TurboQuantCache(_config(), **{name: value})


@pytest.mark.parametrize("bits", [1, 1.5, 1.99])
def test_prod_keys_below_two_bits_are_refused_at_construction(bits: float) -> None:
    """``prod`` spends a bit per channel on QJL signs: below 2 bits no code bits are left (it failed at the first
    compressed step)."""
    with pytest.raises(ValueError, match=r"key_bits: key_mode='prod' .* needs key_bits >= 2"):
        TurboQuantCache(_config(), key_bits=bits, key_mode="prod")
    TurboQuantCache(_config(), key_bits=2, key_mode="prod")


def test_a_static_step_past_max_cache_len_raises_before_writing() -> None:
    """On the CPU a one-token step that would overflow the static cache raises and leaves the cache as it was."""
    model = _model("tqvec")
    cache = StaticTurboQuantCache(model.config, 42, window=8, sinks=2)
    with torch.no_grad():
        model(input_ids=IDS, cache=cache)
        model(input_ids=IDS[:, :1], cache=cache)
        model(input_ids=IDS[:, :1], cache=cache)  # 42 tokens: full
        before = [layer.lengths.clone() for layer in cache.layers]
        with pytest.raises(ValueError, match=r"max_cache_len = 42 tokens: 42 cached \+ 1 new do not fit"):
            model(input_ids=IDS[:, :1], cache=cache)
    assert all(torch.equal(layer.lengths, b) for layer, b in zip(cache.layers, before))


@pytest.mark.parametrize("keys, got", [(torch.ones(1, 2, 3, 16, dtype=torch.int64), r"torch.int64 \(1, 2, 3, 16\)"),
                                       (torch.ones(2, 3, 16), r"torch.float32 \(2, 3, 16\)"), ([1.0], "list")])
def test_bad_states_say_what_was_given(keys, got: str) -> None:
    with pytest.raises(ValueError, match=rf"key_states must be a \(batch, heads, tokens, head_dim\) float tensor, got {got}"):
        TurboQuantCache(_config()).update(keys, torch.ones(1, 2, 3, 16), 0)


def test_config_none_or_the_model_itself() -> None:
    model = _model()
    with pytest.raises(TypeError, match="config must be a transformers PretrainedConfig, got NoneType"):
        TurboQuantCache(None)
    with pytest.raises(TypeError, match=r"config must be .*pass model.config, not the model.*LlamaForCausalLM"):
        TurboQuantCache(model)


def test_config_with_another_head_dim() -> None:
    model = _model("tqvec")
    other = copy.deepcopy(model.config)
    other.head_dim = 32
    with pytest.raises(ValueError, match=r"config: the cache was built for head_dim 32, but the model's key_states have "
                                         r"head_dim 16"):
        model(input_ids=IDS, cache=TurboQuantCache(other, window=8, sinks=2))


def test_config_with_fewer_layers() -> None:
    model = _model("tqvec")
    other = copy.deepcopy(model.config)
    other.num_hidden_layers = 1
    with pytest.raises(ValueError, match=r"config: the cache was built for 1 layers, but the model updates layer 1"):
        model(input_ids=IDS, cache=TurboQuantCache(other, window=8, sinks=2))


def test_output_attentions_is_refused() -> None:
    model = _model("tqvec")
    with pytest.raises(ValueError, match="output_attentions=True"):
        model(input_ids=IDS, cache=TurboQuantCache(model.config, window=8, sinks=2), output_attentions=True)


def test_non_finite_states_are_refused_when_compressed() -> None:
    cache = TurboQuantCache(_config(), window=8, sinks=2)
    keys = torch.randn(1, 2, 40, 16)
    values = torch.randn(1, 2, 40, 16)
    keys[0, 1, 20, 3] = float("nan")
    with pytest.raises(ValueError, match="key_states contains NaN or Inf"):
        cache.update(keys, values, 0)
    values[0, 0, 5, 0] = float("inf")
    with pytest.raises(ValueError, match="value_states contains NaN or Inf"):
        cache.update(torch.randn(1, 2, 40, 16), values, 1)


@pytest.mark.parametrize("version", ["4.57.6", "5.0.0", "5.23.0"])
def test_an_older_transformers_is_named_with_its_fix(version: str) -> None:
    with pytest.raises(ImportError, match=rf"needs transformers >= 5\.24, found {version}: pip install -U"):
        require_transformers(version)


@pytest.mark.parametrize("version", ["5.24.0", "5.25.0", "5.26.0.dev0", "6.0.0"])
def test_transformers_from_5_24_on_is_accepted(version: str) -> None:
    require_transformers(version)


def test_importing_the_package_under_an_older_transformers_fails_at_once_with_the_fix() -> None:
    """The check runs before the package's other modules: their imports would fail on a missing name instead."""
    code = "import transformers; transformers.__version__ = '5.20.0'; import tqvec.kv"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == ('ImportError: tqvec.kv needs transformers >= 5.24, found 5.20.0: '
                                                    'pip install -U "transformers>=5.24"')
