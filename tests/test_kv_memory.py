"""What the KV cache holds and allocates: code-store growth, ``nbytes``, bounded prefill transients, no causal mask."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kv_models import tiny_llama  # noqa: E402

from tqvec.kv import TurboQuantCache, TurboQuantLayer, attention  # noqa: E402
from tqvec.kv import store as store_mod  # noqa: E402
from tqvec.kv.codec import HeadCodec  # noqa: E402
from tqvec.kv.store import CodeStore  # noqa: E402


def _x(b: int, h: int, t: int, d: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits,mode", [(4, "mse"), (3.5, "mse"), (3, "prod")])
def test_store_growth_stays_close_to_contents(bits: float, mode: str) -> None:
    """A prefill allocates exactly; 16-token appends grow by max(MIN_GROWTH, 1/GROWTH_DIVISOR) tokens, never x1.5."""
    store = CodeStore(HeadCodec(64, bits, mode))
    x = _x(2, 3, 4000 + 40 * 16)
    store.append(x[:, :, :4000])
    assert store.capacity == 4000 and store.nbytes() == store.used_nbytes()
    grows = 0
    for start in range(4000, x.shape[2], 16):
        before = store.capacity
        store.append(x[:, :, start:start + 16])
        grows += store.capacity != before
        slack = max(store_mod.MIN_GROWTH, store.length // store_mod.GROWTH_DIVISOR)
        assert store.length <= store.capacity <= store.length + slack
        # nbytes counts the allocation: bytes_per_vector per token of capacity, for every (batch row, head)
        assert store.nbytes() == 2 * 3 * store.capacity * store.codec.bytes_per_vector
    assert grows <= 40 * 16 // store_mod.MIN_GROWTH + 1  # a copy per MIN_GROWTH tokens at most


@pytest.mark.parametrize("bits,mode", [(4, "mse"), (3.5, "mse"), (2, "prod")])
def test_sliced_append_equals_one_encode(bits: float, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of ENCODE_ROWS rows give bit-identical codes to encoding all rows at once (encodes are row-wise), and no
    encode call sees more than ENCODE_ROWS rows (the prefill's transients are bounded by a slice)."""
    codec = HeadCodec(64, bits, mode)
    b, h, t = 2, 3, 3000
    x = _x(b, h, t, seed=1) * 3 + 1
    mean = x.mean(dim=2)
    perm = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(i)) for i in range(h)])
    seen = []
    for g in codec.groups:
        real = g.quantizer.encode_checked
        monkeypatch.setattr(g.quantizer, "encode_checked", lambda rows, real=real: seen.append(rows.shape[0]) or real(rows))
    store = CodeStore(codec)
    store.append(x, mean, perm)
    assert max(seen) <= store_mod.ENCODE_ROWS and sum(seen) == len(codec.groups) * b * h * t
    prepared = torch.gather(x - mean[:, :, None], 3, perm[None, :, None, :].expand(b, h, t, 64))
    for gi, g in enumerate(codec.groups):
        whole = g.quantizer.encode(prepared[..., g.start:g.stop].reshape(-1, g.stop - g.start))
        assert torch.equal(store.fields[gi]["packed"].reshape(-1, whole.packed.shape[1]), whole.packed)
        assert torch.equal(store.fields[gi]["scales"].reshape(-1), whole.scales.half())


def test_prefill_moments_match_the_unsliced_ones() -> None:
    """Centering means and outlier order from sliced float64 moments equal the plain float32 formulas."""
    layer = TurboQuantLayer(HeadCodec(64, 3.5), HeadCodec(64, 3.5, seed=7), window=16, sinks=4)
    k, v = _x(2, 3, 5000, seed=2), _x(2, 3, 5000, seed=3)
    k[:, 1, :, 9] *= 20
    layer.update(k, v)
    kept = k[:, :, 4:]  # sinks excluded
    assert torch.allclose(layer.key_mean, kept.mean(dim=2), atol=1e-5)
    rms = (kept - kept.mean(dim=2, keepdim=True)).pow(2).mean(dim=(0, 2))
    assert torch.equal(layer.key_perm, torch.argsort(rms, dim=1, descending=True)) and int(layer.key_perm[1, 0]) == 9


def test_causal_attention_gets_no_materialized_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without padding, the prefill and the one-token steps get no (b, 1, q, kv) mask (SDPA's causal path); a padded
    batch still gets one."""
    masks = []
    real = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda module, q, k, v, mask, **kw: masks.append(("sdpa", mask)) or real(module, q, k, v, mask, **kw))
    real_step = attention.decode_step
    monkeypatch.setattr(attention, "decode_step", lambda h, q, mask, s: masks.append(("codes", mask)) or real_step(h, q, mask, s))
    real_native = attention._native_decode
    monkeypatch.setattr(attention, "_native_decode",
                        lambda h, q, mask, s: masks.append(("codes", mask)) or real_native(h, q, mask, s))
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, cache=TurboQuantCache(model.config, window=8, sinks=2))
    assert {kind for kind, _ in masks} == {"sdpa", "codes"}  # the prefill ran SDPA, the steps read the codes
    assert all(mask is None for _, mask in masks)
    masks.clear()
    padded = torch.ones(2, 60, dtype=torch.long)
    padded[1, :20] = 0
    with torch.no_grad():
        model.generate(ids.repeat(2, 1), attention_mask=padded, max_new_tokens=2, do_sample=False,
                       cache=TurboQuantCache(model.config, window=8, sinks=2))
    assert all(mask is not None and mask.dtype == torch.bool for _, mask in masks)
