"""Issue 20: what a careless or hostile caller finds. One regression test (or group) per item of the issue.

Crafted files are built with the public save path (``Index.save`` / ``storage.save_arrays``) plus edits of the
header and arrays, so every one carries a valid SHA-256: the checks under test are the ones behind the checksum.
Each must raise ``StorageError`` within 1 s and 100 MB (peak RSS growth, measured with Linux's resettable
high-water mark ``VmHWM``).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import tqvec
from tqvec import Index, storage
from tqvec._rows import search_results
from tqvec.bench._memory import reset_peak, status_kib
from tqvec.ivf import IVFIndex
from tqvec.storage import StorageError

DIM = 32
MAX_ID = 2**63 - 2  # the documented id range is [0, 2**63 - 2] (tqvec.validation.MAX_ID)
MAX_SQUARED_NORM = 2.0**120  # the documented input limit (tqvec.validation.MAX_SQUARED_NORM)


def _gaussian(n: int, seed: int = 0, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


# ------------------------------------------------------------------------------ 1: huge finite vectors
@pytest.mark.parametrize("make", [lambda: Index(DIM, 4, "l2"), lambda: IVFIndex(DIM, 4, 4, "l2")])
def test_vectors_whose_squared_norm_overflows_are_rejected(make) -> None:
    index = make()
    x = np.concatenate([_gaussian(2000), np.full((2, DIM), 1e20, np.float32)])
    with pytest.raises(ValueError, match=r"x row 2000 has squared L2 norm"):
        index.add(x)
    assert len(index) == 0  # nothing half-added
    with pytest.raises(ValueError, match=r"queries row 0 has squared L2 norm"):
        Index(DIM, 4, "l2").search(np.full((1, DIM), 1e20, np.float32), 1)


def test_large_but_admissible_vectors_never_rank_nan_first() -> None:
    """Entries of 1e17 (squared norm 3.2e35, inside MAX_SQUARED_NORM) are kept, and Gaussian queries never get
    them first, nor a NaN distance (the issue: 51 of 100 queries got one of them, D = nan, at 1e20)."""
    index = Index(DIM, 4, "l2")
    big = np.full((2, DIM), 1e17, np.float32)
    assert float((big.astype(np.float64) ** 2).sum(1).max()) <= MAX_SQUARED_NORM
    index.add(np.concatenate([_gaussian(2000), big]))
    D, I = index.search(_gaussian(100, seed=1), 10)
    assert np.isfinite(D).all()
    assert not np.isin(I[:, 0], [2000, 2001]).any()


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_search_results_never_put_nan_first(metric: str) -> None:
    scores = torch.tensor([[float("nan"), 3.0, 2.0, float("-inf")], [1.0, float("nan"), 0.5, 0.25]])
    rows = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6]])
    ids = np.arange(100, 107)
    D, I = search_results(metric, torch.zeros(2, 3), scores, rows, ids)
    assert not np.isnan(D[:, 0]).any()
    assert I.tolist() == [[101, 102, -1, 100], [103, 105, 106, 104]]  # NaN last, the rest in order
    assert np.isnan(D[:, -1]).all()


# ------------------------------------------------------------------------------ 2: requires_grad input
@pytest.mark.filterwarnings("ignore:correction='center' freezes its center:UserWarning")  # a few rows on purpose
def test_input_that_requires_grad_is_detached() -> None:
    index = Index(DIM, 4, "ip", correction="center")
    ids = index.add(torch.randn(1, DIM, requires_grad=True))
    index.add(torch.randn(3, DIM, dtype=torch.float64, requires_grad=True))
    index.search(torch.randn(2, DIM, requires_grad=True), 2)
    index.score(np.ones((1, DIM), np.float32), ids)
    assert index.reconstruct(ids).shape == (1, DIM)
    assert index.center is not None
    ivf = IVFIndex(DIM, 2, 4)
    ivf.train(torch.randn(100, DIM, requires_grad=True))
    ivf.add(torch.randn(5, DIM, requires_grad=True))
    assert ivf.reconstruct([0]).shape == (1, DIM)


@pytest.mark.filterwarnings("ignore:correction='center' freezes its center:UserWarning")  # a few rows on purpose
def test_requires_grad_index_saves(tmp_path: Path) -> None:
    index = Index(DIM, 4, "ip", correction="center")
    index.add(torch.randn(4, DIM, requires_grad=True))
    index.save(tmp_path / "a.tqv")
    assert len(Index.load(tmp_path / "a.tqv")) == 4


# ------------------------------------------------------------------------------ 4: id range
@pytest.mark.parametrize("ids", [[2**63], np.array([2**64 - 1], np.uint64), [-1], [-5], np.array([-1], np.int8),
                                 [2**63 - 1], [2**70], [3, 2**64]])
@pytest.mark.parametrize("cls", [Index, IVFIndex])
def test_ids_outside_the_range_are_rejected(cls, ids) -> None:
    index = Index(DIM, 4) if cls is Index else IVFIndex(DIM, 1, 4)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 9223372036854775806\]"):
        index.add(_gaussian(len(ids)), ids=ids)  # ids are checked before anything else (IVF: before training)


def test_largest_id_then_automatic_ids_raise_clearly() -> None:
    index = Index(DIM, 4)
    assert index.add(_gaussian(1), ids=[MAX_ID]).tolist() == [MAX_ID]
    with pytest.raises(ValueError, match="automatic ids are used up"):
        index.add(_gaussian(1))
    assert len(index) == 1
    D, I = index.search(_gaussian(1), 3)
    assert I.tolist() == [[MAX_ID, -1, -1]]


# ------------------------------------------------------------------------------ 3: crafted files, valid checksum
def _saved_index(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.tqv"
    if kind == "flat":
        index = Index(DIM, 4, "l2", correction="center")
        index.add(_gaussian(200))
    elif kind == "ivf":
        index = IVFIndex(DIM, 4, 4, "l2")
        index.add(_gaussian(200))
    else:  # ivf-direct: stores a center
        index = IVFIndex(DIM, 4, 4, "ip", encoding="direct", correction="center")
        index.add(_gaussian(200))
    index.save(path)
    return path


def _edit(path: Path, meta: Callable[[dict], None] | None = None,
          arrays: Callable[[dict], None] | None = None) -> None:
    """Rewrite ``path`` through the public save path with its header ``meta`` and ``arrays`` edited in place."""
    kind = "tqvec.Index" if path.name.startswith("flat") else "tqvec.IVFIndex"
    m, a = storage.load_arrays(path, kind)
    if meta:
        meta(m)
    if arrays:
        arrays(a)
    storage.save_arrays(path, kind, m, a)


def _set(d: dict, key: str, value) -> None:
    d[key] = value


def _nan_at(a: dict, name: str, value: float = np.nan) -> None:
    a[name] = a[name].copy()
    a[name].reshape(-1)[3] = value


CRAFTED = {  # name: (file, meta edit, arrays edit)
    "dim 8000": ("flat", lambda m: _set(m, "dim", 8000), None),
    "dim 20000": ("flat", lambda m: _set(m, "dim", 20000), None),
    "dim 0": ("flat", lambda m: _set(m, "dim", 0), None),
    "dim true": ("flat", lambda m: _set(m, "dim", True), None),
    "dim float": ("flat", lambda m: _set(m, "dim", 32.0), None),
    "bits 8": ("flat", lambda m: _set(m, "bits", 8), None),
    "bits string": ("flat", lambda m: _set(m, "bits", "4"), None),
    "metric unknown": ("flat", lambda m: _set(m, "metric", "hamming"), None),
    "seed 2**64": ("flat", lambda m: _set(m, "seed", 2**64), None),
    "seed negative": ("flat", lambda m: _set(m, "seed", -1), None),
    "no next_id": ("flat", lambda m: m.pop("next_id"), None),
    "no center_pending": ("flat", lambda m: m.pop("center_pending"), None),
    "next_id string": ("flat", lambda m: _set(m, "next_id", "5"), None),
    "next_id below ids": ("flat", lambda m: _set(m, "next_id", 10), None),
    "next_id 2**64": ("flat", lambda m: _set(m, "next_id", 2**64), None),
    "center_pending int": ("flat", lambda m: _set(m, "center_pending", 1), None),
    "center_pending with rows": ("flat", lambda m: _set(m, "center_pending", True), None),
    "tail_bits": ("flat", lambda m: _set(m, "tail_bits", 3), None),
    "NaN scale": ("flat", None, lambda a: _nan_at(a, "scale")),
    "Inf bias": ("flat", None, lambda a: _nan_at(a, "bias", np.inf)),
    "huge scale": ("flat", None, lambda a: _nan_at(a, "scale", 1e30)),
    "NaN center": ("flat", None, lambda a: _nan_at(a, "center")),
    "huge center": ("flat", None, lambda a: _nan_at(a, "center", 1e30)),
    "no center": ("flat", None, lambda a: a.pop("center")),
    "center shape": ("flat", None, lambda a: _set(a, "center", a["center"][:-1])),
    "float ids": ("flat", None, lambda a: _set(a, "ids", a["ids"].astype(np.float64) + 0.5)),
    "uint64 ids": ("flat", None, lambda a: _set(a, "ids", np.full(200, 2**64 - 1, np.uint64))),
    "negative id": ("flat", None, lambda a: _nan_at(a, "ids", -1)),
    "duplicate ids": ("flat", None, lambda a: _set(a, "ids", np.zeros(200, np.int64))),
    "int32 ids": ("flat", None, lambda a: _set(a, "ids", a["ids"].astype(np.int32))),
    "ids 2-D": ("flat", None, lambda a: _set(a, "ids", a["ids"].reshape(100, 2))),
    "packed int8": ("flat", None, lambda a: _set(a, "packed", a["packed"].view(np.int8))),
    "packed narrow": ("flat", None, lambda a: _set(a, "packed", a["packed"][:, :-1].copy())),
    "packed short": ("flat", None, lambda a: _set(a, "packed", a["packed"][:-1].copy())),
    "extra array": ("flat", None, lambda a: _set(a, "qjl", np.zeros((200, 4), np.uint8))),
    "missing scale": ("flat", None, lambda a: a.pop("scale")),
    "no ids": ("flat", None, lambda a: a.pop("ids")),
    "ivf nlist 10**9": ("ivf", lambda m: _set(m, "nlist", 10**9), None),
    "ivf dim 8000": ("ivf", lambda m: _set(m, "dim", 8000), None),
    "ivf nprobe 0": ("ivf", lambda m: _set(m, "nprobe", 0), None),
    "ivf NaN centroid": ("ivf", None, lambda a: _nan_at(a, "centroids")),
    "ivf huge centroid": ("ivf", None, lambda a: _nan_at(a, "centroids", 3e38)),
    "ivf float lists": ("ivf", None, lambda a: _set(a, "lists", a["lists"].astype(np.float32) + 0.5)),
    "ivf int64 lists": ("ivf", None, lambda a: _set(a, "lists", a["lists"].astype(np.int64))),
    "ivf list past nlist": ("ivf", None, lambda a: _nan_at(a, "lists", 4)),
    "ivf negative list": ("ivf", None, lambda a: _nan_at(a, "lists", -1)),
    "ivf no centroids": ("ivf", None, lambda a: a.pop("centroids")),
    "ivf centroids shape": ("ivf", None, lambda a: _set(a, "centroids", a["centroids"][:3].copy())),
    "ivf uint64 ids": ("ivf", None, lambda a: _set(a, "ids", a["ids"].astype(np.uint64))),
    "ivf stray center": ("ivf", None, lambda a: _set(a, "center", np.zeros(DIM, np.float32))),
    "ivf-direct NaN center": ("ivf-direct", None, lambda a: _nan_at(a, "center")),
    "ivf-direct no next_id": ("ivf-direct", lambda m: m.pop("next_id"), None),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_file_with_valid_checksum_raises_storage_error_fast(tmp_path: Path, case: str) -> None:
    kind, meta, arrays = CRAFTED[case]
    path = _saved_index(tmp_path, kind)
    _edit(path, meta, arrays)
    cls = Index if kind == "flat" else IVFIndex
    measured = reset_peak()
    before = status_kib("VmRSS") if measured else 0
    start = time.perf_counter()
    with pytest.raises(StorageError):
        cls.load(path)
    elapsed = time.perf_counter() - start
    grown_mb = (status_kib("VmHWM") - before) / 1024 if measured else 0.0
    assert elapsed < 1.0, f"{case}: {elapsed:.2f} s"
    assert grown_mb < 100, f"{case}: peak RSS grew {grown_mb:.0f} MB"


@pytest.mark.parametrize("kind", ["flat", "ivf", "ivf-direct"])
def test_unedited_files_still_load(tmp_path: Path, kind: str) -> None:
    """The control: the files the crafted cases start from load, and rewriting them unchanged keeps them loadable."""
    path = _saved_index(tmp_path, kind)
    _edit(path)
    cls = Index if kind == "flat" else IVFIndex
    assert len(cls.load(path)) == 200 and len(cls.load(path, mmap=True)) == 200


def _forge_entry_shape(path: Path, name: str, shape: list[int]) -> None:
    """Give array ``name`` the zero-size ``shape`` (nbytes 0) in ``path``'s header; recompute the checksum."""
    data = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", data, 16)
    header = json.loads(data[24:24 + header_len])
    old_start = -(-(24 + header_len) // 64) * 64
    payload = data[old_start:-32]
    for e in header["arrays"]:
        if e["name"] == name:
            e.update(shape=shape, nbytes=0)
    body = json.dumps(header).encode()
    head = struct.pack("<8sIIQ", storage.MAGIC, storage.VERSION, 0, len(body)) + body
    head += bytes(-len(head) % 64)
    path.write_bytes(head + payload + hashlib.sha256(head + payload).digest())


@pytest.mark.parametrize("shape", [[0, 2**61], [0] * 40, [0, 2**40, 2**40]])
def test_zero_size_arrays_with_absurd_shapes(tmp_path: Path, shape: list[int]) -> None:
    path = _saved_index(tmp_path, "flat")
    _forge_entry_shape(path, "packed", shape)
    with pytest.raises(StorageError):
        Index.load(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize("opener", ["Index.load", "tqvec.load", "tqvec.load of a manifest"])
def test_fifo_path_raises_instead_of_hanging(tmp_path: Path, opener: str) -> None:
    if opener == "tqvec.load of a manifest":  # a sharded index's directory whose manifest.json is a FIFO
        fifo = tmp_path / "shards" / "manifest.json"
        fifo.parent.mkdir()
        target, load_path = tqvec.load, fifo.parent
    else:
        fifo = tmp_path / "index.tqv"
        target, load_path = (Index.load if opener == "Index.load" else tqvec.load), fifo
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            target(load_path)
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - reported below
            outcome.append(err)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(5)
    if worker.is_alive():  # unblock the old code's open() so the thread ends
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(5)
        pytest.fail(f"{opener} blocked on a FIFO")
    assert isinstance(outcome[0], StorageError) and "not a regular file" in str(outcome[0])


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_loading_onto_a_missing_device_blames_the_device_not_the_file(tmp_path: Path, kind: str) -> None:
    path = _saved_index(tmp_path, kind)
    for load in ((Index if kind == "flat" else IVFIndex).load, tqvec.load):
        with pytest.raises(ValueError, match=r"device 'cuda:99' is not available here") as caught:
            load(path, device="cuda:99")
        assert not isinstance(caught.value, StorageError)


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_saving_into_a_missing_directory_names_the_target_and_leaves_nothing(tmp_path: Path, kind: str) -> None:
    index = Index.load(_saved_index(tmp_path, kind)) if kind == "flat" else IVFIndex.load(_saved_index(tmp_path, kind))
    target = tmp_path / "no" / "such" / "dir" / "x.tqv"
    with pytest.raises(FileNotFoundError, match=re.escape(f"cannot save {target}: no directory {target.parent}")):
        index.save(target)
    assert not (tmp_path / "no").exists()


def test_directory_path_raises_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="not a regular file"):
        IVFIndex.load(tmp_path)


# ------------------------------------------------------------------------------ 7: temp files after a crash
def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_save_after_a_killed_save_removes_its_temp_file(tmp_path: Path) -> None:
    """A real ``kill -9`` during a save leaves ``.a.tqv.<hex>.tmp``; the next save to ``a.tqv`` deletes it (the issue:
    200 kills left 134 files)."""
    target = tmp_path / "a.tqv"
    code = ("import os, signal, sys\nfrom tqvec import storage\n"
            "def write(f):\n    f.write(b'x' * 100000)\n    f.flush()\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            "storage.write_atomic(sys.argv[1], write)\n")
    for _ in range(2):  # each killed save first removes the temp file of the one killed before it
        done = subprocess.run([sys.executable, "-c", code, str(target)], timeout=60)
        assert done.returncode == -signal.SIGKILL
        assert len(_temps(tmp_path)) == 1 and not target.exists()
    index = Index(DIM, 4)
    index.add(_gaussian(10))
    index.save(target)
    assert _temps(tmp_path) == [] and len(Index.load(target)) == 10


def test_cleanup_spares_live_writers_and_other_files(tmp_path: Path) -> None:
    target = tmp_path / "a.tqv"
    stale = tmp_path / ".a.tqv.0123456789ab.tmp"
    live = tmp_path / ".a.tqv.ba9876543210.tmp"
    other = [tmp_path / ".b.tqv.0123456789ab.tmp", tmp_path / ".a.tqv.0123.tmp", tmp_path / "a.tqv.0123456789ab.tmp"]
    for p in (stale, live, *other):
        p.write_bytes(b"old")
    linked = tmp_path / ".a.tqv.aaaaaaaaaaaa.tmp"
    linked.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(b"keep")
    import fcntl

    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a writer still at work (another open file description)
        storage.save_arrays(target, "k", {}, {"a": np.arange(3)})
        names = set(_temps(tmp_path))
    assert stale.name not in names and live.name in names
    assert all(p.exists() for p in other) and linked.is_symlink() and (tmp_path / "elsewhere").read_bytes() == b"keep"
    assert storage.remove_stale_temps(target) == 1  # the live writer is gone now
    assert not live.exists()


def test_concurrent_saves_never_lose_their_temp_file(tmp_path: Path) -> None:
    """Writers that clean up before each save never delete one another's temp file in flight."""
    target = tmp_path / "a.tqv"
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        try:
            for i in range(15):
                storage.save_arrays(target, "k", {"i": i}, {"a": np.full(20000, seed, np.int64)})
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and _temps(tmp_path) == []
    storage.load_arrays(target, "k")


# ------------------------------------------------------------------------------ 5: IVF memory bounded
def test_assignment_scores_are_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Assigning 4096 rows to 2048 lists never holds more than 2**22 scores (16 MiB) at once; the answer equals
    the unblocked one."""
    import tqvec.kmeans as kmeans

    real, seen = kmeans.rowwise_matmul, []

    def spy(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        assert x.shape[0] * m.shape[1] <= 1 << 22, f"{x.shape[0]} x {m.shape[1]} scores at once"
        seen.append(x.shape[0])
        return real(x, m)

    x, centroids = torch.from_numpy(_gaussian(4096, dim=8)), torch.from_numpy(_gaussian(2048, seed=1, dim=8))
    monkeypatch.setattr(kmeans, "rowwise_matmul", spy)
    lists = kmeans.assign_nearest(x, centroids, by_ip=False)
    assert len(seen) > 1
    expected = torch.cdist(x.double(), centroids.double()).argmin(1)
    assert (lists == expected).float().mean() > 0.999  # float32 ties aside


@pytest.mark.parametrize("encoding", ["residual", "direct"])
def test_torch_path_probing_is_blocked(encoding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch search path picks each query's lists from blocks of at most PROBE_BLOCK_SCORES coarse scores
    (never nq x nlist at once: +1.5 GiB at nq = 10k, nlist 8192), and the answer equals the native path's."""
    import tqvec._ivf_search as ivf_search
    from tqvec import _fastscan

    index = IVFIndex(DIM, 64, 4, "l2", encoding=encoding, nprobe=8)
    index.add(_gaussian(64 * 40))
    queries = _gaussian(300, seed=1)
    expected = index.search(queries, 10)
    monkeypatch.setattr(ivf_search, "PROBE_BLOCK_SCORES", 64 * 32)
    real_sort, sorted_scores = torch.sort, []

    def spy(x: torch.Tensor, *args, **kwargs):
        sorted_scores.append(x.numel())
        return real_sort(x, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", spy)
    _fastscan.set_cpu_kernel("torch")
    try:
        D, I = index.search(queries, 10)
    finally:
        _fastscan.set_cpu_kernel("auto")
    assert len(sorted_scores) == 10 and max(sorted_scores) <= 64 * 32
    assert (I == expected[1]).mean() > 0.99 and np.allclose(D, expected[0], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ 8: absurd k
@pytest.mark.parametrize("cls", [Index, IVFIndex])
def test_k_beyond_ntotal_costs_only_the_padding(cls, monkeypatch: pytest.MonkeyPatch) -> None:
    import tqvec.scan as scan

    index = Index(DIM, 4) if cls is Index else IVFIndex(DIM, 1, 4)
    index.add(_gaussian(50))
    real = scan.search

    def spy(queries, block, table, k, projected=None):
        assert k <= 50, f"the scan was asked for k={k} on 50 vectors"
        return real(queries, block, table, k, projected)

    monkeypatch.setattr(scan, "search", spy)
    D, I = index.search(_gaussian(2, seed=1), 10**7)
    assert D.shape == (2, 10**7) and (I[:, 50:] == -1).all() and (I[:, :50] >= 0).all()


@pytest.mark.parametrize("metric, fill", [("l2", np.inf), ("ip", -np.inf)])
def test_search_results_pad_to_k(metric: str, fill: float) -> None:
    D, I = search_results(metric, torch.zeros(1, 3), torch.tensor([[2.0, 1.0]]), torch.tensor([[1, 0]]),
                          np.array([7, 9]), k=5)
    assert I.tolist() == [[9, 7, -1, -1, -1]] and D.dtype == np.float32 and (D[0, 2:] == fill).all()


# ------------------------------------------------------------------------------ 10: smaller ones
def test_seed_out_of_range_names_the_seed() -> None:
    for seed in (2**64, -1, 1.5):
        with pytest.raises(ValueError, match="seed must be an integer"):
            Index(DIM, 4, seed=seed)
        with pytest.raises(ValueError, match="seed must be an integer"):
            IVFIndex(DIM, 4, 4, seed=seed)


def test_unavailable_device_names_the_device() -> None:
    with pytest.raises(ValueError, match="device 'cuda:99' is not available"):
        Index(DIM, 4, device="cuda:99")
    with pytest.raises(ValueError, match="device"):
        IVFIndex(DIM, 4, 4, device="tpu")


def test_longdouble_input_is_accepted() -> None:
    x = _gaussian(5).astype(np.longdouble)
    index = Index(DIM, 4)
    index.add(x)
    assert index.search(x, 1)[1][:, 0].tolist() == list(range(5))


# ------------------------------------------------------------------------------ fuzz target, short version
def test_fuzz_load_short(tmp_path: Path) -> None:
    """400 seeded inputs of ``tqvec.bench.fuzz_load`` (the bench script runs 100,000): only ``StorageError``."""
    from tqvec.bench.fuzz_load import Target, run_random

    target = Target(tmp_path, slow=5.0)
    run_random(target, 400, seed=20)
    assert target.inputs == 400 and target.findings == []
    assert target.loaded > 0  # some mutations keep the file valid: the "loaded, then used" path runs too


def test_fuzz_load_instrumented_functions_exist() -> None:
    """The atheris engine's instrumentation list resolves (its names are looked up without atheris, so a refactor
    that moves one fails here) and covers the file checks, each function once."""
    from tqvec import _file_checks, _rows
    from tqvec.bench.fuzz_load import instrumented_functions

    funcs = instrumented_functions()
    assert len(funcs) == len(set(funcs)) and all(hasattr(f, "__code__") for f in funcs)
    assert {_file_checks.check_index_file, _file_checks.check_ivf_file, _rows.check_rows} <= set(funcs)


def test_fuzz_load_merges_workers(tmp_path: Path) -> None:
    """A parallel run's result: workers' counts summed, and a worker that ended with no result is a finding."""
    from tqvec.bench.fuzz_load import WorkerRun, merge

    done = {"inputs": 50, "loaded": 7, "slowest_input_s": 0.2, "n_findings": 0, "findings": [], "finished": True}
    runs = [WorkerRun(1, 50, tmp_path / "w0.json", tmp_path / "w0.log", returncode=0, result=done),
            WorkerRun(2, 50, tmp_path / "w1.json", tmp_path / "w1.log", returncode=-9, log_tail="Killed")]
    merged = merge(runs, "random", "python -m tqvec.bench.fuzz_load", 12.34)
    assert (merged["inputs"], merged["loaded"], merged["seconds"], merged["seeds"]) == (50, 7, 12.3, [1, 2])
    assert not merged["finished"] and merged["n_findings"] == 1
    assert merged["findings"][0] == {"stage": "worker", "seed": 2, "returncode": -9, "log_tail": "Killed"}
