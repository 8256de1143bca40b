"""End-to-end KV cache on a random Llama-3-8B-shaped model: generate() memory, budgets and decode speed.

The model: a randomly initialized bf16 ``LlamaForCausalLM`` of Llama-3-8B's shape (hidden 4096, 32 query and 8 KV
heads of 128, MLP 14336, vocabulary 128256), ``--layers`` layers (default 32), built on the meta device and drawn
on the GPU (N(0, 0.02) matrices, RMSNorm weights 1, seeded: the figures do not depend on weight values).
DynamicCache runs with transformers' ``sdpa`` attention, TurboQuantCache (``--bits`` keys and values) with
``tqvec``. Parts (``--parts``), each against the acceptance targets of the end-to-end issue:

* ``peak``: one ``generate()`` (prefill + ``--new-tokens`` greedy tokens, batch 1) per cache and ``--contexts``
  length. Peak = ``max_memory_allocated()`` during the call − ``memory_allocated()`` before it (after
  ``empty_cache`` and ``reset_peak_memory_stats``); also the cache's bytes and DynamicCache's 16-bit K/V bytes
  (analytic for the prompt, and held). Target: TurboQuantCache's peak ≤ DynamicCache's − 0.6 × DynamicCache's K/V
  bytes held.
* ``decode``: eager greedy decode tokens/s per context, all variants side by side (:func:`interleaved_decode`: one
  one-shot prefill per cache, ``E2E_WARMUP`` untimed steps per variant, then ``--new-tokens`` timed steps per variant
  in rounds of ``DECODE_ROUND_STEPS`` in which the variants take turns, so that the host's slow stretches hit all alike):
  DynamicCache with PyTorch's default SDPA backend and with cuDNN's off (the faster is the reference),
  TurboQuantCache, and at integer ``--bits`` StaticTurboQuantCache with eager steps, which replay its step graphs
  (:mod:`tqvec.kv.step_graphs`), and with those graphs off. Ratios are medians over rounds of same-round ratios.
  Targets: ≥ 1.0× the reference at 32k, ≥ 1.3× at 128k, checked for TurboQuantCache and for StaticTurboQuantCache's
  eager steps. Beside them runs the bound (:mod:`._kv_bound`): the model with no cache and no attention, whose ratio is
  the most any cache and attention could reach over the reference in this process.
* ``budget``: the longest batch-1 prompt whose ``generate()`` completes within ``--budget-gib`` beyond what is
  allocated before it (the weights), enforced by ``torch.cuda.set_per_process_memory_fraction`` (the allocator
  raises ``OutOfMemoryError`` past it). Peak is fitted as a + b·length from runs at 4 and 8 ``--length-step``, the
  largest length under the budget predicted, then verified: the prediction is run (expected to complete) and one
  step more (expected to fail), moving by ``--length-step`` at most 3 times. Target: ≥ 3× DynamicCache's.
* ``batch``: the same search over batch rows at ``--batch-context`` tokens (fit at 1 and 2 rows). Targets: ≥ 3×
  DynamicCache's rows, and decode tokens/s (rows × steps / s) at the largest batch each completes ≥ 2×.

``generate()`` runs (peak, budget, batch) use SDPA with cuDNN's backend off for both caches (cuDNN's host cost per
call makes eager decoding several times slower, ``kv_gpu.md``) and ``--prefill-chunk`` (generate's ``prefill_chunk_size``)
for both. Their decode tokens/s is timed inside the run by a streamer (the host receives each new token), over the
steps after the first ``SKIP_STEPS`` (kernel compilation, the first compression after the prefill). A budget or
batch run predicted (from the fit runs' times) to take longer than ``--max-run-s``, and any run that would end past
``--time-limit`` seconds after the start, is skipped and recorded as such. Without CUDA the memory figures are null
and the budget and batch parts are skipped. ``--tiny``: a small model, contexts and budget for smoke runs.

Writes ``kv_e2e.json`` (after every run; the parts of an earlier invocation on the same model and device are kept,
so parts can be run by separate invocations) and ``kv_e2e.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache
from transformers.generation.streamers import BaseStreamer
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tqvec.kv import StaticTurboQuantCache, TurboQuantCache, step_graphs

from . import _kv_bound as kv_bound
from .kv_cpu import cache_nbytes
from .kv_gpu import E2E_WARMUP, HKV, HQ, RESULTS, D
from .kv_step import greedy_token

PARTS = ("peak", "decode", "budget", "batch")
#: TurboQuantCache's generate() peak must stay at or under DynamicCache's minus this fraction of its K/V bytes
PEAK_SAVING = 0.6
#: the label that StaticTurboQuantCache's decode rows start with
STATIC_LABEL = "StaticTurboQuantCache"
#: the variant of StaticTurboQuantCache's decode row that the checks report (its eager steps replay step graphs)
STATIC_VARIANT = "tqvec attention, eager steps"
#: the decode part's bound (:mod:`._kv_bound`): its cache label and variant
BOUND_LABEL = "no cache (bound)"
BOUND_VARIANT = "no attention"
#: decode speed targets, TurboQuantCache / the faster DynamicCache, by context (other contexts have none)
DECODE_TARGETS = {32768: 1.0, 131072: 1.3}
#: steps each variant runs per round of the decode part (the variants take turns within a round): TurboQuantCache's
#: default ``compress_chunk``, so that every round of it holds one compression of its window, as its steps on average do
DECODE_ROUND_STEPS = 16
#: longest prompt and largest batch in the budget: TurboQuantCache ≥ this × DynamicCache
SIZE_TARGET = 3.0
#: decode tokens/s at the largest batch each cache completes in the budget: TurboQuantCache ≥ this × DynamicCache
THROUGHPUT_TARGET = 2.0
#: verification moves the predicted size by one step at most this many times (down, or up)
MAX_ADJUST = 3
#: generate() decode steps left out of its timed tokens/s
SKIP_STEPS = 20
#: prompt tokens of the untimed warm-up runs (at least; two prefill chunks if more)
WARM_TOKENS = 1024
#: fit runs of the searches: prompt lengths in ``--length-step`` units; batch rows
LENGTH_FIT = (4, 8)
BATCH_FIT = (1, 2)
WEIGHT_STD = 0.02
#: ``max_position_embeddings`` of the model (default RoPE: not a limit on the prompt, only the config's field)
MAX_POSITIONS = 1 << 21
GIB = 2 ** 30


@dataclass(frozen=True)
class Kind:
    """A cache under test: its label, the attention implementation it needs, and a factory of empty caches."""

    name: str
    attention: str
    make: Callable[[], Cache]


def cache_kinds(cfg: LlamaConfig, bits: float) -> tuple[Kind, Kind]:
    """DynamicCache (``sdpa``) and TurboQuantCache with ``bits`` keys and values (``tqvec``), in that order."""
    return (Kind("DynamicCache + sdpa", "sdpa", lambda: DynamicCache(config=cfg)),
            Kind(f"TurboQuantCache {bits:g}b + tqvec", "tqvec", lambda: TurboQuantCache(cfg, key_bits=bits, value_bits=bits)))


def llama_config(layers: int, tiny: bool) -> LlamaConfig:
    """Llama-3-8B's shape with ``layers`` layers, or (``tiny``) hidden 256, 4 / 2 heads of 64, vocabulary 1000."""
    if tiny:
        return LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           num_hidden_layers=layers, vocab_size=1000, max_position_embeddings=MAX_POSITIONS)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D,
                       num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=MAX_POSITIONS)


def build_model(cfg: LlamaConfig, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """A bf16 ``LlamaForCausalLM`` on ``device`` in eval mode: matrices N(0, ``WEIGHT_STD``) from a ``seed``-ed generator,
    RMSNorm weights 1, drawn once in place (the model is built on the meta device, where its initializers cost nothing).

    Raises ``RuntimeError`` if a 16-token forward gives non-finite logits (that forward also allocates the matmul
    workspaces, so they count in the memory held before the measured runs, not in their peaks).
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).to_empty(device=device)
    with torch.device(device):  # to_empty left RoPE's inverse frequencies (a buffer) uninitialized
        model.model.rotary_emb = LlamaRotaryEmbedding(cfg)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # Llama has no biases: the 1-D parameters are the RMSNorm weights
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, WEIGHT_STD, generator=gen)
        model.eval()
        logits = model(input_ids=torch.arange(16, device=device)[None], use_cache=False).logits
    if not bool(logits.isfinite().all()):
        raise RuntimeError("the random model gives non-finite logits")
    return model


def kv16_bytes_per_token(cfg: LlamaConfig) -> int:
    """Bytes of one token's 16-bit keys and values over all layers: 2 · layers · KV heads · head_dim · 2."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2


class StepClock(BaseStreamer):
    """A ``generate()`` streamer noting when each new token reaches the host (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        """Nothing to flush."""

    def tokens_per_s(self, batch: int) -> float | None:
        """Decode tokens/s over the steps after the first ``SKIP_STEPS`` (None with too few steps)."""
        if len(self.times) < SKIP_STEPS + 2:
            return None
        return batch * (len(self.times) - 1 - SKIP_STEPS) / (self.times[-1] - self.times[SKIP_STEPS])


@contextmanager
def memory_budget(budget_bytes: int | None) -> Iterator[None]:
    """Within the block, the CUDA caching allocator may hold at most what it holds now plus ``budget_bytes`` (beyond
    that an allocation raises ``torch.OutOfMemoryError``); None: no cap. The fraction goes back to 1.0 afterwards."""
    if budget_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + budget_bytes) / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _fresh_memory() -> int:
    """Free what earlier runs left, reset the peak statistic; the bytes allocated now (0 without CUDA)."""
    gc.collect()
    if not torch.cuda.is_initialized():  # nothing on a GPU (a CPU run)
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def generate_run(model: LlamaForCausalLM, kind: Kind, batch: int, length: int, new_tokens: int, chunk: int,
                 budget_bytes: int | None = None) -> dict:
    """One greedy ``generate()`` of exactly ``new_tokens`` tokens after a random ``(batch, length)`` prompt, with a fresh
    ``kind`` cache and ``prefill_chunk_size=chunk`` (0: none), within ``budget_bytes`` (None: no cap).

    Returns the row: ``ok`` (False: ``OutOfMemoryError`` under the budget; without a budget it propagates),
    ``seconds``, ``prefill_s`` (to the first new token), ``decode_tokens_per_s`` (:meth:`StepClock.tokens_per_s`),
    ``peak_bytes`` (beyond the allocation before the call; reached before the failure if not ``ok``; None without
    CUDA), ``cache_bytes`` (held at the end; None if not ``ok``), and for DynamicCache ``kv16_bytes``: the analytic
    16-bit K/V bytes of the prompt.
    """
    device = model.device
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device,
                        generator=torch.Generator(device).manual_seed(1_000_003 * batch + length))
    model.set_attn_implementation(kind.attention)
    cache, clock = kind.make(), StepClock()
    base = _fresh_memory()
    start = time.perf_counter()
    ok = True
    try:
        with memory_budget(budget_bytes):
            model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, prefill_chunk_size=chunk or None, streamer=clock,
                           pad_token_id=model.config.eos_token_id)
    except torch.OutOfMemoryError:
        if budget_bytes is None:
            raise
        ok = False
    seconds = time.perf_counter() - start
    row = {"cache": kind.name, "batch": batch, "context": length, "ok": ok, "seconds": seconds,
           "prefill_s": clock.times[0] - start if clock.times else None, "decode_tokens_per_s": clock.tokens_per_s(batch),
           "peak_bytes": torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None,
           "cache_bytes": cache_nbytes(cache) if ok else None}
    if isinstance(cache, DynamicCache):
        row["kv16_bytes"] = kv16_bytes_per_token(model.config) * batch * length
    return row


class Deadline:
    """Seconds since the start against ``--time-limit``."""

    def __init__(self, seconds: float) -> None:
        self.start, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, expected_s: float = 0.0) -> bool:
        """Whether a run expected to take ``expected_s`` seconds would end within the limit."""
        return self.elapsed() + expected_s <= self.seconds


@dataclass
class Bench:
    """What every part needs: the model, the two caches, the run settings, the time limit, and ``save`` (writes the
    report; called after every run)."""

    model: LlamaForCausalLM
    kinds: tuple[Kind, Kind]
    new_tokens: int
    chunk: int
    deadline: Deadline
    save: Callable[[], None]


def _show(row: dict) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


@contextmanager
def _cudnn_sdpa(enabled: bool) -> Iterator[None]:
    """PyTorch's cuDNN SDPA backend on or off within the block (on afterwards)."""
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


@contextmanager
def _step_graphs(enabled: bool) -> Iterator[None]:
    """A static cache's eager step graphs (:mod:`tqvec.kv.step_graphs`) on or off within the block (as before after)."""
    before, step_graphs.ENABLED = step_graphs.ENABLED, enabled
    try:
        yield
    finally:
        step_graphs.ENABLED = before


def warm_up(bench: Bench, kind: Kind, batches: set[int]) -> None:
    """On CUDA, untimed ``generate()`` runs over a ``WARM_TOKENS``-token prompt (at least two prefill chunks) at each of
    ``batches`` rows, so that the timed runs at those batch sizes include no kernel compilation (none on the CPU)."""
    if bench.model.device.type != "cuda":
        return
    for batch in sorted(batches):
        generate_run(bench.model, kind, batch, max(WARM_TOKENS, 2 * bench.chunk), bench.new_tokens, bench.chunk)


def peak_part(bench: Bench, contexts: list[int], section: dict) -> None:
    """``generate()`` at batch 1 per context and cache (after :func:`warm_up`), no budget: rows into
    ``section["rows"]``."""
    with _cudnn_sdpa(False):
        for kind in bench.kinds:
            warm_up(bench, kind, {1})
        for context in contexts:
            for kind in bench.kinds:
                if not bench.deadline.allows():
                    row = {"cache": kind.name, "context": context, "skipped": "time limit"}
                else:
                    row = generate_run(bench.model, kind, 1, context, bench.new_tokens, bench.chunk)
                section["rows"].append(row)
                _show(row)
                bench.save()


@dataclass(frozen=True)
class DecodeVariant:
    """One eager-decode configuration: a cache kind, its row label, and the switches it runs under (cuDNN's SDPA backend,
    the static cache's step graphs)."""

    kind: Kind
    label: str
    cudnn: bool = True
    graphs: bool = True

    @contextmanager
    def active(self, model: LlamaForCausalLM) -> Iterator[None]:
        """The block runs ``model`` with this variant's attention and switches."""
        model.set_attn_implementation(self.kind.attention)
        with _cudnn_sdpa(self.cudnn), _step_graphs(self.graphs):
            yield


def interleaved_decode(model: LlamaForCausalLM, variants: list[DecodeVariant], ids: torch.Tensor, rounds: int, steps: int,
                       warmup: int) -> tuple[list[list[float]], dict[str, Cache]]:
    """Milliseconds per greedy step of each variant in each round, measured side by side.

    One cache per distinct kind (variants of a kind share it and continue its sequence) is filled by a one-shot prefill
    of ``ids`` ``(1, context)``; every variant then runs ``warmup`` untimed steps (kernel compilation, graph recording,
    the first compression); then ``rounds`` rounds each run ``steps`` steps of every variant, synchronized around each
    variant's steps, the order rotating by one variant per round and reversed in every other round (so that no variant
    always follows the same one), so that a slow stretch of the host hits all alike.

    Returns ``(times, caches)``: ``times[i][r]`` ms/step of ``variants[i]`` in round ``r``; the caches by kind name.
    """
    def sync() -> None:
        if ids.is_cuda:
            torch.cuda.synchronize()

    caches: dict[str, Cache] = {}
    tokens: dict[str, torch.Tensor] = {}
    times: list[list[float]] = [[] for _ in variants]
    with torch.no_grad():
        for v in variants:
            name = v.kind.name
            with v.active(model):
                if name not in caches:
                    caches[name] = cache = v.kind.make()
                    tokens[name] = greedy_token(model, cache, ids, logits_to_keep=1)
                for _ in range(warmup):
                    tokens[name] = greedy_token(model, caches[name], tokens[name])
        for r in range(rounds):
            order = [(r + j) % len(variants) for j in range(len(variants))]
            for i in order if r % 2 == 0 else order[::-1]:
                v, name = variants[i], variants[i].kind.name
                with v.active(model):
                    sync()
                    start = time.perf_counter()
                    for _ in range(steps):
                        tokens[name] = greedy_token(model, caches[name], tokens[name])
                    sync()
                times[i].append((time.perf_counter() - start) / steps * 1000)
    return times, caches


def decode_variants(bench: Bench, context: int, bits: float, rounds: int, steps: int) -> list[DecodeVariant]:
    """The decode part's variants at ``context``: DynamicCache with the default SDPA backend choice and (on CUDA) with
    cuDNN's off, TurboQuantCache, and for integer ``bits`` StaticTurboQuantCache (its steps eager, as
    ``generate(disable_compile=True)`` runs them; on CUDA also with its step graphs off), sized for every step that
    :func:`interleaved_decode` runs on it, and last the bound: no cache and no attention (:mod:`._kv_bound`)."""
    dynamic, turbo = bench.kinds
    cuda = bench.model.device.type == "cuda"
    out = [DecodeVariant(dynamic, "default SDPA backend")]
    if cuda:
        out.append(DecodeVariant(dynamic, "cuDNN SDPA off", cudnn=False))
    out.append(DecodeVariant(turbo, "tqvec attention"))
    if bits == int(bits):
        sharing = 2 if cuda else 1
        length = context + sharing * (E2E_WARMUP + rounds * steps) + 1
        static = Kind(f"{STATIC_LABEL} {bits:g}b + tqvec", "tqvec", functools.partial(
            StaticTurboQuantCache, bench.model.config, length, int(bits), int(bits)))
        out.append(DecodeVariant(static, STATIC_VARIANT))
        if cuda:  # the same steps launched without the graphs (the CPU has none)
            out.append(DecodeVariant(static, STATIC_VARIANT + ", step graphs off", graphs=False))
    kv_bound.register()
    layers = bench.model.config.num_hidden_layers
    out.append(DecodeVariant(Kind(BOUND_LABEL, kv_bound.NO_ATTENTION, functools.partial(kv_bound.bound_cache, layers)),
                             BOUND_VARIANT))
    return out


def decode_rounds(new_tokens: int) -> int:
    """Rounds of ``DECODE_ROUND_STEPS`` steps the decode part times per variant for ``--new-tokens`` (at least one)."""
    return max(1, new_tokens // DECODE_ROUND_STEPS)


def decode_part(bench: Bench, contexts: list[int], section: dict, bits: float) -> None:
    """Eager decode per context, every variant of :func:`decode_variants` measured side by side by
    :func:`interleaved_decode` (``E2E_WARMUP`` untimed steps each, then ``--new-tokens`` rounded down to whole rounds of
    ``DECODE_ROUND_STEPS``, at least one round, timed steps each: ``timed_steps``). A row's ``ms_per_step`` is its
    median round, ``round_ms`` all rounds. Rows into ``section["rows"]``."""
    rounds, steps = decode_rounds(bench.new_tokens), DECODE_ROUND_STEPS
    device = bench.model.device
    for context in contexts:
        variants = decode_variants(bench, context, bits, rounds, steps)
        rows = [{"cache": v.kind.name, "variant": v.label, "context": context} for v in variants]
        if not bench.deadline.allows():
            for row in rows:
                row["skipped"] = "time limit"
        else:
            ids = torch.randint(0, bench.model.config.vocab_size, (1, context), device=device,
                                generator=torch.Generator(device).manual_seed(context))
            _fresh_memory()
            times, caches = interleaved_decode(bench.model, variants, ids, rounds, steps, E2E_WARMUP)
            for row, v, ms in zip(rows, variants, times):
                median = statistics.median(ms)
                row.update(ms_per_step=median, tokens_per_s=1000 / median, timed_steps=rounds * steps, round_ms=ms,
                           cache_bytes=cache_nbytes(caches[v.kind.name]))
            del caches
        for row in rows:
            section["rows"].append(row)
            _show({k: v for k, v in row.items() if k != "round_ms"})
        bench.save()


def _seconds_model(points: list[tuple[int, float]], quadratic: bool) -> Callable[[int], float]:
    """Run time as a function of size through two (size, seconds) points: c1·s + c2·s² (``quadratic``: a prefill's
    attention, c2 ≥ 0) or a + b·s, never below the slower point's time."""
    (s1, t1), (s2, t2) = points
    if quadratic:
        c2 = max(0.0, (t2 / s2 - t1 / s1) / (s2 - s1))
        c1 = max(t1 / s1 - c2 * s1, 0.0)
        return lambda s: max(t2, c1 * s + c2 * s * s)
    b = (t2 - t1) / (s2 - s1)
    return lambda s: max(t2, t1 + b * (s - s1))


def largest_in_budget(bench: Bench, kind: Kind, shape: Callable[[int], tuple[int, int]], fit: tuple[int, int], step: int,
                      budget_bytes: int, max_run_s: float, quadratic: bool, result: dict) -> None:
    """The largest size (a multiple of ``step``; ``shape(size)`` = (batch, length)) whose ``generate()`` completes within
    ``budget_bytes``, written into ``result`` as it goes.

    After :func:`warm_up` at the fit runs' batch sizes, the two ``fit`` sizes run; their peaks give peak ≈ a + b·size
    (``peak_model``) and the ``predicted`` largest size, their times a run-time model (``quadratic`` in size: prompt
    length). Then the prediction is run; if it completes, one step more (and again, up to ``MAX_ADJUST`` steps up
    while those complete), else one step less (down to ``MAX_ADJUST`` steps). A run predicted to exceed ``max_run_s``
    or the deadline is recorded as skipped and ends the search. ``result`` gets ``fit`` and ``attempts`` (rows with
    ``size`` and ``predicted_s``), and ``largest_completed`` / ``smallest_failed`` over all runs.
    """
    result.update(cache=kind.name, fit=[], attempts=[])
    warm_up(bench, kind, {shape(size)[0] for size in fit})

    def run(size: int, into: str, expected_s: float | None = None) -> bool | None:
        if expected_s is not None and expected_s > max_run_s:
            reason = f"predicted {expected_s:.0f} s > --max-run-s {max_run_s:g}"
        elif not bench.deadline.allows(expected_s or 0.0):
            reason = "time limit"
        else:
            reason = None
        if reason:
            row = {"cache": kind.name, "size": size, "predicted_s": expected_s, "skipped": reason}
        else:
            row = {"size": size, "predicted_s": expected_s,
                   **generate_run(bench.model, kind, *shape(size), bench.new_tokens, bench.chunk, budget_bytes)}
        result[into].append(row)
        done = [r for r in result["fit"] + result["attempts"] if "ok" in r]
        result["largest_completed"] = max((r["size"] for r in done if r["ok"]), default=None)
        result["smallest_failed"] = min((r["size"] for r in done if not r["ok"]), default=None)
        _show(row)
        bench.save()
        return None if reason else row["ok"]

    for size in fit:
        if not run(size, "fit"):
            result["stopped"] = f"the fit run at {size} did not complete"
            return
    (s1, p1), (s2, p2) = [(r["size"], r["peak_bytes"]) for r in result["fit"]]
    slope = (p2 - p1) / (s2 - s1)
    intercept = p1 - slope * s1
    result["peak_model"] = {"intercept_bytes": intercept, "bytes_per_unit": slope}
    if slope <= 0:
        result["stopped"] = "the peak did not grow between the fit runs"
        return
    predicted = max(step, int((budget_bytes - intercept) / slope) // step * step)
    result["predicted"] = predicted
    seconds = _seconds_model([(r["size"], r["seconds"]) for r in result["fit"]], quadratic)
    attempt = lambda size: run(size, "attempts", seconds(size))  # noqa: E731
    ok = attempt(predicted)
    if ok:
        size = predicted
        for _ in range(MAX_ADJUST):
            if not attempt(size + step):
                break
            size += step
    elif ok is False:
        size = predicted
        for _ in range(MAX_ADJUST):
            size -= step
            if size < step or attempt(size) is not False:
                break


def search_part(bench: Bench, shape: Callable[[int], tuple[int, int]], fit: tuple[int, int], step: int, budget_bytes: int,
                max_run_s: float, quadratic: bool, section: dict) -> None:
    """:func:`largest_in_budget` for both caches, into ``section["searches"]``."""
    with _cudnn_sdpa(False):
        for kind in bench.kinds:
            result: dict = {}
            section["searches"].append(result)
            largest_in_budget(bench, kind, shape, fit, step, budget_bytes, max_run_s, quadratic, result)


# ---------------------------------------------------------------------------------------------------- report


def _gib(x: float | None) -> str:
    return "—" if x is None else f"{x / GIB:.2f}"


def _num(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _round_range(row: dict) -> str:
    """A decode row's fastest and slowest round (rows of runs before the rounds: none)."""
    rounds = row.get("round_ms")
    return f"{min(rounds):.2f} – {max(rounds):.2f}" if rounds else "—"


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _target(x: float | None) -> str:
    return "—" if x is None else f"≥ {x:g}×"


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("pass" if ok else "FAIL")


def _by_context(rows: list[dict]) -> dict[int, dict[str, dict]]:
    """Completed rows by context, then by cache label."""
    out: dict[int, dict[str, dict]] = {}
    for r in rows:
        if r.get("ok"):
            out.setdefault(r["context"], {})[r["cache"]] = r
    return out


def peak_checks(section: dict, dynamic: str, turbo: str) -> list[dict]:
    """Per context with both caches run: DynamicCache's K/V bytes held, the target peak, and whether TurboQuantCache
    meets it (None without memory figures)."""
    out = []
    for context, runs in sorted(_by_context(section.get("rows", [])).items()):
        if dynamic not in runs or turbo not in runs:
            continue
        d, t = runs[dynamic], runs[turbo]
        kv = d["cache_bytes"]
        target = None if d["peak_bytes"] is None else d["peak_bytes"] - PEAK_SAVING * kv
        out.append({"context": context, "dynamic_peak_bytes": d["peak_bytes"], "dynamic_kv16_analytic_bytes": d["kv16_bytes"],
                    "dynamic_kv16_held_bytes": kv, "target_bytes": target, "turbo_peak_bytes": t["peak_bytes"],
                    "turbo_cache_bytes": t["cache_bytes"], "pass": None if target is None else t["peak_bytes"] <= target})
    return out


def paired_ratio(reference: dict, row: dict) -> float:
    """How many times faster ``row`` decodes than ``reference`` (rows of one context): the median over rounds of the
    reference's ms/step over the row's in the same round."""
    return statistics.median(r / t for r, t in zip(reference["round_ms"], row["round_ms"]))


def decode_checks(section: dict, dynamic: str, turbo: str) -> list[dict]:
    """Per context: the faster DynamicCache variant (by median round) and its tokens/s, TurboQuantCache's, their
    :func:`paired_ratio`, target and verdict, and StaticTurboQuantCache's tokens/s, ratio and verdict against the same
    target (its eager steps with step graphs, where it was run; None otherwise), and the bound's ratio (None where it was
    not run)."""
    out = []
    by_context: dict[int, list[dict]] = {}
    for r in section.get("rows", []):
        if "tokens_per_s" in r:
            by_context.setdefault(r["context"], []).append(r)
    for context, rows in sorted(by_context.items()):
        ref = max((r for r in rows if r["cache"] == dynamic), key=lambda r: r["tokens_per_s"], default=None)
        tq = next((r for r in rows if r["cache"] == turbo), None)
        if ref is None or tq is None:
            continue
        ratio = paired_ratio(ref, tq)
        target = DECODE_TARGETS.get(context)
        static = next((r for r in rows if r["cache"].startswith(STATIC_LABEL) and r["variant"] == STATIC_VARIANT), None)
        static_ratio = None if static is None else paired_ratio(ref, static)
        bound = next((r for r in rows if r["cache"] == BOUND_LABEL), None)
        out.append({"context": context, "reference": ref["variant"], "reference_tokens_per_s": ref["tokens_per_s"],
                    "turbo_tokens_per_s": tq["tokens_per_s"], "ratio": ratio, "target": target,
                    "pass": None if target is None else ratio >= target,
                    "static_tokens_per_s": None if static is None else static["tokens_per_s"], "static_ratio": static_ratio,
                    "static_pass": None if target is None or static_ratio is None else static_ratio >= target,
                    "bound_ratio": None if bound is None else paired_ratio(ref, bound)})
    return out


def search_value(result: dict, step: int) -> tuple[int | None, str]:
    """A search's answer and how it is known: "measured" (the largest completed size, one step more failed), "at
    least" (the largest completed size, where the predicted size was run but no failure one step above it was seen),
    or "predicted" (the fitted value, where the prediction was never run)."""
    done, failed, predicted = result.get("largest_completed"), result.get("smallest_failed"), result.get("predicted")
    if done is not None and failed == done + step:
        return done, "measured"
    if predicted is None or any(r["size"] == predicted and "ok" in r for r in result.get("attempts", [])):
        return done, "at least"
    return predicted, "predicted"


def search_checks(section: dict, step: int, throughput: bool) -> dict | None:
    """TurboQuantCache's size over DynamicCache's (target ``SIZE_TARGET``) and, with ``throughput``, the ratio of the
    decode tokens/s of each one's run at its largest completed size (target ``THROUGHPUT_TARGET``)."""
    searches = section.get("searches", [])
    if len(searches) < 2:
        return None
    (d_size, d_how), (t_size, t_how) = (search_value(r, step) for r in searches[:2])
    out = {"dynamic": d_size, "dynamic_how": d_how, "turbo": t_size, "turbo_how": t_how,
           "ratio": t_size / d_size if d_size and t_size else None}
    out["pass"] = None if out["ratio"] is None else out["ratio"] >= SIZE_TARGET
    failed = searches[1].get("smallest_failed")
    if out["pass"] is False and t_how != "measured":  # a lower bound below the target decides nothing, unless the
        ceiling = None if failed is None or not d_size else (failed - step) / d_size  # sizes that can fit are too few
        out["pass"] = False if ceiling is not None and ceiling < SIZE_TARGET else None
    if throughput:
        rates = []
        for r in searches[:2]:
            runs = [x for x in r.get("fit", []) + r.get("attempts", [])
                    if x.get("ok") and x["size"] == r.get("largest_completed")]
            rates.append(runs[-1]["decode_tokens_per_s"] if runs else None)
        out["dynamic_tokens_per_s"], out["turbo_tokens_per_s"] = rates
        ok = all(rates)
        out["throughput_ratio"] = rates[1] / rates[0] if ok else None
        # at TurboQuantCache's largest batch only: a smaller one's throughput decides nothing
        out["throughput_pass"] = out["throughput_ratio"] >= THROUGHPUT_TARGET if ok and t_how == "measured" else None
    return out


def _search_rows(section: dict, unit: str, scale: float) -> list[str]:
    rows = []
    for r in section.get("searches", []):
        model = r.get("peak_model")
        fitted = "—" if model is None else \
            f"{model['intercept_bytes'] / GIB:.2f} GiB + {model['bytes_per_unit'] / scale:.1f} {unit}"
        runs = "; ".join(f"{a['size']}: skipped ({a['skipped']})" if "skipped" in a else
                         f"{a['size']}: {'ok' if a['ok'] else 'OOM'}, {_gib(a['peak_bytes'])} GiB, {a['seconds']:.0f} s"
                         for a in r.get("fit", []) + r.get("attempts", []))
        stopped = f" — {r['stopped']}" if "stopped" in r else ""
        rows.append(f"| {r.get('cache', '')} | {fitted} | {r.get('predicted', '—')} | {runs}{stopped} | "
                    f"{_num(r.get('largest_completed'), 0)} | {_num(r.get('smallest_failed'), 0)} |")
    return rows


def part_environment() -> dict[str, str]:
    """What a part's figures depend on beyond the header's device and model, recorded with the part (a report keeps
    parts of earlier runs): the transformers version and the CUDA allocator's configuration."""
    return {"transformers": transformers.__version__, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def _command_line(s: dict) -> str:
    """A part's command, settings and (when recorded) environment, for the report."""
    env = s.get("environment")
    ran = "" if env is None else f"; transformers {env['transformers']}" + (
        f", `PYTORCH_CUDA_ALLOC_CONF={env['PYTORCH_CUDA_ALLOC_CONF']}`" if env["PYTORCH_CUDA_ALLOC_CONF"] else "")
    return f"`{s['command']}` — {s['settings_text']}{ran}"


def markdown(data: dict) -> str:
    """The report's tables (one per part present), with the targets, verdicts and each part's command."""
    m = data["model"]
    out = [f"# End-to-end KV cache on {data['device']}: TurboQuantCache vs DynamicCache, generate() on a random "
           "Llama-3-8B-shaped model", "",
           f"Random bf16 Llama ({m['layers']} layers, hidden {m['hidden']}, {m['heads']}/{m['kv_heads']} heads of "
           f"{m['head_dim']}, MLP {m['intermediate']}, vocabulary {m['vocab']}; weights {m['weights_bytes'] / GIB:.2f} GiB); "
           f"torch {data['torch']}, transformers {data['transformers']}. Memory: peak of `max_memory_allocated()` "
           "minus what was allocated before the call (weights). DynamicCache: `sdpa` attention; TurboQuantCache: `tqvec`. "
           f"`generate()` runs use SDPA with cuDNN's backend off; their decode tokens/s skips the first {SKIP_STEPS} steps. "
           "Module docstring of `bench/kv_e2e.py`: how each part is measured.", ""]
    parts = data["parts"]
    if "peak" in parts:
        s = parts["peak"]
        out += ["## Peak memory of a whole generate(), batch 1", "", _command_line(s), "",
                f"Target: TurboQuantCache peak ≤ DynamicCache peak − {PEAK_SAVING:g} × DynamicCache's 16-bit K/V bytes "
                "(held).", "",
                "| context | DynamicCache peak GiB | its K/V GiB analytic / held | target GiB | TurboQuantCache peak GiB | "
                "its cache GiB | pass |", "|---|---|---|---|---|---|---|"]
        out += [f"| {c['context']} | {_gib(c['dynamic_peak_bytes'])} | {_gib(c['dynamic_kv16_analytic_bytes'])} / "
                f"{_gib(c['dynamic_kv16_held_bytes'])} | {_gib(c['target_bytes'])} | {_gib(c['turbo_peak_bytes'])} | "
                f"{_gib(c['turbo_cache_bytes'])} | {_verdict(c['pass'])} |" for c in s.get("checks", [])]
        out += ["", "| cache | context | peak GiB | cache GiB | prefill s | decode tokens/s | total s |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['cache']} | {r['context']} | skipped ({r['skipped']}) |  |  |  |  |" if "skipped" in r else
                f"| {r['cache']} | {r['context']} | {_gib(r['peak_bytes'])} | {_gib(r['cache_bytes'])} | "
                f"{_num(r['prefill_s'])} | {_num(r['decode_tokens_per_s'])} | {r['seconds']:.1f} |" for r in s["rows"]]
        out.append("")
    if "decode" in parts:
        s = parts["decode"]
        out += ["## Eager decode tokens/s, batch 1", "", _command_line(s), "",
                f"Side by side (`interleaved_decode`): one one-shot prefill per cache, {E2E_WARMUP} untimed steps per "
                f"variant, then rounds in which every variant runs {DECODE_ROUND_STEPS} steps in turn (the order rotating, "
                "reversed every other round); ms/step is a "
                "variant's median round, and a ratio the median over rounds of the reference's ms/step over the "
                "variant's in the same round. Targets: "
                + ", ".join(f"≥ {v:g}× at {k}" for k, v in DECODE_TARGETS.items())
                + " (TurboQuantCache, and StaticTurboQuantCache's eager steps, / the faster DynamicCache). The bound row "
                "runs the model with no cache and no attention (`bench/_kv_bound.py`): its ratio is the most any cache "
                "and attention could reach here.", "",
                "| cache | variant | context | tokens/s | ms/step (median round) | rounds: fastest – slowest ms | cache GiB |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['cache']} | {r['variant']} | {r['context']} | skipped ({r['skipped']}) |  |  |  |" if "skipped" in r else
                f"| {r['cache']} | {r['variant']} | {r['context']} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
                f"{_round_range(r)} | {_gib(r['cache_bytes'])} |" for r in s["rows"]]
        out += ["", "| context | reference (DynamicCache) | its tokens/s | TurboQuantCache tokens/s | ratio | target | pass | "
                "StaticTurboQuantCache (eager) tokens/s | its ratio | its pass | bound's ratio |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {c['context']} | {c['reference']} | {c['reference_tokens_per_s']:.1f} | {c['turbo_tokens_per_s']:.1f} | "
                f"{c['ratio']:.2f}× | {_target(c['target'])} | {_verdict(c['pass'])} | {_num(c.get('static_tokens_per_s'))} | "
                f"{_ratio(c.get('static_ratio'))} | "
                f"{_verdict(c.get('static_pass'))} | {_ratio(c.get('bound_ratio'))} |" for c in s.get("checks", [])]
        out.append("")
    for name, title, unit, scale in (("budget", "Longest prompt in the budget, batch 1", "KiB/token", 2 ** 10),
                                     ("batch", "Largest batch in the budget", "GiB/row", GIB)):
        if name not in parts:
            continue
        s = parts[name]
        out += [f"## {title}", "", _command_line(s), ""]
        if "skipped" in s:
            out += [f"Skipped: {s['skipped']}.", ""]
            continue
        out += ["| cache | fit: peak ≈ | predicted | runs (size: result, peak, time) | largest completed | smallest failed |",
                "|---|---|---|---|---|---|"] + _search_rows(s, unit, scale) + [""]
        c = s.get("checks")
        if c:
            out.append(f"TurboQuantCache {c['turbo']} ({c['turbo_how']}) / DynamicCache {c['dynamic']} ({c['dynamic_how']}): "
                       f"{_num(c['ratio'], 2)}×, target ≥ {SIZE_TARGET:g}×: {_verdict(c['pass'])}"
                       + (" (undecided: TurboQuantCache's largest size was not found)." if c["pass"] is None else "."))
            if "throughput_ratio" in c:
                out.append(f"Decode tokens/s at the largest completed batch: TurboQuantCache {_num(c['turbo_tokens_per_s'])}, "
                           f"DynamicCache {_num(c['dynamic_tokens_per_s'])}: {_num(c['throughput_ratio'], 2)}×, "
                           f"target ≥ {THROUGHPUT_TARGET:g}×: {_verdict(c['throughput_pass'])}.")
            out.append("")
    return "\n".join(out) + "\n"


class Report:
    """``kv_e2e.json`` / ``kv_e2e.md`` under ``out``: the header (device, versions, model) and one section per part.

    Sections of an existing ``kv_e2e.json`` whose device and model match are kept (a part run again replaces its own).
    """

    def __init__(self, out: Path, header: dict, kinds: tuple[Kind, Kind]) -> None:
        self.out, self.kinds = out, kinds
        self.data = {**header, "parts": {}}
        path = out / "kv_e2e.json"
        if path.exists():
            old = json.loads(path.read_text())
            if (old.get("device"), old.get("model")) == (header["device"], header["model"]):
                self.data["parts"] = old.get("parts", {})
            else:
                print(f"{path}: another device or model; its parts are dropped", flush=True)

    def part(self, name: str, command: str, settings: dict) -> dict:
        """A new section for part ``name`` (replacing an earlier one), with an empty ``rows`` (peak, decode) or
        ``searches`` list (budget, batch)."""
        text = ", ".join(f"{k} {v}" for k, v in settings.items())
        section = {"command": command, "settings": settings, "settings_text": text, "environment": part_environment(),
                   "rows" if name in ("peak", "decode") else "searches": []}
        self.data["parts"][name] = section
        return section

    def save(self) -> None:
        """Recompute every part's checks; write both files."""
        dynamic, turbo = (k.name for k in self.kinds)
        for name, s in self.data["parts"].items():
            if name == "peak":
                s["checks"] = peak_checks(s, dynamic, turbo)
            elif name == "decode":
                s["checks"] = decode_checks(s, dynamic, turbo)
            elif "skipped" not in s:
                s["checks"] = search_checks(s, s["settings"]["step"], throughput=name == "batch")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "kv_e2e.json").write_text(json.dumps(self.data, indent=1))
        (self.out / "kv_e2e.md").write_text(markdown(self.data))


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    """Run the parts named by ``--parts`` and write ``kv_e2e.json`` / ``kv_e2e.md`` under ``--out``."""
    p = argparse.ArgumentParser(prog="tqvec bench kv-e2e", description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--contexts", type=_int_list, help="peak and decode prompt lengths (default 32768,131072; tiny 512,1024)")
    p.add_argument("--layers", type=int, help="decoder layers (default 32; tiny 2)")
    p.add_argument("--bits", type=float, default=4, help="TurboQuantCache key and value bits")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per generate() run, timed per decode run")
    p.add_argument("--budget-gib", type=float, help="memory beyond the weights (default 40; tiny 1/16)")
    p.add_argument("--batch-context", type=int, help="prompt length of the batch search (default 32768; tiny 1024)")
    p.add_argument("--length-step", type=int, help="step of the length search (default 8192; tiny 256)")
    p.add_argument("--prefill-chunk", type=int, default=0, help="generate()'s prefill_chunk_size for both caches (0: none)")
    p.add_argument("--max-run-s", type=float, default=120, help="skip budget / batch runs predicted to take longer")
    p.add_argument("--time-limit", type=float, default=420,
                   help="seconds from the start: no run starts later, no budget / batch run predicted to end later")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--device", choices=("cuda", "cpu"), help="where the model runs (default: cuda when available)")
    p.add_argument("--tiny", action="store_true", help="a tiny model, contexts and budget (smoke runs, CPU or GPU)")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if not parts or set(parts) - set(PARTS):
        p.error(f"--parts: a comma list of {', '.join(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (torch.cuda.is_available() is False)")
    if args.new_tokens < SKIP_STEPS + 2:
        p.error(f"--new-tokens must be at least {SKIP_STEPS + 2} (generate()'s tokens/s skips {SKIP_STEPS} steps)")
    tiny = args.tiny
    layers = args.layers or (2 if tiny else 32)
    contexts = args.contexts or ([512, 1024] if tiny else [32768, 131072])
    budget_bytes = int((args.budget_gib if args.budget_gib is not None else (1 / 16 if tiny else 40)) * GIB)
    batch_context = args.batch_context or (1024 if tiny else 32768)
    step = args.length_step or (256 if tiny else 8192)
    command = "python -m tqvec.bench.kv_e2e " + shlex.join(argv if argv is not None else sys.argv[1:])

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    deadline = Deadline(args.time_limit)
    cfg = llama_config(layers, tiny)
    model = build_model(cfg, device)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    kinds = cache_kinds(cfg, args.bits)
    header = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__,
              "model": {"layers": layers, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
                        "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                        "vocab": cfg.vocab_size, "dtype": "bfloat16", "weight_std": WEIGHT_STD, "weights_bytes": weights}}
    report = Report(args.out, header, kinds)
    bench = Bench(model, kinds, args.new_tokens, args.prefill_chunk, deadline, report.save)
    print(f"model ready: {weights / GIB:.2f} GiB of weights on {header['device']}, {deadline.elapsed():.0f} s", flush=True)
    common = {"bits": args.bits, "new tokens": args.new_tokens, "prefill chunk": args.prefill_chunk or "none"}
    budget = {"budget GiB": budget_bytes / GIB, "max run s": args.max_run_s}
    settings = {"peak": {**common, "contexts": contexts},
                "decode": {"bits": args.bits, "timed tokens": decode_rounds(args.new_tokens) * DECODE_ROUND_STEPS,
                           "warm-up": E2E_WARMUP, "contexts": contexts},
                "budget": {**common, **budget, "step": step},
                "batch": {**common, **budget, "step": 1, "context": batch_context}}
    for name in parts:
        began = deadline.elapsed()
        print(f"--- part {name} (at {began:.0f} s)", flush=True)
        section = report.part(name, command, settings[name])
        if name == "peak":
            peak_part(bench, contexts, section)
        elif name == "decode":
            decode_part(bench, contexts, section, args.bits)
        elif device.type != "cuda":
            section["skipped"] = "needs CUDA (the budget is enforced by the CUDA caching allocator)"
            print(f"part {name} skipped: {section['skipped']}", flush=True)
        elif name == "budget":
            search_part(bench, lambda n: (1, n), tuple(f * step for f in LENGTH_FIT), step, budget_bytes, args.max_run_s,
                        True, section)
        else:
            search_part(bench, lambda b: (b, batch_context), BATCH_FIT, 1, budget_bytes, args.max_run_s, False, section)
        section["elapsed_s"] = deadline.elapsed() - began
        report.save()
        print(f"--- part {name}: {section['elapsed_s']:.0f} s", flush=True)
    print(markdown(report.data), flush=True)


if __name__ == "__main__":
    main()
