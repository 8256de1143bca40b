"""tqvec's on-disk container: named numeric arrays plus a JSON header, checksummed, written atomically.

File layout (version 1, all integers little-endian)::

    offset  size  field
    0       8     magic  b"\\x89TQVEC\\r\\n"
    8       4     format version, u32 (= 1)
    12      4     reserved, u32 (= 0)
    16      8     header length H in bytes, u64
    24      H     header: UTF-8 JSON object (below)
    24+H    ...   zero padding up to P = the next multiple of 64 (the payload start)
    P       N     payload: each array's raw C-order bytes at P + its offset (offsets are multiples
                  of 64; the gaps are zero bytes); N = header["payload_nbytes"]
    P+N     32    SHA-256 of every byte before it (magic, version, header, padding, payload)

The header is ``{"kind": str, "meta": {...}, "payload_nbytes": int, "arrays": [{"name": str,
"dtype": str, "shape": [int, ...], "offset": int, "nbytes": int}, ...]}``. ``kind`` names what the
file holds (e.g. ``"tqvec.Index"``) and is checked on load; ``meta`` is any JSON object (strict JSON:
no NaN/Infinity; tuples come back as lists). ``dtype`` is a little-endian numpy type string from a
fixed list of plain numeric types (bool, signed/unsigned ints, floats, complex), e.g. ``"<f4"`` or
``"|u1"``; nothing else is accepted. Array offsets are relative to the payload start P.

Loading never unpickles or evaluates anything: the header is parsed with ``json`` and arrays are raw
bytes reinterpreted as a whitelisted dtype, so an untrusted file can at worst raise
:class:`StorageError`. Only regular files are opened (a FIFO or device raises at once instead of
blocking), and every array must lie inside the payload, so what loading allocates is bounded by the
file's size. What the arrays mean is checked by the loaders (``Index.load``, ``IVFIndex.load``).

Temporary files. A save writes ``.NAME.<12 hex>.tmp`` beside ``NAME`` and holds an exclusive
``flock`` on it until the rename. A crash leaves the file behind; the next save to the same ``NAME``
(or :func:`remove_stale_temps`) deletes every such sibling whose lock it can take, i.e. whose writer
is gone, and never one that a live writer, in any process, still holds.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap as _mmap
import os
import re
import secrets
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

MAGIC = b"\x89TQVEC\r\n"
VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sIIQ")  # magic, version, reserved, header length
_DIGEST_SIZE = 32
_CHUNK = 1 << 24
_ALLOWED_DTYPES = frozenset(
    np.dtype(t).newbyteorder("<").str
    for t in ("?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")
)
_ENTRY_KEYS = {"name", "dtype", "shape", "offset", "nbytes"}
_MAX_NDIM = 32  # numpy's limit is 64; tqvec stores at most 2-D arrays
_TEMP_HEX = 12  # hex digits of a temp file's random part (secrets.token_hex(6))

try:  # POSIX advisory locks mark a temp file as in use by a live writer
    import fcntl
except ImportError:  # pragma: no cover - Windows: stale temp files are left alone
    fcntl = None


class StorageError(ValueError):
    """A file that is corrupt, truncated, of another kind or format, or otherwise unreadable."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------------------------------- save


def _prepare(name: Any, a: Any) -> np.ndarray:
    """``a`` as a C-contiguous little-endian array of an allowed dtype."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"array names must be non-empty strings, got {name!r}")
    if not isinstance(a, np.ndarray):
        raise ValueError(f"array {name!r} must be a numpy array, got {type(a).__name__}")
    little = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    if little.str not in _ALLOWED_DTYPES:
        raise ValueError(f"array {name!r} has dtype {a.dtype}; only plain numeric dtypes can be stored")
    return np.require(a, dtype=little, requirements="C")


def _header_bytes(kind: str, meta: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """The JSON header for ``arrays`` (already prepared) laid out back to back, 64-byte aligned."""
    entries, offset = [], 0
    for name, a in arrays.items():
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                        "nbytes": a.nbytes})
        offset = _align(offset + a.nbytes)
    payload_nbytes = (entries[-1]["offset"] + entries[-1]["nbytes"]) if entries else 0
    header = {"kind": kind, "meta": meta, "payload_nbytes": payload_nbytes, "arrays": entries}
    try:
        return json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be a JSON-serializable dict (no NaN/Infinity): {e}") from e


def _write_file(f, header: bytes, arrays: dict[str, np.ndarray]) -> None:
    """Write prefix, header, padding, payloads and the trailing checksum to the open file ``f``."""
    h = hashlib.sha256()

    def put(data: bytes | memoryview) -> None:
        h.update(data)
        f.write(data)

    head = _PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header
    put(head + bytes(_align(len(head)) - len(head)))
    position = 0  # relative to the payload start
    for a in arrays.values():
        put(bytes(_align(position) - position))
        put(a.reshape(-1).view(np.uint8).data)
        position = _align(position) + a.nbytes
    f.write(h.digest())


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (POSIX only; a no-op elsewhere)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_arrays(path: str | os.PathLike, kind: str, meta: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` and ``meta`` to ``path`` atomically (temp file, fsync, rename, fsync dir).

    On any error the temp file is removed and whatever was at ``path`` before is left untouched.
    """
    path = Path(path)
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind must be a non-empty string, got {kind!r}")
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
    if not isinstance(arrays, dict):
        raise ValueError(f"arrays must be a dict of name -> numpy array, got {type(arrays).__name__}")
    prepared = {name: _prepare(name, a) for name, a in arrays.items()}
    header = _header_bytes(kind, meta, prepared)
    write_atomic(path, lambda f: _write_file(f, header, prepared))


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Create ``path`` with ``write(binary file)``: temp file in the same folder, fsync, rename, fsync of the
    folder. On any error the temp file is removed and whatever was at ``path`` before is left untouched.

    Stale temp files of earlier, crashed saves to ``path`` are removed first (:func:`remove_stale_temps`); this
    save's own temp file stays locked until it has been renamed, so no concurrent cleaner can take it.
    """
    path = Path(path)
    remove_stale_temps(path)
    tmp, fd = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # while the lock is held (closing the file releases it)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _temp_pattern(path: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{{_TEMP_HEX}}}\.tmp")


def _create_temp(path: Path) -> tuple[Path, int]:
    """A new exclusive temp file beside ``path`` and its fd, flock-ed (POSIX) so cleaners leave it alone
    (``FileNotFoundError`` naming ``path`` when its directory does not exist).

    A cleaner can delete the file between its creation and the lock; then the name no longer leads to the
    locked file, and another name is tried.
    """
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(_TEMP_HEX // 2)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileNotFoundError as err:  # name the caller's path, not the hidden temp file
            raise FileNotFoundError(err.errno, f"cannot save {path}: no directory {path.parent}") from err
        if fcntl is None:
            return tmp, fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, tmp):
                return tmp, fd
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
    raise OSError(f"could not create a temp file beside {path}")  # pragma: no cover - 100 lost races


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` (not followed if a link) is the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def remove_stale_temps(path: str | os.PathLike) -> int:
    """Delete the temp files (``.NAME.<12 hex>.tmp``) that crashed saves to ``path`` left beside it; returns how many.

    A temp file is removed only if it is a regular file whose ``flock`` can be taken at once: a live writer
    (this process or another) holds its lock until the rename, and the lock dies with a crashed writer. The
    file is unlinked while locked, after checking that its name still leads to it. No-op without ``flock``
    (Windows) or when the folder cannot be listed.

    >>> remove_stale_temps("/nonexistent/folder/index.tqv")
    0
    """
    path = Path(path)
    if fcntl is None:
        return 0
    pattern, removed = _temp_pattern(path), 0
    try:
        names = [e.name for e in os.scandir(path.parent) if pattern.fullmatch(e.name)]
    except OSError:
        return 0
    for name in names:
        candidate = path.parent / name
        try:
            fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            if _same_file(fd, candidate):
                candidate.unlink()
                removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


# ---------------------------------------------------------------------------------------- load


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _read_header(path: Path, f) -> tuple[dict, int]:
    """Parse and check the prefix and JSON header; returns (header, payload start)."""
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(_PREFIX.size)
    if not MAGIC.startswith(prefix[: len(MAGIC)]):
        raise StorageError(f"{path}: not a tqvec file (bad magic bytes {prefix[:len(MAGIC)]!r})")
    if len(prefix) < _PREFIX.size:
        raise StorageError(f"{path}: truncated file ({size} bytes, shorter than the {_PREFIX.size}-byte prefix)")
    _, version, _, header_len = _PREFIX.unpack(prefix)
    if version != VERSION:
        raise StorageError(f"{path}: unsupported format version {version} (this tqvec reads version {VERSION})")
    payload_start = _align(_PREFIX.size + header_len)
    if payload_start + _DIGEST_SIZE > size:
        raise StorageError(f"{path}: truncated file ({size} bytes) or corrupt header length {header_len}")
    try:
        header = json.loads(f.read(header_len).decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise StorageError(f"{path}: corrupt header (not valid UTF-8 JSON: {e})") from e
    if not (isinstance(header, dict) and isinstance(header.get("kind"), str) and isinstance(header.get("meta"), dict)
            and _is_count(header.get("payload_nbytes")) and isinstance(header.get("arrays"), list)):
        raise StorageError(f"{path}: corrupt header (missing or mistyped kind/meta/payload_nbytes/arrays)")
    expected = payload_start + header["payload_nbytes"] + _DIGEST_SIZE
    if size < expected:
        raise StorageError(f"{path}: truncated file ({size} bytes, the header says {expected})")
    if size > expected:
        raise StorageError(f"{path}: corrupt file ({size - expected} unexpected trailing bytes)")
    return header, payload_start


def _check_entries(path: Path, entries: list, payload_nbytes: int) -> list[tuple[str, np.dtype, tuple, int]]:
    """Validate the array table; returns (name, dtype, shape, offset) per array."""
    out, names, end = [], set(), 0
    for e in entries:
        if not (isinstance(e, dict) and set(e) == _ENTRY_KEYS and isinstance(e["name"], str)
                and isinstance(e["dtype"], str) and e["dtype"] in _ALLOWED_DTYPES
                and isinstance(e["shape"], list) and len(e["shape"]) <= _MAX_NDIM
                and all(_is_count(s) and s < 2**62 for s in e["shape"]) and _is_count(e["offset"])
                and _is_count(e["nbytes"])):
            raise StorageError(f"{path}: corrupt array table entry {e!r}")
        name, dtype, shape = e["name"], np.dtype(e["dtype"]), tuple(e["shape"])
        if name in names:
            raise StorageError(f"{path}: array {name!r} appears twice")
        if e["nbytes"] != dtype.itemsize * math.prod(shape):
            raise StorageError(f"{path}: array {name!r}: nbytes {e['nbytes']} does not match {dtype} {shape}")
        if e["offset"] % ALIGN or e["offset"] < end or e["offset"] + e["nbytes"] > payload_nbytes:
            raise StorageError(f"{path}: array {name!r}: offset {e['offset']} is misaligned, overlaps "
                               f"another array or runs past the payload ({payload_nbytes} bytes)")
        names.add(name)
        end = e["offset"] + e["nbytes"]
        out.append((name, dtype, shape, e["offset"]))
    return out


def _verify(path: Path, buf: _mmap.mmap) -> None:
    """Compare the trailing SHA-256 with one computed over the rest of ``buf``."""
    h = hashlib.sha256()
    body = len(buf) - _DIGEST_SIZE
    with memoryview(buf) as view:
        for start in range(0, body, _CHUNK):
            h.update(view[start:min(start + _CHUNK, body)])
    if h.digest() != buf[body:]:
        raise StorageError(f"{path}: checksum mismatch (the file is corrupt)")


def load_arrays(path: str | os.PathLike, kind: str, mmap: bool = False,
                verify: bool = True) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a file written by :func:`save_arrays`; returns ``(meta, arrays)``.

    ``kind`` must match the one saved. With ``mmap=True`` the arrays are read-only views of a
    read-only memory map of the file; otherwise they are ordinary writable in-memory arrays.
    ``verify`` checks the SHA-256 (reading the whole file once). Raises :class:`StorageError` for
    a corrupt, truncated, foreign or unsupported file; ``FileNotFoundError`` if there is none.
    """
    path = Path(path)
    with _open_regular(path) as f:
        header, payload_start = _read_header(path, f)
        try:
            buf = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
        except (OSError, ValueError) as err:
            raise StorageError(f"{path}: cannot be mapped ({err})") from err
    if verify:
        _verify(path, buf)
    if header["kind"] != kind:
        raise StorageError(f"{path}: holds {header['kind']!r}, expected {kind!r}")
    entries = _check_entries(path, header["arrays"], header["payload_nbytes"])
    arrays = {}
    for name, dtype, shape, offset in entries:
        try:
            a = np.frombuffer(buf, dtype, count=math.prod(shape), offset=payload_start + offset).reshape(shape)
        except ValueError as err:  # e.g. a zero-size shape whose other sides exceed numpy's limits
            raise StorageError(f"{path}: array {name!r} of shape {shape} cannot be read ({err})") from err
        arrays[name] = a if mmap else a.copy()
    return header["meta"], arrays


def _open_regular(path: Path) -> BinaryIO:
    """``path`` opened for binary reading, if it is a regular file (``StorageError`` otherwise, without blocking on
    a FIFO); ``FileNotFoundError`` if there is nothing."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StorageError(f"{path}: not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
