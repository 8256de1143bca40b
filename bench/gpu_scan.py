"""GPU benchmark of tqvec's Triton scan: fused top-k search against torch bf16 exact search, and encode.

For N ∈ {1M, 10M}, d ∈ {128, 384, 768, 1024, 1536}, nq ∈ {1, 100, 10000}, bits ∈ {2, 4}, k = 10 on random
Gaussian data generated on the GPU: QPS of ``tqvec.kernels.ops.search`` and of ``torch.topk(Q @ X.T)`` in
bf16 (the exact search a user would write, query-chunked so one score block stays ≤ 2 GB), recall@10
of both against exact float32 top-10 (first 100 queries), bytes read per second against a measured
device-to-device copy, and encode throughput (rotation GEMM + ``ops.encode``). Two more yardsticks per
tqvec row: the bf16 matmul alone (``Q @ X.T`` in the same chunks, no top-k) and the byte floor (the
codes' bytes at the copy rate).

    tqvec bench gpu-scan --out bench/results          # the table (gpu_scan.json / gpu_scan.md)
    tqvec bench gpu-scan --check --sweep              # GPU correctness check and tile sweep only
    tqvec bench gpu-scan --topk --out DIR             # torch.topk vs Triton top-k, per stage (gpu_topk.*)

Times are medians of CUDA-event timed calls, with the L2 cache flushed before each call.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton

from tqvec import TurboQuantizer, scan
from tqvec.kernels import ops

K = 10
TRUTH_QUERIES = 100
CHUNK_ROWS = 1 << 20
SCORE_BLOCK = 1 << 30  # bf16 scores per baseline query chunk (2 GB)
_FLUSH = None


# ---------------------------------------------------------------- timing
def _flush_l2() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _FLUSH.zero_()


def time_ms(fn: Callable[[], object], budget_ms: float = 400.0, max_reps: int = 30) -> float:
    """Median milliseconds of ``fn()`` (two warm-up calls, then up to ``max_reps`` event-timed calls)."""
    fn()
    fn()
    torch.cuda.synchronize()
    times: list[float] = []
    spent = 0.0
    while len(times) < max_reps and (spent < budget_ms or len(times) < 3):
        _flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        spent += times[-1]
        if times[-1] > budget_ms:
            break
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written (2 GiB buffers)."""
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 31) / ms / 1e6


# ---------------------------------------------------------------- data
def gaussian_chunks(n: int, d: int, seed: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, rows)`` float32 chunks of an ``(n, d)`` standard Gaussian matrix, reproducible per chunk."""
    gen = torch.Generator(device="cuda")
    for start in range(0, n, CHUNK_ROWS):
        gen.manual_seed(seed * 1_000_003 + start)
        yield start, torch.randn(min(CHUNK_ROWS, n - start), d, device="cuda", generator=gen)


def merge_topk(
    best: tuple[torch.Tensor, torch.Tensor] | None, scores: torch.Tensor, offset: int, k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Running top-k: merge ``scores`` (rows numbered from ``offset``) into ``best`` ``(values, rows)``."""
    v, r = torch.topk(scores, min(k, scores.shape[1]), dim=1)
    if best is not None:
        v, r = torch.cat([best[0], v], 1), torch.cat([best[1], r + offset], 1)
        v, pos = torch.topk(v, k, dim=1)
        return v, r.gather(1, pos)
    return v, r + offset


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean fraction of each truth row's ids present in the matching ``found`` row."""
    m = min(found.shape[0], truth.shape[0])
    hits = (found[:m, :, None] == truth[:m, None, :]).any(-1).sum().item()
    return hits / (m * truth.shape[1])


def query_chunks(queries: torch.Tensor, x: torch.Tensor) -> Iterator[torch.Tensor]:
    """``queries`` in chunks whose scores against ``x`` stay within SCORE_BLOCK."""
    chunk = max(1, SCORE_BLOCK // x.shape[0])
    return (queries[i:i + chunk] for i in range(0, queries.shape[0], chunk))


def bf16_search(queries: torch.Tensor, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact bf16 search ``torch.topk(Q @ X.T, k)``, chunked over queries (:func:`query_chunks`)."""
    parts = [torch.topk(q @ x.T, k, dim=1) for q in query_chunks(queries, x)]
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])


def bf16_matmul(queries: torch.Tensor, x: torch.Tensor) -> None:
    """The matmul of :func:`bf16_search` alone, in the same query chunks (scores dropped)."""
    for q in query_chunks(queries, x):
        q @ x.T


# ---------------------------------------------------------------- tqvec pieces
def stage1_ms(rotated: torch.Tensor, block: scan.CodeBlock, table: scan.CodeTable, cfg: ops.TileConfig | None = None) -> float:
    """Milliseconds of the search's first stage alone (:func:`ops.group_maxima`: the scan kernel writing
    group maxima, after the float16 query conversion on the tensor-core path)."""
    cfg = cfg or ops.tile_config(rotated.shape[0], table.layout, n=len(block))
    rows = min(rotated.shape[0], max(1, ops.MAX_GROUP_SCORES // triton.cdiv(len(block), cfg.block_n)))
    return time_ms(lambda: ops.group_maxima(rotated[:rows], None, block, table, cfg)) * rotated.shape[0] / rows


def encode_gpu(tq: TurboQuantizer, x: torch.Tensor, boundaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA encode path (mse, no rescale): rotation GEMM, then the Triton quantize-and-pack kernel."""
    packed, norms, _ = ops.encode(tq.rotation.forward(x), tq.table(x.device), boundaries)
    return packed, norms


class Database:
    """One ``(N, d)`` Gaussian database: bf16 copy, tqvec codes per bit width, exact top-k of the truth queries."""

    def __init__(self, n: int, d: int, bits: tuple[int, ...], queries: torch.Tensor, seed: int = 1) -> None:
        self.n, self.d = n, d
        self.x_bf16 = torch.empty(n, d, dtype=torch.bfloat16, device="cuda")
        self.quantizers = {b: TurboQuantizer(d, b, seed=0) for b in bits}
        bounds = {b: ops.boundary_table(tq._boundaries, "cuda") for b, tq in self.quantizers.items()}
        packed = {b: [] for b in bits}
        scales = {b: [] for b in bits}
        self.encode_vps: dict[int, float] = {}
        truth_q = queries[:TRUTH_QUERIES]
        best = None
        for start, x in gaussian_chunks(n, d, seed):
            self.x_bf16[start:start + len(x)] = x.to(torch.bfloat16)
            best = merge_topk(best, truth_q @ x.T, start, K)
            for b, tq in self.quantizers.items():
                if start == 0:
                    self.encode_vps[b] = len(x) / time_ms(lambda: encode_gpu(tq, x, bounds[b])) * 1e3
                p, s = encode_gpu(tq, x, bounds[b])
                packed[b].append(p)
                scales[b].append(s)
            del x
        self.truth = best[1]
        self.blocks = {b: scan.CodeBlock(torch.cat(packed[b]), torch.cat(scales[b])) for b in bits}

    def code_bytes(self, bits: int) -> int:
        """Bytes a search reads for the database: packed codes plus float32 scales."""
        block = self.blocks[bits]
        return block.packed.numel() + 4 * block.scale.numel()


def run_table(args: argparse.Namespace, out_dir: Path) -> None:
    """Measure every configuration; write ``gpu_scan.json`` and ``gpu_scan.md`` after each one."""
    t0 = time.time()
    info = environment()
    info["copy_gbs"] = copy_bandwidth_gbs()
    print(json.dumps(info), flush=True)
    results: list[dict] = []
    for n in args.sizes:
        for d in args.dims:
            if time.time() - t0 > args.max_seconds:
                results.append({"n": n, "d": d, "skipped": "time budget of the run spent"})
                continue
            queries = torch.randn(max(args.nqs), d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
            db = Database(n, d, tuple(args.bits), queries)
            for b in args.bits:
                results.append({"n": n, "d": d, "bits": b, "encode_vectors_per_s": db.encode_vps[b], "what": "encode"})
            for nq in args.nqs:
                results.extend(measure(db, queries[:nq], args, info["copy_gbs"], t0))
                write_outputs(out_dir, info, results, args)
            del db, queries
            ops.clear_graphs()
            torch.cuda.empty_cache()
    write_outputs(out_dir, info, results, args)
    print(f"total {time.time() - t0:.0f} s", flush=True)


def measure(db: Database, queries: torch.Tensor, args: argparse.Namespace, copy_gbs: float, t0: float) -> list[dict]:
    """Baseline and tqvec rows for one (N, d, nq)."""
    nq, rows = queries.shape[0], []
    base = {"n": db.n, "d": db.d, "nq": nq, "k": K}
    if time.time() - t0 > args.max_seconds:
        return [{**base, "skipped": "time budget of the run spent"}]
    qb = queries.to(torch.bfloat16)
    ms = time_ms(lambda: bf16_search(qb, db.x_bf16, K))
    found = bf16_search(qb[:TRUTH_QUERIES], db.x_bf16, K)[1]
    matmul_ms = time_ms(lambda: bf16_matmul(qb, db.x_bf16))
    rows.append({**base, "what": "torch bf16 matmul+topk", "ms": ms, "qps": nq / ms * 1e3,
                 "recall": recall(found, db.truth), "gbs": db.x_bf16.numel() * 2 / ms / 1e6, "matmul_ms": matmul_ms})
    print(rows[-1], flush=True)
    for b in args.bits:
        tq, block = db.quantizers[b], db.blocks[b]
        rotated = tq.rotate_queries(queries)[0]
        table = tq.table("cuda")
        ms = time_ms(lambda: ops.search(rotated, block, table, K))
        found = ops.search(rotated[:TRUTH_QUERIES], block, table, K)[1]
        scan_ms = stage1_ms(rotated, block, table)
        gbs = db.code_bytes(b) / ms / 1e6
        rows.append({**base, "what": f"tqvec {b}-bit fused search", "bits": b, "ms": ms, "qps": nq / ms * 1e3,
                     "recall": recall(found, db.truth), "gbs": gbs, "copy_fraction": gbs / copy_gbs,
                     "speedup_vs_bf16": rows[0]["ms"] / ms, "speedup_vs_matmul": matmul_ms / ms,
                     "floor_ms": db.code_bytes(b) / copy_gbs / 1e6, "scan_ms": scan_ms,
                     "scan_copy_fraction": db.code_bytes(b) / scan_ms / 1e6 / copy_gbs,
                     "config": str(ops.tile_config(nq, tq.layout, n=len(block)))})
        print(rows[-1], flush=True)
    return rows


# ---------------------------------------------------------------- outputs
def environment() -> dict:
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "command": "python " + " ".join(sys.argv)}


def write_outputs(out_dir: Path, info: dict, results: list[dict], args: argparse.Namespace) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_scan.json").write_text(json.dumps({"environment": info, "results": results}, indent=1))
    (out_dir / "gpu_scan.md").write_text(markdown(info, results))


def markdown(info: dict, results: list[dict]) -> str:
    """The results as markdown tables, with the command and environment."""
    lines = [
        "# tqvec GPU scan benchmark", "",
        f"`{info['command']}` — {info['gpu']}, torch {info['torch']}, triton {info['triton']}, "
        f"Python {info['python']}. Device-to-device copy: {info['copy_gbs']:.0f} GB/s (read + write).", "",
        "Random Gaussian data and queries, k = 10, recall@10 against exact float32 top-10 (first 100 queries). "
        "GB/s: database bytes read per second (bf16 vectors; tqvec packed codes + float32 scales), end to end; "
        "the last column times tqvec's scan kernel (stage 1, group maxima) alone. tqvec searches after the "
        "second call of a shape replay a captured CUDA graph (see kernels/ops.py); the bf16 baseline is two "
        "eager torch calls per query chunk. vs matmul: the bf16 matmul alone (same chunks, no top-k) over tqvec's time; "
        "floor: the codes' bytes at the copy rate.", "",
        "| N | d | nq | method | ms | QPS | recall@10 | GB/s | of copy BW | speed-up vs bf16 | vs matmul | floor ms | "
        "scan kernel ms (of copy BW) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['n']:,} | {r['d']} | {r.get('nq', 'all')} | skipped: {r['skipped']} | | | | | | | | | |")
        elif r.get("what") != "encode":
            frac = f"{r['copy_fraction']:.0%}" if "copy_fraction" in r else ""
            speed = f"{r['speedup_vs_bf16']:.1f}×" if "speedup_vs_bf16" in r else ""
            scan_col = f"{r['scan_ms']:.3f} ({r['scan_copy_fraction']:.0%})" if "scan_ms" in r else ""
            vs_matmul = f"{r['speedup_vs_matmul']:.2f}×" if "speedup_vs_matmul" in r else (
                f"matmul alone {r['matmul_ms']:.3f} ms" if "matmul_ms" in r else "")
            floor = f"{r['floor_ms']:.3f}" if "floor_ms" in r else ""
            lines.append(f"| {r['n']:,} | {r['d']} | {r['nq']:,} | {r['what']} | {r['ms']:.3f} | {r['qps']:,.0f} | "
                         f"{r['recall']:.3f} | {r['gbs']:,.0f} | {frac} | {speed} | {vs_matmul} | {floor} | {scan_col} |")
    lines += ["", "Encode (rotation GEMM in float32 + Triton quantize/pack kernel), first 1M vectors:", "",
              "| d | bits | vectors/s |", "|---|---|---|"]
    seen = set()
    for r in results:
        if r.get("what") == "encode" and (r["d"], r["bits"]) not in seen:
            seen.add((r["d"], r["bits"]))
            lines.append(f"| {r['d']} | {r['bits']} | {r['encode_vectors_per_s'] / 1e6:,.1f} M |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- check and sweep
def check() -> bool:
    """Kernel results on the GPU against the CPU reference (tqvec.scan), realistic tile shapes."""
    ok = True
    cases = [(4, "mse", 128, 20001, 100), (4, "mse", 128, 20001, 1), (2, "mse", 1536, 5003, 37), (1, "mse", 128, 5003, 300),
             (3, "mse", 100, 5003, 5), (2.5, "mse", 128, 5003, 100), (3.5, "prod", 96, 5003, 20), (1, "prod", 64, 5003, 3),
             (4, "mse", 128, 5003, 64), (4, "prod", 128, 5003, 130), (8, "mse", 1536, 3001, 200),
             (4, "mse", 12, 3001, 20), (4, "mse", 12, 3001, 9), (2, "mse", 16, 3001, 3),  # below MIN_BLOCK_D channels
             (4, "mse", 384, 5003, 1), (4, "mse", 768, 5003, 100), (4, "mse", 1024, 5003, 1), (4, "mse", 1536, 5003, 100),
             (4, "mse", 768, 5003, 7), (4, "mse", 1536, 20001, 16),  # 4-bit levels by byte permutes, 2-16 queries
             # the int8 stage 1 (ops.INT8_MIN_QUERIES): two segments, bias, a ragged 128 MiB chunk at d = 1536
             (4, "mse", 384, 20001, 401), (2.5, "mse", 768, 5003, 300), (3.5, "mse", 128, 5003, 1201),
             (4, "mse", 1536, 100003, 257), (3.5, "prod", 384, 5003, 400)]
    for case in cases:
        try:
            ok &= _check_case(*case)
        except Exception as exc:  # noqa: BLE001 - report every case
            print(f"check {case}: FAILED {type(exc).__name__}: {str(exc)[:500]}", flush=True)
            ok = False
    return ok


def _check_case(bits: float, mode: str, d: int, n: int, nq: int) -> bool:
    """One check configuration; prints its errors and returns whether it passed. The reference top-k is the exact
    float32 one (``scan.scores``): the native CPU search's two-stage scan may miss a row (docs/native.md), so it is no
    oracle here."""
    tq = TurboQuantizer(d, bits, mode=mode, seed=3)
    x = torch.randn(n, d, device="cuda")
    codes = tq.encode(x.cpu())
    bias = torch.randn(n) if nq % 2 else None
    rotated, projected = tq.rotate_queries(torch.randn(nq, d))
    block_cpu = tq.code_block(codes, bias)
    block = tq.code_block(codes.to("cuda"), None if bias is None else bias.cuda())
    to_cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    ref = scan.scores(rotated, block_cpu, tq.table("cpu"), projected)
    got = ops.scores(rotated.cuda(), block, tq.table("cuda"), to_cuda(projected)).cpu()
    err = ((got - ref).norm() / ref.norm()).item()
    rv, rr = torch.topk(ref, min(10, n), dim=1)
    gv, gr = (t.cpu() for t in ops.search(rotated.cuda(), block, tq.table("cuda"), 10, to_cuda(projected)))
    verr = ((gv - rv).abs().max() / rv.abs().max()).item()
    ids = (gr == rr).float().mean().item()
    rotated2, projected2 = tq.rotate_queries(torch.randn(nq, d))
    rv2 = torch.topk(scan.scores(rotated2, block_cpu, tq.table("cpu"), projected2), min(10, n), dim=1).values
    gv2 = ops.search(rotated2.cuda(), block, tq.table("cuda"), 10, to_cuda(projected2))[0].cpu()  # captured
    gv3 = ops.search(rotated.cuda(), block, tq.table("cuda"), 10, to_cuda(projected))[0].cpu()  # replayed
    verr = max(verr, ((gv2 - rv2).abs().max() / rv2.abs().max()).item(), ((gv3 - rv).abs().max() / rv.abs().max()).item())
    packed, norms, _ = ops.encode(tq.rotation.forward(x), tq.table("cuda"), ops.boundary_table(tq._boundaries, "cuda"))
    enc = (packed.cpu() == tq.encode(x.cpu()).packed).float().mean().item()
    good = err < 1e-4 and verr < 1e-4
    print(f"check bits={bits} {mode} d={d} n={n} nq={nq}: scores rel err {err:.1e}, top-k value err {verr:.1e}, "
          f"ids equal {ids:.4f}, encode bytes equal {enc:.4f} {'OK' if good else 'FAIL'}", flush=True)
    return good


def graph_ms(fn: Callable[[], object]) -> float:
    """:func:`time_ms` of ``fn`` replayed from a captured CUDA graph (no host launch overhead)."""
    return time_ms(ops.capture_graph(fn)[0].replay, 50, 10)


def sweep() -> None:
    """Time stage 1 (group maxima) and the whole search for candidate tilings on random codes, replaying
    CUDA graphs; for the first tiling of each shape also the search's steps one by one."""
    C = ops.TileConfig
    grid = {
        (1 << 20, 128, 100, 4): [C(128, 128, 128, False, 2, True, 4), C(128, 128, 128, False, 4, True, 8),
                                 C(128, 128, 128, False, 4, True, 4), C(128, 128, 128, False, 8, True, 8),
                                 C(128, 64, 64, False, 4, True, 4)],
        (1 << 20, 128, 200, 4): [C(128, 128, 128, False, 2, True, 4), C(128, 128, 128, False, 4, True, 8)],
        (1 << 20, 128, 1, 4): [C(1, 32, 64, tiles=32, matvec=True), C(1, 128, 64, tiles=8, matvec=True),
                               C(16, 128, 128, True, 1)],
        (10 << 20, 128, 1, 4): [C(1, 32, 64, tiles=128, matvec=True), C(1, 32, 64, tiles=32, matvec=True),
                                C(16, 128, 128, True, 1)],
        (1 << 20, 128, 1, 2): [C(1, 32, 64, tiles=32, matvec=True), C(16, 128, 128, True, 1)],
        (1 << 20, 128, 4, 4): [C(16, 128, 128, True, 1)],
        (1 << 18, 1536, 1, 4): [C(16, 128, 128, True, 1), C(1, 128, 64, tiles=8, matvec=True)],
    }
    copy_gbs = copy_bandwidth_gbs()
    for (n, d, nq, bits), configs in grid.items():
        tq = TurboQuantizer(d, bits, seed=0)
        table = tq.table("cuda")
        block = scan.CodeBlock(torch.randint(0, 256, (n, tq.layout.row_bytes), dtype=torch.uint8, device="cuda"),
                               torch.rand(n, device="cuda") + 0.5)
        nbytes = block.packed.numel() + 4 * n
        q = tq.rotate_queries(torch.randn(nq, d, device="cuda"))[0]
        line = f"sweep n={n} d={d} nq={nq} bits={bits}"
        print(line, flush=True)
        for i, cfg in enumerate(configs):
            try:
                s1 = graph_ms(lambda: ops.group_maxima(q, None, block, table, cfg))
                full = time_ms(lambda: ops.search(q, block, table, K, config=cfg), 100, 10)
                print(f"  {cfg}: stage1 {s1:.4f} ms ({nbytes / s1 / 1e6 / copy_gbs:.0%} of copy), search {full:.4f} ms "
                      f"({nbytes / full / 1e6 / copy_gbs:.0%})", flush=True)
                if i == 0:
                    gm = ops.group_maxima(q, None, block, table, cfg)
                    kg = min(gm.shape[1], K + ops.GROUP_MARGIN)
                    groups = torch.topk(gm, kg, dim=1, sorted=False).indices
                    cand, _ = ops._refine(q, None, groups, block, table, cfg.block_n)
                    print(f"    graphs: half queries {graph_ms(lambda: ops._half_queries(q, None)):.4f}, "
                          f"topk groups {graph_ms(lambda: torch.topk(gm, kg, dim=1, sorted=False)):.4f}, "
                          f"refine {graph_ms(lambda: ops._refine(q, None, groups, block, table, cfg.block_n)):.4f}, "
                          f"final topk {graph_ms(lambda: torch.topk(cand, K, dim=1)):.4f}, "
                          f"empty graph {graph_ms(lambda: None):.4f} ms", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and keep sweeping
                print(f"  {cfg}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        del block
        ops.clear_graphs()
        torch.cuda.empty_cache()


def topk_compare(out_dir: Path, n: int = 1_000_000, d: int = 128, bits: int = 4, nqs: tuple[int, ...] = (1, 100, 10_000)) -> bool:
    """The search's selection steps with ``torch.topk`` (old) against :mod:`tqvec.kernels.topk` (new), each step
    replayed from a CUDA graph on a cold L2, and whole searches both ways beside the bf16 baseline; random codes.
    Checks that both ways choose equal group maxima and return equal results. Writes ``gpu_topk.json`` / ``.md``."""
    info = environment()
    tq = TurboQuantizer(d, bits, seed=0)
    table = tq.table("cuda")
    block = scan.CodeBlock(torch.randint(0, 256, (n, tq.layout.row_bytes), dtype=torch.uint8, device="cuda"),
                           torch.rand(n, device="cuda") + 0.5)
    x_bf16 = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    rows, ok = [], True
    for nq in nqs:
        q = tq.rotate_queries(torch.randn(nq, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(nq)))[0]
        cfg = ops.tile_config(nq, tq.layout, n=n)
        gm = ops.group_maxima(q, None, block, table, cfg)
        kg = min(gm.shape[1], K + ops.GROUP_MARGIN)
        old_groups = torch.topk(gm, kg, dim=1, sorted=False).indices
        new_groups = ops.topk_kernels.row_topk(gm, kg)[1]
        same_groups = torch.equal(gm.gather(1, old_groups).sort(1).values, gm.gather(1, new_groups).sort(1).values)
        cand, ids = ops._refine(q, None, new_groups, block, table, cfg.block_n)
        old_best, old_pos = torch.topk(cand, K, dim=1)
        new_best, new_rows = ops.topk_kernels.row_topk(cand, K, ids)
        same_final = torch.equal(old_best, new_best) and torch.equal(ids.gather(1, old_pos).sort(1).values, new_rows.sort(1).values)
        r = {"n": n, "d": d, "bits": bits, "nq": nq, "k": K, "n_groups": gm.shape[1], "kg": kg, "candidates": cand.shape[1],
             "config": str(cfg), "same_groups": same_groups, "same_final": same_final}
        r["stage1_ms"] = graph_ms(lambda: ops.group_maxima(q, None, block, table, cfg))
        r["groups_torch_ms"] = graph_ms(lambda: torch.topk(gm, kg, dim=1, sorted=False))
        r["groups_triton_ms"] = graph_ms(lambda: ops.topk_kernels.row_topk(gm, kg))
        r["refine_ms"] = graph_ms(lambda: ops._refine(q, None, new_groups, block, table, cfg.block_n))
        r["final_torch_ms"] = graph_ms(lambda: ids.gather(1, torch.topk(cand, K, dim=1).indices))
        r["final_triton_ms"] = graph_ms(lambda: ops.topk_kernels.row_topk(cand, K, ids))
        kp = ops.topk_kernels.k_pad(K)
        kept, _ = ops._refine(q, None, new_groups, block, table, cfg.block_n, local_k=kp)
        r["refine_keep_ms"] = graph_ms(lambda: ops._refine(q, None, new_groups, block, table, cfg.block_n, local_k=kp))
        r["final_kept_ms"] = graph_ms(lambda: ops.topk_kernels.keys_topk(kept, K))
        kept_best, kept_rows = ops.topk_kernels.keys_topk(kept, K)
        r["same_final"] = same_final = same_final and torch.equal(kept_best, new_best) and torch.equal(kept_rows, new_rows)
        r["empty_graph_ms"] = graph_ms(lambda: None)
        results = {}
        for name, flag in (("torch", False), ("triton", True)):
            ops.clear_graphs()
            with ops.configured(triton_topk=flag):
                r[f"search_{name}_ms"] = time_ms(lambda: ops.search(q, block, table, K), 200, 20)
                results[name] = ops.search(q, block, table, K)
        r["same_search"] = (torch.equal(results["torch"][0], results["triton"][0])
                            and torch.equal(results["torch"][1].sort(1).values, results["triton"][1].sort(1).values))
        qb = q.to(torch.bfloat16)
        r["bf16_ms"] = time_ms(lambda: bf16_search(qb, x_bf16, K), 200, 10)
        r["speedup_torch"] = r["bf16_ms"] / r["search_torch_ms"]
        r["speedup_triton"] = r["bf16_ms"] / r["search_triton_ms"]
        ok &= same_groups and same_final and r["same_search"]
        rows.append(r)
        print(json.dumps(r), flush=True)
        ops.clear_graphs()
    lines = ["# torch.topk vs Triton top-k in tqvec search", "",
             f"`{info['command']}` — {info['gpu']}, torch {info['torch']}, triton {info['triton']}. "
             f"N = {n:,}, d = {d}, {bits} bits, k = {K}, random codes; steps replayed from CUDA graphs on a cold L2 "
             "(each includes one graph replay's overhead, see the empty-graph column); searches end to end (graph replay). "
             "Refine: every refined score is a candidate of the final top-k; refine, keep 16: each 128-row slice keeps its "
             "best k_pad(k) = 16 as keys, and the final top-k (kept) runs over those (the search's default with the Triton "
             "top-k; 'search triton' uses it).", "",
             "| nq | groups | stage 1 | groups torch | groups triton | refine | final torch | final triton | refine, keep 16 "
             "| final (kept) | empty graph | search torch | search triton | bf16 | speed-up torch / triton | equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['nq']:,} | {r['n_groups']:,} → {r['kg']} | {r['stage1_ms']:.4f} | {r['groups_torch_ms']:.4f} | "
                     f"{r['groups_triton_ms']:.4f} | {r['refine_ms']:.4f} | {r['final_torch_ms']:.4f} | {r['final_triton_ms']:.4f} | "
                     f"{r['refine_keep_ms']:.4f} | {r['final_kept_ms']:.4f} | "
                     f"{r['empty_graph_ms']:.4f} | {r['search_torch_ms']:.4f} | {r['search_triton_ms']:.4f} | {r['bf16_ms']:.4f} | "
                     f"{r['speedup_torch']:.1f}× / {r['speedup_triton']:.1f}× | "
                     f"{'yes' if r['same_groups'] and r['same_final'] and r['same_search'] else 'NO'} |")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_topk.json").write_text(json.dumps({"environment": info, "results": rows}, indent=1))
    (out_dir / "gpu_topk.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return ok


def main(argv: list[str] | None = None) -> None:
    """``tqvec bench gpu-scan [options]`` (needs CUDA): the table, or only ``--check`` / ``--sweep`` / ``--topk``."""
    parser = argparse.ArgumentParser(prog="tqvec bench gpu-scan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 384, 768, 1024, 1536])
    parser.add_argument("--nqs", type=int, nargs="+", default=[1, 100, 10_000])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-seconds", type=float, default=420.0, help="skip configurations started after this")
    parser.add_argument("--check", action="store_true", help="only check kernels against the CPU reference")
    parser.add_argument("--sweep", action="store_true", help="only time tile configurations")
    parser.add_argument("--topk", action="store_true", help="only compare torch.topk and the Triton top-k kernels "
                        "(N = 1M, d = 128, 4 bits, nq 1 / 100 / 10000), writing gpu_topk.json / .md under --out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the GPU scan benchmark needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.check or args.sweep or args.topk:
        ok = check() if args.check else True
        if args.topk:
            ok &= topk_compare(args.out)
        if args.sweep:
            sweep()
        sys.exit(0 if ok else 1)
    run_table(args, args.out)


if __name__ == "__main__":
    main()
