"""This process's resident memory on Linux, for the memory benchmarks and tests: ``/proc/self/status`` fields and
the reset of the peak mark ``VmHWM``.

    >>> status_kib("VmRSS") > 0
    True
"""
from __future__ import annotations


def status_kib(field: str) -> int:
    """``field`` of ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``, …) in KiB.

    Raises
    ------
    RuntimeError
        When the file has no such field.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> bool:
    """Reset the peak resident set ``VmHWM`` to the current one (``/proc/self/clear_refs``); False where this
    system does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
