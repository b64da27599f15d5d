"""Explicit randomness: the seed arguments of ops (JAX style, no global RNG).

A seed travels as a positional ``i64[]`` tensor, not a static keyword: a static value would be
baked into a fused or compiled program and force a retrace whenever it changes (every step).
Kernels read it from memory (no host synchronisation) and derive their random bits from it with
the counter-based hash of :mod:`functe.kernels.dropout`.
"""

from __future__ import annotations

import torch

from ._errors import ArgumentError, DeviceError, as_int, describe, dtype_error, shape_error

Tensor = torch.Tensor


def seed_tensor(seed, like: Tensor, op: str) -> Tensor:
    """``seed`` (a Python int or an ``i64[]`` tensor) as an ``i64[]`` tensor on ``like``'s device.

    Example:
        >>> import torch
        >>> seed_tensor(7, torch.zeros(2), "dropout")
        tensor(7)
    """
    number = as_int(seed)  # (a numpy integer too)
    if number is not None:
        seed = number
    if isinstance(seed, torch.SymInt):  # (make_fx's symbolic tracing turns an int argument into one)
        return torch.full((), seed, dtype=torch.int64, device=like.device)
    if isinstance(seed, bool) or not isinstance(seed, (int, Tensor)):
        raise ArgumentError(f"functe.{op}: argument 'seed' expected a Python int or an int64 tensor, got {seed!r}")
    if isinstance(seed, int):
        if not -(2**63) <= seed < 2**63:
            raise ArgumentError(f"functe.{op}: argument 'seed' expected a 64-bit signed integer, got {seed}")
        # (torch.full, not torch.tensor: a meta torch.tensor inside torch.func.grad fails in torch 2.13,
        # "attempted to call in-place operation", when shape-checking a training step on meta tensors)
        return torch.full((), seed, dtype=torch.int64, device=like.device)
    if seed.dtype != torch.int64:
        raise dtype_error(op, "seed", "an i64[] tensor", seed)
    if seed.dim() != 0:
        raise shape_error(op, "seed", "an i64[] tensor (one seed; vmap gives each member its own)", seed)
    if seed.device.type == "meta" and like.device.type != "meta":
        raise DeviceError(f"functe.{op}: argument 'seed' is on the meta device (no value), x on {like.device}")
    if seed.device == like.device:
        return seed
    if _traced(seed):  # (an op list has no op that moves a value between devices)
        raise DeviceError(
            f"functe.{op}: argument 'seed' ({describe(seed)} on {seed.device}) must be on x's device "
            f"({like.device}) in a traced or fused function, which records no copy between devices: "
            "pass seed.to(x.device)"
        )
    return seed.to(like.device)


def _traced(seed: Tensor) -> bool:
    """Whether ``seed`` is a value of the trace this thread records (a captured seed is a constant,
    copied as in eager code; another thread's trace is not this call's)."""
    from ._trace import Tracer, tracing  # (the trace module imports the ops, which import this one)

    return isinstance(seed, Tracer) and tracing()
