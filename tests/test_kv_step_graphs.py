"""The CUDA graphs of a static cache's eager one-token steps (tqvec.kv.step_graphs).

Oracle: the same steps with the graphs switched off (``step_graphs.ENABLED = False``), which launch the same kernels
on the same inputs, so logits and generated tokens must be identical. The CPU tests cover what does not need a GPU:
when a step may replay, and deep copies of a cache.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch

pytest.importorskip("transformers")

from kv_models import tiny_llama  # noqa: E402 (tests/support)

from tqvec.kv import StaticTurboQuantCache, static_ops, step_graphs  # noqa: E402
from tqvec.kv.static import StaticKV  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def _cache(model, max_cache_len: int = 96) -> StaticTurboQuantCache:
    return StaticTurboQuantCache(model.config, max_cache_len, window=9, sinks=2)


def test_steps_replay_only_eagerly_on_cuda(monkeypatch) -> None:
    assert not step_graphs.replayable(torch.zeros(1))
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        assert step_graphs.replayable(x)
        monkeypatch.setattr(step_graphs, "ENABLED", False)
        assert not step_graphs.replayable(x)


def test_copies_of_a_cache_start_without_graphs_and_share_the_codecs() -> None:
    """A deep copy's layers get one new pool between them and no recorded graph (the originals write the original's
    buffers), keep the shared codec objects (what a compiled step's constants come from) and are registered for the
    compiled step's operators, where they stay once the original is gone."""
    model = tiny_llama()
    cache = _cache(model)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 12, dtype=torch.long), cache=cache)
    twin = copy.deepcopy(cache)
    pools = {id(layer.graphs.pool) for layer in twin.layers}
    assert len(pools) == 1 and pools.isdisjoint({id(layer.graphs.pool) for layer in cache.layers})
    assert all(layer.graphs.slots == () and layer.graphs.recordings == 0 for layer in twin.layers)
    for a, b in zip(cache.layers, twin.layers):
        assert a.key_codec is b.key_codec and b.key_store.codec is a.key_codec and a.value_codec is b.value_codec
        assert a.key_store.fields[0]["packed"] is not b.key_store.fields[0]["packed"]
        assert b.buffer_token is not a.buffer_token and b.op_key == a.op_key
    key = twin.layers[0].op_key
    del cache
    gc.collect()
    assert all(layer in static_ops._LAYERS[key] for layer in twin.layers)


def test_the_validity_rows_follow_the_mask_given() -> None:
    """The rows the cache's step graphs read are copied once per mask object, again when that mask is written in place
    (a preallocated mask updated between steps), when it is an inference tensor (no version to compare) and after
    forget_masks (each forward's first layer), and into a new buffer (a new token: graphs record again) only when the
    shape changes."""
    pool = step_graphs.GraphPool()
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    rows, token = pool.validity(mask, 2)
    assert rows.tolist() == [[True] * 8] * 2
    mask[1, ..., :3] = False
    again, again_token = pool.validity(mask, 2)
    assert again is rows and again_token is token and rows[1].tolist() == [False] * 3 + [True] * 5
    other = torch.zeros(1, 1, 1, 8, dtype=torch.bool)
    assert pool.validity(other, 2)[0] is rows and not rows.any()  # one row for both batch rows
    other.data[0, ..., :2] = True  # a write the version counter does not see: copied again after forget_masks
    pool.forget_masks()
    assert pool.validity(other, 2)[0][:, :2].all()
    wider, wider_token = pool.validity(torch.ones(2, 1, 1, 9, dtype=torch.bool), 2)
    assert wider.shape == (2, 9) and bool(wider.all()) and wider_token is not token
    with torch.inference_mode():  # an inference tensor has no version: copied at every call
        frozen = torch.ones(2, 1, 1, 9, dtype=torch.bool)
        assert bool(pool.validity(frozen, 2)[0].all())
        frozen[0, ..., 4:] = False
        assert pool.validity(frozen, 2)[0][0].tolist() == [True] * 4 + [False] * 5


def test_each_forward_starts_the_mask_copies_anew() -> None:
    """The cache's first compressed layer (only it) opens a step: its update makes the pool copy the next mask."""
    model = tiny_llama()
    cache = _cache(model)
    assert [layer.opens_step for layer in cache.layers] == [True] + [False] * (len(cache.layers) - 1)
    pool = cache.layers[0].graphs.pool
    mask = torch.ones(1, 1, 1, 96, dtype=torch.bool)
    rows, _ = pool.validity(mask, 1)
    mask.data[..., 50:] = False
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 12, dtype=torch.long), cache=cache)
    assert pool.validity(mask, 1)[0][0, 50:].sum() == 0


def test_a_traced_attention_writes_the_token_its_eager_update_deferred() -> None:
    """Where a one-token update ran eagerly on CUDA (deferring its write) and the attention is traced (a graph break
    between them), the traced attention writes the token first, into its own layer only. Simulated on the CPU: the
    deferral is made by hand, and aot_eager runs the traced attention."""
    from tqvec.kv.attention import tqvec_attention_forward  # noqa: PLC0415

    model = tiny_llama()
    ids = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(9))

    def prompted() -> StaticTurboQuantCache:
        cache = _cache(model)
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
        return cache

    deferred, written = prompted(), prompted()
    b, h, _, d = deferred.layers[0].ring_keys.shape
    g = torch.Generator().manual_seed(10)
    k, v, q = torch.randn(b, h, 1, d, generator=g), torch.randn(b, h, 1, d, generator=g), torch.randn(b, 2 * h, 1, d, generator=g)
    written.update(k, v, 0)
    handle = StaticKV(deferred.layers[0])
    deferred.layers[0].pending = (k, v)  # what update() does on CUDA
    traced = torch.compile(lambda q: tqvec_attention_forward(None, q, handle, handle, None, d ** -0.5)[0],
                           backend="aot_eager")
    with torch.no_grad():
        got = traced(q)
        expected = tqvec_attention_forward(None, q, StaticKV(written.layers[0]), None, None, d ** -0.5)[0]
    assert deferred.layers[0].pending is None
    assert [layer.lengths.tolist() for layer in deferred.layers] == [layer.lengths.tolist() for layer in written.layers]
    assert torch.equal(got, expected)


@cuda
def test_run_records_once_replays_and_returns_copies() -> None:
    graphs = step_graphs.StepGraphs(step_graphs.GraphPool())
    calls = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2

    token = object()
    x = torch.arange(4.0, device="cuda")
    first = graphs.run("step", (token, 1), (x,), double)  # eagerly, then recorded (a second call of double)
    assert torch.equal(first, x * 2) and len(calls) == 2 and graphs.slots == ("step",)
    held = graphs.run("step", (token, 1), (x + 1,), double)  # replayed: double is not called
    assert torch.equal(held, (x + 1) * 2) and len(calls) == 2
    again = graphs.run("step", (token, 1), (x + 5,), double)
    assert torch.equal(again, (x + 5) * 2) and torch.equal(held, (x + 1) * 2)  # the earlier output is a copy
    for key, inputs in (((token, 2), (x,)), ((token, 2), (x[:3],)), ((token, 2), (x[:3].half(),)),
                        ((object(), 2), (x[:3].half(),))):  # each differs from the one before in one thing
        before = len(calls)
        assert torch.equal(graphs.run("step", key, inputs, double), inputs[0] * 2)
        assert len(calls) == before + 2  # another setting, token, shape or dtype: recorded again


@cuda
@pytest.mark.parametrize("pads", [0, 7])
def test_graphed_steps_equal_launched_steps(monkeypatch, pads) -> None:
    """Forty one-token steps (the ring evicts into the codes on each) through recorded graphs give the launched steps'
    logits exactly; with a left-padded row the mask is a graph input too; generate() agrees as well."""
    model = tiny_llama().cuda()
    ids = torch.randint(1, 64, (2, 30), generator=torch.Generator().manual_seed(3)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    follow = torch.randint(1, 64, (2, 40), generator=torch.Generator().manual_seed(4)).cuda()

    def steps() -> tuple[torch.Tensor, list, torch.Tensor]:
        cache = _cache(model)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, cache=cache)
            logits, seen = [], mask
            for t in range(40):
                seen = torch.cat([seen, torch.ones_like(seen[:, :1])], dim=1)
                logits.append(model(input_ids=follow[:, t:t + 1], attention_mask=seen, cache=cache).logits)
            tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                    pad_token_id=0, cache=_cache(model), disable_compile=True)
        return torch.stack(logits), [(layer.graphs.slots, layer.graphs.recordings) for layer in cache.layers], tokens

    graphed, slots, tokens = steps()
    monkeypatch.setattr(step_graphs, "ENABLED", False)
    launched, none, reference_tokens = steps()
    assert slots == [(("step",), 1)] * 2 and none == [((), 0)] * 2  # recorded once, replayed 39 times
    assert torch.equal(graphed, launched)
    assert torch.equal(tokens, reference_tokens)


@cuda
def test_a_deferred_write_is_made_before_anything_else_reads_the_layer(monkeypatch) -> None:
    """On CUDA a one-token update leaves its write to the step's attention (one graph for both); the layer's length,
    its tokens, a copy or a crop asked for before that attention see the token written, as the launched path does."""
    model = tiny_llama().cuda()
    ids = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(7)).cuda()

    def prompt_and_one_update(enabled: bool) -> StaticTurboQuantCache:
        monkeypatch.setattr(step_graphs, "ENABLED", enabled)
        cache = _cache(model)
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
            b, h, _, d = cache.layers[0].ring_keys.shape
            x = torch.randn(b, h, 2, d, generator=torch.Generator().manual_seed(8)).cuda()
            cache.update(x[:, :, :1], x[:, :, 1:], 0)
        return cache

    def tokens(cache: StaticTurboQuantCache) -> tuple[int, torch.Tensor]:
        handle = StaticKV(cache.layers[0]).materialize()
        return handle.n_codes, torch.cat([handle.sink_keys, handle.keys], dim=2).cpu()

    reads = {"length": lambda c: int(c.get_seq_length(0)), "tokens": tokens,
             "copy": lambda c: int(copy.deepcopy(c).layers[0].lengths[0]),
             "crop": lambda c: (c.crop(-1), int(c.layers[0].lengths[0]))[1]}
    for name, read in reads.items():
        launched, graphed = prompt_and_one_update(False), prompt_and_one_update(True)
        assert launched.layers[0].pending is None and graphed.layers[0].pending is not None, name
        expected, got = read(launched), read(graphed)
        assert graphed.layers[0].pending is None, name
        if name == "tokens":
            assert got[0] == expected[0] and torch.equal(got[1], expected[1])
        else:
            assert got == expected == (31 if name != "crop" else 30), name


@cuda
def test_a_step_that_cannot_be_recorded_warns_and_runs_eagerly() -> None:
    """A step that synchronizes cannot be captured: its first call still does the work once, warns, and later calls
    with the same key run it eagerly without trying again."""
    graphs = step_graphs.StepGraphs(step_graphs.GraphPool())
    calls = []

    def synchronizing(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * float(x.sum())  # .item(): not allowed while capturing

    x = torch.ones(3, device="cuda")
    with pytest.warns(RuntimeWarning, match="could not be recorded"):
        assert torch.equal(graphs.run("step", (1,), (x,), synchronizing), x * 3)
    assert len(calls) == 2 and graphs.slots == () and graphs.recordings == 0
    assert torch.equal(graphs.run("step", (1,), (x * 2,), synchronizing), x * 12)
    assert len(calls) == 3
    assert torch.equal(torch.ones(2, device="cuda") + 1, torch.full((2,), 2.0, device="cuda"))  # CUDA still usable


@cuda
def test_a_step_captured_by_the_caller_launches_its_kernels() -> None:
    """Inside a CUDA graph the caller captures, a step does not record graphs of its own (it launches the kernels into
    the caller's graph): replaying the caller's graph continues the eager steps' logits."""
    model = tiny_llama().cuda()
    ids = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(5)).cuda()
    token = torch.full((1, 1), 7, device="cuda")

    def run(capture: bool) -> list[torch.Tensor]:
        cache = _cache(model)
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
            model(input_ids=token, cache=cache)  # an eager step first (records the layers' graphs)
            if not capture:
                return [model(input_ids=token, cache=cache).logits.clone() for _ in range(5)]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = model(input_ids=token, cache=cache).logits
            out = []
            for _ in range(5):
                graph.replay()
                out.append(logits.clone())
            return out

    assert torch.equal(torch.stack(run(True)), torch.stack(run(False)))


def test_a_used_cache_deep_copies_and_both_copies_continue_alike() -> None:
    """After CPU decode steps (whose code tables then hold the native kernel's plan, which cannot be copied), a deep
    copy of either cache class continues exactly as the original (transformers' prompt-reuse recipe deep-copies a
    cache)."""
    from tqvec.kv import TurboQuantCache  # noqa: PLC0415

    model = tiny_llama()
    ids = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(6))
    for make in (lambda: _cache(model), lambda: TurboQuantCache(model.config, window=8, sinks=2, compress_chunk=1)):
        cache = make()
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
            for t in range(3):
                model(input_ids=ids[:, t:t + 1], cache=cache)
            twin = copy.deepcopy(cache)
            a = [model(input_ids=ids[:, t:t + 1], cache=cache).logits for t in range(4)]
            b = [model(input_ids=ids[:, t:t + 1], cache=twin).logits for t in range(4)]
        assert torch.equal(torch.stack(a), torch.stack(b))
