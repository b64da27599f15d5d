"""Data parallelism as a function: gradients all-reduced as a pytree, and the training-step wrapper.

Each data-parallel rank runs the same step on its own batch; the parameter gradients (and the
loss) are averaged over the group, so every rank applies the same update and the replicas stay
identical. :func:`all_reduce_gradients` packs every floating leaf of a pytree into one flat
buffer per (dtype, device) and runs one all-reduce per buffer (what DDP's buckets do, without
hooks or module state); :func:`data_parallel_value_and_grad` wraps :func:`functe.value_and_grad`.

FP8 scaling states under data parallelism: pass the data-parallel (or the world) group as
``amax_group`` to ``ops.fp8_linear``, so that amaxes are MAX-reduced inside the ops and the next
states come out identical on every replica (TE reduces over its ``fp8_group`` the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optree
import torch

from ._collectives import check_same_layout, collective, meet_before_raising, resolve_group, stand_in
from ._errors import ArgumentError, DTypeError, check_flag, describe
from ._fp8_state import flatten_states
from ._state import ScalingState
from ._train import make_step
from ._tree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Tensor = torch.Tensor


def all_reduce_gradients(tree: Any, *, group: ProcessGroup | None = None, average: bool = True) -> Any:
    """Sum (``average``: the mean) of every tensor in ``tree`` over the ranks of ``group``.

    Tensors are packed into one flat buffer per dtype and device, so a whole gradient pytree
    costs one all-reduce per dtype. ``None`` leaves pass through; every tensor must be floating
    point. Every rank must pass the same structure and shapes (checked with the collective). One
    rank (or no process group): the tree itself.

    Example:
        >>> import torch, functe
        >>> functe.all_reduce_gradients({"w": torch.ones(2), "b": None})["w"].tolist()
        [1.0, 1.0]
    """
    average = check_flag("all_reduce_gradients", "average", average)  # (bool("False") is True: a sum taken for a mean)
    g = resolve_group("all_reduce_gradients", group)
    leaves, spec = tree_flatten(tree)
    # (a rank without tensors still joins the checks the others run, on a device of the group)
    like = next((t for t in leaves if isinstance(t, Tensor)), None)
    if like is None and g.size > 1:
        like = stand_in(g)
    if any(isinstance(v, ScalingState) for v in flatten_states(tree)[0]):
        # (summed or averaged, FP8 state cotangents make a state no rank measured: a mean amax in the
        # history, a mean of scales, which the count of 1 let through; the ranks' larger tensors
        # then saturated)
        if like is not None:
            meet_before_raising(like, g)
        raise ArgumentError(
            "functe.all_reduce_gradients: the tree holds a ScalingState (an FP8 state's cotangent): averaging "
            "it over ranks gives a state no rank measured; leave states out of the reduction and reduce their "
            "amaxes with amax_group= on the FP8 ops (functe.data_parallel_value_and_grad does both)"
        )
    for leaf in leaves:
        if leaf is not None and not (isinstance(leaf, Tensor) and leaf.is_floating_point()):
            # (the other ranks may be waiting in the layout check: tell them)
            if like is not None:
                meet_before_raising(like, g)
            raise DTypeError(
                f"functe.all_reduce_gradients: every leaf must be a floating-point tensor or None, got {describe(leaf)}"
            )
    if g.size == 1:
        return tree
    if like is not None:
        check_same_layout(lambda: f"{_layout(spec, leaves)} average={average}", like, g, "all_reduce_gradients")
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf is not None:
            buckets.setdefault((leaf.dtype, leaf.device), []).append(i)
    out = list(leaves)
    for members in buckets.values():
        flat = torch.cat([leaves[i].reshape(-1) for i in members])
        if average:
            # (divided before the sum, as DDP does: an fp16 sum of P gradients overflows to inf
            # where their mean is finite)
            flat = flat / g.size
        flat = collective("all_reduce", flat, g, op="sum", who="all_reduce_gradients")
        for i, part in zip(members, flat.split([leaves[i].numel() for i in members])):
            out[i] = part.view(leaves[i].shape)
    return tree_unflatten(spec, out)


def _layout(spec, leaves: list) -> str:
    """A pytree's structure, shapes and dtypes as text that is the same in every process: node types
    by name and leaves by path (a spec's repr shows a defaultdict's factory or a custom node's
    metadata with its address, which differs between processes for the same tree)."""

    def node(s) -> str:
        if s.is_leaf():
            return "*"
        return f"{s.type.__module__}.{s.type.__qualname__}({','.join(node(c) for c in s.children())})"

    paths = optree.treespec_paths(spec)
    return node(spec) + " " + ", ".join(f"{path}: {describe(leaf)}" for path, leaf in zip(paths, leaves))


def data_parallel_value_and_grad(
    fn: Callable[..., Any], *, group: ProcessGroup | None = None, has_aux: bool = False, check: bool = True
) -> Callable[..., Any]:
    """:func:`functe.value_and_grad` with the loss and parameter gradients averaged over ``group``.

    ``step(params, state, *batch) -> (loss, param_grads, next_state)``: each rank passes its own
    shard of the batch; the returned loss is the mean over ranks, the gradients are the means
    (one all-reduce per dtype, the loss included), ``aux`` (with ``has_aux``) stays per rank.
    With equal per-rank batch sizes and a mean-reduced loss this is the gradient of the loss
    over the global batch. FP8 states stay identical across ranks when the quantized ops reduce
    their amaxes over the same group (``amax_group=``, see ``ops.fp8_linear``).

    Example:
        >>> import torch, functe
        >>> def loss_fn(params, state, x):
        ...     return functe.ops.linear(x, params["w"]).square().mean()
        >>> step = functe.data_parallel_value_and_grad(loss_fn)
        >>> loss, grads, _ = step({"w": torch.ones(2, 3)}, None, torch.ones(4, 3))
        >>> loss.item(), grads["w"].shape
        (9.0, torch.Size([2, 3]))
    """
    local = make_step("data_parallel_value_and_grad", fn, has_aux, check)

    def step(params, state, *args, **kwargs):
        # (resolved here, not where the reduction is: its errors would name all_reduce_gradients)
        g = resolve_group("data_parallel_value_and_grad", group)
        value, grads, next_state = local(params, state, *args, **kwargs)
        loss, aux = value if has_aux else (value, None)
        loss, grads = all_reduce_gradients((loss, grads), group=g)
        return ((loss, aux) if has_aux else loss), grads, next_state

    return step
