"""The runs ``config.yml`` asks ann-benchmarks for, expanded as the harness expands them, and what a full run
of them costs.

:func:`definitions` follows ``ann_benchmarks/definitions.py`` (``create_definitions_from_algorithm``): each
run group's ``args`` is a list whose items are lists of choices (a bare item is one choice); every
combination, prefixed by ``base_args`` with ``@metric`` / ``@count`` / ``@dimension`` substituted, is one
constructor call; ``query_args`` expand the same way into the query-argument groups passed to
``set_query_arguments(*group)`` one after another on the built index.

:func:`full_run_seconds` is a cost model, not a measurement: IVF scan work (``nprobe · n / nlist`` codes
per query) at a given scan rate plus a fixed cost per query, and k-means builds (the sample IVFIndex trains
on, ``min(n, 256 · nlist)`` rows × ``nlist`` × ``dim`` multiply-adds per iteration, plus one assignment of
all ``n`` rows) at a given FLOP rate.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tqvec.ivf import MAX_POINTS_PER_LIST
from tqvec.kmeans import KMEANS_ITERATIONS

CONFIG = Path(__file__).with_name("config.yml")


@dataclass(frozen=True)
class Run:
    """One constructor call of a run group and the query-argument groups run on its index."""

    name: str  # the algorithm name in config.yml
    group: str  # the run group
    constructor: str
    args: list[Any]
    query_groups: list[list[Any]]


def _combinations(spec: list[Any]) -> list[list[Any]]:
    return [list(c) for c in itertools.product(*[s if isinstance(s, list) else [s] for s in spec])]


def definitions(metric: str, dimension: int, count: int = 10, point_type: str = "float",
                path: str | Path = CONFIG) -> list[Run]:
    """Every run ``path`` defines for ``point_type`` data compared by ``metric`` (its ``any`` entries too)."""
    with open(path) as f:
        config = yaml.safe_load(f)
    entries = config.get(point_type, {})
    runs = []
    variables = {"@metric": metric, "@count": count, "@dimension": dimension}
    for algo in [*entries.get("any", []), *entries.get(metric, [])]:
        base = [variables.get(a, a) if isinstance(a, str) else a for a in algo.get("base_args", [])]
        for group, spec in algo["run_groups"].items():
            queries = _combinations(spec["query_args"]) if "query_args" in spec else []
            for args in _combinations(spec["args"]):
                runs.append(Run(algo["name"], group, algo["constructor"], base + args, queries))
    return runs


def full_run_seconds(runs: list[Run], n: int, nq: int, dim: int, harness_runs: int = 1,
                     codes_per_s: float = 3e6, query_overhead_s: float = 5e-5,
                     flops: float = 5e10) -> dict[str, float]:
    """Modelled seconds of a full harness run of ``runs`` (``TqvecIVF(metric, bits, encoding, nlist, ...)``)
    on ``n`` rows of ``dim`` and ``nq`` queries, each query group timed ``harness_runs`` times: ``search``,
    ``build`` and ``total``."""
    search = build = 0.0
    for run in runs:
        nlist = min(int(run.args[3]), n)
        sample = min(n, MAX_POINTS_PER_LIST * nlist)
        build += 2 * dim * nlist * (KMEANS_ITERATIONS * sample + n) / flops
        for q in run.query_groups or [[1]]:
            nprobe = min(int(q[0]), nlist)
            search += harness_runs * nq * (nprobe * n / nlist / codes_per_s + query_overhead_s)
    return {"search": search, "build": build, "total": search + build}
