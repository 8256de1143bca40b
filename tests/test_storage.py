"""tqvec.storage: round trips, corruption and truncation, atomic replace."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from tqvec import storage
from tqvec.storage import StorageError, load_arrays, save_arrays

KIND = "test.Kind"


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "codes": rng.integers(0, 256, size=(37, 13), dtype=np.uint8),
        "norms": rng.standard_normal(37).astype(np.float32),
        "ids": np.arange(37, dtype=np.int64)[::-1],  # not contiguous
        "big_endian": np.arange(5, dtype=">f8"),
        "empty": np.zeros(0, dtype=np.float64),
        "no_rows": np.zeros((0, 8), dtype=np.int32),
        "flags": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float16),
        "half": rng.standard_normal((3, 4)).astype(np.float16),
        "complex": np.array([1 + 2j, -3j], dtype=np.complex64),
    }


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "a.tqv"
    save_arrays(path, KIND, {"bits": 4, "metric": "ip", "nested": {"x": [1, 2.5, None]}}, _arrays())
    return path


@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip_bit_exact(saved, mmap):
    meta, arrays = load_arrays(saved, KIND, mmap=mmap)
    assert meta == {"bits": 4, "metric": "ip", "nested": {"x": [1, 2.5, None]}}
    expected = _arrays()
    assert list(arrays) == list(expected)
    for name, a in expected.items():
        b = arrays[name]
        assert b.shape == a.shape and b.dtype == a.dtype.newbyteorder("<"), name
        assert a.astype(b.dtype).tobytes() == b.tobytes(), name  # bit-exact
        assert b.flags.writeable != mmap, name
        if mmap and b.size:
            assert b.ctypes.data % storage.ALIGN == 0, name


def test_payloads_are_aligned_and_layout_documented(saved):
    raw = saved.read_bytes()
    magic, version, reserved, header_len = struct.unpack_from("<8sIIQ", raw)
    assert (magic, version, reserved) == (storage.MAGIC, storage.VERSION, 0)
    header = json.loads(raw[24:24 + header_len])
    start = -(-(24 + header_len) // 64) * 64
    assert len(raw) == start + header["payload_nbytes"] + 32
    norms = next(e for e in header["arrays"] if e["name"] == "norms")
    assert norms["offset"] % 64 == 0 and norms["dtype"] == "<f4"
    got = np.frombuffer(raw, "<f4", count=37, offset=start + norms["offset"])
    assert np.array_equal(got, _arrays()["norms"])


def test_empty_arrays_dict(tmp_path):
    save_arrays(tmp_path / "e", KIND, {}, {})
    assert load_arrays(tmp_path / "e", KIND) == ({}, {})


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.3, 0.5, 0.9, 0.999])
def test_truncated(saved, tmp_path, fraction, verify):
    raw = saved.read_bytes()
    cut = tmp_path / "cut"
    cut.write_bytes(raw[:int(len(raw) * fraction)])
    with pytest.raises(StorageError, match="truncated|corrupt header") as e:
        load_arrays(cut, KIND, verify=verify)
    assert str(cut) in str(e.value)


def test_truncated_by_one_byte(saved):
    saved.write_bytes(saved.read_bytes()[:-1])
    with pytest.raises(StorageError, match="truncated"):
        load_arrays(saved, KIND)


def test_trailing_bytes(saved):
    saved.write_bytes(saved.read_bytes() + b"\0")
    with pytest.raises(StorageError, match="trailing"):
        load_arrays(saved, KIND)


@pytest.mark.parametrize("where", [-1, -40, -300, 35])
def test_flipped_byte_fails_checksum(saved, where):
    raw = bytearray(saved.read_bytes())
    raw[where] ^= 0x10  # last: in the digest; others: payload; 35: inside the JSON header's "kind"
    saved.write_bytes(bytes(raw))
    for mmap in (False, True):
        with pytest.raises(StorageError, match="checksum"):
            load_arrays(saved, KIND, mmap=mmap)


def test_wrong_magic(saved, tmp_path):
    raw = bytearray(saved.read_bytes())
    raw[1] = ord("X")
    saved.write_bytes(bytes(raw))
    with pytest.raises(StorageError, match="not a tqvec file"):
        load_arrays(saved, KIND)
    npy = tmp_path / "x.npy"
    np.save(npy, np.arange(3))
    with pytest.raises(StorageError, match="not a tqvec file"):
        load_arrays(npy, KIND)


def test_unsupported_version(saved):
    raw = bytearray(saved.read_bytes())
    struct.pack_into("<I", raw, 8, 99)
    saved.write_bytes(bytes(raw))
    with pytest.raises(StorageError, match="version 99"):
        load_arrays(saved, KIND, verify=False)


def test_wrong_kind(saved):
    with pytest.raises(StorageError, match="'test.Kind', expected 'tqvec.Index'"):
        load_arrays(saved, "tqvec.Index")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_arrays(tmp_path / "nope", KIND)


def _forge(path, header: dict, payload: bytes = b"") -> None:
    """Write a structurally valid file (correct checksum) around an arbitrary header."""
    import hashlib

    body = json.dumps(header).encode()
    head = struct.pack("<8sIIQ", storage.MAGIC, storage.VERSION, 0, len(body)) + body
    head += bytes(-len(head) % 64)
    data = head + payload
    path.write_bytes(data + hashlib.sha256(data).digest())


@pytest.mark.parametrize("entry, match", [
    ({"name": "a", "dtype": "<f4", "shape": [1000], "offset": 0, "nbytes": 4000}, "runs past"),
    ({"name": "a", "dtype": "<f4", "shape": [4], "offset": 0, "nbytes": 64}, "does not match"),
    ({"name": "a", "dtype": "<f4", "shape": [4], "offset": 8, "nbytes": 16}, "misaligned"),
    ({"name": "a", "dtype": "|O", "shape": [4], "offset": 0, "nbytes": 32}, "corrupt array table"),
    ({"name": "a", "dtype": "<U4", "shape": [1], "offset": 0, "nbytes": 16}, "corrupt array table"),
    ({"name": "a", "dtype": "<f4", "shape": [-4], "offset": 0, "nbytes": 16}, "corrupt array table"),
    ({"name": "a", "dtype": "<f4", "shape": [4], "offset": 0, "nbytes": 16, "x": 1}, "corrupt array table"),
    ({"name": "a", "dtype": ["<f4"], "shape": [4], "offset": 0, "nbytes": 16}, "corrupt array table"),  # unhashable
    ({"name": "a", "dtype": {"<f4": 1}, "shape": [4], "offset": 0, "nbytes": 16}, "corrupt array table"),
    ({"name": "a", "dtype": "<f4", "shape": [0] * 33, "offset": 0, "nbytes": 0}, "corrupt array table"),
    ({"name": "a", "dtype": "<f4", "shape": [0, 2**62], "offset": 0, "nbytes": 0}, "corrupt array table"),
])
def test_header_lying_about_sizes(tmp_path, entry, match):
    path = tmp_path / "forged"
    _forge(path, {"kind": KIND, "meta": {}, "payload_nbytes": 64, "arrays": [entry]}, bytes(64))
    with pytest.raises(StorageError, match=match):
        load_arrays(path, KIND)


def test_header_payload_size_lie_is_truncation(tmp_path):
    path = tmp_path / "forged"
    _forge(path, {"kind": KIND, "meta": {}, "payload_nbytes": 1 << 40, "arrays": []})
    with pytest.raises(StorageError, match="truncated"):
        load_arrays(path, KIND)


def test_overlapping_arrays_rejected(tmp_path):
    path = tmp_path / "forged"
    e = {"dtype": "<f4", "shape": [4], "offset": 0, "nbytes": 16}
    _forge(path, {"kind": KIND, "meta": {}, "payload_nbytes": 64, "arrays": [{"name": "a", **e}, {"name": "b", **e}]},
           bytes(64))
    with pytest.raises(StorageError, match="overlaps"):
        load_arrays(path, KIND)


@pytest.mark.parametrize("header", [b"not json", b"\xff\xfe", b"[" * 100_000, b'{"kind": 1}'])
def test_corrupt_header(tmp_path, header):
    path = tmp_path / "bad"
    path.write_bytes(struct.pack("<8sIIQ", storage.MAGIC, storage.VERSION, 0, len(header)) + header + bytes(128))
    with pytest.raises(StorageError, match="corrupt header"):
        load_arrays(path, KIND)


@pytest.mark.parametrize("arrays, match", [
    ({"o": np.array([object()])}, "plain numeric"),
    ({"s": np.array(["x"])}, "plain numeric"),
    ({"r": np.zeros(2, dtype=[("a", "f4")])}, "plain numeric"),
    ({"t": [1.0, 2.0]}, "numpy array"),
    ({"": np.zeros(1)}, "non-empty"),
])
def test_rejects_bad_arrays(tmp_path, arrays, match):
    with pytest.raises(ValueError, match=match):
        save_arrays(tmp_path / "x", KIND, {}, arrays)
    assert list(tmp_path.iterdir()) == []


def test_rejects_bad_meta(tmp_path):
    with pytest.raises(ValueError, match="JSON"):
        save_arrays(tmp_path / "x", KIND, {"f": float("nan")}, {})
    with pytest.raises(ValueError, match="JSON"):
        save_arrays(tmp_path / "x", KIND, {"o": object()}, {})
    assert list(tmp_path.iterdir()) == []


class _Boom(RuntimeError):
    pass


def _failing_fdopen(real, fail_after: int):
    """os.fdopen whose file raises on the ``fail_after``-th write."""
    class File:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            self.n += 1
            if self.n == fail_after:
                raise _Boom("disk full")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    return lambda *a, **k: File(real(*a, **k))


@pytest.mark.parametrize("failure", ["write1", "write4", "fsync", "replace", "interrupt"])
def test_failed_save_leaves_old_file_intact(saved, monkeypatch, failure):
    before = saved.read_bytes()
    if failure.startswith("write"):
        monkeypatch.setattr(os, "fdopen", _failing_fdopen(os.fdopen, int(failure[-1])))
        error = _Boom
    elif failure == "interrupt":
        def interrupt(fd):
            raise KeyboardInterrupt

        monkeypatch.setattr(os, "fsync", interrupt)
        error = KeyboardInterrupt
    else:
        def boom(*a):
            raise _Boom(failure)

        monkeypatch.setattr(os, failure, boom)
        error = _Boom
    with pytest.raises(error):
        save_arrays(saved, KIND, {"new": True}, {"x": np.ones(1000)})
    monkeypatch.undo()
    assert saved.read_bytes() == before
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]
    assert load_arrays(saved, KIND)[0]["bits"] == 4


def test_overwrite_replaces(saved):
    save_arrays(saved, KIND, {"v": 2}, {"x": np.arange(3)})
    meta, arrays = load_arrays(saved, KIND)
    assert meta == {"v": 2} and list(arrays) == ["x"]
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]


def test_mmap_arrays_are_read_only_views(saved):
    _, arrays = load_arrays(saved, KIND, mmap=True)
    with pytest.raises(ValueError):
        arrays["codes"][0, 0] = 1
