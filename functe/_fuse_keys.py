"""The plan cache's keys: static leaves keyed so that values ``==`` confuses stay apart, dict keys,
and the constant key Dynamo folds under torch.compile."""

from __future__ import annotations

import collections
import dataclasses
import decimal
import operator
from typing import TYPE_CHECKING, Any

import optree
import torch

from . import _trace
from ._errors import (
    TraceError,
)
from ._fp8_state import hides_tensors
from ._tree import (
    NAMESPACE,
    argument_labels,
    rebuild_dataclass,
)
from ._vjp_checks import (
    positional_names,
)

if TYPE_CHECKING:
    from ._fuse import Fused

Tensor = torch.Tensor


def _unhashable_error(fused: Fused, leaves: list, spec) -> TraceError:
    """The error for a call whose static (non-tensor) leaves do not all hash: which, where, and, for an
    object that holds tensors functe cannot see, what to do (its tensors would be captured constants)."""

    labels = argument_labels(*spec.children(), names=positional_names(fused.__wrapped__))
    bad = []
    for label, leaf in zip(labels, leaves):
        if isinstance(leaf, Tensor):
            continue
        try:
            hash(leaf)
        except TypeError:
            bad.append((label, leaf))
    shown = ", ".join(f"{label} ({type(leaf).__name__})" for label, leaf in bad[:4]) + (" ..." if len(bad) > 4 else "")
    hidden = [label for label, leaf in bad if hides_tensors(leaf)]
    hint = (
        f"; {hidden[0]} holds tensors that functe cannot flatten: use dicts, lists and tuples, or register "
        "its class with functe.pytree_dataclass"
        if hidden
        else ": a set as a frozenset, an array as a tensor"
    )
    return TraceError(
        f"functe.fuse({fused.__name__}): non-tensor arguments are static (a plan per value) and must be "
        f"hashable, got {shown}{hint}"
    )


class _Bits(str):
    """A static leaf's key text where its value cannot be its key (see _static_key): a float's hex
    bits, a complex number's, a wide numpy scalar's or a decimal's exact text (told apart from a
    ``str`` subclass's value, an ``np.str_`` or a ``StrEnum``, whose key also holds a string under
    another type); ``shown``: the value, for messages."""

    shown: str | None = None


def _bits(text: str, value: Any) -> _Bits:
    key = _Bits(text)
    key.shown = repr(value)
    return key


def _shown(entry: tuple) -> str:
    """A static leaf's key entry as the value it stands for (floats are keyed by their hex bits)."""
    _, value = entry
    if isinstance(value, _Bits):
        return value.shown or repr(float.fromhex(value))
    return repr(value)


def _static_key(x: Any) -> tuple:
    """The cache key of a static leaf: its type and value, with the values that ``==`` calls equal
    but a function can tell apart kept apart: floating values by their bits (``-0.0 == 0.0``; also
    a float subclass such as ``np.float64``), complex numbers by both parts' bits, numpy's other
    floating and complex scalars by their repr (``np.longdouble``: ``float()`` would round it),
    decimals by their text (``Decimal('-0') == 0``), and a frozenset by its elements' keys.
    """
    if isinstance(x, float):
        return (type(x), _Bits(float(x).hex()))
    if isinstance(x, complex):
        return (type(x), _bits(f"{x.real.hex()} {x.imag.hex()}", x))
    kind = getattr(getattr(x, "dtype", None), "kind", None)
    numpy_scalar = type(x).__module__ == "numpy" and type(x).__name__ != "ndarray"  # (an array is unhashable)
    if kind == "f" and numpy_scalar and x.dtype.itemsize <= 8:  # (float() is exact; the type keys the dtype)
        return (type(x), _Bits(float(x).hex()))
    if kind in ("f", "c") and numpy_scalar:  # (repr: exact and signed; the bytes hold x87 padding)
        return (type(x), _bits(repr(x), x))
    if isinstance(x, decimal.Decimal):
        return (type(x), _bits(str(x), x))
    if isinstance(x, frozenset):
        return (type(x), _bits(" ".join(sorted(repr(_static_key(e)) for e in x)), x))
    return (type(x), x)


def _dict_keys(tree: tuple) -> tuple:
    """The keys of every dict among ``tree``'s nodes, in insertion order and with their types.

    (One or two ``isinstance`` per value: this runs on every cached call. Nodes other than the
    builtin containers, a ``pytree_dataclass`` or a ``deque`` holding a dict, open one level.)
    """
    found: list = []

    def walk(node) -> None:
        for value in node.values() if isinstance(node, dict) else node:
            if isinstance(value, _CONTAINERS):
                if isinstance(value, dict):
                    found.append((tuple(value), tuple(map(type, value))))
                walk(value)
            elif not isinstance(value, _PLAIN_LEAVES) and not optree.tree_is_leaf(
                value, none_is_leaf=True, namespace=NAMESPACE
            ):
                walk(optree.tree_flatten_one_level(value, none_is_leaf=True, namespace=NAMESPACE).children)

    walk(tree)
    return tuple(found)


_CONTAINERS = (dict, tuple, list)
_PLAIN_LEAVES = (torch.Tensor, int, float, str, type(None), torch.dtype, torch.device)


# ----------------------------------------------------------------------------- the key Dynamo folds under torch.compile


def _constant_key(tree: Any, tensors: list) -> Any:
    """A key of plain constants (structure, shapes, dtypes, devices, static leaves) that Dynamo can fold.

    Tensors met on the way are appended to ``tensors`` (Dynamo cannot trace
    optree's flattening of dicts, so this walk stands in for it).
    """
    if isinstance(tree, Tensor):
        tensors.append(tree)
        # operator.index specialises a size Dynamo made symbolic (on a recompile: automatic dynamic
        # shapes; or dynamic=True), with a guard: a plan is per shape anyway, and
        # assume_constant_result cannot take a symbolic argument (int() does not specialise).
        return ("T", tuple(operator.index(d) for d in tree.shape), tree.dtype, tree.device)
    if type(tree) is int:
        return ("S", operator.index(tree))
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return ("nt", type(tree), tuple(_constant_key(t, tensors) for t in tree))
    if isinstance(tree, (tuple, list)):
        return ("seq", type(tree), tuple(_constant_key(t, tensors) for t in tree))
    if isinstance(tree, dict):
        factory = tree.default_factory if isinstance(tree, collections.defaultdict) else None
        values = tuple(_constant_key(v, tensors) for v in tree.values())
        return ("map", type(tree), tuple(tree.keys()), values, factory)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        names = tuple(f.name for f in dataclasses.fields(tree))
        return ("dc", type(tree), names, tuple(_constant_key(getattr(tree, n), tensors) for n in names))
    if isinstance(tree, float):
        # by its bits (-0.0 is not 0.0: see Fused._lookup); .hex() also specialises a float Dynamo
        # made symbolic, where float() does not
        return ("F", type(tree), tree.hex())
    return ("S", tree)


def _rebuild(key: Any) -> Any:
    """Arguments with shape-only tensors, from a :func:`_constant_key`."""
    kind = key[0]
    if kind == "T":
        return _trace.shape_only(key[1], key[2], key[3])
    if kind == "nt":
        return key[1](*(_rebuild(k) for k in key[2]))
    if kind == "seq":
        return key[1](_rebuild(k) for k in key[2])
    if kind == "map":
        items = zip(key[2], (_rebuild(k) for k in key[3]))
        return key[1](key[4], items) if issubclass(key[1], collections.defaultdict) else key[1](items)
    if kind == "dc":
        return rebuild_dataclass(key[1], key[2], [_rebuild(k) for k in key[3]])
    return key[1](float.fromhex(key[2])) if kind == "F" else key[1]
