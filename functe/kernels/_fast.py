"""CPU fast paths for PyTorch twins.

A twin has two jobs: it is the *reference* (differentiable, vmap- and
fake-tensor-friendly, used for second derivatives and as a custom op's fake
implementation) and it is the CPU *implementation* (what ``functe.ops`` runs on
CPU tensors). The second job needs speed. Evaluated on whole tensors, a formula
of several torch ops reads and writes memory once per op, and for bf16 inputs
an fp32 evaluation adds an upcast pass and doubles the bytes of every
temporary. So when nothing can observe how a result is computed (plain CPU
tensors, no autograd recording, no ``torch.func`` transform, not compiling), a
twin may instead evaluate the same formula, in the same precision, on
cache-sized chunks of rows with ``out=`` and in-place ops.

The chunks are spread over ``torch.get_num_threads()`` worker threads, each
limited to one intra-op thread (a per-thread OpenMP setting), so an op on a
chunk runs inline and torch releases the GIL while it computes. Many small
ops each opening an OpenMP parallel region would instead pay a barrier per op,
which is ruinous when the machine is shared (a descheduled thread stalls every
op by a scheduler tick).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.autograd.forward_ad import _set_fwd_grad_enabled

from .._backend import PLAIN_TENSOR_TYPES, any_tangent

Tensor = torch.Tensor

CHUNK_ELEMENTS = 1 << 17
"""Elements per chunk: a few fp32 temporaries of this size stay in a core's L2 cache."""


def eager_cpu(*tensors: Tensor | None) -> bool:
    """Whether a twin may take its CPU fast path for these arguments.

    True for plain CPU tensors (not fake, not ``torch.func`` wrappers or legacy-vmap batched tensors,
    no forward-mode tangent) that autograd does not record, outside ``torch.compile`` and outside a
    tracing dispatch mode.
    """
    # (a tracing dispatch mode records what runs: make_fx, and torch.func.linearize through it,
    # traced the fast path's out= writes into scratch buffers, and its constant folding moved reads
    # of those buffers ahead of the writes: tangents of uninitialised memory; the threaded path is
    # not recorded at all. Other modes, a user's logging or FlopCounterMode, only watch: the fast
    # path keeps its bits there, as it does under autograd.)
    if torch.compiler.is_compiling() or (torch._C._len_torch_dispatch_stack() and _tracing_mode()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        # (is_cpu: t.device builds a device object, ~0.3 us per tensor on this per-op path)
        if type(t) not in PLAIN_TENSOR_TYPES or not t.is_cpu or (grad and t.requires_grad):
            return False
        # (torch's legacy vmap, autograd.grad(is_grads_batched=True) and the vectorized
        # autograd.functional jacobian/hessian: a plain-typed CPU tensor with no out= batching rules)
        if torch._C._functorch.is_functorch_wrapped_tensor(t) or torch._C._functorch.is_legacy_batchedtensor(t):
            return False
    return not any_tangent(tensors)  # (a dual needs the recorded path: forward AD refuses out=)


def _tracing_mode() -> bool:
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


_TRACING_MODES = (torch._C._TorchDispatchModeKey.PROXY, torch._C._TorchDispatchModeKey.FUNCTIONAL)


def rows_per_chunk(row_elements: int, chunk_scale: int = 1) -> int:
    """How many rows of ``row_elements`` elements make one chunk (of ``chunk_scale`` x :data:`CHUNK_ELEMENTS`)."""
    return max(1, CHUNK_ELEMENTS * chunk_scale // max(row_elements, 1))


class Scratch:
    """Reusable chunk buffers of one row shape and dtype, sliced to each chunk's rows."""

    def __init__(self, rows: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.rows, self.shape, self.dtype = rows, shape, dtype
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, m: int, dtype: torch.dtype | None = None) -> Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = torch.empty((self.rows, *self.shape), dtype=dtype or self.dtype, device="cpu")
        return buf[:m]

    def upcast(self, name: str, t: Tensor) -> Tensor:
        """``t`` in the compute dtype: itself if it already is, else a copy into a buffer."""
        if t.dtype == self.dtype:
            return t
        return self.get(name, t.shape[0]).copy_(t)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _single_threaded() -> None:
    # Per thread: the caller's own setting is untouched. torch applies the last count any thread set
    # to a thread lazily, at its first op, so that first happens here, before the setting: else a
    # user thread's set_num_threads(3) reached a worker (3 OpenMP threads, and results that changed
    # by an ulp with the thread count).
    torch.get_num_threads()
    torch.set_num_threads(1)


def _forget_pool() -> None:
    # A forked child inherits the pool without its threads, and the pool believes its idle workers
    # exist: the first submission waited forever. The child starts a pool of its own.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers != workers:
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="functe-cpu", initializer=_single_threaded)
        return _pool


def parallel_chunks(
    n_rows: int,
    row_shape: tuple[int, ...],
    dtype: torch.dtype,
    body: Callable[[int, slice, Scratch], None],
    *,
    chunk_scale: int = 1,
) -> int:
    """Call ``body(index, rows, scratch)`` for every chunk of rows; return the number of chunks.

    Chunk ``index`` covers ``rows``; each thread has its own ``scratch``. The
    chunking does not depend on the thread count, so a caller that reduces
    per-chunk partial results in index order gets the same bits on any machine.
    ``chunk_scale``: chunks of that many times :data:`CHUNK_ELEMENTS` (whole rows, at least one), for
    a body whose per-call cost favours larger chunks.
    """
    row_elements = 1
    for d in row_shape:
        row_elements *= d
    step = rows_per_chunk(row_elements, chunk_scale)
    chunks = [slice(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]
    threads = min(torch.get_num_threads(), len(chunks))

    def work(first: int, stride: int, inference: bool = False) -> None:
        # Grad modes are thread-local (on in a fresh thread) and the fast path records nothing: a
        # custom_vjp forward turns forward AD off for its own thread only, and a worker reading a
        # slice of a dual input would otherwise trace its tangent into out= ops, which refuse it.
        # Inference mode too: a worker outside it may not write into an output the caller made in it.
        with torch.no_grad(), _set_fwd_grad_enabled(False), _inference_mode(inference):
            scratch = Scratch(step, row_shape, dtype)
            for i in range(first, len(chunks), stride):
                body(i, chunks[i], scratch)

    if threads <= 1 or row_elements > CHUNK_ELEMENTS * chunk_scale:
        work(0, 1)  # one chunk, one thread, or rows so long that each op is worth parallelising itself
    else:
        pool, inference = _executor(torch.get_num_threads()), torch.is_inference_mode_enabled()
        for f in [pool.submit(work, t, threads, inference) for t in range(threads)]:
            f.result()
    return len(chunks)


def _inference_mode(enabled: bool):
    return torch.inference_mode() if enabled else contextlib.nullcontext()
