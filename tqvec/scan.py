"""THE dispatch point for "float queries × packed codes → scores / top-k".

Index search, ``TurboQuantizer.inner_product`` and KV attention all call :func:`scores` or
:func:`search`; none of them knows whether torch (CPU) or a Triton kernel (CUDA) ran.

For database vector ``i`` with packed indices decoded to rotated-domain values ``ŷ_i`` (the
codebook levels), and QJL sign bits ``s_i ∈ {±1}^D`` in ``prod`` mode, the score of rotated query
``q`` (with QJL projection ``p = S q``) is::

    score(q, i) = scale[i] · ⟨q, ŷ_i⟩ + sign_scale[i] · ⟨p, s_i⟩ + bias[i]

CPU paths: the native kernel (:mod:`tqvec._fastscan`: for codes of at most 4 bits a fast scan with 8-bit tables,
32 rows per byte shuffle and an exact re-score of the best candidates) wherever it serves the codes (no QJL
signs), and the torch reference: decode a block of rows to float32 through a byte → levels lookup table, then
one GEMM, then a running top-k. Memory stays bounded by ``block_rows × query_chunk`` floats (torch) or
``nq × rescore`` candidates (native).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import _fastscan
from .packing import Layout, unpack, unpack_signs
from .rotation import rowwise_matmul

#: rows decoded per block on the CPU path
BLOCK_ROWS = 16384
#: at most this many float32 scores live at once per block (query chunking)
MAX_BLOCK_SCORES = 1 << 22
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class CodeTable:
    """Static decoding data of one quantizer: the packed layout and its codebook levels.

    ``levels`` is ``(n_segments, 256)`` float32: row ``s`` holds segment ``s``'s levels (zero-padded).
    """

    layout: Layout
    levels: torch.Tensor
    _luts: dict[int | str, torch.Tensor | str] = field(default_factory=dict, compare=False, repr=False)  # derived tables, by name
    _plan: list[_fastscan.Plan] = field(default_factory=list, compare=False, repr=False)

    def to(self, device: torch.device | str) -> "CodeTable":
        return CodeTable(self.layout, self.levels.to(device))

    def __reduce__(self):
        """Copies and pickles hold the layout and levels only: the derived tables (a native plan among them, which
        cannot be copied) are made again on first use."""
        return type(self), (self.layout, self.levels)

    def native_plan(self) -> _fastscan.Plan:
        """How the native kernel reads this layout, computed once."""
        if not self._plan:
            self._plan.append(_fastscan.plan(self.layout, self.levels))
        return self._plan[0]

    def byte_lookup(self, segment: int) -> torch.Tensor:
        """``(256, 8 // bits)`` float32: the levels of every code packed in one byte value of ``segment``."""
        if segment not in self._luts:
            bits = self.layout.segments[segment][1]
            byte = torch.arange(256, device=self.levels.device)
            shifts = bits * torch.arange(8 // bits, device=self.levels.device)
            self._luts[segment] = self.levels[segment][(byte[:, None] >> shifts) & ((1 << bits) - 1)]
        return self._luts[segment]


@dataclass(frozen=True)
class CodeBlock:
    """What the scan reads for ``n`` database vectors (all on one device)."""

    packed: torch.Tensor  # (n, layout.row_bytes) uint8
    scale: torch.Tensor  # (n,) float32
    bias: torch.Tensor | None = None  # (n,) float32, added to every score
    signs: torch.Tensor | None = None  # (n, ceil(D / 8)) uint8 QJL sign bits
    sign_scale: torch.Tensor | None = None  # (n,) float32
    #: derived once per block: what the native kernel reads (all rows, "rows", or one list grouping, "lists":
    #: (lists, rows), with their fast-scan layout) and what a GPU search graph's key records of the tensors
    #: ("graph_key"); two threads may both build one, and either result is kept
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return self.packed.shape[0]

    def rows(self, start: int, stop: int) -> "CodeBlock":
        """The block of rows ``[start, stop)`` (views, no copy)."""
        cut = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return CodeBlock(cut(self.packed), cut(self.scale), cut(self.bias), cut(self.signs), cut(self.sign_scale))


def dequantize(packed: torch.Tensor, table: CodeTable) -> torch.Tensor:
    """``(n, row_bytes)`` uint8 → ``(n, D)`` float32 rotated-domain levels ``ŷ`` (unit scale)."""
    layout, n = table.layout, packed.shape[0]
    parts, byte = [], 0
    for s, ((dim, bits), nbytes) in enumerate(zip(layout.segments, layout.segment_bytes)):
        seg = packed[:, byte:byte + nbytes]
        byte += nbytes
        if bits == 0:
            parts.append(packed.new_zeros((n, dim), dtype=torch.float32))
        elif 8 % bits == 0:
            # index_select on the flattened bytes: ~4x faster on CPU than advanced indexing
            lut = table.byte_lookup(s)
            parts.append(lut.index_select(0, seg.reshape(-1).long()).view(n, nbytes * (8 // bits))[:, :dim])
        else:
            idx = unpack(seg, Layout(((dim, bits),)))
            parts.append(table.levels[s].index_select(0, idx.reshape(-1)).view(n, dim))
    return torch.cat(parts, dim=1)


def _block_scores(queries: torch.Tensor, projected: torch.Tensor | None, block: CodeBlock, table: CodeTable) -> torch.Tensor:
    """Scores of all queries against one block: ``(nq, len(block))`` float32; a row's scores do not depend on
    the other rows of the block (:func:`~tqvec.rotation.rowwise_matmul`), so shards score like one index."""
    out = rowwise_matmul(dequantize(block.packed, table), queries.T).T * block.scale
    if block.signs is not None:
        if projected is None:
            raise ValueError("codes carry QJL signs: projected queries (S·q) are required")
        signs = unpack_signs(block.signs, projected.shape[1])
        out += rowwise_matmul(signs, projected.T).T * block.sign_scale
    if block.bias is not None:
        out += block.bias
    return out


def _check(queries: torch.Tensor, projected: torch.Tensor | None, block: CodeBlock, table: CodeTable) -> None:
    if queries.ndim != 2 or queries.shape[1] != table.layout.dim:
        raise ValueError(f"rotated queries must be (nq, {table.layout.dim}), got {tuple(queries.shape)}")
    if projected is not None and projected.shape[0] != queries.shape[0]:
        raise ValueError("projected queries must have one row per query")


def _use_kernels(queries: torch.Tensor) -> bool:
    return queries.is_cuda


def native_serves(queries: torch.Tensor, block: CodeBlock, table: CodeTable) -> bool:
    """True when :func:`search` runs the native CPU kernel for these arguments (:mod:`tqvec._fastscan`).

    Raises
    ------
    RuntimeError
        When the kernel is set to ``"native"`` (:func:`tqvec._fastscan.set_cpu_kernel`) and cannot serve them.
    """
    kernel = _fastscan.cpu_kernel()
    if queries.is_cuda or kernel == "torch":
        return False
    reason = ("the extension is not built" if not _fastscan.available() else
              "QJL signs (mode='prod') are scored by torch" if block.signs is not None else None)
    if reason is not None and kernel == "native":
        raise RuntimeError(f"the native CPU kernel cannot serve this search: {reason}")
    return reason is None


def native_queries(device: torch.device, mode: str) -> bool:
    """True when an index search on ``device`` runs natively end to end (:func:`query_search`): a CPU index,
    codes without QJL signs (``mode="mse"``), the extension built and the CPU kernel not set to ``"torch"``.
    Indexes fall back to their torch path otherwise (and for rerank)."""
    on_cpu = device == _CPU or device.type == "cpu"  # the comparison first: reading .type builds a string
    return mode == "mse" and on_cpu and _fastscan.available() and _fastscan.cpu_kernel() != "torch"


def scores(queries: torch.Tensor, block: CodeBlock, table: CodeTable, projected: torch.Tensor | None = None) -> torch.Tensor:
    """All scores ``(nq, n)`` float32 of rotated ``queries`` ``(nq, D)`` against ``block``."""
    _check(queries, projected, block, table)
    queries = queries.float()
    projected = None if projected is None else projected.float()
    if _use_kernels(queries):
        from .kernels import ops  # noqa: PLC0415 - Triton is optional and CUDA-only

        return ops.scores(queries, block, table, projected)
    out = torch.empty(queries.shape[0], len(block), dtype=torch.float32, device=queries.device)
    for start in range(0, len(block), BLOCK_ROWS):
        stop = min(start + BLOCK_ROWS, len(block))
        out[:, start:stop] = _block_scores(queries, projected, block.rows(start, stop), table)
    return out


def search(
    queries: torch.Tensor,
    block: CodeBlock,
    table: CodeTable,
    k: int,
    projected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` largest scores per query: ``(values (nq, k) float32, rows (nq, k) int64)``.

    Rows index ``block``; when ``k > n`` the tail is padded with ``-inf`` / ``-1``. Best first.
    """
    _check(queries, projected, block, table)
    queries = queries.float()
    projected = None if projected is None else projected.float()
    if _use_kernels(queries):
        from .kernels import ops  # noqa: PLC0415

        return ops.search(queries, block, table, k, projected)
    if native_serves(queries, block, table):
        values, rows = _fastscan.search(queries.cpu().numpy(), native_rows(block, table), table.native_plan(), k)
        return torch.from_numpy(values), torch.from_numpy(rows)
    return _search_torch(queries, block, table, k, projected)


def search_lists(queries: torch.Tensor, block: CodeBlock, table: CodeTable, k: int, lists: _fastscan.Lists,
                 probes: _fastscan.Probes) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`search` of each query over its own probed lists only, in one native call (inverted-file search):
    query ``i`` scans the rows of lists ``probes.lists[i]`` of ``lists``, adding ``probes.constant[i, j]`` to the
    scores from list ``probes.lists[i, j]``. Rows index ``block``. The lists' fast-scan layout is built on the first
    call and kept in ``block.cache`` while ``lists`` stays the same object. Callers check :func:`native_serves` first
    (the torch strategies of :class:`tqvec.ivf.IVFIndex` serve the rest).

    Raises
    ------
    RuntimeError
        When the native kernel cannot serve these codes.
    """
    _check(queries, None, block, table)
    queries = queries.float()
    if not native_serves(queries, block, table):
        raise RuntimeError("search_lists runs the native CPU kernel only: check native_serves first")
    values, rows = _fastscan.search(queries.cpu().numpy(), native_rows(block, table, lists), table.native_plan(), k, probes)
    return torch.from_numpy(values), torch.from_numpy(rows)


def native_rows(block: CodeBlock, table: CodeTable, lists: _fastscan.Lists | None = None) -> object:
    """What the native kernel reads for ``block`` (grouped by ``lists``, None: all rows), built on the first call and
    kept in ``block.cache`` while ``lists`` stays the same object."""
    key = "rows" if lists is None else "lists"
    cached = block.cache.get(key)
    if cached is None or cached[0] is not lists:
        cached = block.cache[key] = (lists, _fastscan.rows(block.packed, block.scale, block.bias, table.native_plan(), lists))
    return cached[1]


def query_search(block: CodeBlock, table: CodeTable, prep: object, ids: np.ndarray, l2: bool,
                 lists: _fastscan.Lists | None = None) -> _fastscan.QuerySearch:
    """The native index search over ``block`` (grouped by ``lists``), bound once per index snapshot: called with raw
    validated CPU ``queries`` ``(nq, dim)`` float32, ``k`` and ``nprobe``, it prepares them in the kernel as ``prep``
    says (:func:`tqvec._fastscan.query_prep`: normalize, rotate, probe ``nprobe`` of ``lists``), scans and answers
    ``(D, I)`` (:class:`tqvec._fastscan.QuerySearch`: ``ids`` per row of ``block``, ``l2`` distances). Callers check
    :func:`native_queries` first."""
    return _fastscan.QuerySearch(native_rows(block, table, lists), table.native_plan(), prep, ids, l2)


def _search_torch(queries: torch.Tensor, block: CodeBlock, table: CodeTable, k: int,
                  projected: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`search` (blockwise decode, GEMM, running top-k)."""
    nq, n = queries.shape[0], len(block)
    best_values = torch.full((nq, k), float("-inf"), device=queries.device)
    best_rows = torch.full((nq, k), -1, dtype=torch.int64, device=queries.device)
    query_chunk = max(1, MAX_BLOCK_SCORES // BLOCK_ROWS)
    for start in range(0, n, BLOCK_ROWS):
        stop = min(start + BLOCK_ROWS, n)
        rows = block.rows(start, stop)
        for q0 in range(0, nq, query_chunk):
            q1 = min(q0 + query_chunk, nq)
            s = _block_scores(queries[q0:q1], None if projected is None else projected[q0:q1], rows, table)
            take = min(k, stop - start)
            v, r = torch.topk(s.nan_to_num(nan=float("-inf")), take, dim=1)  # a NaN score never takes a slot
            merged_v = torch.cat([best_values[q0:q1], v], dim=1)
            merged_r = torch.cat([best_rows[q0:q1], r + start], dim=1)
            top_v, pos = torch.topk(merged_v, k, dim=1)
            best_values[q0:q1] = top_v
            best_rows[q0:q1] = torch.gather(merged_r, 1, pos)
    best_rows[best_values == float("-inf")] = -1
    return best_values, best_rows


# ---------------------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class CodedHeads:
    """Codes of ``(b, h, tokens)`` head vectors of one quantizer (tokens ``[0, n)`` are read)."""

    packed: torch.Tensor  # (b, h, ≥n, layout.row_bytes) uint8
    scale: torch.Tensor  # (b, h, ≥n) float16/float32
    table: CodeTable


@dataclass(frozen=True)
class DecodeAttention:
    """One decode step of one layer over a compressed KV cache (all tensors on one device).

    Cache positions: ``sinks`` (exact), then ``n_codes`` coded tokens, then the ``window`` (exact).
    Coded keys are ``k − key_mean = scale · ŷ · key_back``; the queries meet them as
    ``q · key_rotation`` (``(head_dim, D)``, the keys' forward rotation), values come back as
    ``scale · ŷ · value_back + value_mean``. ``valid`` ``(b, kv_length)`` bool masks positions out (padding).

    Channel groups coded apart (each its own quantizer, rotation and scale; CPU only): ``keys`` / ``values`` hold the
    first group, ``key_segments`` / ``value_segments`` the others, their rotated channels side by side (``D`` is the
    sum); a coded key's logit sums its groups' ``scale · ⟨q_rot channels, ŷ⟩``. ``key_rotation`` ``(h, head_dim, D)``
    and ``value_back`` ``(h, D, head_dim)`` may then differ per head (a per-head channel permutation folded in).

    A static cache (:mod:`tqvec.kv.static`; the CUDA kernel only) gives ``ring`` = ``[total, codes_end]`` on the device
    instead of lengths on the host: ``n_codes`` is then the codes' capacity, of which tokens ``[0, codes_end − s)`` are
    read; the sinks hold ``min(total, s)`` tokens; the window is a ring of ``w`` slots, slot ``e`` holding the position
    ``p ∈ [total − w, total)`` with ``p ≡ e (mod w)``, read when ``p ≥ codes_end``; ``valid`` covers ``s + n_codes``
    positions.
    """

    queries: torch.Tensor  # (b, h, G, head_dim): the G query heads of each KV head
    scaling: float
    key_rotation: torch.Tensor  # (head_dim, D) or (h, head_dim, D) float32
    value_back: torch.Tensor  # (D, head_dim) or (h, D, head_dim) float32
    keys: CodedHeads
    values: CodedHeads
    n_codes: int
    key_mean: torch.Tensor  # (b, h, head_dim) float32
    value_mean: torch.Tensor  # (b, h, head_dim) float32
    sink_keys: torch.Tensor  # (b, h, s, head_dim)
    sink_values: torch.Tensor
    window_keys: torch.Tensor  # (b, h, w, head_dim)
    window_values: torch.Tensor
    valid: torch.Tensor | None = None  # (b, s + n_codes + w) bool
    key_segments: tuple[CodedHeads, ...] = ()  # further channel groups (CPU only)
    value_segments: tuple[CodedHeads, ...] = ()
    ring: torch.Tensor | None = None  # (2,) int64 [total, codes_end] on the device: a static cache (CUDA only)

    @property
    def key_parts(self) -> tuple[CodedHeads, ...]:
        """Every key channel group, in the order of their rotated channels."""
        return (self.keys, *self.key_segments)

    @property
    def value_parts(self) -> tuple[CodedHeads, ...]:
        """Every value channel group, in the order of their rotated channels."""
        return (self.values, *self.value_segments)


def _softmax_merge(state: tuple[torch.Tensor, ...], logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Online softmax: fold ``logits`` ``(..., G, L)`` with ``values`` ``(..., L, d)`` into ``(max, sum, acc)``."""
    m, l, acc = state
    m_new = torch.maximum(m, logits.amax(-1))
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha, p = torch.exp(m - m_safe), torch.exp(logits - m_safe[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ values


def _coded_state(a: DecodeAttention, q_rot: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The online-softmax state ``(max, sum, acc)`` of the rotated, scaled queries ``q_rot`` ``(b, h, G, D)`` over the
    coded tokens (``valid`` ``(b, n_codes)`` or None), in torch, in blocks of ``BLOCK_ROWS`` code rows over all heads
    (tensors on any device: the kernel tests' reference on CUDA)."""
    b, h, G, _ = q_rot.shape
    value_dim = sum(c.table.layout.dim for c in a.value_parts)
    state = (q_rot.new_full((b, h, G), float("-inf")), q_rot.new_zeros((b, h, G)), q_rot.new_zeros((b, h, G, value_dim)))
    step = max(1, BLOCK_ROWS // (b * h))
    for start in range(0, a.n_codes, step):
        stop = min(start + step, a.n_codes)
        decoded = lambda c: dequantize(c.packed[:, :, start:stop].reshape(-1, c.packed.shape[-1]), c.table).view(  # noqa: E731
            b, h, stop - start, -1)
        logits, first = 0.0, 0
        for c in a.key_parts:
            dim = c.table.layout.dim
            scores = q_rot[..., first:first + dim] @ decoded(c).transpose(2, 3)
            logits = logits + scores * c.scale[:, :, None, start:stop].float()
            first += dim
        if valid is not None:
            logits = logits.masked_fill(~valid[:, None, None, start:stop], float("-inf"))
        v = torch.cat([decoded(c) * c.scale[:, :, start:stop, None].float() for c in a.value_parts], dim=3)
        state = _softmax_merge(state, logits, v)
    return state


def native_attends(queries: torch.Tensor) -> bool:
    """Whether :func:`attend` runs the native kernel for ``queries``: on the CPU, the extension built and not switched
    off (:func:`tqvec._fastscan.set_cpu_kernel`)."""
    return queries.device.type == "cpu" and _fastscan.available() and _fastscan.cpu_kernel() != "torch"


def bind_native_step(a: DecodeAttention) -> _fastscan.BoundDecodeStep:
    """The native step (:class:`tqvec._fastscan.BoundDecodeStep`) bound to ``a``'s codes, rotations, means and sinks;
    calling it with ``a``'s scaled queries, ``n_codes``, window and mask gives :func:`attend`'s output (float32).

    Example: ``bind_native_step(a)(a.queries.float() * a.scaling, a.n_codes, (a.window_keys, a.window_values),
    a.valid)``; a cache layer keeps the bound step while its buffers stay (:mod:`tqvec.kv.attention`).
    """
    segments = lambda parts: [(c.packed, c.scale, c.table.native_plan(), c.table.layout.dim) for c in parts]  # noqa: E731
    return _fastscan.BoundDecodeStep(a.key_rotation, a.value_back, segments(a.key_parts), segments(a.value_parts),
                                     a.key_mean, a.value_mean, (a.sink_keys, a.sink_values))


def _attend_native(a: DecodeAttention) -> torch.Tensor:
    """:func:`attend` by the native kernel (:func:`bind_native_step`)."""
    out = bind_native_step(a)(a.queries.float() * a.scaling, a.n_codes, (a.window_keys, a.window_values), a.valid)
    return out.to(a.queries.dtype)


def _attend_torch(a: DecodeAttention) -> torch.Tensor:
    """:func:`attend` in torch (the native kernel's reference, and its fallback): the coded tokens' softmax state
    (:func:`_coded_state`), merged with the exact tokens'."""
    q = a.queries.float() * a.scaling
    q_rot = q @ a.key_rotation
    valid = a.valid
    n_sinks, n = a.sink_keys.shape[2], a.n_codes
    coded_valid = None if valid is None else valid[:, n_sinks:n_sinks + n]
    m_c, l_c, acc_c = _coded_state(a, q_rot.contiguous(), coded_valid)
    coded = acc_c @ a.value_back + l_c[..., None] * a.value_mean[:, :, None]
    keys = torch.cat([a.sink_keys, a.window_keys], dim=2).float()
    values = torch.cat([a.sink_values, a.window_values], dim=2).float()
    logits = q @ keys.transpose(2, 3) - (q @ a.key_mean[..., None])
    if valid is not None:
        exact_valid = torch.cat([valid[:, :n_sinks], valid[:, n_sinks + n:]], dim=1)
        logits = logits.masked_fill(~exact_valid[:, None, None], float("-inf"))
    m_e, l_e, acc_e = _softmax_merge((torch.full_like(m_c, float("-inf")), torch.zeros_like(l_c),
                                      torch.zeros_like(coded)), logits, values)
    m = torch.maximum(m_c, m_e)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_c, w_e = torch.exp(m_c - m_safe), torch.exp(m_e - m_safe)
    total = w_c * l_c + w_e * l_e
    out = (w_c[..., None] * coded + w_e[..., None] * acc_e) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return out.to(a.queries.dtype)


def attend(a: DecodeAttention) -> torch.Tensor:
    """Attention output ``(b, h, G, head_dim)`` (``queries``' dtype) of one decode step over coded and exact tokens.

    On the CPU the native kernel (:func:`tqvec._fastscan.decode_step`) where it is built and not switched off
    (:func:`tqvec._fastscan.set_cpu_kernel`), else torch (blockwise, bounded memory); the split-sequence Triton
    kernels of :mod:`tqvec.kernels.attention` on CUDA.
    """
    window = 0 if a.ring is not None else a.window_keys.shape[2]
    if a.valid is not None and a.valid.shape != (a.queries.shape[0], a.sink_keys.shape[2] + a.n_codes + window):
        raise ValueError(f"valid must be (b, kv_length), got {tuple(a.valid.shape)}")
    if a.ring is not None and not _use_kernels(a.queries):
        raise ValueError("a static cache's ring (DecodeAttention.ring) is read by the CUDA kernel only")
    if _use_kernels(a.queries):
        if a.key_segments or a.value_segments:
            raise ValueError("channel groups coded apart (key_segments / value_segments) are served on the CPU only")
        from .kernels import attention  # noqa: PLC0415 - Triton is optional and CUDA-only

        return attention.decode_attention(a)
    if native_attends(a.queries):
        return _attend_native(a)
    return _attend_torch(a)
