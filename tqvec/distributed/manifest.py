"""The files of a saved :class:`~tqvec.distributed.ShardedIndex`: a directory, its manifest and its lock.

Layout. ``manifest.json`` (config, and per shard its file, size, vector count and the SHA-256 that ends
the file) and one index file per shard, ``shard-<shard>-<save token>.tqv``. A save writes new shard
files, then switches the manifest (written atomically), then deletes the shard files of earlier saves:
a crash at any point leaves a loadable directory.

Checks. :func:`verify_shard_files` recomputes every shard file's SHA-256 and compares it with the
file's own and the manifest's, so a corrupt or swapped file is rejected before any actor starts.

Writers and stale files. Every writer (a save, a bulk build) holds the directory's lock, ``.tqvec.lock``
(an OS file lock, released by the kernel when its process dies). Under the lock no other writer is
running, so temp files (``.shard-…tqv.<hex>.tmp``, ``.manifest.json.<hex>.tmp``), bulk-build work
folders (``.build-*``) and shard files the manifest does not name are leftovers of a crash:
:func:`remove_stale` deletes them, and only them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import filelock

from .. import storage
from .routing import ROUTINGS

MANIFEST = "manifest.json"
MANIFEST_KIND = "tqvec.ShardedIndex"
MANIFEST_VERSION = 1
LOCK = ".tqvec.lock"
SHARD_FILE = re.compile(r"shard-\d{5}-[0-9a-f]{8}\.tqv")
#: temp files of :func:`tqvec.storage.write_atomic` (``.NAME.<hex>.tmp``) for a shard file or the manifest
_TEMP_FILE = re.compile(r"\.(?:shard-\d{5}-[0-9a-f]{8}\.tqv|manifest\.json)\.[0-9a-f]+\.tmp")
#: work folders of :func:`tqvec.distributed.build_shards` (``tempfile.mkdtemp(prefix=".build-")``)
BUILD_PREFIX = ".build-"
_BUILD_DIR = re.compile(r"\.build-[A-Za-z0-9_]+")
_DIGEST_SIZE = 32  # the SHA-256 that ends every tqvec.storage file
_CHUNK = 1 << 24


def shard_file_name(shard: int, token: str) -> str:
    """The file name of ``shard`` in the save with ``token`` (8 hex digits)."""
    return f"shard-{shard:05d}-{token}.tqv"


def _write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`tqvec.storage.write_atomic`)."""
    text = json.dumps(obj, indent=1, allow_nan=False).encode("utf-8")
    storage.write_atomic(path, lambda f: f.write(text))


def file_entry(path: Path, count: int) -> dict[str, Any]:
    """Manifest entry of a shard file: name, size, vector count and its trailing SHA-256 (read, not recomputed)."""
    with open(path, "rb") as f:
        f.seek(-_DIGEST_SIZE, os.SEEK_END)
        digest = f.read(_DIGEST_SIZE).hex()
    return {"file": path.name, "bytes": path.stat().st_size, "count": int(count), "sha256": digest}


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The checked manifest of a saved ``ShardedIndex`` directory.

    Parameters
    ----------
    directory : path-like
        The directory ``ShardedIndex.save`` or :func:`build_shards` wrote.

    Returns
    -------
    dict
        The manifest: its kind, version, the shards' configuration and one entry per shard file.

    Raises
    ------
    FileNotFoundError
        No manifest in ``directory``.
    tqvec.storage.StorageError
        Unreadable, of another kind or version, or inconsistent.

    Examples
    --------
    >>> read_manifest(directory)["config"]["n_shards"]  # doctest: +SKIP
    2
    """
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as err:
        raise storage.StorageError(f"{path}: unreadable manifest ({err})") from err
    ok = (isinstance(manifest, dict) and manifest.get("kind") == MANIFEST_KIND
          and isinstance(manifest.get("config"), dict) and isinstance(manifest.get("shards"), list))
    if not ok:
        raise storage.StorageError(f"{path}: not a {MANIFEST_KIND} manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise storage.StorageError(f"{path}: unsupported manifest version {manifest.get('version')!r}")
    config = manifest["config"]

    def whole(key: str, low: int) -> bool:
        return isinstance(config.get(key), int) and not isinstance(config[key], bool) and config[key] >= low

    if not (whole("n_shards", 1) and whole("next_id", 0) and whole("dim", 1) and config.get("routing") in ROUTINGS
            and "index" in config and isinstance(config["index"], (dict, type(None)))):
        raise storage.StorageError(f"{path}: corrupt config {config!r}")
    if len(manifest["shards"]) != config.get("n_shards"):
        raise storage.StorageError(f"{path}: {len(manifest['shards'])} shard entries for n_shards="
                                   f"{config.get('n_shards')!r}")
    for s, entry in enumerate(manifest["shards"]):
        if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and SHARD_FILE.fullmatch(entry["file"])):
            raise storage.StorageError(f"{path}: corrupt entry for shard {s}: {entry!r}")
    return manifest


def check_shard_file(directory: Path, shard: int, entry: dict[str, Any], *, full: bool = False) -> Path:
    """The path of ``shard``'s file after checking it against its manifest ``entry``.

    Always compares the size and the trailing SHA-256; ``full`` also recomputes the SHA-256 over the file
    (one read of it). Raises ``StorageError`` naming the shard on a mismatch, ``FileNotFoundError`` if the
    file is missing.
    """
    path = directory / entry["file"]
    found = file_entry(path, entry["count"])
    if (found["bytes"], found["sha256"]) != (entry.get("bytes"), entry.get("sha256")):
        raise storage.StorageError(f"shard {shard}: {path} does not match the manifest (size {found['bytes']} vs "
                                   f"{entry.get('bytes')}, or checksum): a file from another save?")
    if full:
        h, left = hashlib.sha256(), found["bytes"] - _DIGEST_SIZE
        with open(path, "rb") as f:
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                h.update(chunk)
                left -= len(chunk)
        if h.hexdigest() != found["sha256"]:
            raise storage.StorageError(f"shard {shard}: {path} is corrupt (its SHA-256 differs from the manifest's)")
    return path


def verify_shard_files(directory: Path, manifest: dict[str, Any]) -> None:
    """Check every shard file of ``manifest`` in full (:func:`check_shard_file`), several files at a time.

    Raises ``StorageError`` naming the first bad shard (a missing file included).
    """
    def check(item: tuple[int, dict[str, Any]]) -> None:
        s, entry = item
        try:
            check_shard_file(directory, s, entry, full=True)
        except FileNotFoundError as err:
            raise storage.StorageError(f"shard {s}: {err}") from err

    shards = list(enumerate(manifest["shards"]))
    with ThreadPoolExecutor(max_workers=max(1, min(len(shards), os.cpu_count() or 1))) as pool:
        list(pool.map(check, shards))  # hashlib releases the GIL: files are hashed in parallel


def commit(directory: Path, config: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Switch ``directory`` to the shard files of ``entries`` (manifest written atomically), then delete the
    shard files of earlier saves. Call it holding :func:`writer_lock`. Returns the manifest."""
    manifest = {"kind": MANIFEST_KIND, "version": MANIFEST_VERSION, "config": config, "shards": entries}
    _write_json_atomic(directory / MANIFEST, manifest)
    _remove_unnamed_shard_files(directory, {entry["file"] for entry in entries})
    return manifest


def _remove_unnamed_shard_files(directory: Path, keep: Iterable[str]) -> list[str]:
    """Delete the shard files in ``directory`` not named in ``keep``; returns their names."""
    keep, removed = set(keep), []
    for entry in os.scandir(directory):
        if SHARD_FILE.fullmatch(entry.name) and entry.name not in keep and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
            removed.append(entry.name)
    return removed


@contextmanager
def writer_lock(directory: Path, timeout: float) -> Iterator[None]:
    """Hold ``directory``'s writer lock (module docstring) for the ``with`` block.

    ``timeout`` seconds to wait for another writer (0: fail at once). Raises ``TimeoutError`` naming the
    directory when another process (or thread) writes it, ``OSError`` when the lock file cannot be created.
    """
    lock = filelock.FileLock(directory / LOCK, thread_local=False, is_singleton=False)
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout as err:
        raise TimeoutError(f"{directory}: another writer (a save or build_shards) held its lock for "
                           f"{timeout:g} s") from err
    try:
        yield
    finally:
        lock.release()


def remove_stale(directory: Path) -> list[str]:
    """Delete what crashed writers left in ``directory``: temp files, build folders, unnamed shard files.

    Call it holding :func:`writer_lock`. Shard files are deleted only when a valid manifest names others
    (never with a missing or unreadable manifest). Links and files of other names are left alone.
    Returns the names removed.
    """
    removed = []
    for entry in os.scandir(directory):
        if _TEMP_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
        elif _BUILD_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            continue
        removed.append(entry.name)
    try:
        named = [entry["file"] for entry in read_manifest(directory)["shards"]]
    except (FileNotFoundError, storage.StorageError):
        return removed
    return removed + _remove_unnamed_shard_files(directory, named)


def try_remove_stale(directory: Path) -> list[str]:
    """:func:`remove_stale` if the writer lock is free now; nothing if a writer holds it or the directory
    is read-only (a reader must not fail over leftovers). Returns the names removed."""
    try:
        with writer_lock(directory, timeout=0):
            return remove_stale(directory)
    except OSError:  # TimeoutError (a writer holds the lock) and PermissionError included
        return []
