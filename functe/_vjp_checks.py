"""The checks of a backward rule's result, and the per-argument gradient flags it is given.

A ``custom_vjp`` backward rule returns one cotangent per positional argument, each a pytree
matching that argument. :func:`_flatten_cotangents` flattens them to the call's leaves and checks
their count, structure (:func:`cotangent_count_error`) and every leaf's shape and dtype against the
input's (:func:`check_gradients`: autograd would silently sum a ``[1,N]`` gradient to ``[N]``, or
cast it), naming the input by the forward rule's parameter names and key paths
(:func:`input_labels`). :func:`argument_needs` folds autograd's per-leaf ``needs_input_grad`` into
the per-argument flags a ``needs_input_grad`` rule takes. Used by :mod:`functe._vjp`'s backward,
the batched twin's (:mod:`functe._vjp_batch`) and a fused plan's generated one (:mod:`functe._codegen`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ._errors import RuleError, describe, describe_shape
from ._tree import PyTreeSpec, argument_labels, same_structure, tree_flatten
from ._vjp_layout import _FLAT, _Call

Tensor = torch.Tensor


def _flatten_cotangents(
    name: str, call: _Call, cts: Any, in_meta: list, fwd: Callable, where: str = "", labels: Callable | None = None
) -> list:
    """The backward rule's cotangents ``cts`` (one per positional argument) as flat leaves, checked
    against the inputs' structure and ``in_meta``; an error names an input by ``labels()`` (default:
    :func:`input_labels`) and ends with ``where``."""
    compiling = torch.compiler.is_compiling()
    labels = labels or (lambda: input_labels(fwd, call.in_tree))
    if (
        not compiling
        and isinstance(cts, tuple)
        and len(cts) < len(_FLAT)
        and call.in_tree is _FLAT[len(cts)]
        and all(ct is None or isinstance(ct, Tensor) for ct in cts)
    ):
        # (every argument one leaf, every cotangent a tensor or None: the structures match)
        flat = list(cts)
        check_gradients(name, flat, in_meta, where, labels, compiling)
        return flat
    arg_trees = call.in_tree.children()
    if not isinstance(cts, tuple) or len(cts) != len(arg_trees):
        raise cotangent_count_error(name, cts, len(arg_trees), where)
    flat: list = []
    for index, (tree, ct) in enumerate(zip(arg_trees, cts)):
        if ct is None:
            flat.extend([None] * tree.num_leaves)
            continue
        ct_leaves, ct_tree = tree_flatten(ct)
        if not same_structure(ct_tree, tree):
            raise RuleError(
                f"functe.{name}: cotangent {index} from the backward rule has structure {ct_tree}, "
                f"expected the argument's structure {tree}{where}"
            )
        flat.extend(ct_leaves)
    check_gradients(name, flat, in_meta, where, labels, compiling)
    return flat


def input_labels(fwd: Callable, in_tree: PyTreeSpec) -> list[str]:
    """How errors name each input leaf of a call flattened as ``in_tree``: by the forward rule's
    parameter names and the key path inside each argument, or by the labels a generated rule
    carries as its ``input_labels`` attribute (a function giving them: a fused program's, named after
    its caller's arguments)."""
    given = getattr(fwd, "input_labels", None)
    if given is not None:
        return list(given())
    return argument_labels(in_tree, names=positional_names(fwd))


def positional_names(fn: Callable) -> list[str]:
    """The names of ``fn``'s positional parameters (none where it has no signature to read; a
    module's are its ``forward``'s: its ``__call__`` takes ``*args``)."""
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # (a builtin or a C function: positions only)
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in positional]


def cotangent_count_error(name: str, cts: Any, count: int, where: str = "") -> RuleError:
    """The error for a backward rule whose result is not a tuple of ``count`` cotangents."""
    return RuleError(
        f"functe.{name}: the backward rule must return a tuple of {count} cotangents "
        f"(one per positional argument), got {describe(cts)}"
        + (f" of length {len(cts)}" if isinstance(cts, tuple) else "")
        + where
    )


def check_gradients(
    name: str, grads, in_meta: list, hint: str = "", labels: Callable | None = None, compiling: bool | None = None
) -> None:
    """Every non-None gradient has its input's ``(shape, dtype)`` (``in_meta``; ``None`` for a
    non-tensor input, which takes no gradient), else a :class:`functe.RuleError` naming the input by
    ``labels()`` (one label per input; by its position without) (autograd would
    silently sum a ``[1,N]`` gradient to ``[N]``, or cast it). While compiling, symbolic sizes are
    not compared (Dynamo could not compare one saved by the forward: a strict torch.export with a
    dynamic batch failed on it); the rank and the dtype still are."""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    for index, (ct, meta) in enumerate(zip(grads, in_meta)):
        if ct is None:
            continue
        if (
            meta is None
            or not isinstance(ct, Tensor)
            or ct.dtype != meta[1]
            or not _same_shape(ct.shape, meta[0], compiling)
        ):
            expected = "None" if meta is None else describe_shape(meta[1], meta[0])
            label = f"input leaf {index}" if labels is None else labels()[index]
            raise RuleError(
                f"functe.{name}: the backward rule returned {describe(ct)} for {label}, expected {expected}{hint}"
            )


def _same_shape(shape, expected, compiling: bool) -> bool:
    # (while compiling, the rank only: comparing even the concrete sizes of a shape the forward saved
    # made Dynamo fail, "argument of type LazyProxy", under a strict export with a dynamic batch)
    return len(shape) == len(expected) if compiling else shape == expected


def argument_needs(leaf_needs, in_tree: PyTreeSpec) -> tuple[bool, ...]:
    """Per positional argument of a call flattened as ``in_tree``, whether any of its leaves wants a
    cotangent (``leaf_needs``: one flag per leaf), as a ``needs_input_grad`` rule takes it."""
    sizes = _ARGUMENT_SIZES.get(in_tree, _UNKNOWN)
    if sizes is _UNKNOWN:  # (walking the spec's children costs ~1.5 us; this runs in every backward)
        if len(_ARGUMENT_SIZES) > 4096:
            _ARGUMENT_SIZES.clear()
        sizes = tuple(tree.num_leaves for tree in in_tree.children())
        sizes = _ARGUMENT_SIZES[in_tree] = None if all(n == 1 for n in sizes) else sizes
    if sizes is None:  # one leaf per argument
        return tuple(leaf_needs)
    flags, offset = [], 0
    for n in sizes:
        flags.append(any(leaf_needs[offset : offset + n]))
        offset += n
    return tuple(flags)


# per call structure: leaves per argument, None when each argument is one leaf
_ARGUMENT_SIZES: dict[PyTreeSpec, tuple[int, ...] | None] = {}
_UNKNOWN = object()
