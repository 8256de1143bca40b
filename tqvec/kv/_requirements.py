"""The transformers release ``tqvec.kv`` needs, checked when the package is imported (before its other modules, which
would otherwise fail on a missing transformers name with no hint of the fix)."""
from __future__ import annotations

import transformers
from packaging.version import Version

#: the oldest transformers release ``tqvec.kv`` works with: ``generate(cache=...)`` and the cache-layer mappings
MIN_TRANSFORMERS = "5.24"


def require_transformers(version: str) -> None:
    """Raise ``ImportError`` naming the fix when transformers ``version`` is older than :data:`MIN_TRANSFORMERS`.

    Examples
    --------
    >>> require_transformers("5.25.0")
    >>> require_transformers("5.23.0")
    Traceback (most recent call last):
    ...
    ImportError: tqvec.kv needs transformers >= 5.24, found 5.23.0: pip install -U "transformers>=5.24"
    """
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"tqvec.kv needs transformers >= {MIN_TRANSFORMERS}, found {version}: "
                          f'pip install -U "transformers>={MIN_TRANSFORMERS}"')


require_transformers(transformers.__version__)
