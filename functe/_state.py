"""Explicit state pytrees.

functe keeps no state on modules, contexts or globals: anything that changes
from step to step (FP8 scales, amax histories) is a value the caller passes in
and gets back. State classes are :func:`functe.pytree_dataclass` es, so they
flatten with optree and with ``torch.utils._pytree`` and can be arguments and
results of every ``torch.func`` transform (``vmap`` gives each ensemble member
its own state).
"""

from __future__ import annotations

import torch

from ._errors import StateError, as_int, check_device, describe, shown_number
from ._tree import pytree_dataclass


@pytree_dataclass
class ScalingState:
    """Per-tensor FP8 scaling state for one tensor role (input, weight or grad_output).

    Fields (both float32, always; a state in another dtype is rejected):
        scale: ``f32[]``. The quantization multiplier, TransformerEngine's convention:
            ``q = saturating_cast(x * scale)`` and ``dequant = q / scale``. Starts at 1.
        amax_history: ``f32[L]``. Recorded ``max|x|`` values, ``L`` = the recipe's
            ``amax_history_len``. Index 0 is the slot that receives the amax of the
            tensor cast with the current (delayed) scale; the scale update reduces the
            window, rolls it by one and clears index 0 for the next step.

    Under ``torch.func.vmap`` both fields gain a leading ensemble dimension.

    Example:
        >>> s = init_scaling_state(history_len=4)
        >>> s.scale.item(), s.amax_history.tolist()
        (1.0, [0.0, 0.0, 0.0, 0.0])
    """

    scale: torch.Tensor
    amax_history: torch.Tensor


HISTORY_LEN_LIMIT = 2**61
"""Amax histories are shorter than this: 2**61 f32 values are 2**63 bytes, more than a tensor's size
in bytes holds (torch's overflow error named nothing). Checked by init_scaling_state and DelayedScaling."""


def init_scaling_state(history_len: int = 1024, *, device: torch.device | str | None = None) -> ScalingState:
    """A fresh :class:`ScalingState`: scale 1, empty (zero) amax history of ``history_len``.

    Example:
        >>> init_scaling_state(8).amax_history.shape
        torch.Size([8])
    """
    length = as_int(history_len)
    if length is None or not 1 <= length < HISTORY_LEN_LIMIT:
        raise StateError(
            f"functe.init_scaling_state: argument 'history_len' expected an int from 1 to 2**61 - 1, "
            f"got {shown_number(history_len)}"
        )
    check_device("init_scaling_state", "device", device)
    history_len = length
    return ScalingState(
        scale=torch.ones((), dtype=torch.float32, device=device),
        amax_history=torch.zeros((history_len,), dtype=torch.float32, device=device),
    )


def check_scaling_state(op: str, arg: str, state: object) -> ScalingState:
    """Validate a scaling state at an op boundary and return it.

    The checks are on metadata only (no host synchronisation).
    """
    if not isinstance(state, ScalingState):
        raise StateError(f"functe.{op}: argument '{arg}' expected a ScalingState, got {type(state).__name__}")
    for name in ("scale", "amax_history"):
        value = getattr(state, name)
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            raise StateError(
                f"functe.{op}: argument '{arg}.{name}' expected float32 (states stay fp32), got {describe(value)}"
            )
    if state.scale.dim() != 0:
        raise StateError(f"functe.{op}: argument '{arg}.scale' expected f32[], got {describe(state.scale)}")
    if state.amax_history.dim() != 1:
        raise StateError(
            f"functe.{op}: argument '{arg}.amax_history' expected f32[L], got {describe(state.amax_history)}"
        )
    if state.scale.device != state.amax_history.device:
        # (an update computes the scale from the history: torch's error named neither, and a meta
        # scale beside a real history went through without a value)
        raise StateError(
            f"functe.{op}: argument '{arg}.scale' is on {state.scale.device}, its amax_history on "
            f"{state.amax_history.device}: a state's tensors share a device"
        )
    return state
