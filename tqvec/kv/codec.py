"""How one kind of head vector (keys or values) of one model is turned into TurboQuant codes.

A :class:`HeadCodec` holds one or two channel *groups*, each with its own :class:`TurboQuantizer`
(own norm, own rotation, own Lloyd–Max codebook):

* integer ``bits``: one group of all ``head_dim`` channels;
* fractional ``bits`` with ``split="outlier"`` (default): the ``round(frac·d)`` channels of largest
  RMS magnitude of each (layer, KV head) — measured on the first tokens that the layer compresses,
  after centering — form an *outlier* group at ``ceil(bits)`` bits, the rest a group at
  ``floor(bits)`` bits (TurboQuant paper, §4.3). Keys' channel magnitudes choose the keys' outliers,
  values' magnitudes the values'. The outlier group gets its own norm, so its large channels no
  longer set the scale of the small ones;
* fractional ``bits`` with ``split="rotated"``: one quantizer using its built-in two-segment split of
  the rotated channels (rotated channels are exchangeable, so no selection is involved).

The per-vector scales (and QJL residual norms) are stored as float16 by :mod:`tqvec.kv.store`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..quantizer import TurboQuantizer
from . import checks

SPLITS = ("outlier", "rotated")


@dataclass(frozen=True)
class Group:
    """Channels ``[start, stop)`` of the permuted head vector, coded by ``quantizer``."""

    start: int
    stop: int
    quantizer: TurboQuantizer


class HeadCodec:
    """Quantizers for ``head_dim``-dimensional head vectors at ``bits`` bits per channel (codes only)."""

    def __init__(self, head_dim: int, bits: float, mode: str = "mse", rescale: bool = False,
                 split: str = "outlier", seed: int = 0) -> None:
        checks.check_choice("split", split, SPLITS)
        checks.check_int("head_dim", head_dim, 1)
        bits = checks.check_bits("bits", bits)
        self.head_dim, self.bits, self.mode = head_dim, float(bits), mode
        #: the construction arguments: codecs of equal ``spec`` code alike
        self.spec = (head_dim, float(bits), mode, bool(rescale), split, seed)
        low = math.floor(bits)
        n_high = round((bits - low) * head_dim)
        if split == "rotated" or n_high in (0, head_dim):
            make = [(0, head_dim, bits)]
        else:
            make = [(0, n_high, low + 1), (n_high, head_dim, low)]
        self.groups = [Group(a, b, TurboQuantizer(b - a, g_bits, mode, seed=seed + i, rescale=rescale))
                       for i, (a, b, g_bits) in enumerate(make)]

    @property
    def uses_outliers(self) -> bool:
        """True when channels are split by magnitude (a per-head channel permutation is needed)."""
        return len(self.groups) > 1

    def choose_permutation(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, h, t, d)`` centered vectors → ``(h, d)`` int64 channel order, outliers (largest RMS) first."""
        rms = x.float().pow(2).mean(dim=(0, 2))
        return torch.argsort(rms, dim=1, descending=True)

    @property
    def bytes_per_vector(self) -> int:
        """Stored bytes per head vector: packed codes + float16 scale (+ QJL bits + float16 ‖r‖) per group."""
        total = 0
        for g in self.groups:
            q = g.quantizer
            total += q.layout.row_bytes + 2
            if q.mode == "prod":
                total += math.ceil(q.rotated_dim / 8) + 2
        return total
