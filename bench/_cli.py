"""Argument types shared by the benchmarks' command lines."""
from __future__ import annotations

import argparse

from tqvec.validation import check_positive_int


def positive_int(text: str) -> int:
    """``argparse`` type of a count: an int ≥ 1, else a usage error naming the value.

    Examples
    --------
    >>> positive_int("3")
    3
    >>> positive_int("-5")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a positive integer, got '-5'
    """
    try:
        return check_positive_int("count", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
