"""Issue 7: ShardedIndex on a local Ray cluster (2 CPUs, started here) and the Ray Data bulk build.

Shard actors take seconds to start on this machine (each imports torch), so the tests share a few
indexes: each test still checks one behaviour and fails on its own.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import filelock
import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # starts a Ray cluster and its actors
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tqvec import storage  # noqa: E402
from tqvec.distributed import (  # noqa: E402
    LOCK, MANIFEST, IndexSettings, ShardError, ShardedIndex, build_shards, merge_topk, read_manifest, shard_of,
    splitmix64)
from tqvec.distributed.manifest import try_remove_stale  # noqa: E402
from tqvec.index import Index  # noqa: E402

DIM, N, NQ, K = 48, 1500, 25, 10
SAVED_SHARDS = 2
#: seconds a test lets shard actors start (each imports torch: 13-21 s here at a load average of 20 on 2 cores)
START_TIMEOUT = 120


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clustered vectors (n, DIM), queries (NQ, DIM) and shuffled, sparse int64 ids (n,)."""
    rng = np.random.default_rng(7)
    centers = rng.standard_normal((20, DIM)) * 3
    x = (centers[rng.integers(0, 20, N)] + rng.standard_normal((N, DIM))).astype(np.float32)
    q = (centers[rng.integers(0, 20, NQ)] + rng.standard_normal((NQ, DIM))).astype(np.float32)
    ids = rng.choice(10**12, size=N, replace=False).astype(np.int64)
    return x, q, ids


# ------------------------------------------------------------------------------- pure functions


def test_splitmix64_reference_values():
    # SplitMix64 outputs for seeds 0 and 1 (Vigna's reference: state += golden gamma, then the finalizer)
    assert splitmix64(np.array([0, 1]))[0] == np.uint64(0xE220A8397B1DCDAF)
    assert splitmix64(np.array([-1]))[0] == splitmix64(np.array([2**64 - 1], np.uint64).view(np.int64))[0]
    shards = shard_of(np.arange(40_000), 4)
    assert np.bincount(shards).min() > 9_500  # balanced for consecutive ids
    assert (shard_of(np.arange(10), 4, "round_robin") == np.arange(10) % 4).all()


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_merge_topk_direction_and_padding(metric):
    pad = -np.inf if metric == "ip" else np.inf
    good, worse, worst = (5.0, 3.0, 1.0) if metric == "ip" else (1.0, 3.0, 5.0)  # per shard: best first
    a = (np.array([[good, worst, pad]], np.float32), np.array([[10, 11, -1]]))
    b = (np.array([[worse, pad, pad]], np.float32), np.array([[20, -1, -1]]))
    D, I = merge_topk([a, b], 4, metric, nq=1)
    assert I.tolist() == [[10, 20, 11, -1]]
    assert D[0, 3] == pad and D.dtype == np.float32
    D, I = merge_topk([], 2, metric, nq=3)  # no shard answered
    assert (I == -1).all() and (D == pad).all()


def test_index_settings_check_resolve_and_round_trip():
    settings = IndexSettings(DIM, 3, "cosine")
    assert settings.correction == Index(DIM, 3, "cosine").correction != "auto"  # resolved as Index does
    assert settings.bits == 3.0 and IndexSettings.from_dict(settings.as_dict(), "m") == settings
    with pytest.raises(ValueError, match="metric"):
        IndexSettings(DIM, metric="dot")
    with pytest.raises(storage.StorageError, match="m: index settings must have exactly the keys"):
        IndexSettings.from_dict(dict(settings.as_dict(), extra=1), "m")
    with pytest.raises(storage.StorageError, match="m: invalid index settings .*bits"):
        IndexSettings.from_dict(dict(settings.as_dict(), bits=99), "m")
    with pytest.raises(ValueError, match="index must be IndexSettings or a callable"):
        ShardedIndex(DIM, 2)  # the old signature: a clear error, no actor started


# ------------------------------------------------------------------------------- same answers as one Index


@pytest.mark.parametrize("metric,correction,routing,n_shards",
                         [("cosine", "center", "hash", 3), ("l2", "center", "round_robin", 2)])
def test_sharded_equals_single_index(data, metric, correction, routing, n_shards):
    x, q, ids = data
    settings = IndexSettings(DIM, 3, metric, correction=correction, seed=5)
    single = settings.new_index()
    use_ids = ids if routing == "hash" else None
    with ShardedIndex(settings, n_shards, routing=routing, timeout=START_TIMEOUT) as sharded:
        for lo, hi in [(0, 900), (900, N)]:  # the first add freezes the center: same batches for both
            got = sharded.add(x[lo:hi], None if use_ids is None else use_ids[lo:hi])
            want = single.add(x[lo:hi], None if use_ids is None else use_ids[lo:hi])
            assert (got == want).all()
        assert single.correction == "center" and np.array_equal(sharded.center, single.center)
        assert len(sharded) == N and min(sharded.shard_sizes()) > 0
        D, I = sharded.search(q, K)
        D1, I1 = single.search(q, K)
        assert np.array_equal(I, I1) and np.array_equal(D, D1)  # bit-identical, not approximately
        D, I = sharded.search(q[:2], N + 5)  # k beyond the data: −1 / ∓inf padding as Index
        D1, I1 = single.search(q[:2], N + 5)
        assert np.array_equal(I, I1) and np.array_equal(D, D1)
        some = single.search(q[:1], 1)[1][0]
        assert np.array_equal(sharded.reconstruct(some), single.reconstruct(some))
        gone = I1[:, :3].ravel()
        assert sharded.remove(gone) == single.remove(gone) == len(np.unique(gone))
        D, I = sharded.search(q, K)
        D1, I1 = single.search(q, K)
        assert np.array_equal(I, I1) and np.array_equal(D, D1)
        with pytest.raises(KeyError):
            sharded.reconstruct(gone[:1])
        with pytest.raises(ValueError, match="dimension"):
            sharded.add(x[:3, :5])
        if routing == "round_robin":
            assert sharded.shard_sizes() == [int((np.setdiff1d(np.arange(N), gone) % 2 == s).sum()) for s in (0, 1)]
            with pytest.raises(ValueError, match="round_robin"):
                sharded.add(x[:3], ids[:3])
        else:
            with pytest.raises(ValueError, match="already in the index"):
                sharded.add(x[:1], ids[-1:])
    with pytest.raises(ValueError, match="routing"):
        ShardedIndex(IndexSettings(DIM), 2, routing="random")


# ------------------------------------------------------------------------------- save / load


@pytest.fixture(scope="module")
def saved(tmp_path_factory, data) -> tuple[Path, Index]:
    """A 2-shard ip/center index saved to a directory, and the single Index it must match."""
    x, _, ids = data
    directory = tmp_path_factory.mktemp("sharded")
    settings = IndexSettings(DIM, 4, "ip", correction="center", seed=2)
    single = settings.new_index()
    single.add(x[5:], ids[5:])
    single.add(x[:5], ids[:5])
    with ShardedIndex(settings, SAVED_SHARDS, timeout=START_TIMEOUT) as sharded:
        sharded.add(x[5:], ids[5:])
        sharded.save(directory)  # first save to a directory: the actors now restart from it
        sharded.add(x[:5], ids[:5])
        sharded.save(directory)  # new files, then the manifest, then the old files go
    return directory, single


def test_an_index_emptied_by_remove_keeps_its_center_across_save_and_load(data, tmp_path):
    """All rows removed, saved, reopened: the frozen center stays, so adds work as on one Index (the shards' center
    was read only from shards holding rows, and the next add froze another, which the shards refused)."""
    x, q, ids = data
    settings = IndexSettings(DIM, 4, "ip", correction="center", seed=2)
    single = settings.new_index()
    single.add(x[:500], ids[:500])
    single.remove(ids[:500])
    single.add(2 * x[500:510], ids[500:510])
    with ShardedIndex(settings, 2, timeout=START_TIMEOUT) as sharded:
        sharded.add(x[:500], ids[:500])
        sharded.remove(ids[:500])
        sharded.save(tmp_path / "emptied")  # a first save to a directory: the actors restart from its files
        sharded.add(2 * x[500:510], ids[500:510])
        assert np.array_equal(sharded.center, single.center)
        D, I = sharded.search(q, K)
    D1, I1 = single.search(q, K)
    assert np.array_equal(D, D1) and np.array_equal(I, I1)
    with ShardedIndex.load(tmp_path / "emptied", timeout=START_TIMEOUT) as reopened:
        assert np.array_equal(reopened.center, single.center)
        reopened.add(2 * x[500:510], ids[500:510])
        assert len(reopened) == 10


def test_a_center_frozen_from_a_small_first_add_warns_as_on_one_index(data):
    x, _, ids = data
    with ShardedIndex(IndexSettings(DIM, 4, "ip", correction="center"), 2, timeout=START_TIMEOUT) as sharded:
        with pytest.warns(UserWarning, match=r"freezes its center from 3 row\(s\)") as caught:
            sharded.add(x[:3], ids[:3])
    assert caught[0].filename == __file__


def test_a_closed_index_refuses_calls_and_says_so(data, tmp_path):
    x, q, ids = data
    with ShardedIndex(IndexSettings(DIM, 4, "ip"), 2, timeout=START_TIMEOUT) as sharded:
        sharded.add(x[:100], ids[:100])
    assert repr(sharded).endswith(", closed)")
    for call in (lambda: sharded.search(q, K), lambda: sharded.add(x[:1]), lambda: sharded.save(tmp_path / "never")):
        with pytest.raises(RuntimeError, match="this ShardedIndex is closed"):
            call()
    assert not (tmp_path / "never").exists()  # the refused save left no directory or lock file


@pytest.fixture(scope="module")
def loaded(saved):
    """The saved index, loaded once for the tests below (the last one leaves it lost)."""
    with ShardedIndex.load(saved[0], timeout=START_TIMEOUT) as sharded:
        yield sharded


def test_save_load_round_trip(saved, loaded, data):
    directory, single = saved
    x, q, ids = data
    manifest = read_manifest(directory)
    files = sorted(p.name for p in directory.glob("shard-*.tqv"))
    assert files == sorted(e["file"] for e in manifest["shards"]) and len(files) == SAVED_SHARDS
    assert sum(e["count"] for e in manifest["shards"]) == N
    assert manifest["config"]["index"]["correction"] == "center"
    D, I = loaded.search(q, K)
    D1, I1 = single.search(q, K)
    assert np.array_equal(I, I1) and np.array_equal(D, D1)
    assert np.array_equal(loaded.center, single.center) and len(loaded) == N
    assert np.array_equal(loaded.reconstruct(ids[:7]), single.reconstruct(ids[:7]))


def test_load_rejects_a_file_from_another_save(saved, tmp_path):
    directory, _ = saved
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["shards"][1]["sha256"] = "0" * 64
    bad = tmp_path / "bad"
    bad.mkdir()
    for e in manifest["shards"]:
        (bad / e["file"]).write_bytes((directory / e["file"]).read_bytes())
    (bad / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(storage.StorageError, match="shard 1: .*does not match the manifest"):
        ShardedIndex.load(bad)
    (bad / MANIFEST).write_text("{}")
    with pytest.raises(storage.StorageError, match="not a tqvec.ShardedIndex manifest"):
        ShardedIndex.load(bad)


def test_load_rejects_a_corrupted_shard_file(saved, tmp_path):
    """One flipped byte inside a shard file, its size and trailing SHA-256 (those the manifest records)
    unchanged: load recomputes the checksums and raises StorageError naming the shard, before any actor."""
    directory, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    path = bad / read_manifest(bad)["shards"][1]["file"]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(raw)
    with pytest.raises(storage.StorageError, match="shard 1: .*corrupt"):
        ShardedIndex.load(bad, timeout=START_TIMEOUT)


def test_stale_temp_files_are_removed_safely(saved, tmp_path, data):
    """What crashed writers leave (temp files of a shard file or of the manifest, a build folder, a shard
    file no manifest names) goes at load and save; other files stay; while another writer holds the
    directory's lock nothing is removed and save waits for it, then raises TimeoutError."""
    directory, single = saved
    _, q, _ = data
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    stale = [".shard-00000-0123abcd.tqv.0123456789ab.tmp", ".manifest.json.abcdef012345.tmp", "shard-00001-0badf00d.tqv"]
    keep = [".notes.tmp", "notes.txt", ".shard-00000-0123abcd.tqv.tmp", "shard-1-0badf00d.tqv"]
    for name in stale + keep:
        (copy / name).write_bytes(b"partial")
    (copy / ".build-k3y_9").mkdir()
    (copy / ".build-k3y_9" / "part-00000-0123456789abcdef.tqv").write_bytes(b"partial")
    stale.append(".build-k3y_9")
    with ShardedIndex.load(copy, timeout=START_TIMEOUT) as index:
        names = {p.name for p in copy.iterdir()}
        assert not names & set(stale) and set(keep) <= names
        for name in stale[:2]:  # a writer at work: its temp files must survive
            (copy / name).write_bytes(b"in progress")
        with filelock.FileLock(copy / LOCK, thread_local=False):
            assert try_remove_stale(copy) == []
            index.timeout = 1.0
            t = time.monotonic()
            with pytest.raises(TimeoutError, match="another writer"):
                index.save(copy)
            assert 1.0 <= time.monotonic() - t < 10
        assert {p.name for p in copy.iterdir()} >= set(stale[:2])
        index.timeout = 60.0
        index.save(copy)
        names = {p.name for p in copy.iterdir()}
        assert not names & set(stale) and set(keep) <= names
        D, I = index.search(q, K)
        D1, I1 = single.search(q, K)
        assert np.array_equal(I, I1) and np.array_equal(D, D1)


def _error_within(seconds: float, call: Callable[[], object]) -> tuple[BaseException | None, float]:
    """Run ``call`` in a daemon thread; its exception (None if it returned) and its duration. Fails the test
    if it is still running after ``seconds`` (a blocked ``ray.wait`` ignores pytest-timeout's signal)."""
    box: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box.append(err)

    t = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return (box[0] if box else None), time.monotonic() - t


def test_start_and_load_honour_timeout(saved):
    """Actors that cannot be scheduled (three num_cpus=1 shards on this 2-CPU Ray; 3 CPUs each) raise
    ShardError naming them within about ``timeout`` (plus killing them), and their CPUs come back."""
    err, took = _error_within(40, lambda: ShardedIndex(IndexSettings(DIM), 3, actor_options={"num_cpus": 1}, timeout=3))
    assert isinstance(err, ShardError) and err.shards and took < 3 + 10  # the one not scheduled, at least
    assert all(f"shard {s}: no answer within 3 s" in str(err) for s in err.shards)
    err, took = _error_within(40, lambda: ShardedIndex.load(saved[0], actor_options={"num_cpus": 3}, timeout=2))
    assert isinstance(err, ShardError) and err.shards == tuple(range(SAVED_SHARDS)) and took < 2 + 10
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


# ------------------------------------------------------------------------------- failures


def test_killed_shard_during_query_burst(saved, loaded: ShardedIndex, data):
    """Saved data survive a kill: searches in flight wait for the restart and return the full answer;
    a short timeout raises ShardError naming the shard; allow_partial names it as missing."""
    directory, single = saved
    x, q, ids = data
    D1, I1 = single.search(q, K)
    answers, errors = [], []

    def burst() -> None:
        for _ in range(30):
            try:
                answers.append(loaded.search(q, K))
            except Exception as err:  # noqa: BLE001 - every failure is reported below
                errors.append(err)
            time.sleep(0.05)

    threads = [threading.Thread(target=burst) for _ in range(2)]
    for t in threads:
        t.start()
    epoch = ray.get(loaded.shard_actor(1).info.remote())[1]
    time.sleep(0.2)
    ray.kill(loaded.shard_actor(1), no_restart=False)
    for t in threads:
        t.join()
    assert ray.get(loaded.shard_actor(1).info.remote())[1] != epoch  # it did restart (same handle)
    assert not errors and len(answers) == 60
    for D, I in answers:
        assert np.array_equal(I, I1) and np.array_equal(D, D1)

    ray.kill(loaded.shard_actor(0), no_restart=False)
    loaded.timeout = 0.5
    with pytest.raises(ShardError, match="shard 0") as err:
        loaded.search(q, K)
    assert err.value.shards == (0,)
    D, I, missing = loaded.search(q, K, allow_partial=True)  # the restart takes seconds (torch import)
    assert missing == (0,)
    assert not np.isin(I, ids[shard_of(ids, SAVED_SHARDS) == 0]).any() and (I != -1).all()
    loaded.timeout = 60
    D, I = loaded.search(q, K)  # back after the restart
    assert np.array_equal(I, I1) and np.array_equal(D, D1)


def test_restart_that_loses_unsaved_adds_is_never_silent(saved, loaded, data):
    directory, _ = saved
    x, q, ids = data
    rng = np.random.default_rng(3)
    new_ids = rng.choice(10**12, size=50, replace=False) + 10**13
    victim = int(shard_of(new_ids[:1], SAVED_SHARDS)[0])
    loaded.add(x[:50], new_ids)
    ray.kill(loaded.shard_actor(victim), no_restart=False)
    with pytest.raises(ShardError, match=f"shard\\(s\\) \\[{victim}\\] restarted .*lost") as err:
        loaded.search(q, K)
    assert err.value.shards == (victim,)
    _, I, missing = loaded.search(q, K, allow_partial=True)
    assert missing == (victim,) and not np.isin(I, ids[shard_of(ids, SAVED_SHARDS) == victim]).any()
    with pytest.raises(ShardError, match="lost"):
        loaded.save(directory)  # never persist the truncated shard
    assert read_manifest(directory)["config"]["next_id"] == int(ids.max()) + 1  # directory untouched
    more = rng.choice(10**12, size=20, replace=False) + 2 * 10**13  # routed to both shards
    assert set(shard_of(more, SAVED_SHARDS)) == set(range(SAVED_SHARDS))
    healthy = ray.get(loaded.shard_actor(1 - victim).count.remote())[0]
    with pytest.raises(ShardError, match="lost") as err:
        loaded.add(x[:20], more)  # could never be saved: refused, nothing sent
    assert err.value.shards == (victim,)
    assert ray.get(loaded.shard_actor(1 - victim).count.remote())[0] == healthy
    with pytest.raises(ShardError, match="lost"):
        loaded.remove(ids[:3])


def test_shard_dead_for_good_fails_at_once(loaded, data):
    """A shard that Ray will not restart (killed without restart; the same once ``max_restarts`` is used up) fails
    reads at once, not after ``timeout`` of retries: ``search`` raises ShardError naming it as dead, ``allow_partial``
    returns the other shards' answer with it missing, ``len`` raises. (After the test above one shard is lost; the
    other is the one killed here.)"""
    _, q, _ = data
    _, _, missing = loaded.search(q, K, allow_partial=True)
    (victim,) = set(range(SAVED_SHARDS)) - set(missing)
    ray.kill(loaded.shard_actor(victim), no_restart=True)
    loaded.timeout = 60
    err, took = _error_within(20, lambda: loaded.search(q, K))
    assert isinstance(err, ShardError) and err.shards == (victim,) and "dead for good" in str(err) and took < 10
    box = []
    _, took = _error_within(20, lambda: box.append(loaded.search(q, K, allow_partial=True)))
    assert box[0][2] == tuple(range(SAVED_SHARDS)) and (box[0][1] == -1).all() and took < 10
    err, took = _error_within(20, lambda: len(loaded))
    assert isinstance(err, ShardError) and err.shards == (victim,) and took < 10


# ------------------------------------------------------------------------------- bulk build with Ray Data


def test_build_shards_parquet_matches_single_index(data, tmp_path):
    x, q, ids = data
    for i, (lo, hi) in enumerate([(0, 700), (700, N)]):
        table = pa.table({"id": ids[lo:hi], "vector": pa.FixedSizeListArray.from_arrays(pa.array(x[lo:hi].ravel()), DIM)})
        pq.write_table(table, tmp_path / f"part{i}.parquet")
    settings = IndexSettings(DIM, 4, "cosine", seed=9, correction="center")
    single = settings.new_index()
    single.add(x, ids)
    out = tmp_path / "built"
    manifest = build_shards(sorted(tmp_path.glob("*.parquet")), out, settings, 2, center=single.center,
                            rows_per_task=400)
    assert sum(e["count"] for e in manifest["shards"]) == N
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, LOCK, *(e["file"] for e in manifest["shards"])])
    with ShardedIndex.load(out, timeout=START_TIMEOUT) as sharded:
        for s, n in enumerate(sharded.shard_sizes()):
            assert n == int((shard_of(ids, 2) == s).sum())
        D, I = sharded.search(q, K)
        D1, I1 = single.search(q, K)
        assert np.array_equal(I, I1) and np.array_equal(D, D1)


def test_build_shards_refuses_more_encoders_than_the_cluster_can_run(data, tmp_path):
    """2 CPUs (the module's cluster) hold 2 encoders of 0.5 CPU and a read task; 4 encoders would wait forever."""
    np.save(tmp_path / "a.npy", data[0][:100])
    with pytest.raises(ValueError, match=r"workers=4: .* need 3 CPUs, the Ray cluster has 2"):
        build_shards([tmp_path / "a.npy"], tmp_path / "out", IndexSettings(DIM, 4, "ip"), 2, workers=4)
    assert not (tmp_path / "out").exists()


def test_build_shards_npy_row_ids_and_computed_center(data, tmp_path):
    x, q, _ = data
    np.save(tmp_path / "a.npy", x[:1000])
    np.save(tmp_path / "b.npy", x[1000:])
    manifest = build_shards([tmp_path / "a.npy", tmp_path / "b.npy"], tmp_path / "out",
                            IndexSettings(DIM, 4, "ip", correction="center"), 2, routing="round_robin", rows_per_task=300)
    assert manifest["config"]["next_id"] == N and [e["count"] for e in manifest["shards"]] == [N // 2, N // 2]
    shards = [Index.load(tmp_path / "out" / e["file"]) for e in manifest["shards"]]  # in process: no actors
    for s, shard in enumerate(shards):
        assert np.array_equal(shard.reconstruct(np.arange(s, N, 2)).shape, (N // 2, DIM))
        np.testing.assert_allclose(shard.center, x.astype(np.float64).mean(0), rtol=0, atol=1e-5)
    _, I = merge_topk([shard.search(q, K) for shard in shards], K, "ip", nq=NQ)
    exact = np.argsort(-(q @ x.T), axis=1)[:, :K]
    assert np.mean([len(set(a) & set(b)) / K for a, b in zip(I, exact)]) > 0.7
    with pytest.raises(ValueError, match="routing='hash'"):
        build_shards([tmp_path / "c.parquet"], tmp_path / "x", IndexSettings(DIM), 2, routing="round_robin")
    with pytest.raises(ValueError, match="all .parquet or all .npy"):
        build_shards([tmp_path / "a.npy", tmp_path / "c.parquet"], tmp_path / "x", IndexSettings(DIM), 2)
