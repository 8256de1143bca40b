"""Host-side launch helpers: direct launches of compiled Triton kernels, and grid arithmetic.

``kernel[grid](*args, **constexprs)`` binds all of a kernel's arguments in Python on every call and checks its caches
(~100–200 µs of host time per launch of the decode-attention kernel, which takes ~90 arguments). :class:`Launcher`
keeps the compiled kernel that such a call returns, keyed by what Triton specializes on for the runtime arguments
(computed by Triton's own ``native_specialize_impl``: tensors' dtype and 16-byte alignment, integers' width and
divisibility), by the compile-time arguments and by the debug and instrumentation settings, and launches it through
its own launcher afterwards. The first call
of each specialization, the interpreter, launch hooks (profilers) and Triton versions without these internals take
the normal path.

:func:`cdiv` and :func:`pow2` size grids and blocks on the host: ``triton.cdiv`` and ``triton.next_power_of_2`` are
constexpr functions, microseconds per call from Python, on every launch.
"""
from __future__ import annotations

from typing import Any

import triton

try:  # Triton internals (3.x); without them every call takes the normal path
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import native_specialize_impl
except ImportError:  # pragma: no cover - depends on the installed Triton
    native_specialize_impl = None


def cdiv(x: int, y: int) -> int:
    """``⌈x / y⌉`` on the host."""
    return -(-x // y)


def pow2(x: int) -> int:
    """The smallest power of two ``≥ x`` (``x ≥ 1``), on the host."""
    return 1 << (x - 1).bit_length()


#: specializations kept per kernel
MAX_ENTRIES = 256


class Launcher:
    """``Launcher(kernel)(grid, args, constexprs, interpret)`` launches ``kernel[grid](*args, **constexprs)``.

    ``args``: the runtime arguments in signature order; ``constexprs``: the compile-time arguments and launch options,
    one dict object per configuration (the cache holds on to it and compares by identity, so pass a memoized dict).
    """

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel = kernel
        params = getattr(kernel, "params", None)  # None under the interpreter
        self.direct = native_specialize_impl is not None and params is not None
        runtime = [p for p in params or () if not p.is_constexpr]
        self.flags = [(p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment) for p in runtime]
        self.names = [p.name for p in params or ()]
        self.slots = [self.names.index(p.name) for p in runtime]
        #: specialization key → (constexprs, compiled kernel, full argument list with the constexprs filled in)
        self.compiled: dict[tuple, tuple[dict[str, Any], Any, list[Any]]] = {}
        self.direct_launches = 0

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], interpret: bool) -> None:
        if interpret or not self.direct or _hooked():
            self.kernel[grid](*args, **constexprs)
            return
        if len(args) != len(self.slots):
            raise TypeError(f"{self.kernel.__name__} takes {len(self.slots)} runtime arguments, got {len(args)}")
        device = driver.active.get_current_device()
        backend = self.kernel.device_caches[device][-2]  # (…, target, backend, binder)
        key = (device, id(constexprs), knobs.runtime.debug, getattr(knobs.compilation, "instrumentation_mode", None),
               *(native_specialize_impl(backend, a, *f)[:2] for a, f in zip(args, self.flags)))
        hit = self.compiled.get(key)
        if hit is None:  # (an id in the key cannot be reused while the entry holds its dict)
            compiled = self.kernel[grid](*args, **constexprs)
            if hasattr(compiled, "function") and hasattr(compiled, "packed_metadata"):
                if len(self.compiled) >= MAX_ENTRIES:  # configurations come and go (sweeps, tests): start over
                    self.compiled.clear()
                self.compiled[key] = (constexprs, compiled, [constexprs.get(name) for name in self.names])
            return
        _, compiled, full = hit
        full = full.copy()
        for slot, a in zip(self.slots, args):
            full[slot] = a
        grid = (*grid, 1, 1)
        compiled.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *full)
        self.direct_launches += 1


def _hooked() -> bool:
    """Launch hooks are installed (Triton keeps them in chains that are empty by default)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)
