"""Triton glue: a ``jit`` that can run one kernel compiled *or* interpreted, and launch helpers.

Triton decides at decoration time whether ``@triton.jit`` builds a compiled
``JITFunction`` or an ``InterpretedFunction`` (the ``TRITON_INTERPRET`` knob),
and an interpreted kernel cannot call a compiled helper. functe switches
backends at run time (:mod:`functe._backend`), so :func:`jit` builds the normal
``JITFunction`` and retypes it to :class:`_SwitchableJIT`, which launches
through the interpreter when ``functe`` is in ``"interpret"`` mode and acts as
an interpreted device function when an interpreted kernel calls it. Compiled
launches (GPU) take the unmodified ``JITFunction`` path.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .._backend import interpreting

COMPILE_OPTIONS = {"enable_fp_fusion": True}
"""Compile options of every GPU launch (``tests/test_gpu_codegen.py`` compiles with them too)."""


class _SwitchableJIT(JITFunction):
    """A ``JITFunction`` that defers to an ``InterpretedFunction`` in interpret mode."""

    def _interpreted(self):
        fn = self.__dict__.get("_functe_interpreted")
        if fn is None:
            # Imported lazily: Triton's interpreter needs numpy, which GPU users may lack.
            from triton.runtime.interpreter import InterpretedFunction

            _make_triton_library_switchable()
            fn = InterpretedFunction(self.fn)
            self.__dict__["_functe_interpreted"] = fn
        return fn

    def __getitem__(self, grid):
        if interpreting():
            launch = _quiet(self._interpreted()[grid])
            return launch if _launch_log is None else _recorded(self, launch, grid)
        return super().__getitem__(grid)

    def run(self, *args, **kwargs):
        # Compiled launches (kernel[grid](...) and the autotuner both end here). Triton launches on
        # the *current* CUDA device and rejects pointers of another one ("Pointer argument cannot be
        # accessed from Triton"): a tensor on cuda:1 while cuda:0 is current would fail, so the
        # launch runs on its first tensor's device.
        # FMA contraction pinned (Triton 3.9 enables it by default, warns, and 3.10 disables it): the
        # GPU bits must not change with a Triton upgrade.
        kwargs.update(COMPILE_OPTIONS)
        with on_device_of(*args):
            return super().run(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        # Only reached as a device-function call from an interpreted kernel:
        # compiled kernels inline helpers without calling them from Python.
        # Triton's InterpretedFunction.__call__ patches the language builtins of
        # the callee's modules and never restores them; a Triton library helper
        # (tl.max, tl.zeros_like) patches triton.language.core, which the
        # kernel's own patch scope does not cover, so a compiled kernel built
        # later in the process would see interpreter builtins. Run the call in
        # a patch scope of our own, restored afterwards.
        from triton.runtime.interpreter import InterpreterError, _patch_lang

        interpreted = self._interpreted()
        scope = _patch_lang(interpreted.fn)
        try:
            return interpreted.rewrite()(*args, **kwargs)
        except Exception as e:
            raise InterpreterError(repr(e)) from e
        finally:
            scope.restore()


def launch_device(args) -> torch.device | None:
    """The CUDA device a launch must make current: its first tensor argument's, when that is not
    the current device already (``None``: nothing to switch)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            device = a.device
            if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
                return None
            return device
    return None


def on_device_of(*args):
    """A context making the CUDA device of the first tensor among ``args`` current (a no-op on the
    CPU or when it is current): see :func:`launch_device`.

    Every compiled launch runs in it, and so does a whole autotuned launch: Triton's autotuner times
    its configurations with events on the current device's stream, so timing a ``cuda:1`` launch
    while ``cuda:0`` is current would pick a configuration from the wrong device's timings.
    """
    device = launch_device(args)
    return contextlib.nullcontext() if device is None else torch.cuda.device(device)


_launch_log: list | None = None


@contextlib.contextmanager
def record_launches():
    """Collect ``(kernel, args, kwargs, grid)`` of every interpreted launch in the block.

    The test suite compiles what it recorded for a GPU target (``tests/test_gpu_codegen.py``):
    the interpreter accepts code that Triton's compiler rejects, so passing interpreter tests
    alone does not prove a kernel builds for a GPU.
    """
    global _launch_log
    previous, _launch_log = _launch_log, []
    try:
        yield _launch_log
    finally:
        _launch_log = previous


def _recorded(kernel, launch, grid):
    log = _launch_log

    def run(*args, **kwargs):
        log.append((kernel, args, kwargs, grid))
        return launch(*args, **kwargs)

    return run


_INTERPRETER_LOCK = threading.RLock()


def _quiet(launch):
    """Run an interpreted launch with numpy's floating-point warnings off, one launch at a time.

    The interpreter computes with numpy, which warns on overflow to inf and on
    inf - inf; a GPU produces the same IEEE results silently, and kernels rely
    on them (e.g. ``exp(-x)`` overflowing to inf inside a sigmoid). Triton's
    interpreter patches the language's builtins for the duration of a launch,
    process-wide: two threads launching at once broke each other's launches
    ("_semantic argument must be provided outside of JIT functions").
    """

    def run(*args, **kwargs):
        import numpy

        with _INTERPRETER_LOCK, numpy.errstate(all="ignore"):
            return launch(*args, **kwargs)

    return run


_library_switchable = False


def _make_triton_library_switchable() -> None:
    """Let Triton's own ``@jit`` library functions (``tl.sum``, ``tl.sigmoid``,
    ``tl.randint``...) run inside interpreted kernels.

    Triton builds them at import time as compiled ``JITFunction`` s unless
    ``TRITON_INTERPRET=1`` was set before the import. Retyping them to
    :class:`_SwitchableJIT` changes only what a *Python* call does (compiled
    kernels never call them from Python), so compiled GPU launches are unaffected.
    """
    global _library_switchable
    if _library_switchable:
        return
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("triton.language"):
            continue
        for value in list(vars(module).values()):
            if type(value) is JITFunction:
                value.__class__ = _SwitchableJIT
    _round_bf16_to_nearest_even()
    _library_switchable = True


_casts_patched = False


def _round_bf16_to_nearest_even() -> None:
    """Make the interpreter's casts to and from bf16 what a GPU and the twins compute.

    Triton's interpreter (3.6-3.9) truncates the mantissa from fp32 to bf16, so an interpreted
    kernel's bf16 outputs could be one ulp off the compiled kernel's and the twins': that cast
    rounds to nearest even here (NaN stays a quiet NaN of its sign). Its other casts between bf16
    and fp64 or fp16 converted the value to bf16's integer storage (numpy has no bf16: an fp64 GEMM
    stored as bf16 gave NaN and 9e-41): they go through fp32, exactly from bf16 (by its bits: the
    interpreter's own bf16 -> fp32 misread subnormals), and to bf16 as torch's CPU cast from fp64
    rounds (twice, through fp32).
    """
    global _casts_patched
    if _casts_patched:
        return
    _casts_patched = True
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = type(interpreter.interpreter_builder)
    truncating_cast = builder.cast_impl
    wide_or_half = (tl.float64, tl.float16)
    from_bf16 = {tl.float32: np.float32, tl.float64: np.float64, tl.float16: np.float16}

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar in from_bf16:
            # (exact: bf16 is fp32's top half; the interpreter's own conversion misread subnormals)
            bits = np.ascontiguousarray(src.data).view(np.uint16).astype(np.uint32) << np.uint32(16)
            value = bits.view(np.float32).astype(from_bf16[dst_type.scalar])
            return interpreter.TensorHandle(value, dst_type.scalar)
        if src.dtype.scalar in wide_or_half and dst_type.scalar == tl.bfloat16:
            src = truncating_cast(self, src, tl.float32)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
            quiet_nan = ((bits >> 16) | np.uint32(0x0040)).astype(np.uint16)
            return interpreter.TensorHandle(np.where(np.isnan(src.data), quiet_nan, rounded), tl.bfloat16)
        return truncating_cast(self, src, dst_type)

    builder.cast_impl = cast_impl


def jit(fn):
    """``triton.jit`` for functe kernels and device helpers (see the module docstring)."""
    kernel = triton.jit(fn)
    if isinstance(kernel, JITFunction):
        kernel.__class__ = _SwitchableJIT
    else:
        # With TRITON_INTERPRET=1 set by the user, Triton already returns an InterpretedFunction;
        # it then runs interpreted everywhere, as asked, and never through the interpret backend,
        # which patches the bf16 casts: patched here (interpreted bf16 outputs truncated before).
        _round_bf16_to_nearest_even()
    return kernel


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints: ``triton.cdiv`` is a ``ConstexprFunction`` since Triton 3.9,
    ~1.5 µs a host call (two or three per launch: a fifth of an activation launcher's Python)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def row_launch(n_cols: int, *, max_block: int = 65536) -> tuple[int, int]:
    """Block size and warps for a one-row-per-program kernel over ``n_cols`` columns.

    The whole row lives in registers, so the block is the next power of two;
    wide rows get more warps to keep the per-thread register load bounded.
    """
    block = next_power_of_2(n_cols)
    if block > max_block:
        raise ValueError(f"row of {n_cols} elements exceeds the {max_block}-element single-pass limit")
    warps = 4 if block < 2048 else 8 if block < 8192 else 16
    return block, warps


ELEMENTWISE_BLOCK = 1024


# CUDA grids take up to 2^31 - 1 programs on axis 0 but only 65,535 on axes 1 and 2, so a second axis
# of column blocks fails on a wide row (a flattened 4096x4096 weight is one row of 2^24 elements).
# Two-dimensional tilings therefore launch a 1-D grid and split the program id.


@jit
def tile_ids(n_col_programs):
    """``(row program, column program)`` of a :func:`tiled_grid` launch (row-major: consecutive
    programs share a row). Both are int64: a column program times its block passed 2^31 on a row of
    2^31 elements or more (a flattened 4 GiB buffer), and int32 offsets wrapped negative."""
    pid = tl.program_id(0).to(tl.int64)
    return pid // n_col_programs, pid % n_col_programs


def tiled_grid(n_row_programs: int, n_col_programs: int) -> tuple[int]:
    """The 1-D grid of ``n_row_programs x n_col_programs`` programs that :func:`tile_ids` splits."""
    n = n_row_programs * n_col_programs
    if n >= 2**31:
        raise ValueError(f"a launch of {n_row_programs} x {n_col_programs} programs exceeds CUDA's 2^31 - 1")
    return (n,)
