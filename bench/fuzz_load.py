"""Fuzz ``Index.load`` / ``IVFIndex.load``: any input file may raise ``StorageError`` and nothing else.

Each fuzzer input (bytes) becomes one file, derived from a few small valid index files (:func:`seed_files`)
by one of four mutations (:func:`derive`): the input bytes as the whole file; byte overwrites; an edit of the
JSON header (a meta field or an array-table field set to an awkward value); an overwrite of array payload
values with awkward bit patterns (NaN, ±Inf, huge, negative). All but the first recompute the trailing
SHA-256, as an attacker would, so the checks behind the checksum are the ones exercised. Every file is loaded
by both index classes; a file that loads is then searched once and saved again. Any other exception, or one
input taking more than ``--slow`` seconds, is a finding.

Engines: ``atheris`` (coverage-guided, libFuzzer) when it is installed, else ``hypothesis`` over bytes, or
``random`` (seeded bytes, the CI smoke test's engine). Results go to ``bench/results/fuzz_load.{json,md}``.

    python -m tqvec.bench.fuzz_load --inputs 100000            # atheris if installed, else hypothesis
    python -m tqvec.bench.fuzz_load --inputs 2000 --engine random --no-write
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tqvec import storage
from tqvec.index import Index
from tqvec.ivf import IVFIndex

RESULTS = Path(__file__).resolve().parent / "results"
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

    def __init__(self, folder: Path, slow: float = 1.0, report: Callable[[Target], None] | None = None,
                 every: int = 0, last: int = 0) -> None:
        """``report(self)`` runs every ``every`` inputs and at input ``last`` (then the process exits: atheris)."""
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
            self.report(self)
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


def run_hypothesis(target: Target, inputs: int) -> None:
    from hypothesis import HealthCheck, given, settings  # noqa: PLC0415
    from hypothesis import strategies as st

    @settings(max_examples=inputs, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.binary(min_size=3, max_size=400))
    def one(fuzz: bytes) -> None:
        target(fuzz)

    one()


def run_atheris(target: Target, inputs: int) -> None:
    import atheris  # noqa: PLC0415

    from tqvec import index as index_module  # noqa: PLC0415
    from tqvec import ivf as ivf_module
    from tqvec import validation

    # coverage feedback from the code under test (not torch/numpy: instrumenting those would crawl)
    for module in (storage, validation):
        for value in vars(module).values():
            if callable(value) and getattr(value, "__module__", None) == module.__name__ and hasattr(value, "__code__"):
                atheris.instrument_func(value)
    for func in (derive, index_module._check_file, ivf_module._check_file, index_module.check_rows,
                 Index.load.__func__, IVFIndex.load.__func__):
        atheris.instrument_func(func)
    atheris.Setup([sys.argv[0], f"-runs={inputs + 1}", "-seed=1", "-max_len=400", "-len_control=0"], target)
    atheris.Fuzz()  # libFuzzer exits the process when done: Target.__call__ reports at its input number `inputs`


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--engine", choices=("auto", "atheris", "hypothesis", "random"), default="auto")
    parser.add_argument("--slow", type=float, default=1.0, help="seconds per input that count as a finding")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/results/fuzz_load.*")
    args = parser.parse_args(argv)
    engine = args.engine
    if engine == "auto":
        try:
            import atheris  # noqa: F401, PLC0415
            engine = "atheris"
        except ImportError:
            engine = "hypothesis"
    command = "python -m tqvec.bench.fuzz_load " + " ".join(argv if argv is not None else sys.argv[1:])

    def report(target: Target) -> None:
        seconds = time.perf_counter() - target.start
        result = {"engine": engine, "inputs": target.inputs, "loaded": target.loaded, "seconds": round(seconds, 1),
                  "slowest_input_s": round(target.slowest, 3), "n_findings": len(target.findings),
                  "findings": target.findings[:50], "python": platform.python_version(), "command": command,
                  "finished": target.inputs >= args.inputs}
        print(json.dumps({k: v for k, v in result.items() if k != "findings"}), flush=True)
        for f in target.findings[:10]:
            print(f)
        if args.no_write:
            return
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fuzz_load.json").write_text(json.dumps(result, indent=1) + "\n")
        state = "" if result["finished"] else f" (stopped early: {target.inputs} of {args.inputs} inputs)"
        (RESULTS / "fuzz_load.md").write_text(
            f"# Fuzzing `Index.load` / `IVFIndex.load`\n\n`{command}` ({engine}, Python {result['python']}){state}:"
            f" {target.inputs} inputs in {seconds:.0f} s, {target.loaded} loads succeeded (each then searched and "
            f"saved), slowest input {target.slowest:.3f} s, **{len(target.findings)} findings** (exceptions other "
            "than `StorageError`, or inputs slower than the limit).\n")

    folder = Path(tempfile.mkdtemp(prefix="tqvec-fuzz-"))
    target = Target(folder, args.slow, report, every=5000, last=args.inputs if engine == "atheris" else 0)
    try:
        {"atheris": run_atheris, "hypothesis": run_hypothesis, "random": run_random}[engine](target, args.inputs)
        report(target)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if target.findings else 0


if __name__ == "__main__":
    sys.exit(main())
