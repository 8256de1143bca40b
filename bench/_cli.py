"""Argument types shared by the benchmarks' command lines."""
from __future__ import annotations

import argparse


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
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value
