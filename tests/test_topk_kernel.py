"""The Triton top-k kernels (tqvec.kernels.topk) against torch.topk, and the search using them.

Runs on CUDA when present, else through Triton's interpreter (``TRITON_INTERPRET=1``, set by kernel_env.py
when no GPU is visible). The interpreter sorts slowly, so the shapes are small and the kernels' blocks too (16–64
candidates), which exercises every pass: one program per row, rows split over programs, merged keys,
several blocks per program.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_env import KERNEL_DEVICE, needs_kernels

from tqvec import Codes, TurboQuantizer, scan
from tqvec.kernels import ops, topk

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.gpu, needs_kernels]


def _values(nq: int, length: int, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct values, -inf among them, ±0
        v = torch.randint(-3, 3, (nq, length), generator=gen).float()
        v[v == -3] = float("-inf")
        v[v == -2] = -0.0
        return v
    if kind == "constant":  # every candidate at the floor
        return torch.full((nq, length), 0.5)
    if kind == "ascending":  # each block above the last: the filter's floor lets most candidates through
        return torch.sort(torch.randn(nq, length, generator=gen), dim=1).values
    if kind == "inf":  # mostly -inf (the tile kernel's padding), a few finite
        v = torch.full((nq, length), float("-inf"))
        v[:, ::7] = torch.randn(nq, (length + 6) // 7, generator=gen)
        return v
    return torch.randn(nq, length, generator=gen) * 1e3


def _check(got: tuple[torch.Tensor, torch.Tensor], values: torch.Tensor, k: int, ids: torch.Tensor | None) -> None:
    """Sorted values equal torch.topk's; each id is the id of a candidate holding that value; ties by lower id."""
    gv, gi = (t.cpu() for t in got)
    kc = min(k, values.shape[1])
    rv = torch.topk(values, kc, dim=1).values
    assert gv.shape == gi.shape == (values.shape[0], kc) and gv.dtype == torch.float32 and gi.dtype == torch.int64
    assert torch.equal(gv, rv)  # best first, exactly torch's values (ties included)
    ident = torch.arange(values.shape[1]).expand_as(values) if ids is None else ids
    for r in range(values.shape[0]):
        real = [i for i in gi[r].tolist() if i >= 0]  # id -1: padding, at -inf, may repeat
        assert len(set(real)) == len(real)
        picked = [(ident[r] == i).nonzero()[0, 0].item() for i in gi[r].tolist()]
        assert torch.equal(values[r, picked], gv[r])
        rank = torch.where(gi[r] < 0, 1 << 40, gi[r])
        for j in range(1, kc):  # equal values: lower id first (-1 last)
            if gv[r, j] == gv[r, j - 1] and not (gv[r, j] == 0 and torch.signbit(gv[r, j]) != torch.signbit(gv[r, j - 1])):
                assert rank[j] >= rank[j - 1] if rank[j] == 1 << 40 else rank[j] > rank[j - 1]


@pytest.mark.parametrize("nq,length,k,block,kind", [
    (1, 1, 1, 16, "randn"),          # single candidate
    (3, 10, 4, 16, "randn"),         # one block, one pass
    (2, 7, 20, 16, "randn"),         # k > length
    (5, 300, 18, 32, "randn"),       # rows split over programs, then a merge pass (nq < SMALL_NQ)
    (9, 200, 10, 16, "ties"),        # many splits, ties, -inf and ±0
    (2, 130, 9, 16, "inf"),          # mostly -inf
    (1, 70, 33, 16, "ties"),         # K_PAD (64) above the block (16): the block grows to 2 · K_PAD
    (4, 100, 2, 16, "randn"),        # smallest K_PAD
])
def test_row_topk_matches_torch(monkeypatch: pytest.MonkeyPatch, nq: int, length: int, k: int, block: int,
                                kind: str) -> None:
    """The passes of topk_kernel, at any number of rows (the filtered kernel is tested below)."""
    monkeypatch.setattr(topk, "FILTER_MIN_ROWS", 1 << 30)
    values = _values(nq, length, kind, seed=length + k)
    got = topk.row_topk(values.to(KERNEL_DEVICE), k, block=block)
    _check(got, values, k, None)


@pytest.mark.parametrize("cap", [512, 16])  # the passed candidates selected once / too many pass: every block merged
@pytest.mark.parametrize("nq,length,k,block,kind", [
    (8, 300, 18, 32, "randn"),       # the group choice's k_pad (32 strips)
    (9, 200, 10, 16, "ties"),        # ties at the floor, -inf and ±0
    (10, 130, 9, 16, "inf"),         # mostly -inf: strips without a finite candidate
    (8, 5, 10, 16, "randn"),         # k > length
    (12, 1000, 3, 64, "randn"),      # many blocks
    (8, 500, 33, 64, "randn"),       # k_pad (64) above FILTER_STRIPS: as many strips
    (8, 700, 20, 32, "ascending"),   # the floor rises with every block
    (8, 300, 10, 32, "constant"),    # every candidate equal to the floor: all pass, ids break the ties
])
def test_filtered_topk_matches_torch(monkeypatch: pytest.MonkeyPatch, cap: int, nq: int, length: int, k: int, block: int,
                                     kind: str) -> None:
    """Rows of at least FILTER_MIN_ROWS queries take filtered_topk_kernel, with torch.topk's answer whether the
    candidates passing its floor fit in FILTER_CAP or not."""
    monkeypatch.setattr(topk, "FILTER_CAP", cap)
    calls = []
    monkeypatch.setattr(topk, "_filtered", lambda *a, f=topk._filtered: calls.append(1) or f(*a))
    values = _values(nq, length, kind, seed=length + k)
    _check(topk.row_topk(values.to(KERNEL_DEVICE), k, block=block), values, k, None)
    assert calls == [1]


@pytest.mark.parametrize("nq,length,k,block,kind", [(2, 10, 4, 16, "ties"), (1, 40, 3, 16, "randn")])
def test_bitonic_selection(monkeypatch: pytest.MonkeyPatch, nq: int, length: int, k: int, block: int, kind: str) -> None:
    """``tl.topk`` (the GPU's selection; the interpreter otherwise uses max-and-remove), one and two passes."""
    monkeypatch.setattr(topk, "INTERPRET_BITONIC", True)
    values = _values(nq, length, kind, seed=5)
    _check(topk.row_topk(values.to(KERNEL_DEVICE), k, block=block), values, k, None)


@pytest.mark.parametrize("nq,length,k,block", [(3, 90, 7, 16), (1, 33, 40, 16), (8, 40, 5, 64)])
def test_row_topk_with_ids(nq: int, length: int, k: int, block: int) -> None:
    """Candidates carry row ids (refine's output): -1 for padding at -inf, ties broken by lower row."""
    values = _values(nq, length, "ties", seed=nq)
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(10 * length, generator=gen)[:length] for _ in range(nq)])
    ids[:, -3:] = -1
    values[:, -3:] = float("-inf")
    got = topk.row_topk(values.to(KERNEL_DEVICE), k, ids.to(KERNEL_DEVICE), block=block)
    _check(got, values, k, ids)
    gv, gi = (t.cpu() for t in got)
    assert bool((gi[torch.isinf(gv) & (gi < 0)] == -1).all())


def test_plan_splits_and_serial_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes: 8192 groups, 100 queries: 8 programs per query, then one; few queries split more."""
    assert topk._plan(8192, 100, 1024, 32) == (8, 1)
    assert topk._plan(8 * 32, 100, 1024, 32) == (1, 1)
    assert topk._plan(2304, 100, 1024, 16) == (1, 3)
    assert topk._plan(78125, 100, 1024, 32) == (26, 3)
    assert topk._plan(312500, 1, 1024, 32) == (102, 3)
    assert topk._plan(8192, 100, 2048, 1024) == (1, 4)  # splitting would not halve the candidates
    monkeypatch.setattr(topk, "MAX_K_PAD", 4)
    assert not topk.supported(5) and topk.supported(4)
    values = _values(2, 50, "randn", 0)
    _check(topk.row_topk(values.to(KERNEL_DEVICE), 6, block=16), values, 6, None)  # torch.topk fallback


def _recorded_topk_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that records, in order, each call of topk.row_topk and topk.keys_topk (which still run)."""
    calls: list[str] = []
    for name in ("row_topk", "keys_topk"):
        real = getattr(topk, name)
        monkeypatch.setattr(topk, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
    return calls


def _search_case(seed: int, nq: int = 3) -> tuple[TurboQuantizer, Codes, scan.CodeBlock, torch.Tensor]:
    """A 4-bit quantizer of 40 dimensions, the CPU codes of 300 random rows, their block on KERNEL_DEVICE and ``nq``
    rotated random queries (CPU), drawn from ``seed``."""
    tq = TurboQuantizer(40, 4, seed=0)
    gen = torch.Generator().manual_seed(seed)
    codes = tq.encode(torch.randn(300, 40, generator=gen))
    rotated, _ = tq.rotate_queries(torch.randn(nq, 40, generator=gen))
    return tq, codes, tq.code_block(codes.to(KERNEL_DEVICE)), rotated


def test_search_uses_kernels_and_matches_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.search with the Triton top-k equals the torch.topk path (same candidates), and the reference."""
    tq, codes, block, rotated = _search_case(0)
    calls = _recorded_topk_calls(monkeypatch)
    got = ops.search(rotated.to(KERNEL_DEVICE), block, tq.table(KERNEL_DEVICE), 5)
    assert calls == ["row_topk", "keys_topk"]  # group selection, then the final top-k of the refined slices' best
    with ops.configured(triton_topk=False):
        old = ops.search(rotated.to(KERNEL_DEVICE), block, tq.table(KERNEL_DEVICE), 5)
    assert torch.equal(got[0].cpu(), old[0].cpu()) and torch.equal(got[1].cpu(), old[1].cpu())
    ref = scan.search(rotated, tq.code_block(codes), tq.table("cpu"), 5)
    assert torch.allclose(got[0].cpu(), ref[0], rtol=1e-5) and torch.equal(got[1].cpu(), ref[1])


def test_final_topk_over_kept_keys_beyond_the_query_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """More queries than triton_topk_max_queries: torch.topk chooses the groups, and the final top-k still runs over
    each refined slice's kept keys in Triton, with the answer of the torch.topk path."""
    tq, _, block, rotated = _search_case(1)
    rotated = rotated.to(KERNEL_DEVICE)
    calls = _recorded_topk_calls(monkeypatch)
    with ops.configured(triton_topk_max_queries=2):
        got = ops.search(rotated, block, tq.table(KERNEL_DEVICE), 5)
    assert calls == ["keys_topk"]
    with ops.configured(triton_topk=False):
        old = ops.search(rotated, block, tq.table(KERNEL_DEVICE), 5)
    assert torch.equal(got[0].cpu(), old[0].cpu()) and torch.equal(got[1].cpu(), old[1].cpu())


def test_filtered_group_choice_beyond_the_query_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """More queries than triton_topk_max_queries, at least FILTER_MIN_ROWS: the filtered kernel still chooses the
    groups, with the torch.topk path's answer."""
    tq, _, block, rotated = _search_case(2, nq=topk.FILTER_MIN_ROWS)
    rotated = rotated.to(KERNEL_DEVICE)
    calls = _recorded_topk_calls(monkeypatch)
    with ops.configured(triton_topk_max_queries=2):
        got = ops.search(rotated, block, tq.table(KERNEL_DEVICE), 5)
    assert calls == ["row_topk", "keys_topk"]
    with ops.configured(triton_topk=False):
        old = ops.search(rotated, block, tq.table(KERNEL_DEVICE), 5)
    assert torch.equal(got[0].cpu(), old[0].cpu()) and torch.equal(got[1].cpu(), old[1].cpu())


def test_select_groups_fewer_groups_than_kg() -> None:
    """n_groups < k + GROUP_MARGIN: every group is chosen."""
    gm = _values(2, 5, "randn", 3).to(KERNEL_DEVICE)
    groups = ops.select_groups(gm, 5)
    assert sorted(groups[0].tolist()) == sorted(groups[1].tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("k", [1, 5, 16, 20])
def test_refined_topk_local_keys_equal_all_scores(k: int) -> None:
    """Refine keeping each slice's best k_pad(k) keys gives exactly the top-k of all refined scores (k = 20 under the
    interpreter: k_pad = 32 is not below the 32-row slices, so every score is a candidate), ragged last group included."""
    tq = TurboQuantizer(24, 3, seed=1)
    gen = torch.Generator().manual_seed(k)
    codes = tq.encode(torch.randn(250, 24, generator=gen))
    block, table = tq.code_block(codes.to(KERNEL_DEVICE)), tq.table(KERNEL_DEVICE)
    q = tq.rotate_queries(torch.randn(4, 24, generator=gen))[0].to(KERNEL_DEVICE)
    # group 7: rows 224..249 of 256
    groups = torch.tensor([[7, 0, 3], [1, 7, 2], [5, 4, 6], [0, 1, 2]], device=KERNEL_DEVICE)
    scores, ids = ops._refine(q, None, groups, block, table, 32)
    values, rows = ops.refined_topk(q, None, groups, block, table, 32, k)
    _check((values, rows), scores.cpu(), k, ids.cpu())
    with ops.configured(triton_topk=False):
        torch_values, torch_rows = ops.refined_topk(q, None, groups, block, table, 32, k)
    assert torch.equal(values.cpu(), torch_values.cpu()) and torch.equal(rows.cpu(), torch_rows.cpu())


def _host_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The kernels' int64 keys (kernels/topk.py, _keys), built with torch."""
    bits = values.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()
    return (ordered << 32) | ((1 << 32) - 1 - (ids & 0xFFFFFFFF))


def test_keys_topk_equals_row_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates given as keys (what refine writes) select like the same values and ids; INT64_MIN pads."""
    values = _values(3, 90, "ties", seed=4)
    ids = torch.stack([torch.randperm(1000, generator=torch.Generator().manual_seed(r))[:90] for r in range(3)])
    keys = _host_keys(values, ids)
    keys[:, -7:] = torch.iinfo(torch.int64).min  # no candidate: decoded as -inf / -1
    values[:, -7:], ids[:, -7:] = float("-inf"), -1
    got = topk.keys_topk(keys.to(KERNEL_DEVICE), 9, block=16)
    _check(got, values, 9, ids)
    monkeypatch.setattr(topk, "MAX_K_PAD", 4)  # no torch.topk fallback for keys: a clear error instead
    with pytest.raises(ValueError, match="k_pad"):
        topk.keys_topk(keys.to(KERNEL_DEVICE), 6)
