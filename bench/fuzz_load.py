"""Fuzz ``Index.load`` / ``IVFIndex.load``: any input file may raise ``StorageError`` and nothing else.

Each fuzzer input (bytes) becomes one file, derived from a few small valid index files (:func:`seed_files`)
by one of four mutations (:func:`derive`): the input bytes as the whole file; byte overwrites; an edit of the
JSON header (a meta field or an array-table field set to an awkward value); an overwrite of array payload
values with awkward bit patterns (NaN, ±Inf, huge, negative). All but the first recompute the trailing
SHA-256, as an attacker would, so the checks behind the checksum are the ones exercised. Every file is loaded
by both index classes; a file that loads is then searched once and saved again. Any other exception, or one
input taking more than ``--slow`` seconds, is a finding.

Engines: ``atheris`` (coverage-guided, libFuzzer) when it is installed, else ``hypothesis`` over bytes, or
``random`` (seeded bytes, the CI smoke test's engine). ``--seed`` seeds each of them (libFuzzer's ``-seed``,
hypothesis's ``@seed``, numpy's generator), so a run repeats. ``--workers N`` runs N processes of this script
with seeds ``seed … seed+N-1``, splits the inputs between them and merges their results (:func:`merge`).
Results go to ``bench/results/fuzz_load.{json,md}``.

    python -m tqvec.bench.fuzz_load --inputs 100000 --workers 14   # atheris if installed, else hypothesis
    python -m tqvec.bench.fuzz_load --inputs 2000 --engine random --no-write
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tqvec import _file_checks, _rows, storage, validation
from tqvec.index import Index
from tqvec.ivf import IVFIndex

RESULTS = Path(__file__).resolve().parent / "results"
WORKER_REPORT_EVERY = 1000  # inputs between a worker's JSON updates (the merged progress lines)
POLL_S = 5.0  # seconds between the merged progress checks of a parallel run
_AWKWARD_JSON = [0, 1, -1, 2, 3, 8, 31, 32, 33, 255, 256, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64,
                 10**9, 10**30, -(2**63), 0.5, -0.0, 1e308, 1e-310, "", "l2", "ip", "cosine", "haar", "hadamard",
                 "center", "none", "rescale", "direct", "residual", "mse", "prod", "<f4", "<i8", "|u1", "<f2", "|O",
                 None, True, False, [], [0], [1, 2], [2**62, 0], {}, {"a": 1}]
_AWKWARD_BITS = [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff", b"\xff\xff\x7f\x7f", b"\x00\x00\x80\x00",
                 b"\xff\xff\xff\xff", b"\x00\x00\x00\x80", b"\xff\xff\xff\xff\xff\xff\xff\x7f", b"\x00\xfc", b"\x00\x7c"]


def seed_files(folder: Path) -> list[bytes]:
    """Bytes of small valid index files of varied configurations (flat and IVF, every optional array)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((160, 32)).astype(np.float32)
    builds: list[Callable[[], Index | IVFIndex]] = [
        lambda: Index(32, 4, "l2", correction="center"),
        lambda: Index(32, 1, "cosine"),  # centering bias in the code padding
        lambda: Index(32, 3, "ip", mode="prod", rerank_bits=6),
        lambda: Index(32, 2, "ip", rotation="hadamard", correction="rescale"),
        lambda: IVFIndex(32, 3, 4, "l2"),
        lambda: IVFIndex(32, 2, 4, "ip", encoding="direct", correction="center", rerank_bits=5),
        lambda: IVFIndex(32, 2, 2, "cosine", mode="prod"),
    ]
    out = []
    for i, build in enumerate(builds):
        index = build()
        index.add(x[: 120 + 5 * i])
        path = folder / f"seed{i}.tqv"
        index.save(path)
        out.append(path.read_bytes())
    empty = folder / "empty.tqv"
    Index(32, 4).save(empty)
    out.append(empty.read_bytes())
    return out


def _resign(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def _split(data: bytes) -> tuple[dict, bytes]:
    """(header, payload) of a valid file."""
    (header_len,) = struct.unpack_from("<Q", data, 16)
    start = -(-(24 + header_len) // 64) * 64
    return json.loads(data[24:24 + header_len]), data[start:-32]


def _join(header: dict, payload: bytes) -> bytes:
    body = json.dumps(header).encode()
    head = struct.pack("<8sIIQ", storage.MAGIC, storage.VERSION, 0, len(body)) + body
    return _resign(head + bytes(-len(head) % 64) + payload)


def derive(fuzz: bytes, seeds: list[bytes]) -> bytes:
    """The file that fuzzer input ``fuzz`` stands for (module docstring)."""
    if len(fuzz) < 3:
        return fuzz
    strategy, pick, rest = fuzz[0] % 4, seeds[fuzz[1] % len(seeds)], fuzz[2:]
    if strategy == 0:
        return rest
    if strategy == 1:  # overwrite bytes at positions the input names, then re-sign
        body = bytearray(pick[:-32])
        for i in range(0, len(rest) - 2, 3):
            body[int.from_bytes(rest[i:i + 2], "little") % len(body)] = rest[i + 2]
        return _resign(bytes(body))
    header, payload = _split(pick)
    if strategy == 2:  # set header fields to awkward values
        for i in range(0, len(rest) - 2, 3):
            value = _AWKWARD_JSON[rest[i + 2] % len(_AWKWARD_JSON)]
            if rest[i] % 2:
                keys = sorted(header["meta"])
                header["meta"][keys[rest[i + 1] % len(keys)]] = value
            elif header["arrays"]:
                entry = header["arrays"][rest[i + 1] % len(header["arrays"])]
                entry[sorted(entry)[rest[i] // 2 % len(entry)]] = value
            else:
                header[("kind", "payload_nbytes", "arrays")[rest[i] % 3]] = value
        return _join(header, payload)
    body = bytearray(payload)  # strategy 3: awkward numbers into the arrays
    for i in range(0, len(rest) - 2, 3):
        if body:
            bits = _AWKWARD_BITS[rest[i + 2] % len(_AWKWARD_BITS)]
            at = int.from_bytes(rest[i:i + 2], "little") % len(body)
            body[at:at + len(bits)] = bits[: len(body) - at]
    return _join(header, bytes(body))


class Target:
    """Loads derived files; records findings (an exception other than ``StorageError``, or a slow input)."""

    def __init__(self, folder: Path, slow: float = 1.0, report: Callable[[Target, bool], None] | None = None,
                 every: int = 0, last: int = 0) -> None:
        """``report(self, final)`` runs every ``every`` inputs (``final`` false) and at input ``last`` (``final``
        true; then the process exits, status 1 if there are findings, else 0: atheris's libFuzzer never returns)."""
        self.folder, self.slow = folder, slow
        self.report, self.every, self.last = report, every, last
        self.start = time.perf_counter()
        self.seeds = seed_files(folder)
        self.path = folder / "input.tqv"
        self.out = folder / "resaved.tqv"
        self.inputs = self.loaded = 0
        self.slowest = 0.0
        self.findings: list[dict] = []

    def __call__(self, fuzz: bytes) -> None:
        self.inputs += 1
        data = derive(fuzz, self.seeds)
        self.path.write_bytes(data)
        start = time.perf_counter()
        for cls in (Index, IVFIndex):
            try:
                index = cls.load(self.path)
            except storage.StorageError:
                continue
            except Exception as err:  # noqa: BLE001 - the finding
                self._finding("load", cls, err, data)
                continue
            self.loaded += 1
            try:
                index.search(np.ones((1, index.dim), np.float32), 3)
                index.save(self.out)
            except Exception as err:  # noqa: BLE001 - a file that loads must be usable
                self._finding("use", cls, err, data)
        elapsed = time.perf_counter() - start
        self.slowest = max(self.slowest, elapsed)
        if elapsed > self.slow:
            self.findings.append({"stage": "slow", "seconds": elapsed, "sha256": hashlib.sha256(data).hexdigest()})
        if self.report is not None and (self.inputs == self.last or (self.every and self.inputs % self.every == 0)):
            self.report(self, self.inputs == self.last)
            if self.inputs == self.last:
                sys.stdout.flush()
                os._exit(1 if self.findings else 0)

    def _finding(self, stage: str, cls: type, err: Exception, data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        (self.folder / f"finding-{digest[:16]}.tqv").write_bytes(data)
        self.findings.append({"stage": stage, "class": cls.__name__, "error": f"{type(err).__name__}: {err}"[:300],
                              "where": traceback.format_exc().strip().splitlines()[-3][:200], "sha256": digest})


def run_random(target: Target, inputs: int, seed: int = 0) -> None:
    """Seeded random inputs: a strategy byte, a seed byte, then 3–300 random bytes."""
    rng = np.random.default_rng(seed)
    for _ in range(inputs):
        target(rng.integers(0, 256, int(rng.integers(3, 300)), dtype=np.uint8).tobytes())


def run_hypothesis(target: Target, inputs: int, seed: int = 1) -> None:
    """``inputs`` examples of hypothesis's bytes strategy (3–400 bytes), the same ones for the same ``seed``."""
    from hypothesis import HealthCheck, given, settings  # noqa: PLC0415
    from hypothesis import seed as start_from
    from hypothesis import strategies as st

    @start_from(seed)
    @settings(max_examples=inputs, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(min_size=3, max_size=400))
    def one(fuzz: bytes) -> None:
        target(fuzz)

    one()


def instrumented_functions() -> list[Callable[..., object]]:
    """The functions :func:`run_atheris` instruments for coverage feedback, each once: every plain function defined
    in the modules that read and check a file (``storage``, ``validation``, ``_file_checks``, ``_rows``), and by
    name :func:`derive`, the file checks, ``check_rows`` and the load path's methods of both index classes. Not torch or
    numpy: instrumenting those would crawl. A name that no longer exists raises ``AttributeError`` here, and the
    CI smoke test calls this without atheris, so a refactor that moves one fails there."""
    found = [value for module in (storage, validation, _file_checks, _rows) for value in vars(module).values()
             if inspect.isfunction(value) and value.__module__ == module.__name__]
    named = [derive, _file_checks.check_index_file, _file_checks.check_ivf_file, _rows.check_rows,
             _rows.CodedRows._loaded_tensors, Index.load.__func__, Index._check_loaded, IVFIndex.load.__func__,
             IVFIndex._check_loaded]
    return list(dict.fromkeys(named + found))


def run_atheris(target: Target, inputs: int, seed: int = 1) -> None:
    """libFuzzer from ``seed`` (0: it picks one) over ``inputs`` inputs of at most 400 bytes, with coverage feedback
    from :func:`instrumented_functions`. Never returns: ``target`` reports at input ``inputs`` and exits."""
    import atheris  # noqa: PLC0415

    for func in instrumented_functions():
        atheris.instrument_func(func)
    atheris.Setup([sys.argv[0], f"-runs={inputs + 1}", f"-seed={seed}", "-max_len=400", "-len_control=0"], target)
    atheris.Fuzz()


def target_result(target: Target, engine: str, command: str, seed: int, final: bool) -> dict:
    """The JSON result of the run in this process so far; ``final``: the engine ran to its end."""
    return {"engine": engine, "inputs": target.inputs, "loaded": target.loaded,
            "seconds": round(time.perf_counter() - target.start, 1), "slowest_input_s": round(target.slowest, 3),
            "n_findings": len(target.findings), "findings": target.findings[:50], "python": platform.python_version(),
            "command": command, "finished": final, "workers": 1, "seeds": [seed]}


@dataclass
class WorkerRun:
    """One worker process of a parallel run: its seed, its share of the inputs, the files it writes its JSON result
    (``out``) and its output (``log``) to; as last seen, its exit status (``None`` while it runs) and result
    (``None`` before it wrote one); the end of its log once it :attr:`failed`."""

    seed: int
    inputs: int
    out: Path
    log: Path
    returncode: int | None = None
    result: dict | None = None
    log_tail: str = ""

    @property
    def failed(self) -> bool:
        """It ended without a finished result that explains its exit status (1 exactly when it found something):
        it crashed, was killed, or libFuzzer stopped before the last input."""
        if self.returncode is None:
            return False
        return (self.result is None or not self.result["finished"]
                or self.returncode != (1 if self.result["n_findings"] else 0))


def merge(runs: list[WorkerRun], engine: str, command: str, seconds: float) -> dict:
    """The result of a parallel run from its workers' as last seen: inputs and successful loads summed, the slowest
    input, every finding counted and the first 50 kept, a :attr:`WorkerRun.failed` worker being one (listed first,
    with its exit status and log tail); ``seconds``: the run's wall time; finished when every worker's result is."""
    results = [run.result for run in runs if run.result is not None]
    failures = [{"stage": "worker", "seed": run.seed, "returncode": run.returncode, "log_tail": run.log_tail}
                for run in runs if run.failed]
    findings = failures + [finding for result in results for finding in result["findings"]]
    return {"engine": engine, "inputs": sum(r["inputs"] for r in results), "loaded": sum(r["loaded"] for r in results),
            "seconds": round(seconds, 1), "slowest_input_s": max((r["slowest_input_s"] for r in results), default=0.0),
            "n_findings": len(failures) + sum(r["n_findings"] for r in results), "findings": findings[:50],
            "python": platform.python_version(), "command": command,
            "finished": all(run.result is not None and run.result["finished"] for run in runs),
            "workers": len(runs), "seeds": [run.seed for run in runs]}


def _read_result(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _tail(path: Path, nbytes: int = 1500) -> str:
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
        return f.read().decode(errors="replace")


def run_workers(args: argparse.Namespace, engine: str, command: str) -> dict:
    """Fuzz in ``args.workers`` processes of this script (at most one per input), worker ``i`` with seed
    ``args.seed + i`` and an even share of the inputs, one OpenMP thread each unless ``OMP_NUM_THREADS`` is set,
    its JSON result and output in a temporary folder. Prints a merged summary line whenever the workers' inputs
    advance; returns the merged result (:func:`merge`) once all ended. Kills workers left running by an error."""
    n = min(args.workers, args.inputs)
    folder = Path(tempfile.mkdtemp(prefix="tqvec-fuzz-workers-"))
    runs = [WorkerRun(args.seed + i, args.inputs // n + (i < args.inputs % n), folder / f"worker-{i}.json",
                      folder / f"worker-{i}.log") for i in range(n)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    processes: list[subprocess.Popen] = []
    start = time.perf_counter()
    try:
        for run in runs:
            with run.log.open("wb") as log:
                processes.append(subprocess.Popen(
                    [sys.executable, "-m", "tqvec.bench.fuzz_load", "--inputs", str(run.inputs), "--engine", engine,
                     "--slow", str(args.slow), "--seed", str(run.seed), "--out", str(run.out),
                     "--report-every", str(WORKER_REPORT_EVERY)], stdout=log, stderr=subprocess.STDOUT, env=env))
        shown = 0
        while True:
            for run, process in zip(runs, processes):
                run.returncode = process.poll()  # before the result, so an ended worker's result is its last
                run.result = _read_result(run.out)
            running = [process for process in processes if process.returncode is None]
            if not running:
                break
            progress = merge(runs, engine, command, time.perf_counter() - start)
            if progress["inputs"] != shown:
                shown = progress["inputs"]
                print(_summary(progress), flush=True)
            try:
                running[0].wait(POLL_S)
            except subprocess.TimeoutExpired:
                pass
        for run in runs:
            if run.failed:
                run.log_tail = _tail(run.log)
        return merge(runs, engine, command, time.perf_counter() - start)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _summary(result: dict) -> str:
    return json.dumps({k: v for k, v in result.items() if k != "findings"})


def _markdown(result: dict, requested: int) -> str:
    """The one-paragraph ``fuzz_load.md`` of ``result`` (a run of ``requested`` inputs)."""
    seeds, workers = result["seeds"], result["workers"]
    how = f"{workers} worker processes, seeds {seeds[0]}–{seeds[-1]}" if workers > 1 else f"seed {seeds[0]}"
    state = "" if result["finished"] else f" (stopped early: {result['inputs']} of {requested} inputs)"
    kinds = "exceptions other than `StorageError`, " + (
        "inputs slower than the limit, or workers that ended without a result" if workers > 1 else
        "or inputs slower than the limit")
    return (f"# Fuzzing `Index.load` / `IVFIndex.load`\n\n`{result['command']}` ({result['engine']}, Python "
            f"{result['python']}, {how}){state}: {result['inputs']} inputs in {result['seconds']:.0f} s, "
            f"{result['loaded']} loads succeeded (each then searched and saved), slowest input "
            f"{result['slowest_input_s']:.3f} s, **{result['n_findings']} findings** ({kinds}).\n")


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it: a reader never sees the file half written."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(text)
    os.replace(temp, path)


def publish(result: dict, args: argparse.Namespace) -> None:
    """Print ``result``'s summary line and first ten findings; unless ``--no-write``, write it: as JSON to ``--out``
    if given, else to ``bench/results/fuzz_load.json`` with the paragraph ``fuzz_load.md`` beside it."""
    print(_summary(result), flush=True)
    for finding in result["findings"][:10]:
        print(finding)
    if args.no_write:
        return
    if args.out is not None:
        _replace(args.out, json.dumps(result, indent=1) + "\n")
        return
    RESULTS.mkdir(exist_ok=True)
    _replace(RESULTS / "fuzz_load.json", json.dumps(result, indent=1) + "\n")
    _replace(RESULTS / "fuzz_load.md", _markdown(result, args.inputs))


def run_here(args: argparse.Namespace, engine: str, command: str) -> dict:
    """Fuzz in this process, publishing (:func:`publish`) the result every ``--report-every`` inputs and at the end;
    return it. With atheris this never returns: the last input publishes the result and exits (:class:`Target`)."""
    folder = Path(tempfile.mkdtemp(prefix="tqvec-fuzz-"))

    def report(target: Target, final: bool) -> None:
        publish(target_result(target, engine, command, args.seed, final), args)

    target = Target(folder, args.slow, report, every=args.report_every, last=args.inputs if engine == "atheris" else 0)
    try:
        {"atheris": run_atheris, "hypothesis": run_hypothesis, "random": run_random}[engine](target, args.inputs, args.seed)
        result = target_result(target, engine, command, args.seed, True)
        publish(result, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """Fuzz as the command line says (module docstring); 1 if there were findings, else 0."""
    parser = argparse.ArgumentParser(prog="tqvec bench fuzz-load", description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--engine", choices=("auto", "atheris", "hypothesis", "random"), default="auto")
    parser.add_argument("--slow", type=float, default=1.0, help="seconds per input that count as a finding")
    parser.add_argument("--seed", type=int, default=1, help="the engine's seed; worker i gets seed + i")
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the inputs (at most one per core)")
    parser.add_argument("--out", type=Path, help="write the JSON result here (no markdown) instead of bench/results/")
    parser.add_argument("--report-every", type=int, default=5000,
                        help="inputs between progress lines and result writes of one process (0: only at the end)")
    parser.add_argument("--no-write", action="store_true", help="write no result file")
    args = parser.parse_args(argv)
    if args.inputs < 1 or args.workers < 1 or args.report_every < 0:
        parser.error("--inputs and --workers must be at least 1, --report-every at least 0")
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if importlib.util.find_spec("atheris") is not None else "hypothesis"
    command = "python -m tqvec.bench.fuzz_load " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.workers == 1:
        result = run_here(args, engine, command)
    else:
        result = run_workers(args, engine, command)
        publish(result, args)
    return 1 if result["n_findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
