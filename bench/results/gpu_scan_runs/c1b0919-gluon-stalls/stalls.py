"""Where the Gluon stage 1's warps wait (1M x 384, H100): for 100 queries (group_max_kernel, fused) and 10,000
(decoded_group_max_kernel), the stall reasons of h100/ncu_stalls_384_NQ.csv (per issued instruction) and the
per-instruction samples of h100/ncu_sass_384_NQ.csv (share of all samples, the instructions with the most), as
../c6fc0ea-stalls/stalls.py. ``python3 stalls.py`` from this folder."""
import csv
import re
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent


def table(path: Path, first: str) -> list[dict[str, str]]:
    """The CSV rows from the first header line (starting ``first``) on; repeated headers (one per kernel) dropped."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    return [r for r in csv.DictReader(lines[start:]) if r[next(iter(r))] != next(iter(r))]


def number(text: str) -> float:
    return float(text.replace(",", "")) if text else 0.0


for nq in (100, 10000):
    rows = [r for r in table(HERE / "h100" / f"ncu_stalls_384_{nq}.csv", '"ID"') if "group_max" in r["Kernel Name"]]
    row = rows[0]
    print(f"== {nq} queries: {row['Kernel Name']} x{len(rows)}, {number(row['gpu__time_duration.sum']) / 1000:.1f} us "
          f"each, issue slots busy {row['smsp__issue_active.avg.pct_of_peak_sustained_active']}%, tensor pipe "
          f"{row['sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active']}%, warps active "
          f"{row['sm__warps_active.avg.pct_of_peak_sustained_active']}%")
    reasons = {k.split("stalled_")[1].split("_per_issue")[0]: number(v) for k, v in row.items() if "issue_stalled" in k}
    print("warp cycles per issued instruction:", round(sum(reasons.values()), 2))
    for name, value in sorted(reasons.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {name:<18} {value:.2f}")
    samples = [r for r in table(HERE / "h100" / f"ncu_sass_384_{nq}.csv", '"Address"') if r.get("Source")]
    total = sum(number(r["Warp Stall Sampling (All Samples)"]) for r in samples)
    columns = [c for c in samples[0] if c.startswith("stall_") and "Not Issued" not in c]
    by_reason = Counter()
    for r in samples:
        for c in columns:
            by_reason[c[6:]] += number(r[c])
    print(f"{total:.0f} samples; by reason (%):", {k: round(100 * v / total, 1) for k, v in by_reason.most_common(6)})
    print("instructions with the most samples (% of all, main reason):")
    for r in sorted(samples, key=lambda r: -number(r["Warp Stall Sampling (All Samples)"]))[:10]:
        share = 100 * number(r["Warp Stall Sampling (All Samples)"]) / total
        reason = max(columns, key=lambda c: number(r[c]))[6:]
        source = re.sub(r"\s+", " ", r["Source"].strip())[:58]
        print(f"  {source:<58} {share:5.2f}  {reason}")
