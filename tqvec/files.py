"""``tqvec.load``: open any saved tqvec index by the kind its file records.

A file written by :meth:`Index.save` or :meth:`IVFIndex.save` is a :mod:`tqvec.storage` container whose JSON
header names its kind (``"tqvec.Index"``, ``"tqvec.IVFIndex"``); a :class:`~tqvec.distributed.ShardedIndex`
is a directory holding ``manifest.json`` (kind ``"tqvec.ShardedIndex"``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from . import storage

MANIFEST = "manifest.json"


def file_kind(path: str | os.PathLike) -> str:
    """The kind a tqvec file or sharded-index directory records, e.g. ``"tqvec.Index"``.

    Raises ``FileNotFoundError`` when ``path`` does not exist and :class:`~tqvec.storage.StorageError` when it
    is not a tqvec file (not a regular file, bad magic, truncated, corrupt header) or a directory without a readable
    manifest.
    """
    path = Path(path)
    if path.is_dir():
        manifest = path / MANIFEST
        try:
            with storage._open_regular(manifest) as f:  # a FIFO or device raises at once instead of blocking
                kind = json.loads(f.read().decode("utf-8")).get("kind")
        except FileNotFoundError as err:
            raise storage.StorageError(f"{path}: a directory without {MANIFEST}, not a saved tqvec index") from err
        except (OSError, ValueError, AttributeError) as err:
            raise storage.StorageError(f"{manifest}: unreadable manifest ({err})") from err
        if not isinstance(kind, str):
            raise storage.StorageError(f"{manifest}: the manifest records no kind")
        return kind
    with storage._open_regular(path) as f:  # a FIFO or device raises at once instead of blocking
        header, _ = storage._read_header(path, f)
    return header["kind"]


def load(path: str | os.PathLike, **kwargs: Any) -> Any:
    """Open a saved tqvec index of any type, choosing the class by the kind its file records.

    Parameters
    ----------
    path : str or os.PathLike
        A file written by :meth:`Index.save <tqvec.Index.save>` or :meth:`IVFIndex.save <tqvec.IVFIndex.save>`,
        or a directory written by :meth:`ShardedIndex.save <tqvec.distributed.ShardedIndex.save>` (or that
        directory's ``manifest.json``).
    **kwargs
        Passed to the chosen class's ``load``, e.g. ``mmap=True``, ``device="cuda"`` (``Index``, ``IVFIndex``),
        ``index_factory=...`` (a sharded index of IVF shards), ``timeout=...`` (``ShardedIndex``).

    Returns
    -------
    Index or IVFIndex or ShardedIndex
        The opened index, as that class's ``load`` returns it.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    tqvec.storage.StorageError
        ``path`` is not a tqvec file (not a regular file, bad magic, truncated, corrupt header), is a directory
        without a readable ``manifest.json``, records a kind this version does not open, or fails the chosen
        class's own checks. ``StorageError`` is a subclass of ``ValueError``.
    TypeError
        A keyword the chosen class's ``load`` does not take.
    ImportError
        ``path`` holds a sharded index and Ray is not installed (the message names the ``ray`` extra).
    ValueError
        A ``device`` this machine lacks (``Index``, ``IVFIndex``).
    tqvec.distributed.ShardError
        A sharded index whose shard actors do not start within ``timeout``; :meth:`ShardedIndex.load
        <tqvec.distributed.ShardedIndex.load>` lists its other errors.

    Examples
    --------
    >>> import numpy as np, tempfile, os, tqvec
    >>> index = tqvec.Index(16, bits=4)
    >>> _ = index.add(np.random.default_rng(0).standard_normal((100, 16)).astype(np.float32))
    >>> path = os.path.join(tempfile.mkdtemp(), "x.tqv")
    >>> index.save(path)
    >>> back = tqvec.load(path, mmap=True)
    >>> type(back).__name__, len(back)
    ('Index', 100)
    """
    import tqvec  # noqa: PLC0415 - the classes, ShardedIndex through tqvec's lazy import

    path = Path(path)
    if path.name == MANIFEST and path.is_file():
        path = path.parent
    kind = file_kind(path)
    classes = {"tqvec.Index": "Index", "tqvec.IVFIndex": "IVFIndex", "tqvec.ShardedIndex": "ShardedIndex"}
    if kind not in classes:
        raise storage.StorageError(f"{path}: holds {kind!r}, which is not a tqvec index kind this version "
                                   f"opens ({', '.join(classes)})")
    return getattr(tqvec, classes[kind]).load(path, **kwargs)
