"""``torch.autocast`` as TransformerEngine treats it: under autocast an op computes in autocast's dtype.

TransformerEngine's ops take their compute dtype from ``torch.autocast`` when it is on for their
device (else from their input, or weight), and return results in it; gradients come back in the
parameters' own dtype. functe does the same in two halves:

* an op's public function passes its floating-point *data* arguments (inputs, weights, biases,
  norm parameters; not scaling states, row scales ``s`` or seeds) through
  :func:`functe.ops._cast.autocast_inputs`, which casts them to autocast's dtype with the ``cast``
  op. That op's backward casts the gradient back, so an fp32 master weight gets an fp32 gradient,
  and a trace records the casts as equations, so a fused plan has the dtypes the unfused ops
  compute in;
* every op's rules run with autocast off (:func:`without_autocast`): their dtypes are their
  arguments', as the kernels' are. (Autocast would otherwise recast inside a rule: the FP8 GEMM's
  emulation multiplied FP8 values held in fp32, up to 448·448·K, in fp16 and overflowed to inf,
  and a linear's backward met a bf16 ``dy`` beside its fp32 weight.)

fp64 arguments are left alone, as autocast leaves them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

DEVICES = ("cpu", "cuda")
"""The devices functe's ops cast for and turn autocast off on."""

CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes autocast casts (fp64 and the rest are left alone)."""


def casts_to_one_dtype(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether autocast, on for their device, casts both ``a`` and ``b`` to its one dtype."""
    if not torch._C._is_any_autocast_enabled():
        return False
    device = a.device.type
    return device in DEVICES and torch.is_autocast_enabled(device) and a.dtype in CASTABLE and b.dtype in CASTABLE


_STATE_DEVICES = ("cpu", "cuda", "xpu", "mps")


def autocast_state() -> tuple:
    """Which devices autocast is on for, and to which dtype (``()`` when it is on for none)."""
    if not torch._C._is_any_autocast_enabled():
        return ()
    return tuple(
        (device, torch.get_autocast_dtype(device)) for device in _STATE_DEVICES if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def autocast_as(state: tuple):
    """Autocast inside the block as it was when ``state`` (:func:`autocast_state`) was read."""
    if not state and not torch._C._is_any_autocast_enabled():
        yield  # (off then and now: nothing to change)
        return
    with contextlib.ExitStack() as stack:
        on = dict(state)
        for device in _STATE_DEVICES:
            if device in on:
                stack.enter_context(torch.autocast(device, dtype=on[device]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def without_autocast(rule: Callable) -> Callable:
    """``rule`` run with autocast off on the CPU and CUDA (the dtypes a rule computes in are its
    arguments'). Two plain ``torch.autocast`` contexts, which Dynamo traces: a generator-based
    context made a compiled function's ops fail in backward under autocast."""

    @functools.wraps(rule)
    def run(*args, **kwargs):
        if not torch._C._is_any_autocast_enabled():
            return rule(*args, **kwargs)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return rule(*args, **kwargs)

    return run
