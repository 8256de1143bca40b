"""A code store's compression in one launch (:func:`tqvec.kernels.append.encode_chunk`, what ``CodeStore.append`` runs on
CUDA) against the torch operations of ``CodeStore.append``."""
from __future__ import annotations

import pytest
import torch

from tqvec.kv import store as store_module
from tqvec.kv.attention import _rotation_matrices
from tqvec.kv.codec import HeadCodec
from tqvec.kv.store import CodeStore

append = pytest.importorskip("tqvec.kernels.append")
from kernel_env import KERNEL_DEVICE  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bits,rescale,dtype", [(4, True, torch.float32), (4, False, torch.bfloat16),
                                                (2, True, torch.float16), (8, False, torch.float32),
                                                (1, True, torch.float32)])
def test_encode_chunk_equals_torch_append(bits, rescale, dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chunks of a window (a strided view of its first tokens, as the cache compresses them) written at a token
    offset: codes equal to the torch path's but for rare level flips where the kernel's float32 rotation order moves a
    coordinate across a decision boundary (at most 1% of the bytes), scales within float16 rounding (1e-3 relative);
    the tokens past the chunks stay untouched."""
    monkeypatch.setattr(store_module, "FUSED_ENCODE", False)  # the reference: torch operations also on CUDA
    b, h, d = 2, 3, 64
    g = torch.Generator().manual_seed(bits)
    codec = HeadCodec(d, bits, rescale=rescale)
    window = (torch.randn(b, h, 40, d, generator=g) + 0.3).to(KERNEL_DEVICE, dtype)
    mean = torch.randn(b, h, d, generator=g).to(KERNEL_DEVICE)
    reference = CodeStore(codec)
    reference.append(window[:, :, :5], mean)  # the first compression: exact capacity
    reference.append(window[:, :, 5:22], mean)  # grows
    fused = CodeStore(codec)
    fused.allocate(reference.capacity, b, h, torch.device(KERNEL_DEVICE))
    quantizer = codec.groups[0].quantizer
    rotation = _rotation_matrices(quantizer, torch.device(KERNEL_DEVICE))[0]
    fields = fused.fields[0]
    for start, stop in ((0, 5), (5, 22)):
        append.encode_chunk(window[:, :, start:stop], mean, rotation, quantizer, fields["packed"], fields["scales"], start)
    got, want = fields["packed"][:, :, :22], reference.fields[0]["packed"][:, :, :22]
    assert (got != want).float().mean().item() <= 0.01
    torch.testing.assert_close(fields["scales"][:, :, :22].float(), reference.fields[0]["scales"][:, :, :22].float(),
                               rtol=1e-3, atol=1e-6)
    assert not fields["packed"][:, :, 22:].any() and not fields["scales"][:, :, 22:].any()


def test_fused_append_serves_one_mse_quantizer_on_cuda() -> None:
    """``CodeStore.append`` takes the one-launch path only on CUDA, for one ``mse`` quantizer the kernel serves."""
    x = torch.zeros(1, 2, 3, 32)
    assert CodeStore(HeadCodec(32, 4))._fused_kernel(x) is None  # CPU tensors: the torch operations
    if torch.cuda.is_available():
        cuda = x.cuda()
        assert CodeStore(HeadCodec(32, 4))._fused_kernel(cuda) is append
        assert CodeStore(HeadCodec(32, 4, mode="prod"))._fused_kernel(cuda) is None  # QJL signs: torch
        assert CodeStore(HeadCodec(32, 3))._fused_kernel(cuda) is None  # 3-bit codes straddle bytes: not served
        assert CodeStore(HeadCodec(32, 3.5))._fused_kernel(cuda) is None  # two channel groups


def test_encode_chunk_refuses_a_mean_it_cannot_read() -> None:
    codec = HeadCodec(32, 4)
    store = CodeStore(codec)
    store.allocate(8, 1, 2, torch.device(KERNEL_DEVICE))
    quantizer, fields = codec.groups[0].quantizer, store.fields[0]
    rotation = _rotation_matrices(quantizer, torch.device(KERNEL_DEVICE))[0]
    x = torch.randn(1, 2, 4, 32, device=KERNEL_DEVICE)
    for mean in (torch.zeros(1, 2, 32, dtype=torch.float64), torch.zeros(1, 32, 2).transpose(1, 2), torch.zeros(2, 32)):
        with pytest.raises(ValueError, match="mean must be"):
            append.encode_chunk(x, mean.to(KERNEL_DEVICE), rotation, quantizer, fields["packed"], fields["scales"], 0)
