"""Small models for the KV cache tests (importable from every test: ``tests/support`` is on pytest's ``pythonpath``)."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(attention: str = "tqvec") -> LlamaForCausalLM:
    """A seeded random 2-layer Llama (hidden 64, 4 query / 2 KV heads of 16, vocabulary 64), float32, eval mode, set to
    the ``attention`` implementation."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(attention)
    return model
