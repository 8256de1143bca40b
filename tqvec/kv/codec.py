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
    """Quantizers for ``head_dim``-dimensional head vectors at ``bits`` bits per channel (codes only).

    The channel groups and the ``split`` rules are described in the module docstring.

    Parameters
    ----------
    head_dim : int
        Channels per head vector, ≥ 2 (every group needs at least 2).
    bits : float
        Bits per channel in [1, 8], fractional allowed.
    mode : {"mse", "prod"}
        The quantizers' mode (:class:`~tqvec.quantizer.TurboQuantizer`).
    rescale : bool
        Store the rescaled norm (``mse`` mode only).
    split : {"outlier", "rotated"}
        How fractional ``bits`` split the channels.
    seed : int
        Group ``i`` quantizes with seed ``seed + i``.

    Attributes
    ----------
    groups : list of Group
        One group, or two (outlier channels first) when ``uses_outliers``.
    spec : tuple
        The construction arguments: codecs of equal ``spec`` code alike.
    head_dim : int
    bits : float
    mode : str

    Raises
    ------
    TypeError
        ``head_dim`` is not an int, or ``bits`` not a real number.
    ValueError
        ``head_dim`` < 2, or fractional ``bits`` whose outlier split leaves a group of fewer than 2 channels;
        ``bits`` outside [1, 8] or NaN; an unknown ``split`` or ``mode``; ``rescale`` with ``mode="prod"``.

    Examples
    --------
    >>> from tqvec.kv import HeadCodec
    >>> codec = HeadCodec(128, 3.5)
    >>> [(g.start, g.stop, g.quantizer.bits) for g in codec.groups]  # 64 outlier channels at 4 bits, 64 at 3
    [(0, 64, 4.0), (64, 128, 3.0)]
    >>> codec.bytes_per_vector  # 32 + 24 bytes of codes, a float16 scale per group
    60
    >>> HeadCodec(128, 3.5, split="rotated").bytes_per_vector  # 56 bytes of codes, one scale
    58
    """

    def __init__(self, head_dim: int, bits: float, mode: str = "mse", rescale: bool = False,
                 split: str = "outlier", seed: int = 0) -> None:
        checks.check_choice("split", split, SPLITS)
        checks.check_int("head_dim", head_dim, 2)
        bits = checks.check_bits("bits", bits)
        self.head_dim, self.bits, self.mode = head_dim, float(bits), mode
        #: the construction arguments: codecs of equal ``spec`` code alike
        self.spec = (head_dim, float(bits), mode, bool(rescale), split, seed)
        low = math.floor(bits)
        n_high = round((bits - low) * head_dim)
        if split == "rotated" or n_high in (0, head_dim):
            make = [(0, head_dim, bits)]
        else:
            if min(n_high, head_dim - n_high) < 2:
                raise ValueError(f"bits={bits:g} splits head_dim={head_dim} into groups of {n_high} and {head_dim - n_high} "
                                 "channels, and a group needs 2 at least: use split='rotated' or other bits")
            make = [(0, n_high, low + 1), (n_high, head_dim, low)]
        self.groups = [Group(a, b, TurboQuantizer(b - a, g_bits, mode, seed=seed + i, rescale=rescale))
                       for i, (a, b, g_bits) in enumerate(make)]

    @property
    def uses_outliers(self) -> bool:
        """True when channels are split by magnitude (a per-head channel permutation is needed)."""
        return len(self.groups) > 1

    def choose_permutation(self, x: torch.Tensor) -> torch.Tensor:
        """Each head's channel order, outliers (largest RMS over batch and tokens) first.

        Parameters
        ----------
        x : torch.Tensor of shape (b, h, t, head_dim)
            Centered head vectors, any float dtype.

        Returns
        -------
        torch.Tensor of shape (h, head_dim), dtype int64
            On ``x``'s device.
        """
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
