"""CPU fast paths for PyTorch twins.

A twin has two jobs: it is the *reference* (differentiable, vmap- and
fake-tensor-friendly, used for second derivatives and as a custom op's fake
implementation) and it is the CPU *implementation* (what ``functe.ops`` runs on
CPU tensors). The second job needs speed: a formula of several torch ops in
fp32 reads and writes memory once per op, and for bf16 inputs it also pays an
upcast and a downcast pass. When nothing can observe how a result is computed
(plain CPU tensors, no autograd recording, no ``torch.func`` transform, not
compiling), a twin may instead process its rows in cache-sized chunks with
``out=`` and in-place ops: the same formula, in the same precision, with one
trip through memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

Tensor = torch.Tensor

CHUNK_ELEMENTS = 1 << 16
"""Elements per chunk: a few fp32 temporaries of this size stay in a core's L2 cache."""


def eager_cpu(*tensors: Tensor | None) -> bool:
    """Whether a twin may take its CPU fast path for these arguments.

    True for plain CPU tensors (not fake, not ``torch.func`` wrappers) that
    autograd does not record, outside ``torch.compile``.
    """
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not Tensor or t.device.type != "cpu" or (grad and t.requires_grad):
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    return True


def row_chunks(n_rows: int, n_cols: int, elements: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    """Slices of whole rows holding about ``elements`` elements each."""
    step = max(1, elements // max(n_cols, 1))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))
