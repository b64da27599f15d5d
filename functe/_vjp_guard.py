"""The second-order guard of ``custom_vjp``: an op's backward that uses intermediates raises when differentiated.

An op whose forward rule returns intermediate results among its residuals (not its inputs, outputs
or ``constant_residuals``) saves them as non-differentiable extra outputs, so autograd cannot see
how they depend on the inputs. When such a backward pass is itself differentiated, its cotangents go
through :class:`_HigherOrderGuard`, an identity whose backward and ``jvp`` raise
:class:`~functe.TransformError` naming the op (under ``vmap`` it guards the unbatched level again):
never silent zeros. The guard hangs on an *anchor* (:func:`higher_order_anchor`), an empty
differentiable output of the op saved for its backward, so it is on the graph even when nothing else
in the backward pass is (the cotangent of a plain ``.sum()`` is a constant). Ops that know a better
reason (a quantizing cast, a fused plan) mark their forward rule with :func:`first_order_only`. Used
by :mod:`functe._vjp` (every op's backward), its batched twin and a fused plan's node
(:mod:`functe._plan`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._errors import TransformError

Tensor = torch.Tensor


def higher_order_anchor(like: Tensor) -> Tensor:
    """An empty float tensor on ``like``'s device: returned as a differentiable output of an op whose
    residuals include intermediates and saved for its backward, where :func:`_guard` hangs on it
    (last among the new residual outputs; see the module docstring)."""
    return torch.empty(0, device=like.device)


class _HigherOrderGuard(torch.autograd.Function):
    """Identity on ``tensors`` whose backward raises: marks cotangents that are not differentiable
    further. Its outputs are on the graph whenever the ``anchor`` is (see the module docstring)."""

    @staticmethod
    def forward(name, anchor, *tensors):
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.name = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        subject, reason = _second_order_subject(ctx.name)
        raise TransformError(f"{subject}: second-order derivatives are not supported: {reason}")

    @staticmethod
    def vmap(info, in_dims, name, anchor, *tensors):
        # The guard again at the unbatched level: a view here would let an outer grad level
        # differentiate through (hessian, jacrev(jacrev) gave wrong values instead of raising).
        return _HigherOrderGuard.apply(name, anchor, *tensors), tuple(in_dims[2:])

    @staticmethod
    def jvp(ctx, *tangents):
        subject, reason = _second_order_subject(ctx.name)
        raise TransformError(
            f"{subject}: forward-mode derivatives of its backward (jvp of grad) are not supported: {reason}"
        )


QUANTIZED_FIRST_ORDER = (
    "it quantizes its operands (FP8 or block-scaled) and the cast has no derivative: it is differentiated "
    "straight-through, to first order only"
)


def first_order_only(fwd: Callable, subject: str, reason: str) -> Callable:
    """``fwd``, marked with what a second-order error through its op says (``subject: ... not
    supported: reason``), for an op that knows better than the generic reason (a quantizing linear,
    a fused plan). Set before ``custom_vjp`` wraps ``fwd`` (the wrapper copies the mark); read by
    the guard through :func:`second_order_subject`."""
    fwd.second_order = (subject, reason)
    return fwd


def quantized_first_order(fwd: Callable, op: str) -> Callable:
    """:func:`first_order_only` for the quantizing op ``op`` (its cast has no derivative)."""
    return first_order_only(fwd, f"functe.{op}", QUANTIZED_FIRST_ORDER)


def second_order_subject(fwd: Callable, name: str) -> str | tuple[str, str]:
    """What a guarded backward's error names: the mark :func:`first_order_only` left on ``fwd``, or
    the op's ``name``."""
    return getattr(fwd, "second_order", name)


def _second_order_subject(name: str | tuple[str, str]) -> tuple[str, str]:
    """``(who, why and what to do)`` for the error of a guarded backward (see :func:`second_order_subject`)."""
    if isinstance(name, tuple):
        return name
    return (
        f"functe.{name}",
        "its backward rule uses intermediate results of the forward pass, whose dependence on the inputs "
        "autograd cannot see. Differentiate through the unfused reference instead, or define the op so that "
        "its residuals are only its inputs and outputs.",
    )


def _guard(name: str | tuple[str, str], flat: list, anchor: Tensor) -> list:
    """``flat`` (the gradients a backward rule returned) through :class:`_HigherOrderGuard`."""
    positions = [i for i, t in enumerate(flat) if isinstance(t, Tensor)]
    if not positions:
        return flat
    guarded = _HigherOrderGuard.apply(name, anchor, *(flat[i] for i in positions))
    flat = list(flat)
    for i, t in zip(positions, guarded):
        flat[i] = t
    return flat
