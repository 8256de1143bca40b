"""StaticTurboQuantCache (tqvec.kv.static) on a small random Llama (CPU), and its decode kernel's ring mode (the Triton
kernel under the interpreter, or on CUDA) against the torch reference.

Oracles: the dynamic TurboQuantCache, which a one-token step of the static cache must equal exactly (the static cache
encodes the token leaving its window before attending, the dynamic one after: ``window=w + 1`` against
``window=w, compress_chunk=1`` attend to the same tokens with the same codes), and DynamicCache at 8 bits.
"""
from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("transformers")

from kv_models import tiny_llama  # noqa: E402 (tests/support)
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from transformers import CompileConfig, DynamicCache  # noqa: E402

from tqvec.bench.kv_cpu import cache_nbytes  # noqa: E402
from tqvec.kv import StaticTurboQuantCache, StaticTurboQuantLayer, TurboQuantCache  # noqa: E402
from tqvec.kv.attention import compressed_attention, static_decode_step  # noqa: E402
from tqvec.kv.codec import HeadCodec  # noqa: E402
from tqvec.kv.static import StaticKV  # noqa: E402

WINDOW, SINKS = 8, 2


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _pair(model, bits: int = 4, max_cache_len: int = 96) -> tuple[TurboQuantCache, StaticTurboQuantCache]:
    dynamic = TurboQuantCache(model.config, key_bits=bits, value_bits=bits, window=WINDOW, sinks=SINKS, compress_chunk=1)
    static = StaticTurboQuantCache(model.config, max_cache_len, key_bits=bits, value_bits=bits, window=WINDOW + 1,
                                   sinks=SINKS)
    return dynamic, static


def test_decode_steps_equal_the_dynamic_cache(model) -> None:
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    dynamic, static = _pair(model)
    with torch.no_grad():
        a, b = model(input_ids=ids, cache=dynamic).logits, model(input_ids=ids, cache=static).logits
        assert torch.equal(a, b)
        for _ in range(20):
            token = a[:, -1:].argmax(-1)
            a, b = model(input_ids=token, cache=dynamic).logits, model(input_ids=token, cache=static).logits
            assert torch.equal(a, b)
    layer = static.layers[0]
    assert layer.lengths.tolist() == [60, 60 - WINDOW - 1] and int(static.get_seq_length()) == 60
    assert dynamic.layers[0].key_store.length == 60 - WINDOW - 1 - SINKS + 1  # dynamic: compressed after attending


def _padded_prompt(seed: int, pads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 30 tokens and their attention mask, row 1 left-padded with ``pads`` pad tokens (id 0)."""
    ids = torch.randint(1, 64, (2, 30), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    ids[1, :pads] = 0
    return ids, mask


def _recording_compile_config(**options) -> tuple[CompileConfig, list]:
    """A CompileConfig for generate() on any device whose backend (aot_eager) records each graph it compiles into the
    returned list (a function, not a counter object: generate() deep-copies its compile_config)."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    config = CompileConfig(backend=backend, mode=None, **options)
    config._compile_all_devices = True
    return config, graphs


def test_generate_with_left_padding_equals_the_dynamic_cache(model) -> None:
    ids, mask = _padded_prompt(2, 11)  # row 1 left-padded: its sinks and first coded positions are pads
    dynamic, static = _pair(model)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, cache=dynamic,
                             pad_token_id=0)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, cache=static,
                             pad_token_id=0)
        full = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              cache=DynamicCache(config=model.config), pad_token_id=0)
        _, static8 = _pair(model, bits=8)
        out8 = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, cache=static8,
                              pad_token_id=0)
    assert torch.equal(out, ref)
    assert torch.equal(out8, full)  # 8-bit codes: DynamicCache's greedy tokens (a pad read as a token would change them)


def test_generate_compiles_decode_steps_like_static_cache(model) -> None:
    """The layers are compileable, so generate() compiles their decode steps with its compile_config (transformers does
    that on GPUs by itself; _compile_all_devices lets it here): one compiled graph serves two caches, and the tokens
    equal eager generation's."""
    ids, mask = _padded_prompt(2, 11)
    config, graphs = _recording_compile_config(fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad():
        runs = [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                               cache=_pair(model)[1], **options)
                for options in ({"disable_compile": True}, {"compile_config": config}, {"compile_config": config})]
    assert len(graphs) == 1
    assert torch.equal(runs[1], runs[0]) and torch.equal(runs[2], runs[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_reduce_overhead_steps_on_cuda() -> None:
    """torch.compile(mode="reduce-overhead") on CUDA: steps recorded into CUDA graphs by cudagraph trees (which refuse
    a step that creates tensors outliving it: the layer makes its constants when it allocates its buffers) give the
    eager steps' logits, for two caches with one compilation; generate() compiles on its own and completes."""
    cuda_model = tiny_llama().cuda()
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(7)).cuda()
    follow = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(8)).cuda()

    def steps(forward) -> torch.Tensor:
        _, static = _pair(cuda_model)
        with torch.no_grad():
            cuda_model(input_ids=ids, cache=static)
            logits = [forward(input_ids=follow[:, t:t + 1], cache=static).logits.clone() for t in range(16)]
        assert int(static.get_seq_length()) == 56
        return torch.stack(logits)

    torch._dynamo.reset()
    compiled = torch.compile(cuda_model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    eager = steps(cuda_model)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    first, second = steps(compiled), steps(compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    torch.testing.assert_close(first, eager, rtol=0, atol=1e-4)
    torch.testing.assert_close(second, eager, rtol=0, atol=1e-4)
    with torch.no_grad():
        out = cuda_model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, cache=_pair(cuda_model)[1],
                                  pad_token_id=0)
    assert out.shape == (2, 52)


@pytest.mark.slow  # ~20 s: dynamo compiles the model around every eager update of the chunks
def test_chunked_prompt_under_compile_config(model) -> None:
    """With compile_config, generate() also runs a chunked prompt's chunks through the compiled model: the static
    cache's multi-token updates and their attention run eagerly inside it (torch.compiler.disable), so the tokens equal
    eager generation's."""
    ids, mask = _padded_prompt(3, 5)
    config, graphs = _recording_compile_config()
    torch._dynamo.reset()
    with torch.no_grad():
        eager, compiled = (model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                          pad_token_id=0, prefill_chunk_size=8, cache=_pair(model)[1], **options)
                           for options in ({"disable_compile": True}, {"compile_config": config}))
    assert graphs and torch.equal(compiled, eager)


def test_8bit_logits_track_the_full_cache(model) -> None:
    """8-bit codes: logits within 0.05 of DynamicCache's over 30 steps (measured: 0.004 on this model; a token read from
    the wrong slot moves them by whole units)."""
    ids = torch.randint(0, 64, (1, 50), generator=torch.Generator().manual_seed(3))
    full = DynamicCache(config=model.config)
    _, static = _pair(model, bits=8)
    with torch.no_grad():
        a, b = model(input_ids=ids, cache=full).logits, model(input_ids=ids, cache=static).logits
        for _ in range(30):
            token = a[:, -1:].argmax(-1)
            a, b = model(input_ids=token, cache=full).logits, model(input_ids=token, cache=static).logits
            assert (a - b).abs().max() < 0.05
    assert static.layers[0].lengths.tolist() == [80, 80 - WINDOW - 1]


def test_crop_and_reset(model) -> None:
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(4))
    _, static = _pair(model, bits=8)
    with torch.no_grad():
        full = model(input_ids=ids, cache=DynamicCache(config=model.config)).logits[0, -1]
        model(input_ids=ids[:, :50], cache=static)
        static.crop(-15)  # 35 tokens: positions [35, 41) were already coded, they stay so; the window is empty
        assert static.layers[0].lengths.tolist() == [35, 35] and int(static.get_seq_length()) == 35
        for t in range(35, 60):  # refeed one token at a time: the window fills again from empty
            logits = model(input_ids=ids[:, t:t + 1], cache=static).logits[0, -1]
        assert (logits - full).abs().max() < 0.05
        static.reset()
        assert int(static.get_seq_length()) == 0
        again = model(input_ids=ids, cache=static).logits[0, -1]
        _, fresh = _pair(model, bits=8)
        assert torch.equal(again, model(input_ids=ids, cache=fresh).logits[0, -1])


def test_one_token_update_traces_without_graph_breaks(model) -> None:
    """The one-token path is tensor operations only (what a CUDA graph needs): dynamo traces it in one graph."""
    layer = StaticTurboQuantLayer(HeadCodec(16, 4, rescale=True), HeadCodec(16, 4, seed=1000), 64, WINDOW, SINKS)
    g = torch.Generator().manual_seed(5)
    layer.update(torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g))

    def step(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        handle, _ = layer.update(k, v)
        return handle.layer.lengths + 0

    explained = torch._dynamo.explain(step)(torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g))
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert layer.lengths.tolist() == [21, 21 - WINDOW]


def test_compiled_decode_steps_equal_eager_steps(model) -> None:
    """torch.compile(fullgraph=True) traces a one-token step in one graph (the step's writes and attention are custom
    operators, tqvec.kv.static_ops), and its functionalized writes reach the cache: the same logits and lengths as
    eager steps (aot_eager runs the traced graph without inductor's code generation)."""
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(6))
    prompt_mask = torch.ones(2, 40, dtype=torch.long)
    prompt_mask[1, :7] = 0
    step_mask = torch.ones(2, 96, dtype=torch.long)  # one width for every step (no recompilation): max_cache_len
    step_mask[1, :7] = 0

    def started() -> tuple[StaticTurboQuantCache, torch.Tensor]:
        _, static = _pair(model)
        with torch.no_grad():
            return static, model(input_ids=ids, attention_mask=prompt_mask, cache=static).logits

    def steps(forward) -> tuple[torch.Tensor, list[int]]:
        static, logits = started()
        out = []
        with torch.no_grad():
            for _ in range(12):
                logits = forward(input_ids=logits[:, -1:].argmax(-1), attention_mask=step_mask, cache=static).logits
                out.append(logits)
        return torch.stack(out), static.layers[0].lengths.tolist()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    (eager, eager_lengths), (traced, traced_lengths) = steps(model), steps(compiled)
    assert traced_lengths == eager_lengths == [52, 52 - WINDOW - 1]
    torch.testing.assert_close(traced, eager, rtol=0, atol=1e-6)
    compiled_frames = counter.frame_count
    again, _ = steps(compiled)  # a new cache built with the same arguments: the same compiled step
    assert counter.frame_count == compiled_frames == 1
    torch.testing.assert_close(again, eager, rtol=0, atol=1e-6)

    (first, logits_a), (second, logits_b) = started(), started()  # two live caches, stepped in turn, then one dropped
    assert first.layers[0].key_codec is second.layers[0].key_codec  # one specification, one codec object
    outs_a, outs_b = [], []
    with torch.no_grad():
        for t in range(12):
            if t < 6:
                logits_a = compiled(input_ids=logits_a[:, -1:].argmax(-1), attention_mask=step_mask, cache=first).logits
                outs_a.append(logits_a)
            elif t == 6:
                del first
                gc.collect()
            logits_b = compiled(input_ids=logits_b[:, -1:].argmax(-1), attention_mask=step_mask, cache=second).logits
            outs_b.append(logits_b)
    assert counter.frame_count == 1
    torch.testing.assert_close(torch.stack(outs_a), eager[:6], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.stack(outs_b), eager, rtol=0, atol=1e-6)


def test_bad_arguments_are_refused(model) -> None:
    with pytest.raises(ValueError, match="key_bits: a static cache takes integer bit widths"):
        StaticTurboQuantCache(model.config, 64, key_bits=3.5)
    with pytest.raises(ValueError, match="max_cache_len must be >= 5"):
        StaticTurboQuantCache(model.config, 4, sinks=4)
    with pytest.raises(ValueError, match="window must be >= 1"):
        StaticTurboQuantCache(model.config, 64, window=0)
    static = StaticTurboQuantCache(model.config, 32)
    with torch.no_grad(), pytest.raises(ValueError, match="max_cache_len = 32 tokens: 0 cached \\+ 40 new"):
        model(input_ids=torch.zeros(1, 40, dtype=torch.long), cache=static)
    with pytest.raises(NotImplementedError, match="keeps its batch size"):
        static.layers[0].batch_repeat_interleave(2)


# ------------------------------------------------------------------------------------------------ the ring kernel
def _filled(bits: int, batch: int, heads: int, d: int, prompt: int, steps: int, crop: int = 0,
            fused: bool | None = None) -> StaticTurboQuantLayer:
    """A layer (200 tokens, window 16, 3 sinks) after a ``prompt``, a ``crop`` and ``steps`` one-token steps; ``fused``:
    force the fused one-token kernels on or off (None: the layer's choice)."""
    from kernel_env import KERNEL_DEVICE  # noqa: PLC0415

    layer = StaticTurboQuantLayer(HeadCodec(d, bits, rescale=True), HeadCodec(d, bits, seed=1000), 200, 16, 3)
    g = torch.Generator().manual_seed(bits * 100 + prompt)
    new = lambda t: (torch.randn(batch, heads, t, d, generator=g) + 0.3).to(KERNEL_DEVICE)  # noqa: E731
    if prompt:
        layer.update(new(prompt), new(prompt))
    else:
        layer.lazy_initialization(new(0), new(0))
    if fused is not None:
        layer.fused = fused
    if crop:
        layer.crop(-crop)
    for _ in range(steps):
        layer.update(new(1), new(1))
    layer.flush()  # what a model's attention does next (on CUDA an update leaves its write to it)
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("bits,prompt,steps,crop", [
    (4, 60, 5, 0),    # ring full, codes written by the prompt and by steps
    (4, 2, 4, 0),     # fewer tokens than sinks + window: sinks partly filled, ring partly filled, no codes
    (2, 40, 3, 12),   # after a crop: the ring holds fewer tokens than its slots, stale slots must be skipped
    (3, 90, 30, 0),   # the ring wrapped around several times
])
def test_ring_kernel_equals_torch_reference(bits, prompt, steps, crop) -> None:
    """The split kernel's ring mode (lengths read on the device) against the torch reference over the same tokens put
    in order (:meth:`StaticKV.materialize`); bound as ``test_kernels_equal_torch_reference``'s (float16 rounding of
    queries, rotations, levels, probabilities and accumulators: 3e-3)."""
    kernels = pytest.importorskip("tqvec.kernels.attention")
    layer = _filled(bits, 2, 2, 32, prompt, steps, crop)
    g = torch.Generator().manual_seed(9)
    q = (2 * torch.randn(2, 6, 1, 32, generator=g)).to(layer.device)
    total = int(layer.lengths[0])
    mask = torch.ones(2, 1, 1, layer.max_cache_len, dtype=torch.bool, device=layer.device)
    mask[:, ..., total:] = False
    mask[1, ..., :7] = False  # row 1 left-padded
    handle = StaticKV(layer)
    reference = handle.materialize()
    for m in (None, mask):
        out = kernels.decode_attention(static_decode_step(handle, q, m, 32 ** -0.5)).float().reshape(q.shape)
        if reference.n_codes:
            ref = compressed_attention(reference, q, None if m is None else m[..., :total], 32 ** -0.5)
        else:  # nothing coded yet: exact attention over the sinks and the window
            keys = torch.cat([reference.sink_keys, reference.keys], dim=2).repeat_interleave(3, 1)
            values = torch.cat([reference.sink_values, reference.values], dim=2).repeat_interleave(3, 1)
            valid = None if m is None else m[..., :total]
            ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=valid, scale=32 ** -0.5)
        assert ((out - ref.float()).norm() / ref.norm()).item() < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("bits,prompt,steps", [(4, 40, 30), (2, 1, 25), (8, 30, 5), (1, 20, 12)])
def test_fused_one_token_steps_equal_torch_steps(bits, prompt, steps) -> None:
    """:mod:`tqvec.kernels.append` against the torch path over the same tokens: sinks, ring and lengths identical; codes
    equal but for rare flips of a level where rounding moves a coordinate across a decision boundary (the kernel rotates
    in its own float32 order: at most 1% of the codes bytes), scales within float16 rounding (1e-3 relative)."""
    pytest.importorskip("tqvec.kernels.append")
    torch_layer = _filled(bits, 2, 3, 32, prompt, steps, fused=False)
    fused_layer = _filled(bits, 2, 3, 32, prompt, steps, fused=True)
    assert fused_layer.lengths.tolist() == torch_layer.lengths.tolist()
    for name in ("sink_keys", "sink_values", "ring_keys", "ring_values"):
        assert torch.equal(getattr(fused_layer, name), getattr(torch_layer, name)), name
    for a, b in ((fused_layer.key_store, torch_layer.key_store), (fused_layer.value_store, torch_layer.value_store)):
        fa, fb = a.fields[0], b.fields[0]
        assert (fa["packed"] != fb["packed"]).float().mean().item() <= 0.01
        torch.testing.assert_close(fa["scales"].float(), fb["scales"].float(), rtol=1e-3, atol=1e-6)
    assert int(fused_layer.lengths[1]) > 3 + (prompt > 16) * (prompt - 3 - 16)  # the steps did evict tokens


def test_nbytes_counts_every_buffer(model) -> None:
    """Per layer: sinks and window ring (float32 here), codes (4-bit: 8 bytes + a float16 scale per head vector of 16
    channels) for max_cache_len − sinks tokens, float32 means, the lengths and the all-valid row."""
    _, static = _pair(model, max_cache_len=96)
    with torch.no_grad():
        model(input_ids=torch.zeros(2, 20, dtype=torch.long), cache=static)
    b, h, d = 2, 2, 16
    per_layer = (2 * b * h * (SINKS + WINDOW + 1) * d * 4 + 2 * b * h * (96 - SINKS) * (8 + 2) + 2 * b * h * d * 4
                 + 2 * 8 + b * 96)
    assert static.nbytes() == model.config.num_hidden_layers * per_layer
    assert cache_nbytes(static) == static.nbytes()  # the benchmarks' cache bytes (they read 0 for a static cache)
