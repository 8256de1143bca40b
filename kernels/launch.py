"""Host-side launch helpers: direct launches of compiled Triton kernels, and grid arithmetic.

``kernel[grid](*args, **constexprs)`` binds all of a kernel's arguments in Python on every call and checks its caches
(a large share of a step's host time for the decode-attention kernel, which takes ~90 arguments; docs/kv.md). :class:`Launcher`
keeps the compiled kernel that such a call returns, keyed by what Triton specializes on for the runtime arguments
(computed by Triton's own ``native_specialize_impl``: tensors' dtype and 16-byte alignment, integers' width and
divisibility), by the compile-time arguments and by the debug and instrumentation settings, and launches it through
its own launcher afterwards. The first call
of each specialization, the interpreter, launch hooks (profilers) and Triton versions without these internals take
the normal path.

:func:`cdiv` and :func:`pow2` size grids and blocks on the host: ``triton.cdiv`` and ``triton.next_power_of_2`` are
constexpr functions, microseconds per call from Python, on every launch. :func:`multiprocessors` and
:func:`resident_blocks` size grids of programs that loop over their work (one wave, no tail).
"""
from __future__ import annotations

from typing import Any

import torch
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


_MULTIPROCESSORS: dict[int, int] = {}


def multiprocessors(device: torch.device) -> int:
    """The multiprocessors (SMs) of CUDA ``device`` (cached per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]


def resident_blocks(kernel: Any, device: torch.device) -> int:
    """Blocks of the compiled Triton ``kernel`` (as ``warmup`` returns it) that one multiprocessor of ``device`` holds at
    once, limited by its registers (allocated per warp in steps of 8 per thread), its shared memory (1 KiB reserved per
    block) and its threads; at least 0.

    Example: a kernel of 4 warps at 168 registers and 48 KiB on an H100 (64K registers, 228 KiB, 2,048 threads) →
    ``min(65536 // (168 · 128), 233472 // (49152 + 1024), 2048 // 128)`` = 3.
    """
    kernel._init_handles()  # loads the binary, which reports the registers
    props = torch.cuda.get_device_properties(device)
    threads = kernel.metadata.num_warps * props.warp_size
    registers = -(-kernel.n_regs // 8) * 8 * threads
    # 64K registers per multiprocessor on every NVIDIA GPU since Kepler; some torch builds do not report it
    return min(getattr(props, "regs_per_multiprocessor", 65536) // registers,
               props.shared_memory_per_multiprocessor // (kernel.metadata.shared + 1024),
               props.max_threads_per_multi_processor // threads)


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
        self._launch(grid, args, constexprs, device, [self._spec(device, a, f) for a, f in zip(args, self.flags)])

    def bind(self, fixed: dict[str, Any], moving: tuple[str, ...], constexprs: dict[str, Any],
             interpret: bool) -> BoundLaunch:
        """A :class:`BoundLaunch` of this kernel with the runtime arguments ``fixed`` (name → value) set once and those
        named in ``moving`` passed at each call, in that order (together: all runtime arguments). The specializations
        of the fixed arguments are computed once, so a fixed tensor must not be resized or re-pointed while bound."""
        return BoundLaunch(self, fixed, moving, constexprs, interpret)

    def _spec(self, device: int, arg: Any, flags: tuple[bool, bool, bool]) -> tuple:
        """What Triton specializes on for one runtime argument (its type and alignment or divisibility key)."""
        backend = self.kernel.device_caches[device][-2]  # (…, target, backend, binder)
        return native_specialize_impl(backend, arg, *flags)[:2]

    def _launch(self, grid: tuple[int, ...], args, constexprs: dict[str, Any], device: int,
                specs: list) -> tuple | None:
        """Launch the compiled kernel of the specialization ``specs`` directly, compiling it through Triton first.
        Returns its entry (constexprs, compiled kernel, argument list with the constexprs filled in), or None where
        Triton returned no kernel this launcher can run."""
        key = (device, id(constexprs), knobs.runtime.debug, getattr(knobs.compilation, "instrumentation_mode", None),
               *specs)
        hit = self.compiled.get(key)
        if hit is None:  # (an id in the key cannot be reused while the entry holds its dict)
            compiled = self.kernel[grid](*args, **constexprs)
            if hasattr(compiled, "function") and hasattr(compiled, "packed_metadata"):
                if len(self.compiled) >= MAX_ENTRIES:  # configurations come and go (sweeps, tests): start over
                    self.compiled.clear()
                hit = self.compiled[key] = (constexprs, compiled, [constexprs.get(name) for name in self.names])
            return hit
        self._run(grid, device, hit[1], hit[2], self.slots, args)
        return hit

    def _run(self, grid: tuple[int, ...], device: int, compiled: Any, full: list, slots: list[int], args) -> None:
        """Run ``compiled`` on the current stream with the argument list ``full``, ``args`` put at ``slots``."""
        full = full.copy()
        for slot, a in zip(slots, args):
            full[slot] = a
        grid = (*grid, 1, 1)
        compiled.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *full)
        self.direct_launches += 1


class BoundLaunch:
    """A :class:`Launcher`'s kernel with some runtime arguments fixed (:meth:`Launcher.bind`).

    ``bound(grid, moving)`` launches it with ``moving``, the other runtime arguments in the order given to
    :meth:`Launcher.bind`: only their specializations are computed per call (a decode step's queries and window,
    against some thirty arguments that stay the same while a layer's cache does not grow)."""

    def __init__(self, launcher: Launcher, fixed: dict[str, Any], moving: tuple[str, ...], constexprs: dict[str, Any],
                 interpret: bool) -> None:
        self.launcher, self.fixed, self.moving_names = launcher, fixed, moving
        self.constexprs, self.interpret = constexprs, interpret
        if launcher.names:  # a compiled kernel (the interpreter's has no parameter list)
            runtime = [launcher.names[s] for s in launcher.slots]
            if sorted(runtime) != sorted([*fixed, *moving]):
                raise TypeError(f"{launcher.kernel.__name__}: fixed and moving arguments must name its runtime "
                                f"arguments {runtime} once each")
            self.args = [fixed.get(n) for n in runtime]
            self.moving = [runtime.index(n) for n in moving]
            self.moving_slots = [launcher.slots[i] for i in self.moving]  # positions in the full argument list
        self._specs: dict[int, list] = {}  # device → specializations of all arguments, the fixed ones filled in
        #: the last launch's (device, settings, moving specializations) and its compiled kernel and full argument list
        self._last: tuple | None = None

    def __call__(self, grid: tuple[int, ...], moving: tuple) -> None:
        if len(moving) != len(self.moving_names):
            raise TypeError(f"{self.launcher.kernel.__name__}: {len(self.moving_names)} moving arguments, "
                            f"got {len(moving)}")
        launcher = self.launcher
        if self.interpret or not launcher.direct or _hooked():
            launcher.kernel[grid](**self.fixed, **dict(zip(self.moving_names, moving)), **self.constexprs)
            return
        device = driver.active.get_current_device()
        flags = launcher.flags
        state = (device, knobs.runtime.debug, getattr(knobs.compilation, "instrumentation_mode", None),
                 *(launcher._spec(device, a, flags[i]) for i, a in zip(self.moving, moving)))
        last = self._last
        if last is not None and last[0] == state:  # the same specialization as the last launch: fill in and run
            launcher._run(grid, device, last[1], last[2], self.moving_slots, moving)
            return
        args = self.args.copy()
        for i, a in zip(self.moving, moving):
            args[i] = a
        specs = self._specs.get(device)
        if specs is None:
            specs = self._specs[device] = [launcher._spec(device, a, f) for a, f in zip(args, flags)]
        specs = specs.copy()
        for i, s in zip(self.moving, state[3:]):
            specs[i] = s
        entry = launcher._launch(grid, args, self.constexprs, device, specs)
        if entry is not None:  # compiled (now or before): later launches of this specialization take the short path
            full = entry[2].copy()
            for slot, a in zip(launcher.slots, args):
                full[slot] = a
            for slot in self.moving_slots:  # filled in at each call: the template keeps no step's tensors alive
                full[slot] = None
            self._last = (state, entry[1], full)


def _hooked() -> bool:
    """Launch hooks are installed (Triton keeps them in chains that are empty by default)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)
