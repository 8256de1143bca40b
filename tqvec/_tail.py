"""The bias tail code of :class:`~tqvec.index.Index` (``correction="center"`` in the code padding): a unit
vector's ``bias = ⟨c, x⟩`` as a uniform code over ``[−‖c‖, ‖c‖]`` in the padding bits of its row's last byte,
its scale derived from it (module docstring of :mod:`tqvec.index`, ``docs/design.md``)."""
from __future__ import annotations

import torch

from .packing import Layout, layout_for_bytes, read_tail
from .quantizer import Codes, TurboQuantizer

#: fewest padding bits that carry the bias code (4, 5 and 6 bits ranked alike on GloVe-50 at 1 bit)
TAIL_MIN_BITS = 4


def tail_layout(channels: int, row_bytes: int) -> Layout | None:
    """The code layout of ``row_bytes`` with ≥ :data:`TAIL_MIN_BITS` spare bits for the bias code and at least
    1 bit on every one of ``channels``, or None."""
    try:
        layout = layout_for_bytes(channels, row_bytes, spare_bits=TAIL_MIN_BITS)
    except ValueError:
        return None
    return layout if layout.bits_per_row >= channels else None


def bias_range(center: torch.Tensor, tail_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(‖c‖, step)`` of the uniform ``tail_bits``-bit bias code over ``[−‖c‖, ‖c‖]`` (float32 scalars)."""
    radius = torch.linalg.vector_norm(center)
    return radius, radius * (2.0 / ((1 << tail_bits) - 1))


def bias_code(bias: torch.Tensor, center: torch.Tensor, tail_bits: int) -> torch.Tensor:
    """``bias = ⟨c, x⟩`` ``(n,)`` → nearest of the ``2**tail_bits`` uniform levels over ``[−‖c‖, ‖c‖]`` (int64)."""
    radius, step = bias_range(center, tail_bits)
    if float(step) == 0.0:  # c = 0: every bias is 0, level 0 decodes to −‖c‖ = 0
        return torch.zeros(bias.shape[0], dtype=torch.int64, device=bias.device)
    return torch.round((bias + radius) / step).clamp(0, (1 << tail_bits) - 1).to(torch.int64)


def tail_side(packed: torch.Tensor, center: torch.Tensor, tail_bits: int,
              quantizer: TurboQuantizer) -> tuple[Codes, torch.Tensor]:
    """Scale ``‖x − c‖ / ‖ŷ‖`` and bias ``⟨c, x⟩`` of unit rows ``packed`` that carry the bias as a tail code."""
    radius, step = bias_range(center, tail_bits)
    bias = read_tail(packed, quantizer.layout, tail_bits).to(torch.float32) * step - radius
    distance = torch.sqrt((1 - 2 * bias + radius * radius).clamp_min(0))  # ‖x − c‖ for unit x
    norms = quantizer.code_norms(packed)
    scale = torch.where(norms > 0, distance / norms.clamp_min(1e-30), torch.zeros_like(distance))
    return Codes(packed, scale), bias
