"""The files of a saved :class:`~tqvec.distributed.ShardedIndex`: a directory and its manifest.

Layout. ``manifest.json`` (config, and per shard its file, size, vector count and the SHA-256 that ends
the file) and one index file per shard, ``shard-<shard>-<save token>.tqv``. A save writes new shard
files, then switches the manifest (written atomically), then deletes the shard files of earlier saves:
a crash at any point leaves a loadable directory.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import storage
from .routing import ROUTINGS

MANIFEST = "manifest.json"
MANIFEST_KIND = "tqvec.ShardedIndex"
MANIFEST_VERSION = 1
SHARD_FILE = re.compile(r"shard-\d{5}-[0-9a-f]{8}\.tqv")
#: work folders of :func:`tqvec.distributed.build_shards` (``tempfile.mkdtemp(prefix=".build-")``)
BUILD_PREFIX = ".build-"
_DIGEST_SIZE = 32  # the SHA-256 that ends every tqvec.storage file


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

    Raises:
        FileNotFoundError: no manifest in ``directory``.
        tqvec.storage.StorageError: unreadable, of another kind or version, or inconsistent.

    Example::

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


def check_shard_file(directory: Path, shard: int, entry: dict[str, Any]) -> Path:
    """The path of ``shard``'s file after checking its size and trailing SHA-256 against its manifest
    ``entry``. Raises ``StorageError`` naming the shard on a mismatch, ``FileNotFoundError`` if missing."""
    path = directory / entry["file"]
    found = file_entry(path, entry["count"])
    if (found["bytes"], found["sha256"]) != (entry.get("bytes"), entry.get("sha256")):
        raise storage.StorageError(f"shard {shard}: {path} does not match the manifest (size {found['bytes']} vs "
                                   f"{entry.get('bytes')}, or checksum): a file from another save?")
    return path


def commit(directory: Path, config: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Switch ``directory`` to the shard files of ``entries`` (manifest written atomically), then delete the
    shard files of earlier saves. Returns the manifest."""
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
