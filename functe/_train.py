"""The training-step helper: loss, parameter gradients and the next state in one call.

``functe.value_and_grad(loss_fn)(params, state, *batch)`` differentiates ``loss_fn`` with
``torch.func`` with respect to the parameters *and* the state. The state's "gradient" is made of
the next values the quantized ops returned as cotangents (see :mod:`functe._fp8_state`);
:func:`functe.state_from_gradient` turns it into the next state (untouched states are kept, a
state used twice is rejected). A training step is therefore one line, with no extra outputs in
the loss function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from ._checkpoint import _key
from ._errors import ArgumentError, StateError, check_callable, check_flag, describe
from ._fp8_state import hides_tensors, loose_tensor, state_from_gradient
from ._kernel import _with
from ._tree import NAMESPACE, tree_flatten, tree_unflatten


def value_and_grad(fn: Callable[..., Any], *, has_aux: bool = False, check: bool = True) -> Callable[..., Any]:
    """``fn(params, state, *args) -> loss`` to ``(loss, param_grads, next_state)``.

    Args:
        fn: the loss function; ``params`` and ``state`` are pytrees of tensors (``params`` of
            floating-point tensors, ``None`` leaves and frozen ``nn.Parameter`` s
            (``requires_grad=False``: a LoRA base) getting ``None`` gradients, as autograd gives
            them, and costing no weight-gradient GEMM; any other tensor is differentiated, as
            ``torch.func.grad`` does; ``state`` made of
            :class:`functe.ScalingState` s, e.g. :class:`functe.LinearScalingState` s, or ``None``).
        has_aux: ``fn`` returns ``(loss, aux)``; the result's first item is then ``(loss, aux)``.
        check: reject a state that was used twice in the step (one host synchronisation;
            see :func:`functe.state_from_gradient`).

    Works under ``torch.func.vmap`` (each ensemble member keeps its own state). A stateless recipe's
    state is ``None`` (also the next state returned), which ``vmap`` refuses to batch as an output:
    give it ``out_dims=(0, 0, None)`` (or a ``None`` for each stateless leaf of a mixed state; the same
    for a frozen ``nn.Parameter`` shared by every member, whose gradient is ``None``). Under
    ``torch.compile`` compile ``fn`` itself and take gradients with ``torch.autograd.grad``
    outside (pytorch#193279, ``docs/design.md``); a compiled training step that calls the returned
    step runs it eagerly and exactly (Dynamo compiles the rest around it; ``fullgraph=True`` refuses).

    Example:
        >>> import torch, functe
        >>> recipe = functe.DelayedScaling(amax_history_len=4)
        >>> def loss_fn(params, state, x):
        ...     return functe.ops.fp8_linear(x, params["w"], None, state, recipe=recipe).square().mean()
        >>> params = {"w": torch.full((16, 16), 0.25)}
        >>> state = functe.init_linear_scaling_state(recipe)
        >>> loss, grads, state = functe.value_and_grad(loss_fn)(params, state, torch.ones(4, 16))
        >>> state.input.amax_history.tolist(), state.input.scale.item()  # (448 / 1) / 2**0
        ([0.0, 0.0, 0.0, 1.0], 448.0)
    """
    return make_step("value_and_grad", fn, has_aux, check)


def make_step(who: str, fn: Callable[..., Any], has_aux: Any, check: Any) -> Callable[..., Any]:
    """:func:`value_and_grad`'s step, whose errors name ``functe.<who>``, the function the caller
    called (:func:`functe.data_parallel_value_and_grad` makes one too)."""
    check_callable(who, "fn", fn)
    has_aux = check_flag(who, "has_aux", has_aux)
    check = check_flag(who, "check", check)

    def step(params, state, *args, **kwargs):
        return _step(who, fn, has_aux, check, params, state, args, kwargs)

    return step


def _checked_loss(who: str, loss: Any, has_aux: bool) -> torch.Tensor:
    """The loss, refused unless a 0-d floating-point tensor: an integer loss made every gradient zero
    silently (torch.func differentiates it as a constant), and torch.func's own refusals named
    ``grad_and_value(f)``, which the caller never called."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return loss
    what = "fn's loss (the first item of its result)" if has_aux else "fn's loss"
    hint = ""
    if isinstance(loss, torch.Tensor) and loss.dim() != 0:
        hint = ": reduce it to one number (.sum(), .mean())"
    elif isinstance(loss, torch.Tensor) and loss.is_complex():
        hint = ": take a real part or a magnitude (torch.func differentiates a real loss only)"
    elif isinstance(loss, torch.Tensor):
        hint = ": an integer or boolean loss has no gradient (its gradients would all be zero)"
    elif isinstance(loss, tuple) and not has_aux:
        hint = ": a (loss, aux) pair needs has_aux=True"
    raise ArgumentError(f"functe.{who}: {what} expected a 0-d floating-point tensor, got {describe(loss)}{hint}")


def _not_compiled(fn: Callable) -> Callable:
    """``fn`` run eagerly inside a compiled caller (which Dynamo compiles around it): see _step."""
    reason = (
        "functe.value_and_grad runs eagerly under torch.compile; compile the loss and take gradients "
        "outside it with torch.autograd.grad (pytorch#193279)"
    )
    try:
        return torch._dynamo.disable(fn, reason=reason)
    except TypeError:  # (an older torch without reasons)
        return torch._dynamo.disable(fn)


# Dynamo does not trace the step (torch.compile of a training step that calls it runs it eagerly, and
# compiles the rest): Dynamo's optree polyfill, past a graph break inside torch.func.grad_and_value,
# unflattened the state and parameters wrongly ("length mismatch"), and compiling a torch.func
# transform would replace functe's backward rules anyway (pytorch#193279, README).
@_not_compiled
def _step(
    who: str, fn: Callable, has_aux: bool, check: bool, params: Any, state: Any, args: tuple, kwargs: dict
) -> tuple:
    leaves, spec = tree_flatten(state)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    param_leaves, param_spec = tree_flatten(params)
    # (a plain dataclass of weights was refused as "expected a floating-point tensor, got Params")
    _refuse_hidden_tensors(who, params, param_leaves, "params", ArgumentError, "would take no gradient")
    trainable = _trainable_positions(who, param_leaves, params)

    aux_rest: list = []  # (the aux's non-tensor leaves and layout, which torch.func refuses to return)

    def with_state(p, tensors):
        full_params, full = _with(param_leaves, trainable, p), _with(leaves, positions, tensors)
        out = fn(tree_unflatten(param_spec, full_params), tree_unflatten(spec, full), *args, **kwargs)
        if not has_aux:
            return _checked_loss(who, out, has_aux)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ArgumentError(
                f"functe.{who}: with has_aux=True the function must return (loss, aux), got {describe(out)}"
            )
        loss, aux = out
        loss = _checked_loss(who, loss, has_aux)
        aux_leaves, aux_spec = tree_flatten(aux)
        # (returned as given, the transform's tensors in it would be its dead wrappers; captured ones are fine)
        _refuse_hidden_tensors(
            who, aux, aux_leaves, "aux", ArgumentError, "would be a finished transform's wrappers", wrapped_only=True
        )
        aux_rest[:] = [aux_leaves, aux_spec]
        return loss, [leaf for leaf in aux_leaves if isinstance(leaf, torch.Tensor)]

    # (an object optree cannot flatten is one opaque leaf: its scaling states would never enter the
    # gradient, and the state would silently never update)
    _refuse_hidden_tensors(who, state, leaves, "state", StateError, "would never update")
    loose = loose_tensor(state)
    if loose is not None:  # (refused by state_from_gradient too, but only after the whole step had run)
        key, tensor = loose
        raise StateError(
            f"functe.{who}: argument 'state' (fn is called as fn(params, state, *args)) expected a "
            f"pytree of functe.ScalingState leaves (or None), got a tensor {describe(tensor)} at {key}: a loss "
            "without scaling state takes it anyway (pass None), data goes after it"
        )
    tensors = [leaves[i] for i in positions]
    for i, t in zip(positions, tensors):
        if not t.is_floating_point():  # (torch.func would refuse it with a message naming nothing)
            raise StateError(
                f"functe.{who}: state leaf {_leaf_key(state, i)!r} expected a float32 "
                f"tensor (states travel back through the gradient), got {describe(t)}"
            )
    trainable_params = [param_leaves[i] for i in trainable]
    grads, value = torch.func.grad_and_value(with_state, argnums=(0, 1), has_aux=has_aux)(trainable_params, tensors)
    if has_aux:  # (the aux as fn returned it: its tensors from torch.func, any other leaf as it was)
        loss, aux_tensors = value
        aux_leaves, aux_spec = aux_rest
        returned = iter(aux_tensors)
        value = (
            loss,
            tree_unflatten(aux_spec, [next(returned) if isinstance(x, torch.Tensor) else x for x in aux_leaves]),
        )
    trainable_grads, state_grads = grads
    next_state = state_from_gradient(state, tree_unflatten(spec, _with(leaves, positions, state_grads)), check=check)
    param_grads = _with([None] * len(param_leaves), trainable, trainable_grads)
    return value, tree_unflatten(param_spec, param_grads), next_state


def _refuse_hidden_tensors(
    who: str, tree: Any, leaves: list, what: str, error: type, why: str, *, wrapped_only: bool = False
) -> None:
    """Raise ``error`` for a leaf of ``tree`` that is an object holding tensors optree cannot flatten
    (``wrapped_only``: ``torch.func`` wrappers)."""
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) and hides_tensors(leaf, wrapped_only=wrapped_only):
            raise error(
                f"functe.{who}: {what} leaf {_leaf_key(tree, i) or f'(the {what} itself)'!r} is a "
                f"{type(leaf).__name__}, which functe cannot flatten (its tensors {why}): use "
                "dicts, lists and tuples, or register the class with functe.pytree_dataclass"
            )


def _trainable_positions(who: str, leaves: list, params: Any) -> list[int]:
    """The positions of ``params``' tensor leaves; a ``None`` leaf (an absent bias) and a frozen
    ``nn.Parameter`` get a ``None`` gradient; anything else is refused naming its key (torch.func's
    message names nothing)."""
    positions = []
    for i, leaf in enumerate(leaves):
        if leaf is None or _frozen_parameter(leaf):
            continue
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
            raise ArgumentError(
                f"functe.{who}: params leaf {_leaf_key(params, i) or '(the params themselves)'!r} expected a "
                f"floating-point tensor or None, got {describe(leaf)}"
            )
        positions.append(i)
    return positions


def _frozen_parameter(leaf: Any) -> bool:
    """A module's parameter frozen with ``requires_grad_(False)`` (LoRA's base, BitFit's weights).

    ``dict(model.named_parameters())`` is the usual ``params``: differentiated as torch.func does
    (every leaf), the frozen base got a gradient (and its wgrad GEMMs ran), which the usual
    ``p.grad = g; optimizer.step()`` then applied to it, where autograd leaves ``.grad`` ``None``
    and the optimizer skips it. A plain tensor carries no such intent (``torch.randn`` does not
    require grad) and is always differentiated."""
    return isinstance(leaf, torch.nn.Parameter) and not leaf.requires_grad


def _leaf_key(tree: Any, i: int) -> str:
    """The dotted key of ``tree``'s ``i``-th leaf (as functe flattens it), for an error message."""
    return _key(optree.tree_paths(tree, none_is_leaf=True, namespace=NAMESPACE)[i])
